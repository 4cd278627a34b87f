//! The core as its executors see it (`executor::Events`), the one way in for build events:
//! the local executor is handed it at start, and the service's receiver of Buildkite's
//! webhooks delivers through it too. A build's event delivered to the App (returning once its
//! change is committed), a submission's watch, and a build left by the previous run taken back
//! through recovery. Its own module, so that neither the App nor recovery imports the other to
//! serve it.

use std::sync::{Arc, Weak};

use futures_util::future::BoxFuture;

use crate::app::App;
use crate::executor::{BuildEvent, Events, Reclaim};
use crate::submission::Submission;

/// The events handle for an executor (the local one; Buildkite's webhook receiver): holds the
/// App weakly, as the App holds the executor.
pub fn for_executor(app: &Arc<App>) -> Arc<dyn Events> {
    Arc::new(CoreEvents {
        app: Arc::downgrade(app),
    })
}

/// The core behind an executor's events handle ([`for_executor`]).
struct CoreEvents {
    app: Weak<App>,
}

impl Events for CoreEvents {
    fn deliver(&self, event: BuildEvent) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(app) = self.app.upgrade() {
                app.handle_event(event).await;
            }
        })
    }

    fn watch(&self, submission_id: &str) -> Option<tokio::sync::watch::Receiver<Submission>> {
        self.app.upgrade()?.store.subscribe(submission_id)
    }

    fn reclaim<'a>(&'a self, submission_id: &'a str, build_id: &'a str) -> BoxFuture<'a, Reclaim> {
        Box::pin(async move {
            let Some(app) = self.app.upgrade() else {
                return Reclaim::Unreadable("the service is stopping".into());
            };
            match app.lookup(submission_id).await {
                Ok(Some(sub))
                    if !sub.state.is_terminal()
                        && sub.build.as_ref().is_some_and(|b| b.id == build_id) =>
                {
                    crate::recovery::recover_submission(&app, &sub).await;
                    Reclaim::Recovered
                }
                Ok(Some(_)) => Reclaim::NotOpen,
                Ok(None) => Reclaim::Unknown,
                Err(e) => Reclaim::Unreadable(crate::report::report(&e).to_string()),
            }
        })
    }

    fn held_back(&self, slice: &str) -> bool {
        self.app
            .upgrade()
            .is_some_and(|a| a.fleet().held_back(slice))
    }

    fn max_artifact_bytes(&self) -> u64 {
        self.app
            .upgrade()
            .map_or(crate::config::DEFAULT_MAX_ARTIFACT_BYTES, |a| {
                a.cfg.max_artifact_bytes
            })
    }
}
