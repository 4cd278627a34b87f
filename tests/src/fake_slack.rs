//! A stand-in for Slack's incoming webhooks, on loopback: `POST <hook URL>` with a JSON body
//! whose `text` is the message; Slack answers `200` with the body `ok`, or an error status with
//! a code as the body (`400 invalid_payload`, `403 action_prohibited`, `404 no_service`,
//! `410 channel_is_archived`, `500 rollup_error`), as its documentation lists them
//! (<https://api.slack.com/messaging/webhooks>, "Handling errors"). The hook's path carries a
//! secret, as Slack's do (`/services/T…/B…/<secret>`). It records every message it accepted,
//! and can answer a failure or be taken down.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::http::StatusCode;

/// The secret part of the hook's path.
pub const SECRET: &str = "xoxb-T0KEN-in-the-path";

/// How the hook answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `200 ok`.
    Accept,
    /// `500 rollup_error`.
    Fail,
}

#[derive(Default)]
struct State {
    messages: Vec<(Instant, String)>,
    refused: u64,
    mode: Option<Mode>,
}

/// The hook.
pub struct FakeSlack {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for FakeSlack {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FakeSlack {
    /// Listening on a loopback port, accepting.
    pub async fn start() -> FakeSlack {
        let state = Arc::new(Mutex::new(State::default()));
        let s = state.clone();
        let app = axum::Router::new().route(
            "/services/T1/B1/{secret}",
            axum::routing::post(
                move |axum::extract::Path(secret): axum::extract::Path<String>, body: Bytes| {
                    let s = s.clone();
                    async move {
                        let mut st = s.lock().unwrap_or_else(|e| e.into_inner());
                        if secret != SECRET {
                            return (StatusCode::NOT_FOUND, "no_service");
                        }
                        if st.mode == Some(Mode::Fail) {
                            st.refused += 1;
                            return (StatusCode::INTERNAL_SERVER_ERROR, "rollup_error");
                        }
                        let text = serde_json::from_slice::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|v| v["text"].as_str().map(str::to_string));
                        match text {
                            Some(t) => {
                                st.messages.push((Instant::now(), t));
                                (StatusCode::OK, "ok")
                            }
                            None => (StatusCode::BAD_REQUEST, "invalid_payload"),
                        }
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeSlack {
            addr,
            state,
            server,
        }
    }

    /// The hook's URL (its path holds [`SECRET`]).
    pub fn url(&self) -> String {
        format!("http://{}/services/T1/B1/{SECRET}", self.addr)
    }

    /// Every message accepted so far, in order.
    pub fn messages(&self) -> Vec<String> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.messages.iter().map(|(_, t)| t.clone()).collect()
    }

    /// Requests answered with a failure so far.
    pub fn refused(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).refused
    }

    /// Answers from now on as `mode` says.
    pub fn set_mode(&self, mode: Mode) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).mode = Some(mode);
    }

    /// Stops listening: connections are refused.
    pub fn take_down(&self) {
        self.server.abort();
    }
}
