//! GPU leases: which job holds which GPU, exclusive across every agent on the node.
//!
//! One lock file per GPU under `<run dir>/leases/gpu<N>.lock`. Its content names the holder
//! (job id, agent, and the job's anchor process as pid + start time). Taking or dropping a
//! lease happens under `flock` on that file, so two agents racing for a GPU are serialised by
//! the kernel even when they were misconfigured with the same `gpu-index`. A lease outlives
//! the hook that took it (the job's other hooks run later, in other processes), so "held"
//! means "recorded and the anchor process is still alive": a job whose agent died loses its
//! lease to the next job without anyone cleaning up.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::process::{is_alive, ProcessId};

/// Who holds a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The Buildkite job id.
    pub job_id: String,
    /// Agent name, for messages only.
    pub agent: String,
    /// The process that lives as long as the job (see [`crate::process::job_anchor`]).
    pub anchor: ProcessId,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "job {} (agent {:?}, pid {})",
            self.job_id, self.agent, self.anchor.pid
        )
    }
}

/// Which GPUs a job wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    /// These GPUs exactly (the agent is bound to them by tag or name).
    Exactly(Vec<u32>),
    /// Any `count` free GPUs among `candidates`, lowest first.
    Pool {
        /// How many.
        count: u32,
        /// The GPU indices to choose from.
        candidates: Vec<u32>,
    },
}

/// Why GPUs could not be leased or released.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The lease directory or a lock file could not be used.
    #[error("cannot use lease directory {path}: {error} (set KERNELKITE_RUN_DIR to a directory every agent on the node can write)")]
    Io {
        /// The lease directory.
        path: PathBuf,
        /// What the file system said.
        #[source]
        error: std::io::Error,
    },
    /// Live jobs held the wanted GPUs for the whole wait.
    #[error("no GPU free after waiting {waited_secs}s: {}; raise `lease-wait` or find out why the holder is still running", describe(.held))]
    Busy {
        /// How long the job waited.
        waited_secs: u64,
        /// Each GPU in the way and who holds it.
        held: Vec<(u32, Holder)>,
    },
    /// The job wants more GPUs than there are to choose from.
    #[error("the job wants {wanted} GPU(s) but the node has only {available} ({candidates:?})")]
    NotEnough {
        /// GPUs wanted.
        wanted: u32,
        /// GPUs to choose from.
        available: usize,
        /// Their indices.
        candidates: Vec<u32>,
    },
}

fn describe(held: &[(u32, Holder)]) -> String {
    held.iter()
        .map(|(gpu, h)| format!("GPU {gpu} is held by {h}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The lease directory of a node.
#[derive(Debug, Clone)]
pub struct Leases {
    dir: PathBuf,
    proc_root: PathBuf,
}

/// Holds an exclusive `flock` on a lock file for as long as it lives (std's `File::lock` is
/// `flock(LOCK_EX)` on Linux; the lock is dropped with the file).
struct Locked(File);

impl Locked {
    fn open(path: &Path) -> std::io::Result<Locked> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        loop {
            match file.lock() {
                Ok(()) => return Ok(Locked(file)),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn read_holder(&mut self) -> std::io::Result<Option<Holder>> {
        let mut text = String::new();
        self.0.seek(SeekFrom::Start(0))?;
        self.0.read_to_string(&mut text)?;
        // An unreadable record cannot name a live holder; treat it as free.
        Ok(serde_json::from_str(text.trim()).ok())
    }

    fn write_holder(&mut self, holder: Option<&Holder>) -> std::io::Result<()> {
        self.0.set_len(0)?;
        self.0.seek(SeekFrom::Start(0))?;
        if let Some(h) = holder {
            let text = serde_json::to_string(h).map_err(std::io::Error::other)?;
            self.0.write_all(text.as_bytes())?;
        }
        Ok(())
    }
}

/// Taken GPUs, or the holders in the way.
type Attempt = Result<Vec<u32>, Vec<(u32, Holder)>>;

enum TryTake {
    Taken,
    HeldBy(Holder),
}

impl Leases {
    /// Leases under `<run_dir>/leases`, judging holders' liveness through `proc_root`.
    pub fn new(run_dir: &Path, proc_root: &Path) -> Leases {
        Leases {
            dir: run_dir.join("leases"),
            proc_root: proc_root.to_path_buf(),
        }
    }

    fn io(&self, error: std::io::Error) -> LeaseError {
        LeaseError::Io {
            path: self.dir.clone(),
            error,
        }
    }

    fn lock(&self, gpu: u32) -> Result<Locked, LeaseError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.io(e))?;
        Locked::open(&self.dir.join(format!("gpu{gpu}.lock"))).map_err(|e| self.io(e))
    }

    fn try_take(&self, gpu: u32, me: &Holder) -> Result<TryTake, LeaseError> {
        let mut locked = self.lock(gpu)?;
        match locked.read_holder().map_err(|e| self.io(e))? {
            Some(h) if h.job_id != me.job_id && is_alive(&self.proc_root, h.anchor) => {
                return Ok(TryTake::HeldBy(h))
            }
            Some(h) if h.job_id != me.job_id => {
                tracing::warn!(gpu, holder = %h, "recovering the lease of a job that is gone");
            }
            _ => {}
        }
        locked.write_holder(Some(me)).map_err(|e| self.io(e))?;
        Ok(TryTake::Taken)
    }

    /// The live holder of a GPU, if any.
    pub fn holder(&self, gpu: u32) -> Result<Option<Holder>, LeaseError> {
        let mut locked = self.lock(gpu)?;
        let h = locked.read_holder().map_err(|e| self.io(e))?;
        Ok(h.filter(|h| is_alive(&self.proc_root, h.anchor)))
    }

    /// One attempt: take every wanted GPU or none.
    fn attempt(&self, want: &Want, me: &Holder) -> Result<Attempt, LeaseError> {
        let (needed, candidates) = match want {
            Want::Exactly(gpus) => (gpus.len(), gpus.clone()),
            Want::Pool { count, candidates } => (*count as usize, candidates.clone()),
        };
        let mut taken = Vec::new();
        let mut held = Vec::new();
        for gpu in candidates {
            if taken.len() == needed {
                break;
            }
            match self.try_take(gpu, me)? {
                TryTake::Taken => taken.push(gpu),
                TryTake::HeldBy(h) => {
                    held.push((gpu, h));
                    if matches!(want, Want::Exactly(_)) {
                        break;
                    }
                }
            }
        }
        if taken.len() == needed {
            return Ok(Ok(taken));
        }
        for gpu in taken {
            self.release_one(gpu, &me.job_id)?;
        }
        Ok(Err(held))
    }

    /// Takes the wanted GPUs for `me`, waiting up to `wait` while they are held by live jobs.
    /// Taking a lease the same job already holds succeeds (hooks may run twice).
    pub fn acquire(
        &self,
        want: &Want,
        me: &Holder,
        wait: Duration,
    ) -> Result<Vec<u32>, LeaseError> {
        let (wanted, pool) = match want {
            Want::Exactly(g) => (g.len() as u32, g.clone()),
            Want::Pool { count, candidates } => (*count, candidates.clone()),
        };
        if (pool.len() as u32) < wanted || wanted == 0 {
            return Err(LeaseError::NotEnough {
                wanted,
                available: pool.len(),
                candidates: pool,
            });
        }
        let start = Instant::now();
        let mut pause = Duration::from_millis(10);
        let mut announced = wait.is_zero();
        loop {
            match self.attempt(want, me)? {
                Ok(gpus) => return Ok(gpus),
                Err(held) => {
                    let elapsed = start.elapsed();
                    if elapsed >= wait {
                        return Err(LeaseError::Busy {
                            waited_secs: wait.as_secs(),
                            held,
                        });
                    }
                    if !announced {
                        // Shown in the job log: a job sitting here should say why.
                        tracing::warn!(
                            "{}; waiting up to {}s for it to be released",
                            describe(&held),
                            wait.as_secs()
                        );
                        announced = true;
                    }
                    std::thread::sleep(pause.min(wait - elapsed));
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
            }
        }
    }

    fn release_one(&self, gpu: u32, job_id: &str) -> Result<bool, LeaseError> {
        let mut locked = self.lock(gpu)?;
        match locked.read_holder().map_err(|e| self.io(e))? {
            Some(h) if h.job_id == job_id => {
                locked.write_holder(None).map_err(|e| self.io(e))?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Drops every lease `job_id` holds among `gpus`; returns the GPUs released. Idempotent.
    pub fn release(&self, gpus: &[u32], job_id: &str) -> Result<Vec<u32>, LeaseError> {
        let mut released = Vec::new();
        for &gpu in gpus {
            if self.release_one(gpu, job_id)? {
                released.push(gpu);
            }
        }
        Ok(released)
    }

    /// Drops every lease `job_id` holds, whichever GPU (for clean-up without a state file).
    pub fn release_all(&self, job_id: &str) -> Result<Vec<u32>, LeaseError> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Ok(Vec::new());
        };
        let gpus: Vec<u32> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("gpu")?
                    .strip_suffix(".lock")?
                    .parse()
                    .ok()
            })
            .collect();
        self.release(&gpus, job_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::identify;

    fn me(job: &str) -> Holder {
        Holder {
            job_id: job.into(),
            agent: "test".into(),
            anchor: identify(Path::new("/proc"), std::process::id()).unwrap(),
        }
    }

    fn dead(job: &str) -> Holder {
        let mut h = me(job);
        h.anchor.start_time += 1;
        h
    }

    #[test]
    fn pool_hands_out_distinct_gpus_then_names_holders() {
        let dir = tempfile::tempdir().unwrap();
        let l = Leases::new(dir.path(), Path::new("/proc"));
        let pool = Want::Pool {
            count: 1,
            candidates: vec![0, 1],
        };
        assert_eq!(l.acquire(&pool, &me("a"), Duration::ZERO).unwrap(), vec![0]);
        assert_eq!(l.acquire(&pool, &me("b"), Duration::ZERO).unwrap(), vec![1]);
        let err = l
            .acquire(&pool, &me("c"), Duration::from_millis(30))
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("GPU 0 is held by job a") && msg.contains("job b"),
            "{msg}"
        );
        // Same job again: idempotent.
        assert_eq!(l.acquire(&pool, &me("a"), Duration::ZERO).unwrap(), vec![0]);
        assert_eq!(l.release(&[0, 1], "a").unwrap(), vec![0]);
        assert_eq!(l.release(&[0, 1], "a").unwrap(), Vec::<u32>::new());
        assert_eq!(l.acquire(&pool, &me("c"), Duration::ZERO).unwrap(), vec![0]);
    }

    #[test]
    fn dead_holders_lose_their_lease() {
        let dir = tempfile::tempdir().unwrap();
        let l = Leases::new(dir.path(), Path::new("/proc"));
        let want = Want::Exactly(vec![3]);
        l.acquire(&want, &dead("gone"), Duration::ZERO).unwrap();
        assert!(l.holder(3).unwrap().is_none());
        assert_eq!(
            l.acquire(&want, &me("next"), Duration::ZERO).unwrap(),
            vec![3]
        );
        assert_eq!(l.holder(3).unwrap().unwrap().job_id, "next");
    }

    #[test]
    fn multi_gpu_takes_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let l = Leases::new(dir.path(), Path::new("/proc"));
        l.acquire(&Want::Exactly(vec![1]), &me("a"), Duration::ZERO)
            .unwrap();
        let pool2 = Want::Pool {
            count: 2,
            candidates: vec![0, 1, 2],
        };
        assert_eq!(
            l.acquire(&pool2, &me("b"), Duration::ZERO).unwrap(),
            vec![0, 2]
        );
        let err = l
            .acquire(&Want::Exactly(vec![2, 3]), &me("c"), Duration::ZERO)
            .unwrap_err();
        assert!(matches!(err, LeaseError::Busy { .. }));
        assert!(
            l.holder(3).unwrap().is_none(),
            "a failed multi-GPU take must not keep part"
        );
        let err = l
            .acquire(
                &Want::Pool {
                    count: 4,
                    candidates: vec![0, 1, 2],
                },
                &me("d"),
                Duration::ZERO,
            )
            .unwrap_err();
        assert!(matches!(err, LeaseError::NotEnough { .. }));
        assert_eq!(l.release_all("b").unwrap().len(), 2);
    }

    #[test]
    fn racing_threads_never_share_a_gpu() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::Arc;
        let dir = tempfile::tempdir().unwrap();
        let l = Leases::new(dir.path(), Path::new("/proc"));
        let inside: Arc<Vec<AtomicU32>> = Arc::new((0..2).map(|_| AtomicU32::new(0)).collect());
        let threads: Vec<_> = (0..6)
            .map(|t| {
                let l = l.clone();
                let inside = inside.clone();
                std::thread::spawn(move || {
                    let pool = Want::Pool {
                        count: 1,
                        candidates: vec![0, 1],
                    };
                    for i in 0..150 {
                        let job = format!("t{t}-{i}");
                        let gpus = l
                            .acquire(&pool, &me(&job), Duration::from_secs(30))
                            .unwrap();
                        let g = gpus[0] as usize;
                        assert_eq!(
                            inside[g].fetch_add(1, Ordering::SeqCst),
                            0,
                            "GPU {g} shared"
                        );
                        std::thread::yield_now();
                        inside[g].fetch_sub(1, Ordering::SeqCst);
                        l.release(&gpus, &job).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn waits_for_the_holder_to_release() {
        let dir = tempfile::tempdir().unwrap();
        let l = Leases::new(dir.path(), Path::new("/proc"));
        let want = Want::Exactly(vec![0]);
        l.acquire(&want, &me("a"), Duration::ZERO).unwrap();
        let l2 = l.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            l2.release(&[0], "a").unwrap();
        });
        assert_eq!(
            l.acquire(&want, &me("b"), Duration::from_secs(5)).unwrap(),
            vec![0]
        );
        t.join().unwrap();
    }
}
