//! Real processes racing for pooled GPUs: 8 jobs, 4 GPUs, one run dir.

use crate::agent;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent::common::output_ok;
use agent::{Node, BIN};
use kernelkite_testkit::Sleeper;

struct Racer {
    job: String,
    anchor: Sleeper,
    hook: Child,
}

impl Drop for Racer {
    fn drop(&mut self) {
        let _ = self.hook.kill();
        let _ = self.hook.wait();
        self.anchor.kill();
    }
}

fn hook(node: &Node, job: &str, anchor: u32, sub: &str) -> Command {
    let mut c = Command::new(BIN);
    c.arg(sub)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(&node.env)
        .env("BUILDKITE_JOB_ID", job)
        .env("BUILDKITE_AGENT_NAME", "pool-agent")
        .env("BUILDKITE_PLUGIN_CONFIGURATION", r#"{"lease-wait":30}"#)
        .env("KERNELKITE_JOB_PID", anchor.to_string());
    if sub == "environment" {
        c.args(["--export", "shell"]);
    }
    c
}

fn gpu_of(stdout: &[u8]) -> u32 {
    let text = String::from_utf8_lossy(stdout);
    text.lines()
        .find_map(|l| {
            // A job of several GPUs is named by its first.
            l.strip_prefix("export KERNELBOT_GPU_INDEX='")?
                .strip_suffix('\'')?
                .split(',')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no KERNELBOT_GPU_INDEX in {text}"))
}

/// Waits until `n` racers' hooks have exited; returns job → GPU for them.
fn finished(racers: &mut [Racer], n: usize, limit: Duration) -> BTreeMap<String, u32> {
    let start = Instant::now();
    loop {
        let done: Vec<usize> = racers
            .iter_mut()
            .enumerate()
            .filter_map(|(i, r)| matches!(r.hook.try_wait(), Ok(Some(_))).then_some(i))
            .collect();
        if done.len() >= n {
            let mut out = BTreeMap::new();
            for i in done {
                let r = &mut racers[i];
                let mut stdout = Vec::new();
                use std::io::Read;
                r.hook
                    .stdout
                    .take()
                    .unwrap()
                    .read_to_end(&mut stdout)
                    .unwrap();
                let mut stderr = String::new();
                r.hook
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut stderr)
                    .unwrap();
                assert!(r.hook.wait().unwrap().success(), "{}: {stderr}", r.job);
                out.insert(r.job.clone(), gpu_of(&stdout));
            }
            return out;
        }
        assert!(
            start.elapsed() < limit,
            "only {} of {n} hooks finished",
            done.len()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn eight_jobs_four_gpus_never_share_and_dead_holders_free_theirs() {
    let node = Node::new(4);
    let mut racers: Vec<Racer> = (0..8)
        .map(|i| {
            let job = format!("race-{i}");
            let anchor = Sleeper::new(600);
            let hook = hook(&node, &job, anchor.id(), "environment")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            Racer { job, anchor, hook }
        })
        .collect();

    let first = finished(&mut racers, 4, Duration::from_secs(20));
    assert_eq!(first.len(), 4);
    let gpus: BTreeSet<u32> = first.values().copied().collect();
    assert_eq!(
        gpus,
        BTreeSet::from([0, 1, 2, 3]),
        "four winners, four different GPUs: {first:?}"
    );
    // The other four are still waiting for a GPU.
    std::thread::sleep(Duration::from_millis(200));
    let waiting: Vec<usize> = (0..8)
        .filter(|&i| !first.contains_key(&racers[i].job))
        .collect();
    for &i in &waiting {
        assert!(
            matches!(racers[i].hook.try_wait(), Ok(None)),
            "{} did not wait",
            racers[i].job
        );
    }

    // Two holders die without cleaning up; two finish normally.
    let winners: Vec<usize> = (0..8)
        .filter(|&i| first.contains_key(&racers[i].job))
        .collect();
    for &i in &winners[..2] {
        racers[i].anchor.kill();
    }
    for &i in &winners[2..] {
        let r = &racers[i];
        output_ok(&mut hook(&node, &r.job, r.anchor.id(), "pre-exit"));
    }

    let mut rest: Vec<Racer> = Vec::new();
    for i in waiting.into_iter().rev() {
        rest.push(racers.remove(i));
    }
    let second = finished(&mut rest, 4, Duration::from_secs(20));
    let gpus: BTreeSet<u32> = second.values().copied().collect();
    assert_eq!(
        gpus,
        BTreeSet::from([0, 1, 2, 3]),
        "the waiters got every freed GPU once: {second:?}"
    );
}

/// Starts `environment` for `job` bound to the GPUs `gpu_index` (as a per-slice agent or a
/// multi-GPU queue's agent is, by tag) with the step's `config`; the job's anchor lives until
/// the racer is dropped.
fn bound(node: &Node, job: &str, gpu_index: &str, config: &str) -> Racer {
    let anchor = Sleeper::new(600);
    let hook = hook(node, job, anchor.id(), "environment")
        .env("BUILDKITE_AGENT_META_DATA_GPU_INDEX", gpu_index)
        .env("BUILDKITE_PLUGIN_CONFIGURATION", config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Racer {
        job: job.into(),
        anchor,
        hook,
    }
}

fn still_waiting(r: &mut Racer) -> bool {
    matches!(r.hook.try_wait(), Ok(None))
}

/// A whole-node job (the multi-GPU queue's agent, bound to every GPU) arrives while one-GPU
/// jobs hold each GPU. As they finish, the GPU they free goes to the whole-node job, which came
/// first, not to the next one-GPU job that asks for it at once; the whole-node job starts as
/// soon as the jobs it found finish, and the one-GPU job after it.
#[test]
fn a_whole_node_job_goes_before_one_gpu_jobs_that_came_after_it() {
    let node = Node::new(4);
    let single = r#"{"lease-wait":30}"#;
    let mut holders: Vec<Racer> = (0..4)
        .map(|g| bound(&node, &format!("one-{g}"), &g.to_string(), single))
        .collect();
    let got = finished(&mut holders, 4, Duration::from_secs(20));
    assert_eq!(got.len(), 4);

    let mut whole = vec![bound(
        &node,
        "whole",
        "0,1,2,3",
        r#"{"gpus":4,"lease-wait":30}"#,
    )];
    std::thread::sleep(Duration::from_millis(300));
    assert!(still_waiting(&mut whole[0]), "every GPU is held");

    // GPU 0 frees, and a one-GPU job asks for it at once: it waits behind the whole-node job.
    output_ok(&mut hook(
        &node,
        "one-0",
        holders[0].anchor.id(),
        "pre-exit",
    ));
    let mut next = vec![bound(&node, "next-0", "0", single)];
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        still_waiting(&mut next[0]),
        "GPU 0 goes to the job that came first"
    );
    assert!(still_waiting(&mut whole[0]), "GPUs 1-3 are still held");

    let freed = Instant::now();
    for (g, h) in holders.iter().enumerate().skip(1) {
        output_ok(&mut hook(
            &node,
            &format!("one-{g}"),
            h.anchor.id(),
            "pre-exit",
        ));
    }
    let started = finished(&mut whole, 1, Duration::from_secs(10));
    assert!(
        freed.elapsed() < Duration::from_secs(5),
        "{:?}",
        freed.elapsed()
    );
    assert!(started.contains_key("whole"));
    assert!(
        still_waiting(&mut next[0]),
        "the whole node is the whole-node job's"
    );

    output_ok(&mut hook(&node, "whole", whole[0].anchor.id(), "pre-exit"));
    let after = finished(&mut next, 1, Duration::from_secs(10));
    assert_eq!(after.get("next-0"), Some(&0));
}
