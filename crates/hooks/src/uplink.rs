//! A job's own network, for a step with `network: true` (host mode): a network namespace of the
//! job's, joined to the node by a veth pair and routed out through the node with NAT, so the job
//! reaches the outside world and nothing of the node's.
//!
//! Sharing the node's network namespace (what `network: true` did before) let a job reach every
//! service on the node's loopback and every abstract unix socket (the kernel keeps those per
//! network namespace), as an outside review showed with a host service listening on `@name`.
//! Here the job has its own namespace, so the node's loopback and abstract sockets are simply
//! not there, and one nftables table (`inet kernelkite_jobs`, the same for every job, loaded
//! again atomically by each) keeps the rest out:
//! - `input`: nothing the job sends reaches the node itself, at any of its addresses (the
//!   host end of the veth, its own LAN address, a service bound to `0.0.0.0`), but replies to
//!   what the node opened;
//! - `forward`: a job reaches no other job, nor link-local addresses (a cloud's metadata
//!   service, 169.254.169.254); nothing unsolicited reaches a job;
//! - `postrouting`: what leaves is masqueraded behind the node's address.
//!
//! The kernel does the forwarding (IPv4 only: a job has no IPv6 route), turned on for the two
//! interfaces involved only (`conf.<if>.forwarding`: the job's host end and the node's uplink,
//! the default route's device), never globally. Addresses: `10.231.<slice>.0/30` per slice (a
//! slice runs one job at a time). Nothing is left per job: closing unmounts the namespace
//! (bound at `<run dir>/net/<job>`) and deletes the host end, which takes the pair with it.
//!
//! The commands are iproute2's `ip`, util-linux's `unshare` and `nsenter`, and nftables' `nft`,
//! run by the `command` hook (root, one thread) before it makes the job's PID namespace; the
//! sandbox's child then joins the namespace ([`crate::sandbox`]). Planning is pure and tested;
//! running the plan is this module's only contact with the machine.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The nftables table every job's uplink shares.
pub const TABLE: &str = "kernelkite_jobs";

/// The prefix of the jobs' host-side interfaces (`kkj<slice>`), which the rules name.
pub const HOST_IF_PREFIX: &str = "kkj";

/// The rules, loaded atomically (the `add` then `delete` make loading idempotent: the table is
/// replaced whole, never doubled). No chain drops by policy: the node's other traffic (and its
/// own firewall) is not this table's business.
pub fn ruleset() -> String {
    let jobs = format!("\"{HOST_IF_PREFIX}*\"");
    format!(
        "add table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n\
  chain input {{\n    type filter hook input priority filter; policy accept;\n    iifname {jobs} ct state established,related accept\n    iifname {jobs} counter drop\n  }}\n\
  chain forward {{\n    type filter hook forward priority filter; policy accept;\n    iifname {jobs} oifname {jobs} counter drop\n    iifname {jobs} ip daddr 169.254.0.0/16 counter drop\n    iifname {jobs} accept\n    oifname {jobs} ct state established,related accept\n    oifname {jobs} counter drop\n  }}\n\
  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    iifname {jobs} oifname != {jobs} masquerade\n  }}\n}}\n"
    )
}

/// Why a job's network could not be made.
#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    /// A command failed or could not run.
    #[error("`network: true` needs the job's own network, and `{command}` failed: {why}; the node needs iproute2 (`ip`), util-linux (`unshare`, `nsenter`) and nftables (`nft`), run as root")]
    Command {
        /// The command line.
        command: String,
        /// What it said, or why it did not run.
        why: String,
    },
    /// The node has no IPv4 default route: nothing to route the job out through.
    #[error("`network: true`: this node has no IPv4 default route (`ip -4 route show default` is empty), so a job's network would lead nowhere; give the node a route out, or set `network: false`")]
    NoRoute,
    /// The slice's index does not fit the address plan.
    #[error("`network: true`: slice {0} is past the 256 slices the job address plan (10.231.<slice>.0/30) has")]
    SliceTooHigh(u32),
    /// A file of the plan could not be written.
    #[error("`network: true`: cannot {what} {}: {source}", .path.display())]
    File {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where a job's network is and what it is called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uplink {
    /// The namespace, bound at `<run dir>/net/<job>`.
    pub netns: PathBuf,
    /// The host end of the veth (`kkj<slice>`); the job's end is its `eth0`.
    pub host_if: String,
    /// The host end's address (the job's gateway).
    pub gateway: String,
    /// The job's address.
    pub address: String,
}

impl Uplink {
    /// The uplink of `job` on `slice`, its namespace under `run_dir`.
    pub fn of(run_dir: &Path, job: &str, slice: u32) -> Result<Uplink, UplinkError> {
        if slice > 255 {
            return Err(UplinkError::SliceTooHigh(slice));
        }
        Ok(Uplink {
            netns: netns_dir(run_dir).join(job),
            host_if: format!("{HOST_IF_PREFIX}{slice}"),
            gateway: format!("10.231.{slice}.1"),
            address: format!("10.231.{slice}.2"),
        })
    }

    /// The commands that make it, in order, given the node's uplink devices (after the
    /// namespace's file exists). A stale host end (a job killed before its clean-up) is deleted
    /// first, separately ([`open`]).
    pub fn commands(&self) -> Vec<Vec<String>> {
        let ns = self.netns.display().to_string();
        let inside = |args: &[&str]| -> Vec<String> {
            let mut v = vec!["nsenter".to_string(), format!("--net={ns}"), "ip".into()];
            v.extend(args.iter().map(|s| s.to_string()));
            v
        };
        let words = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>();
        vec![
            vec!["unshare".into(), format!("--net={ns}"), "true".into()],
            vec![
                "ip".into(),
                "link".into(),
                "add".into(),
                self.host_if.clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                "eth0".into(),
                "netns".into(),
                ns.clone(),
            ],
            words(&format!(
                "ip addr add {}/30 dev {}",
                self.gateway, self.host_if
            )),
            words(&format!("ip link set {} up", self.host_if)),
            inside(&["link", "set", "lo", "up"]),
            inside(&[
                "addr",
                "add",
                &format!("{}/30", self.address),
                "dev",
                "eth0",
            ]),
            inside(&["link", "set", "eth0", "up"]),
            inside(&["route", "add", "default", "via", &self.gateway]),
        ]
    }
}

/// Where jobs' network namespaces are bound.
pub fn netns_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("net")
}

/// The devices of the IPv4 default routes in `ip -4 route show default`'s output.
pub fn default_route_devices(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(i) = words.iter().position(|w| *w == "dev") {
            if let Some(dev) = words.get(i + 1) {
                if !out.iter().any(|d| d == dev) {
                    out.push(dev.to_string());
                }
            }
        }
    }
    out
}

fn run(argv: &[String], stdin: Option<&str>) -> Result<String, UplinkError> {
    use std::io::Write as _;
    let failed = |why: String| UplinkError::Command {
        command: argv.join(" "),
        why,
    };
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| failed("an empty command".into()))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| failed(e.to_string()))?;
    if let (Some(text), Some(mut input)) = (stdin, child.stdin.take()) {
        input
            .write_all(text.as_bytes())
            .map_err(|e| failed(e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| failed(e.to_string()))?;
    if !out.status.success() {
        return Err(failed(format!(
            "{} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn forwarding(dev: &str) -> Result<(), UplinkError> {
    let path = Path::new("/proc/sys/net/ipv4/conf")
        .join(dev)
        .join("forwarding");
    std::fs::write(&path, "1").map_err(|source| UplinkError::File {
        what: "turn on forwarding in",
        path,
        source,
    })
}

/// Makes the job's network: the rules (again), its namespace, the veth pair, the addresses and
/// routes, forwarding on its two interfaces. On failure, what was made is taken down.
pub fn open(run_dir: &Path, job: &str, slice: u32) -> Result<Uplink, UplinkError> {
    let uplink = Uplink::of(run_dir, job, slice)?;
    let route = run(&words("ip -4 route show default"), None)?;
    let devices = default_route_devices(&route);
    if devices.is_empty() {
        return Err(UplinkError::NoRoute);
    }
    run(&words("nft -f -"), Some(&ruleset()))?;
    let made = (|| {
        let dir = netns_dir(run_dir);
        std::fs::create_dir_all(&dir).map_err(|source| UplinkError::File {
            what: "create",
            path: dir,
            source,
        })?;
        std::fs::write(&uplink.netns, "").map_err(|source| UplinkError::File {
            what: "create",
            path: uplink.netns.clone(),
            source,
        })?;
        // A host end left by a job killed before its clean-up.
        let _ = run(&words(&format!("ip link del {}", uplink.host_if)), None);
        for c in uplink.commands() {
            run(&c, None)?;
        }
        forwarding(&uplink.host_if)?;
        for d in &devices {
            forwarding(d)?;
        }
        Ok(())
    })();
    if let Err(e) = made {
        close(run_dir, job, Some(slice));
        return Err(e);
    }
    Ok(uplink)
}

/// Takes the job's network down: its host end (cutting the job off at once, even while its
/// processes live) and its namespace's binding. Idempotent; failures are only logged (the
/// next job on the slice deletes a stale host end).
pub fn close(run_dir: &Path, job: &str, slice: Option<u32>) {
    if let Some(u) = slice.and_then(|s| Uplink::of(run_dir, job, s).ok()) {
        let _ = run(&words(&format!("ip link del {}", u.host_if)), None);
    }
    let netns = netns_dir(run_dir).join(job);
    if netns.exists() {
        let _ = rustix::mount::unmount(&netns, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_file(&netns);
    }
}

fn words(s: &str) -> Vec<String> {
    s.split(' ').map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_slice_has_its_own_link_and_addresses() {
        let u = Uplink::of(Path::new("/run/kernelkite"), "job-1", 7).unwrap();
        assert_eq!(u.netns, Path::new("/run/kernelkite/net/job-1"));
        assert_eq!(u.host_if, "kkj7");
        assert_eq!(
            (u.gateway.as_str(), u.address.as_str()),
            ("10.231.7.1", "10.231.7.2")
        );
        assert!(
            u.host_if.len() <= 15,
            "an interface name is at most 15 bytes"
        );
        assert!(matches!(
            Uplink::of(Path::new("/r"), "j", 256),
            Err(UplinkError::SliceTooHigh(256))
        ));
        let cmds: Vec<String> = u.commands().iter().map(|c| c.join(" ")).collect();
        assert_eq!(cmds[0], "unshare --net=/run/kernelkite/net/job-1 true");
        assert_eq!(
            cmds[1],
            "ip link add kkj7 type veth peer name eth0 netns /run/kernelkite/net/job-1"
        );
        assert_eq!(
            cmds.last().unwrap(),
            "nsenter --net=/run/kernelkite/net/job-1 ip route add default via 10.231.7.1"
        );
    }

    #[test]
    fn the_uplinks_are_the_default_routes_devices() {
        let text = "default via 10.0.0.1 dev eth0 proto dhcp src 10.0.0.5 metric 100\ndefault via 10.1.0.1 dev bond0 metric 200\ndefault via 10.0.0.1 dev eth0 metric 300\n";
        assert_eq!(default_route_devices(text), ["eth0", "bond0"]);
        assert!(default_route_devices("").is_empty());
    }

    #[test]
    fn the_rules_replace_the_table_whole_and_drop_nothing_by_policy() {
        let r = ruleset();
        assert!(
            r.starts_with("add table inet kernelkite_jobs\ndelete table inet kernelkite_jobs\n")
        );
        assert!(!r.contains("policy drop"));
        for rule in [
            "iifname \"kkj*\" counter drop",
            "iifname \"kkj*\" oifname \"kkj*\" counter drop",
            "iifname \"kkj*\" ip daddr 169.254.0.0/16 counter drop",
            "oifname \"kkj*\" counter drop",
            "iifname \"kkj*\" oifname != \"kkj*\" masquerade",
        ] {
            assert!(r.contains(rule), "{rule}");
        }
    }
}
