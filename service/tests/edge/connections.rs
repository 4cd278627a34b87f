//! Slow and idle connections must not take the service down: 1,100 idle connections under
//! systemd's 1,024-file limit made `/healthz`, submissions and signed webhooks time out
//! (`accept error: Too many open files`), and 3,000 connections sending a header byte every
//! few seconds were never closed.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::{
    exchange, forged_signature, healthz, raise_own_nofile, read_answer, signed_ping,
    submission_request, Options, Service,
};

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_under_a_1024_file_limit_leave_healthz_webhooks_and_submissions_answering()
{
    if raise_own_nofile() < 4096 {
        kernelkite_testkit::skip("this test process cannot open 1,100 sockets (ulimit -n)");
        return;
    }
    // Soft and hard both 1024: the service cannot raise it, as under a strict LimitNOFILE.
    let svc = Service::start_with(Options {
        nofile: Some((1024, 1024)),
        ..Options::default()
    })
    .await;
    assert_eq!(svc.nofile_limits(), ("1024".into(), "1024".into()));

    let mut idle = Vec::new();
    for _ in 0..1100 {
        idle.push(TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap());
    }
    // Let the accept loop reach them all.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let t = Instant::now();
    assert_eq!(healthz(svc.port, 3 * SECOND).await.ok(), Some(200));
    let ping = exchange(svc.port, &signed_ping(), 3 * SECOND)
        .await
        .unwrap();
    assert_eq!(ping.status, 200, "{ping:?}");
    let sub = exchange(svc.port, &submission_request(""), 3 * SECOND)
        .await
        .unwrap();
    assert_eq!(sub.status, 202, "{sub:?}");
    assert!(svc.fake.next_created(5 * SECOND).await.is_some());
    eprintln!("answered under 1,100 idle connections in {:?}", t.elapsed());

    let files = svc.open_files();
    assert!(files < 1024 - 64, "the service holds {files} files of 1024");
    // The service let go of all but the cap (832 here) and its reserve for probes (16):
    // the oldest idle connections were closed to make room, or (in a burst, while those
    // were closing) answered 503 and closed.
    let mut let_go = 0;
    for s in &mut idle {
        let mut b = [0u8; 1];
        if let Ok(Ok(_) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await
        {
            let_go += 1;
        }
    }
    assert!(
        let_go >= 1100 - 832 - 16,
        "only {let_go} of 1100 idle connections were let go"
    );
    let evicted = svc
        .metric("kernelkite_http_refusals_total{reason=\"evicted\"}")
        .await;
    let refused = svc
        .metric("kernelkite_http_refusals_total{reason=\"connection_cap\"}")
        .await;
    assert!(
        evicted >= 200.0 && evicted + refused >= (1100 - 832 - 16) as f64,
        "evicted {evicted}, refused {refused}"
    );
    assert_eq!(svc.metric("kernelkite_http_connection_cap").await, 832.0);
    let log = svc.stderr();
    assert!(!log.contains("Too many open files"), "{log}");
}

#[tokio::test]
async fn the_soft_open_files_limit_is_raised_to_the_hard_one() {
    // systemd's default: soft 1024, hard higher.
    let svc = Service::start_with(Options {
        nofile: Some((1024, 4096)),
        ..Options::default()
    })
    .await;
    assert_eq!(svc.nofile_limits(), ("4096".into(), "4096".into()));
    assert_eq!(
        svc.metric("kernelkite_http_connection_cap").await,
        (4096 - 4096 / 8) as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "full tier (scripts/test.sh runs it): waits out timeouts and intervals of seconds"]
async fn slow_headers_idle_keep_alives_and_slow_bodies_are_cut_off() {
    if raise_own_nofile() < 8192 {
        kernelkite_testkit::skip("this test process cannot open 3,000 sockets (ulimit -n)");
        return;
    }
    let svc = Service::start(&[
        ("KERNELKITE_HEADER_READ_TIMEOUT_S", "1"),
        ("KERNELKITE_IDLE_TIMEOUT_S", "2"),
        ("KERNELKITE_BODY_READ_TIMEOUT_S", "1"),
    ])
    .await;

    // 3,000 connections, each sending its request head one byte every 300 ms.
    let start = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..3000 {
        let port = svc.port;
        slow.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            let head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaa";
            let mut b = [0u8; 64];
            for byte in head.iter().cycle().take(100) {
                tokio::select! {
                    r = s.read(&mut b) => {
                        // Closed (or reset) by the service: when.
                        if matches!(r, Ok(0) | Err(_)) {
                            return Some(start.elapsed());
                        }
                    }
                    _ = tokio::time::sleep(Duration::from_millis(300)) => {
                        if s.write_all(std::slice::from_ref(byte)).await.is_err() {
                            return Some(start.elapsed());
                        }
                    }
                }
            }
            None // never closed in 30 s
        }));
    }
    // While they trickle, the service answers.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(healthz(svc.port, 3 * SECOND).await.ok(), Some(200));
    let mut closed_at = Vec::new();
    for t in slow {
        closed_at.push(t.await.unwrap());
    }
    let never = closed_at.iter().filter(|c| c.is_none()).count();
    assert_eq!(
        never, 0,
        "{never} slow-header connections were never closed"
    );
    let latest = closed_at.iter().flatten().max().unwrap();
    let earliest = closed_at.iter().flatten().min().unwrap();
    eprintln!("slow headers closed between {earliest:?} and {latest:?}");
    // Measured from before the first of the 3,000 connects: the last is accepted seconds later
    // on a loaded 2-core machine (5.7 s once, in CI's fresh-clone run beside other suites).
    // What matters is that none lives to the 30 s it would trickle for.
    assert!(
        *latest < Duration::from_secs(10),
        "the last slow header was closed after {latest:?} (timeout 1 s; it trickles for 30 s)"
    );
    assert!(
        *earliest >= Duration::from_millis(900),
        "closed before the header timeout: {earliest:?}"
    );
    assert!(
        svc.metric("kernelkite_http_refusals_total{reason=\"timeout\"}")
            .await
            >= 3000.0
    );

    // A keep-alive connection left idle after its answer is closed after the idle timeout.
    let mut s = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_answer(&mut s).await.unwrap().status, 200);
    let t = Instant::now();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(10 * SECOND, s.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0) | Err(_))), "{r:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(1900) && t.elapsed() < Duration::from_secs(5),
        "idle keep-alive closed after {:?} (timeout 2 s)",
        t.elapsed()
    );

    // A body that trickles is answered 408 (JSON) once the body timeout is over: a webhook
    // with well-formed headers, and a submission.
    for (path, extra) in [
        (
            "/webhooks/buildkite",
            format!("x-buildkite-signature: {}\r\n", forged_signature()),
        ),
        ("/v1/submissions", String::new()),
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
        s.write_all(
            format!("POST {path} HTTP/1.1\r\nhost: x\r\n{extra}content-length: 1000\r\n\r\n{{")
                .as_bytes(),
        )
        .await
        .unwrap();
        let t = Instant::now();
        let a = tokio::time::timeout(10 * SECOND, read_answer(&mut s))
            .await
            .expect("a slow body is answered")
            .unwrap();
        assert_eq!(a.status, 408, "{path}: {a:?}");
        assert!(
            a.json()["error"]
                .as_str()
                .unwrap()
                .contains("KERNELKITE_BODY_READ_TIMEOUT_S"),
            "{a:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    }
}

#[tokio::test]
async fn over_the_cap_idle_and_unauthenticated_connections_make_room_and_busy_ones_get_a_503() {
    let svc = Service::start(&[("KERNELKITE_MAX_CONNECTIONS", "8")]).await;
    let (status, v) = {
        let a = exchange(svc.port, &submission_request(""), 5 * SECOND)
            .await
            .unwrap();
        (a.status, a.json())
    };
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let events = format!("GET /v1/submissions/{id}/events HTTP/1.1\r\nhost: x\r\n\r\n");

    // Eight connections that only send a webhook's headers and a byte of its body: they
    // hold the cap, but nobody has proved anything, so they make room for real requests.
    let mut unauthenticated = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
        s.write_all(
            format!(
                "POST /webhooks/buildkite HTTP/1.1\r\nhost: x\r\nx-buildkite-signature: {}\r\ncontent-length: 1000\r\n\r\n{{",
                forged_signature()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        unauthenticated.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Real work displaces them: eight event streams (each a request in flight). Each one's
    // first bytes are read before the next connects, so the service has it in flight (on a
    // loaded machine a request not yet read is a connection with nothing to show).
    let mut polls = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap();
        s.write_all(events.as_bytes()).await.unwrap();
        let mut first = [0u8; 12];
        tokio::time::timeout(5 * SECOND, s.read_exact(&mut first))
            .await
            .expect("an event stream starts")
            .unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        polls.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for s in &mut unauthenticated {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(SECOND, s.read(&mut b)).await;
        assert!(
            matches!(r, Ok(Ok(0) | Err(_))),
            "an unauthenticated body kept its connection over the cap: {r:?}"
        );
    }

    // Every connection busy: probes still answered (the reserve), and Buildkite's webhooks
    // (issue 21, item 5: they end submissions), anything else 503 in JSON.
    assert_eq!(healthz(svc.port, 3 * SECOND).await.ok(), Some(200));
    let hook = exchange(svc.port, &crate::signed_ping(), 3 * SECOND)
        .await
        .unwrap();
    assert_eq!(
        hook.status, 200,
        "a webhook was refused over the cap: {hook:?}"
    );
    let refused = exchange(svc.port, &submission_request(""), 3 * SECOND)
        .await
        .unwrap();
    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(
        refused.json()["error"]
            .as_str()
            .unwrap()
            .contains("KERNELKITE_MAX_CONNECTIONS"),
        "{refused:?}"
    );
    assert!(refused.head.to_ascii_lowercase().contains("retry-after"));

    // Past the reserve, the fixed 503 — JSON as well. OPS_RESERVE idle connections fill the
    // reserve (held there: nothing evicts a reserve connection, and the timeouts are long);
    // then a probe gets the fixed answer. A reserve connection the service has just answered
    // (the 503 above) may hold its place a moment longer; then one of the idle ones is the
    // one refused, and its answer is the fixed 503 instead.
    let reserve_size = kernelkite_service::http::server::OPS_RESERVE;
    let mut reserve = Vec::new();
    for _ in 0..reserve_size {
        reserve.push(TcpStream::connect(("127.0.0.1", svc.port)).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut answered_idle = None;
    for s in &mut reserve {
        let mut first = [0u8; 1];
        // Only what has already arrived: a held connection has nothing to read.
        if let Ok(peeked) = tokio::time::timeout(Duration::from_millis(1), s.peek(&mut first)).await
        {
            answered_idle = Some(match peeked {
                Ok(0) => Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "an idle connection was closed without an answer",
                )),
                Ok(_) => read_answer(s).await,
                Err(e) => Err(e),
            });
            break;
        }
    }
    let fixed = match answered_idle {
        Some(a) => a.unwrap(),
        None => exchange(
            svc.port,
            b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            3 * SECOND,
        )
        .await
        .unwrap(),
    };
    if fixed.status != 503 {
        // What the service did meanwhile: the streams' submission, evictions, refusals.
        let state = exchange(
            svc.port,
            format!("GET /v1/submissions/{id} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .as_bytes(),
            3 * SECOND,
        )
        .await;
        let metrics = exchange(
            svc.port,
            b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            3 * SECOND,
        )
        .await
        .map(|a| {
            a.body
                .lines()
                .filter(|l| l.starts_with("kernelkite_http"))
                .collect::<Vec<_>>()
                .join("\n")
        });
        let log = svc.stderr();
        let notable: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains(" INFO ") || l.contains("evict") || l.contains("refus"))
            .collect();
        panic!(
            "with {} idle connections past the cap, healthz answered {fixed:?}\nthe submission: {state:?}\nmetrics: {metrics:?}\nthe service's warnings: {}",
            reserve.len(),
            notable.join("\n")
        );
    }
    assert!(fixed.json()["error"]
        .as_str()
        .unwrap()
        .contains("connection"));
    drop(reserve);

    // The streams end: connections are free again.
    drop(polls);
    let deadline = Instant::now() + 5 * SECOND;
    loop {
        let a = exchange(svc.port, &submission_request(""), 3 * SECOND).await;
        if matches!(&a, Ok(a) if a.status == 202) {
            break;
        }
        assert!(Instant::now() < deadline, "never served again: {a:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        svc.metric("kernelkite_http_refusals_total{reason=\"connection_cap\"}")
            .await
            >= 2.0
    );
}
