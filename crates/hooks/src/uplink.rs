//! A job's own network, for a step with `network: true` (host mode): a network namespace of the
//! job's, joined to the node by a veth pair and routed out through the node with NAT, so the job
//! reaches the outside world and nothing of the node's, nor of the networks the node is on.
//!
//! Sharing the node's network namespace (what `network: true` did before) let a job reach every
//! service on the node's loopback and every abstract unix socket (the kernel keeps those per
//! network namespace), as an outside review showed with a host service listening on `@name`.
//! Here the job has its own namespace, so the node's loopback and abstract sockets are simply
//! not there, and two nftables tables keep the rest out, each enough alone for what a job may
//! reach (the same destinations closed in both, [`closing_rules`]):
//! - in the job's namespace (`inet kernelkite_job`, loaded before its link is up, which the
//!   job, without `CAP_NET_ADMIN`, cannot change, and which no firewall tool of the node's
//!   flushes): nothing leaves for the node's own networks (its addresses and its neighbours),
//!   private and special ranges (RFC 1918, CGNAT, loopback, link-local and the clouds'
//!   metadata services, multicast, reserved, the jobs' own range) or IPv6, but the job's
//!   resolvers on port 53 and what the node's operator allows (`KERNELKITE_JOB_NETWORK_ALLOW`);
//! - on the node (`inet kernelkite_jobs`, the same for every job, loaded again atomically by
//!   each): what a job sends to any address of the node's is dropped before any DNAT (a
//!   container's published port included) and in `input`; what it sends on is held to the
//!   same destinations as in its namespace, and reaches no other job nor a DNAT'd
//!   destination; nothing unsolicited reaches a job, and the node opens no connection into
//!   one; what leaves is masqueraded behind the node's address.
//!
//! The kernel does the forwarding (IPv4 only), turned on for the two interfaces involved only
//! (`conf.<if>.forwarding`: the job's host end and the node's uplink, the default route's
//! device), never globally. An uplink whose forwarding was off stays on after the job (another
//! may be using it), and is guarded instead: the node's table forwards nothing that arrives
//! there but to a job, so the node never starts routing for its neighbours. Addresses:
//! `198.18.<slice>.0/30` per slice (the benchmarking range, RFC 2544, on no LAN; a node that
//! routes it is refused, saying so). Nothing is left per job: closing unmounts the namespace
//! (bound at `<run dir>/net/<job>`) and deletes the host end, which takes the pair with it.
//!
//! The commands are iproute2's `ip`, util-linux's `unshare` and `nsenter`, and nftables' `nft`,
//! from the system's directories only (never a `PATH` entry), run by the `command` hook (root,
//! one thread) before it makes the job's PID namespace; the sandbox's child then joins the
//! namespace ([`crate::sandbox`]). Planning is pure and tested; running the plan is this
//! module's only contact with the machine.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The nftables table every job's uplink shares.
pub const TABLE: &str = "kernelkite_jobs";

/// The prefix of the jobs' host-side interfaces (`kkj<slice>`), which the rules name.
pub const HOST_IF_PREFIX: &str = "kkj";

/// What the rules let a job reach besides the outside world, and what they close, for both
/// tables: the job's resolvers (port 53), the operator's ranges, the node's own networks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Destinations {
    /// The resolvers the job's resolver file names.
    pub resolvers: Vec<String>,
    /// `KERNELKITE_JOB_NETWORK_ALLOW`.
    pub allowed: Vec<String>,
    /// The node's networks ([`node_networks`]): its addresses and its neighbours.
    pub networks: Vec<String>,
}

/// The rules both tables share, each line starting with `matching` (the node's table names
/// the jobs' interfaces; the job's namespace holds only the job): its resolvers and the
/// operator's ranges let through, then the node's networks, [`CLOSED_RANGES`] and IPv6
/// dropped.
pub fn closing_rules(matching: &str, d: &Destinations) -> String {
    let set = |items: &[String]| items.join(", ");
    let mut rules = String::new();
    if !d.resolvers.is_empty() {
        for proto in ["udp", "tcp"] {
            rules.push_str(&format!(
                "    {matching}ip daddr {{ {} }} {proto} dport 53 accept\n",
                set(&d.resolvers)
            ));
        }
    }
    if !d.allowed.is_empty() {
        rules.push_str(&format!(
            "    {matching}ip daddr {{ {} }} accept\n",
            set(&d.allowed)
        ));
    }
    // One rule each: two of the node's networks may overlap, which one set would refuse.
    for net in &d.networks {
        rules.push_str(&format!("    {matching}ip daddr {net} counter drop\n"));
    }
    rules.push_str(&format!(
        "    {matching}ip daddr {{ {} }} counter drop\n    {matching}meta nfproto ipv6 counter drop\n",
        CLOSED_RANGES.join(", ")
    ));
    rules
}

/// The node's rules, loaded atomically (the `add` then `delete` make loading idempotent: the
/// table is replaced whole, never doubled). No chain drops by policy: the node's other traffic
/// (and its own firewall) is not this table's business, but for `guarded`, the uplinks whose
/// forwarding the jobs turned on ([`open`]): what arrives there is forwarded only to a job.
pub fn ruleset(d: &Destinations, guarded: &[String]) -> String {
    let jobs = format!("\"{HOST_IF_PREFIX}*\"");
    let from_jobs = format!("iifname {jobs} ");
    let guards: String = guarded
        .iter()
        .map(|dev| format!("    iifname \"{dev}\" oifname != {jobs} counter drop\n"))
        .collect();
    let chains = [
        format!("  chain prerouting {{\n    type filter hook prerouting priority raw; policy accept;\n    iifname {jobs} fib daddr type {{ local, broadcast, multicast }} counter drop\n  }}\n"),
        format!("  chain input {{\n    type filter hook input priority filter; policy accept;\n    iifname {jobs} ct state established,related accept\n    iifname {jobs} counter drop\n  }}\n"),
        format!(
            "  chain forward {{\n    type filter hook forward priority filter; policy accept;\n    iifname {jobs} oifname {jobs} counter drop\n    iifname {jobs} ct status dnat counter drop\n{}    iifname {jobs} accept\n    oifname {jobs} ct state established,related accept\n    oifname {jobs} counter drop\n{guards}  }}\n",
            closing_rules(&from_jobs, d)
        ),
        format!("  chain output {{\n    type filter hook output priority filter; policy accept;\n    oifname {jobs} ct state established,related accept\n    oifname {jobs} counter drop\n  }}\n"),
        format!("  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    iifname {jobs} oifname != {jobs} masquerade\n  }}\n"),
    ];
    format!(
        "add table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n{}}}\n",
        chains.concat()
    )
}

/// The table inside a job's own namespace.
pub const JOB_TABLE: &str = "kernelkite_job";

/// Destinations no job reaches unless allowed: this network (`0/8`), private (RFC 1918), CGNAT
/// (and Alibaba's metadata service in it), loopback, link-local (the metadata services of most
/// clouds), IETF protocol assignments, the benchmarking range (the jobs' own links), multicast,
/// reserved, and Azure's WireServer.
pub const CLOSED_RANGES: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "168.63.129.16/32",
];

/// The rules inside the job's namespace: loopback, then [`closing_rules`].
pub fn job_ruleset(d: &Destinations) -> String {
    format!(
        "table inet {JOB_TABLE} {{\n  chain output {{\n    type filter hook output priority filter; policy accept;\n    oifname \"lo\" accept\n{}  }}\n}}\n",
        closing_rules("", d)
    )
}

/// Checks an operator's allowed range (`KERNELKITE_JOB_NETWORK_ALLOW`): an IPv4 address or
/// `address/prefix`.
pub fn check_allowed(range: &str) -> Result<(), UplinkError> {
    let bad = || UplinkError::Allowed(range.to_string());
    let (addr, len) = match range.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (range, None),
    };
    addr.parse::<std::net::Ipv4Addr>().map_err(|_| bad())?;
    match len.map(str::parse::<u8>) {
        None | Some(Ok(0..=32)) => Ok(()),
        Some(_) => Err(bad()),
    }
}

/// The node's IPv4 networks in `ip -4 -o addr show`'s output: each address's network
/// (`192.0.2.0/24` for `inet 192.0.2.2/24`), which holds the address itself and the node's
/// neighbours on that link, whatever range it is in.
pub fn node_networks(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let net = words
            .iter()
            .position(|w| *w == "inet")
            .and_then(|i| words.get(i + 1))
            .and_then(|a| network_of(a));
        if let Some(n) = net {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    out
}

/// `a.b.c.d/len` (or a bare address, `/32`) as its network, host bits cleared.
fn network_of(cidr: &str) -> Option<String> {
    let (addr, len) = match cidr.split_once('/') {
        Some((a, l)) => (a, l.parse::<u32>().ok()?),
        None => (cidr, 32),
    };
    let ip = u32::from(addr.parse::<std::net::Ipv4Addr>().ok()?);
    let mask = u32::MAX.checked_shl(32 - len.min(32)).unwrap_or(0);
    Some(format!("{}/{len}", std::net::Ipv4Addr::from(ip & mask)))
}

/// The IPv4 resolvers of a resolver file, but loopback ones (not in the job's namespace).
pub fn resolvers(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|s| s.trim().parse::<std::net::Ipv4Addr>().ok())
        .filter(|ip| !ip.is_loopback())
        .map(|ip| ip.to_string())
        .collect()
}

/// Routes other than the default in `ip -4 route show match <address>`'s output: a node that
/// routes the jobs' range would send its own traffic for such addresses into a job.
pub fn clashing_routes(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("default"))
        .map(str::to_string)
        .collect()
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
    #[error("`network: true`: slice {0} is past the 256 slices the job address plan (198.18.<slice>.0/30) has")]
    SliceTooHigh(u32),
    /// The node routes addresses of the jobs' range.
    #[error("`network: true`: this node routes {range} ({routes}), where a job's link goes: its own traffic for those addresses would go into the job; give the node no route into 198.18.0.0/16, or set `network: false`")]
    Clash {
        /// The job's link.
        range: String,
        /// The node's routes there.
        routes: String,
    },
    /// `KERNELKITE_JOB_NETWORK_ALLOW` holds something that is not an IPv4 range.
    #[error("KERNELKITE_JOB_NETWORK_ALLOW: {0:?} is not an IPv4 address or ADDRESS/PREFIX; fix the agents' environment")]
    Allowed(String),

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
            gateway: format!("198.18.{slice}.1"),
            address: format!("198.18.{slice}.2"),
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

/// Where the tools are looked for: the system's directories, never a `PATH` entry (the agents'
/// `PATH` starts with a Python environment's directory).
const SYSTEM_DIRS: &[&str] = &["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

fn tool(name: &str) -> PathBuf {
    SYSTEM_DIRS
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| Path::new(SYSTEM_DIRS[0]).join(name))
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
    let mut cmd = Command::new(tool(program));
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

/// Where the uplinks are recorded whose forwarding was off before a job turned it on: the
/// node's table then forwards nothing that arrives there but to a job ([`ruleset`]). Under the
/// run dir, on tmpfs like the switches themselves (a reboot clears both).
fn guarded_dir(run_dir: &Path) -> PathBuf {
    netns_dir(run_dir).join("guarded")
}

/// Records each of `devices` whose forwarding is off now, before a job turns it on, and
/// returns every uplink so recorded (forwarding stays on after the job: another job may be
/// using it, and with the guard it forwards nothing of the node's neighbours).
fn guarded_uplinks(run_dir: &Path, devices: &[String]) -> Result<Vec<String>, UplinkError> {
    let dir = guarded_dir(run_dir);
    let file_error =
        |what: &'static str, path: PathBuf| move |source| UplinkError::File { what, path, source };
    std::fs::create_dir_all(&dir).map_err(file_error("create", dir.clone()))?;
    for d in devices {
        let switch = Path::new("/proc/sys/net/ipv4/conf")
            .join(d)
            .join("forwarding");
        let was = std::fs::read_to_string(&switch).map_err(file_error("read", switch))?;
        if was.trim() == "0" {
            let mark = dir.join(d);
            std::fs::write(&mark, "").map_err(file_error("write", mark))?;
        }
    }
    let mut out: Vec<String> = std::fs::read_dir(&dir)
        .map_err(file_error("read", dir.clone()))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    out.sort();
    Ok(out)
}

/// What a job's network lets through besides the outside world: its resolvers (port 53) and
/// the operator's ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Openings {
    /// The resolvers the job's resolver file names.
    pub resolvers: Vec<String>,
    /// `KERNELKITE_JOB_NETWORK_ALLOW`.
    pub allowed: Vec<String>,
}

/// Makes the job's network: the node's rules (again), its namespace with its own rules, the
/// veth pair, the addresses and routes, forwarding on its two interfaces. On failure, what was
/// made is taken down.
pub fn open(
    run_dir: &Path,
    job: &str,
    slice: u32,
    openings: &Openings,
) -> Result<Uplink, UplinkError> {
    let uplink = Uplink::of(run_dir, job, slice)?;
    for range in &openings.allowed {
        check_allowed(range)?;
    }
    let route = run(&words("ip -4 route show default"), None)?;
    let devices = default_route_devices(&route);
    if devices.is_empty() {
        return Err(UplinkError::NoRoute);
    }
    // A stale host end (a job killed before its clean-up) goes before the look at the routes.
    let _ = run(&words(&format!("ip link del {}", uplink.host_if)), None);
    let clash = clashing_routes(&run(
        &words(&format!("ip -4 route show match {}", uplink.gateway)),
        None,
    )?);
    if !clash.is_empty() {
        return Err(UplinkError::Clash {
            range: format!("{}/30", uplink.gateway),
            routes: clash.join("; "),
        });
    }
    let destinations = Destinations {
        resolvers: openings.resolvers.clone(),
        allowed: openings.allowed.clone(),
        networks: node_networks(&run(&words("ip -4 -o addr show"), None)?),
    };
    // The guards are in the node's table before any forwarding is turned on.
    let guarded = guarded_uplinks(run_dir, &devices)?;
    run(&words("nft -f -"), Some(&ruleset(&destinations, &guarded)))?;
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
        let mut commands = uplink.commands();
        let links = commands.split_off(1);
        for c in &commands {
            run(c, None)?;
        }
        // The job's own rules before its link: its namespace has no way out until they hold.
        let job_rules = job_ruleset(&destinations);
        let inside = format!("--net={}", uplink.netns.display());
        run(
            &[
                "nsenter".into(),
                inside,
                "nft".into(),
                "-f".into(),
                "-".into(),
            ],
            Some(&job_rules),
        )?;
        for c in &links {
            run(c, None)?;
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
        // Most jobs have no network: asking the kernel is free, starting `ip` is not (a few
        // ms of every job's pre-exit).
        if link_exists(&u.host_if) {
            let _ = run(&words(&format!("ip link del {}", u.host_if)), None);
        }
    }
    let netns = netns_dir(run_dir).join(job);
    if netns.exists() {
        let _ = rustix::mount::unmount(&netns, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_file(&netns);
    }
}

/// Whether this network namespace has a link named `name` (unsure counts as yes).
fn link_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return true;
    };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    index != 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENODEV)
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
            ("198.18.7.1", "198.18.7.2")
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
            "nsenter --net=/run/kernelkite/net/job-1 ip route add default via 198.18.7.1"
        );
    }

    #[test]
    fn a_link_is_deleted_only_where_the_namespace_has_it() {
        // Every network namespace has its loopback; no job's host end is named like this.
        assert!(link_exists("lo"));
        assert!(!link_exists("kkj-absent0"));
        // A name the kernel could not be asked about counts as present: `ip` decides.
        assert!(link_exists("a\0b"));
    }

    #[test]
    fn the_uplinks_are_the_default_routes_devices() {
        let text = "default via 10.0.0.1 dev eth0 proto dhcp src 10.0.0.5 metric 100\ndefault via 10.1.0.1 dev bond0 metric 200\ndefault via 10.0.0.1 dev eth0 metric 300\n";
        assert_eq!(default_route_devices(text), ["eth0", "bond0"]);
        assert!(default_route_devices("").is_empty());
    }

    #[test]
    fn the_rules_replace_the_table_whole_and_drop_nothing_by_policy() {
        let d = destinations();
        let r = ruleset(&d, &["eth0".into()]);
        assert!(
            r.starts_with("add table inet kernelkite_jobs\ndelete table inet kernelkite_jobs\n")
        );
        assert!(!r.contains("policy drop"));
        for rule in [
            "iifname \"kkj*\" fib daddr type { local, broadcast, multicast } counter drop",
            "iifname \"kkj*\" counter drop",
            "iifname \"kkj*\" oifname \"kkj*\" counter drop",
            "iifname \"kkj*\" ct status dnat counter drop",
            "iifname \"kkj*\" ip daddr { 10.255.255.53 } udp dport 53 accept",
            "iifname \"kkj*\" ip daddr 192.0.2.0/24 counter drop",
            "oifname \"kkj*\" counter drop",
            "iifname \"eth0\" oifname != \"kkj*\" counter drop",
            "iifname \"kkj*\" oifname != \"kkj*\" masquerade",
        ] {
            assert!(r.contains(rule), "{rule}\n{r}");
        }
        // The node holds a job to the same destinations as the job's own table, before it
        // lets the rest through.
        let closed = r.find("169.254.0.0/16").unwrap();
        assert!(closed < r.find("iifname \"kkj*\" accept").unwrap(), "{r}");
        assert!(!ruleset(&d, &[]).contains("iifname \"eth0\""));
    }

    fn destinations() -> Destinations {
        Destinations {
            resolvers: vec!["10.255.255.53".into()],
            allowed: vec!["10.20.0.0/16".into()],
            networks: vec!["192.0.2.0/24".into(), "10.0.0.5/32".into()],
        }
    }

    #[test]
    fn the_job_s_rules_open_its_resolvers_and_the_allowed_and_close_the_rest() {
        let r = job_ruleset(&destinations());
        let at = |needle: &str| r.find(needle).unwrap_or_else(|| panic!("{needle}: {r}"));
        let resolver = at("ip daddr { 10.255.255.53 } udp dport 53 accept");
        let allowed = at("ip daddr { 10.20.0.0/16 } accept");
        let node = at("ip daddr 192.0.2.0/24 counter drop\n    ip daddr 10.0.0.5/32 counter drop");
        let closed = at("10.0.0.0/8, 100.64.0.0/10");
        let v6 = at("meta nfproto ipv6 counter drop");
        assert!(
            at("oifname \"lo\" accept") < resolver
                && resolver < allowed
                && allowed < node
                && node < closed
                && closed < v6,
            "{r}"
        );
        let bare = job_ruleset(&Destinations::default());
        assert!(
            !bare.contains("dport 53") && bare.contains("168.63.129.16/32"),
            "{bare}"
        );
    }

    #[test]
    fn addresses_resolvers_routes_and_allowed_ranges_are_read() {
        let addr = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever\n5: wg0    inet 10.9.0.5 peer 10.9.0.6/32 scope global wg0\n6: eth1    inet 203.0.113.77/0 scope global eth1\n";
        assert_eq!(
            node_networks(addr),
            ["127.0.0.0/8", "192.0.2.0/24", "10.9.0.5/32", "0.0.0.0/0"]
        );
        assert_eq!(
            resolvers("nameserver 127.0.0.53\nnameserver 10.255.255.53\nnameserver ::1\n"),
            ["10.255.255.53"]
        );
        assert!(clashing_routes("default via 192.0.2.1 dev eth0 \n").is_empty());
        assert_eq!(
            clashing_routes("default via 192.0.2.1 dev eth0\n198.18.0.0/15 dev vpn0\n"),
            ["198.18.0.0/15 dev vpn0"]
        );
        for ok in ["10.20.0.0/16", "203.0.113.7", "0.0.0.0/0"] {
            assert!(check_allowed(ok).is_ok(), "{ok}");
        }
        for bad in ["10.20.0.0/33", "example.com", "10.0.0.0/x", "::1", ""] {
            assert!(
                matches!(check_allowed(bad), Err(UplinkError::Allowed(_))),
                "{bad}"
            );
        }
    }
}
