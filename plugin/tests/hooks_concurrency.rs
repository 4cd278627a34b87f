//! Real processes racing for pooled GPUs: 8 jobs, 4 GPUs, one run dir.

mod agent;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent::common::output_ok;
use agent::{Node, BIN};

struct Racer {
    job: String,
    anchor: Child,
    hook: Child,
}

impl Drop for Racer {
    fn drop(&mut self) {
        let _ = self.hook.kill();
        let _ = self.hook.wait();
        let _ = self.anchor.kill();
        let _ = self.anchor.wait();
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
            l.strip_prefix("export KERNELBOT_GPU_INDEX='")?
                .strip_suffix('\'')?
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
            let anchor = Command::new("sleep").arg("600").spawn().unwrap();
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
        racers[i].anchor.kill().unwrap();
        racers[i].anchor.wait().unwrap();
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
