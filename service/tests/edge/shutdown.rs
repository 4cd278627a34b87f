//! SIGTERM must finish within the grace period even while an event stream and a long-poll
//! are open (it took 20 s and more, up to the wait's 600 s, so an orchestrator killed it),
//! and both must get an answer the client can resume from.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::{read_answer, submission_request, Service};
use kernelkite_testkit::fake_buildkite::{signature_header, unix_now};
use kernelkite_testkit::harness::WEBHOOK_TOKEN;

const GRACE_S: u64 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_streams_and_long_polls_resumably_and_exits_within_the_grace_period() {
    let mut svc = Service::start(&[
        ("KERNELKITE_SHUTDOWN_GRACE_S", &GRACE_S.to_string()),
        ("KERNELKITE_MAX_WAIT_S", "600"),
    ])
    .await;
    let created = crate::exchange(svc.port, &submission_request(""), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(created.status, 202, "{created:?}");
    let id = created.json()["id"].as_str().unwrap().to_string();
    let number = svc.fake.next_created(Duration::from_secs(5)).await.unwrap();
    assert_eq!(svc.fake.start_build(number).await, Some(200));

    // An event stream, read up to its `running` event.
    let mut sse = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
    sse.write_all(
        format!("GET /v1/submissions/{id}/events HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains("event: running") {
        let n = tokio::time::timeout(Duration::from_secs(5), sse.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    // A long-poll that would wait ten minutes.
    let mut poll = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
    poll.write_all(
        format!("GET /v1/submissions/{id}?wait=600 HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    // A webhook in flight: its head and half its body are in when SIGTERM comes.
    let body = svc.fake.event_body("build.running", number).unwrap();
    let sig = signature_header(WEBHOOK_TOKEN, unix_now(), &body);
    let mut hook = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
    hook.write_all(
        format!(
            "POST /webhooks/buildkite HTTP/1.1\r\nhost: x\r\nx-buildkite-event: build.running\r\nx-buildkite-signature: {sig}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let half = body.len() / 2;
    hook.write_all(&body[..half]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let t = Instant::now();
    svc.sigterm();

    // The long-poll is answered at once with the submission as it is (not terminal).
    let answer = tokio::time::timeout(Duration::from_secs(2), read_answer(&mut poll))
        .await
        .expect("the long-poll is answered when shutdown starts")
        .unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
    let v = answer.json();
    assert_eq!(v["id"], id.as_str());
    assert_eq!(v["state"], "running", "{v}");

    // The stream ends after a `retry:` hint, so the client reconnects with Last-Event-ID.
    let rest = tokio::time::timeout(Duration::from_secs(2), async {
        let mut rest = String::new();
        loop {
            match sse.read(&mut buf).await {
                Ok(0) | Err(_) => break rest,
                Ok(n) => rest.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
            // Chunked encoding's last chunk: the response is over.
            if rest.contains("\r\n0\r\n\r\n") {
                break rest;
            }
        }
    })
    .await
    .expect("the event stream ends when shutdown starts");
    assert!(rest.contains("retry: 1000"), "{rest:?}");
    assert!(rest.contains("Last-Event-ID"), "{rest:?}");

    // The webhook in flight still finishes.
    hook.write_all(&body[half..]).await.unwrap();
    let done = tokio::time::timeout(Duration::from_secs(2), read_answer(&mut hook))
        .await
        .expect("the webhook in flight is answered")
        .unwrap();
    assert_eq!(done.status, 200, "{done:?}");

    // Listening stopped: new clients are refused and go elsewhere.
    assert!(TcpStream::connect(("127.0.0.1", svc.port)).await.is_err());

    let status = svc
        .exit_within(Duration::from_secs(GRACE_S + 2))
        .await
        .expect("exits within the grace period");
    let took = t.elapsed();
    assert!(status.success(), "{status:?}: {}", svc.stderr());
    // Everything ended by itself: no need to wait out the grace period.
    assert!(took < Duration::from_secs(GRACE_S), "took {took:?}");
    let log = svc.stderr();
    assert!(
        log.contains("shutting down") && log.contains("draining"),
        "{log}"
    );
}

#[tokio::test]
async fn sigterm_exits_after_the_grace_period_when_a_request_does_not_finish() {
    let mut svc = Service::start(&[("KERNELKITE_SHUTDOWN_GRACE_S", "1")]).await;
    // A submission whose body never completes: a request in flight that never ends by
    // itself (its body timeout is 30 s).
    let mut stuck = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
    stuck
        .write_all(b"POST /v1/submissions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    svc.sigterm();
    let status = svc
        .exit_within(Duration::from_secs(5))
        .await
        .expect("exits once the grace period is over");
    assert!(status.success(), "{status:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    assert!(
        svc.stderr().contains("grace period over"),
        "{}",
        svc.stderr()
    );
}
