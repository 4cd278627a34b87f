//! Event streams a client stops reading (issue 21, item 5): 30 clients that never read an
//! 8 MiB result held their streams for good and took the service from 100 to 412 MiB, each
//! stream holding its own copies of the result.

use std::time::{Duration, Instant};

use kernelkite_testkit::fake_buildkite::ArtifactSpec;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

use crate::{exchange, submission_request, RssPeak, Service};

const STREAMS: usize = 30;
/// The result's `stdout`: larger than the most a socket buffers here (`tcp_wmem`'s maximum is
/// 4 MiB on this kernel's defaults), so a client that stops reading blocks the service's
/// writes.
const STDOUT: usize = 8 << 20;
/// What the service may grow by while the streams are open: one encoding of the result and
/// the copy read from the store, not one per stream (30 × 8 MiB).
const BOUND_KIB: u64 = 96 * 1024;

/// A result whose `stdout` is `STDOUT` bytes of text.
fn large_result() -> Vec<u8> {
    let mut v: serde_json::Value =
        serde_json::from_str(&kernelkite_testkit::sample_result_json()).unwrap();
    v["runs"]["test"]["run"]["stdout"] = "all good\n".repeat(STDOUT / 9).into();
    serde_json::to_vec(&v).unwrap()
}

/// A connection with a tiny receive buffer (set before connecting, so the window stays
/// small), that asks for the events and reads only the status line.
async fn stalled_stream(port: u16, id: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    s.write_all(format!("GET /v1/submissions/{id}/events HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut first))
        .await
        .expect("an event stream starts")
        .unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn streams_nobody_reads_share_one_copy_of_the_result_and_are_closed_after_the_write_stall() {
    let svc = Service::start(&[("KERNELKITE_WRITE_STALL_S", "1")]).await;
    let a = exchange(svc.port, &submission_request(""), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(a.status, 202, "{a:?}");
    let id = a.json()["id"].as_str().unwrap().to_string();
    let number = svc
        .fake
        .next_created(Duration::from_secs(10))
        .await
        .expect("a build is created");
    svc.fake
        .finish_build(
            number,
            "passed",
            Some(ArtifactSpec::result_json(large_result())),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = svc
            .http
            .get(format!("{}/v1/submissions/{id}?wait=5", svc.base))
            .send()
            .await
            .unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        if v["state"] == "succeeded" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the submission did not succeed: {}",
            v["state"]
        );
    }
    let before = svc.metric("kernelkite_http_connections").await;
    let stalls = "kernelkite_http_refusals_total{reason=\"write_stall\"}";
    assert_eq!(svc.metric(stalls).await, 0.0);

    let idle = svc.rss_kib();
    let peak = RssPeak::start(svc.pid);
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        streams.push(stalled_stream(svc.port, &id).await);
    }
    // Every stream stalls on a full socket and is closed within twice the stall time; the
    // clients still hold their ends, unread.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let closed = svc.metric(stalls).await;
        if closed >= STREAMS as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{closed} of {STREAMS} stalled streams were closed: {}",
            svc.stderr()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let peak = peak.stop();
    eprintln!("resident memory: {idle} KiB before the streams, {peak} KiB at most while open");
    assert!(
        svc.metric("kernelkite_http_connections").await <= before,
        "the stalled connections still count as open"
    );
    assert!(
        peak.saturating_sub(idle) < BOUND_KIB,
        "{STREAMS} streams of an {} MiB result took the service from {idle} KiB to {peak} KiB",
        STDOUT >> 20
    );
    // A client that comes back to read finds the stream cut short: what the sockets held,
    // then the end, never the whole terminal event.
    let mut s = streams.pop().unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .expect("a closed stream ends")
        .ok();
    assert!(got.len() < STDOUT, "{} bytes arrived", got.len());

    // The service still streams the submission whole to a client that reads.
    let r = svc
        .http
        .get(format!("{}/v1/submissions/{id}/events", svc.base))
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    let terminal = text
        .split("\n\n")
        .find(|e| e.starts_with("event: succeeded"))
        .expect("the terminal event");
    let data: String = terminal
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect::<Vec<_>>()
        .join("\n");
    let v: serde_json::Value = serde_json::from_str(&data).unwrap();
    assert_eq!(
        v["submission"]["result"]["runs"]["test"]["run"]["stdout"]
            .as_str()
            .map(str::len),
        Some(STDOUT / 9 * 9)
    );
}
