//! The store on a full disk: a write that cannot be kept fails with a message saying what to
//! do, nothing of it is half-written, the store reports itself unhealthy until a write
//! succeeds again, and everything written before is still there.
//!
//! Its own test binary: the "disk" fills through RLIMIT_FSIZE, which limits every file this
//! process writes (with SIGXFSZ ignored, a write past it fails with EFBIG, as on a full disk);
//! root is not exempt, so this runs anywhere.

use kernelkite_service::executor::Job;
use kernelkite_service::store::{Inserted, NewSubmission, Sqlite, SyncMode};
use kernelkite_service::submission::Submission;

fn new_submission(i: usize) -> NewSubmission {
    let id = uuid::Uuid::new_v4().to_string();
    NewSubmission {
        sub: Submission::new(
            id.clone(),
            "h100".into(),
            Some(format!("run-{i}")),
            None,
            60,
            chrono::Utc::now(),
        ),
        job: Job {
            submission_id: id,
            run_id: format!("run-{i}"),
            queue: "h100".into(),
            mode: "test".into(),
            // Incompressible-ish bytes, so each row takes real space.
            payload: (0..4096)
                .map(|k| char::from(b'a' + ((i * 7 + k * 13) % 26) as u8))
                .collect(),
            ranked: false,
            pin: None,
            pin_tags: Default::default(),
        },
        deadline_ms: i64::MAX,
        idempotency: None,
        fair_tag: Some(0),
        cache_key: None,
    }
}

fn set_file_size_limit(bytes: libc::rlim_t) {
    // SAFETY: plain libc calls on this process's own signal disposition and limits.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut lim), 0);
        lim.rlim_cur = bytes.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
}

#[tokio::test]
async fn a_full_disk_fails_the_write_whole_and_the_store_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
    let mut kept = Vec::new();
    for i in 0..5 {
        let n = new_submission(i);
        let id = n.sub.id.clone();
        assert!(matches!(db.insert(n).await.unwrap(), Inserted::Created));
        kept.push(id);
    }
    db.health().await.unwrap();
    let used: u64 = ["kernelkite.db", "kernelkite.db-wal"]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.path().join(f)).ok())
        .map(|m| m.len())
        .max()
        .unwrap_or(0);
    set_file_size_limit(used + 64 * 1024);
    let mut failed = None;
    for i in 5..1000 {
        let n = new_submission(i);
        let id = n.sub.id.clone();
        match db.insert(n).await {
            Ok(_) => kept.push(id),
            Err(e) => {
                failed = Some((id, e));
                break;
            }
        }
    }
    let (lost_id, err) = failed.expect("the limit was reached");
    let msg = err.to_string();
    assert!(
        msg.contains("could not save") && msg.contains("free disk space"),
        "{msg}"
    );
    let unhealthy = db
        .health()
        .await
        .expect_err("a store whose last write failed is unhealthy");
    assert!(
        unhealthy.to_string().contains("free disk space"),
        "{unhealthy}"
    );
    assert!(db.last_write_error().is_some());

    // Space again: writes work and the store is healthy once one succeeded.
    set_file_size_limit(libc::RLIM_INFINITY);
    let n = new_submission(2000);
    let after = n.sub.id.clone();
    db.insert(n).await.unwrap();
    db.health().await.unwrap();
    drop(db);

    // Reopened: everything acknowledged is there, whole; the refused write left nothing.
    let db = Sqlite::open(Some(dir.path()), SyncMode::Normal, None).unwrap();
    for id in kept.iter().chain([&after]) {
        let s = db.load(id).await.unwrap().expect("kept");
        assert_eq!(&s.id, id);
    }
    assert!(db.load(&lost_id).await.unwrap().is_none(), "half-written");
    assert_eq!(db.pending().await.unwrap().len(), kept.len() + 1);
}
