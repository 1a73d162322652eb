//! Several hosts on one machine for end-to-end tests: Linux network namespaces joined by a bridge. A [`Net`]
//! owns a "switch" namespace holding the bridge `br0`, and one namespace per host with a veth (`eth0`) into that
//! bridge and an address of its own in `10.77.0.0/24`; it starts processes inside a host's namespace
//! (`ip netns exec`), cuts and restores a host's link, and runs the test's own requests from inside the switch
//! namespace. Dropping it (on panic too) kills every process left in its namespaces and deletes them, which
//! also removes the bridge and the veths; namespaces left behind by a test process that died without cleaning
//! up are removed by the next [`Net::new`]. Needs root (`ip netns add`) and iproute2's `ip`.
//!
//! Why a switch namespace rather than a bridge in the host's namespace: nothing of the host is touched (no
//! interface, address or route appears there, whatever happens to the test), the host's firewall never sees
//! the bridged traffic (a Docker host's `FORWARD DROP` policy with `br_netfilter` would drop it), and the
//! subnet cannot collide with the host's networks or with another test's: every network lives in namespaces
//! of its own, so all of them can use the same addresses. The test reaches the hosts from the switch
//! namespace, which has an address on the bridge (`.254`): a network namespace is a per-thread property on
//! Linux (`setns(2)` with `CLONE_NEWNET` moves only the calling thread, and threads it spawns inherit it), so
//! [`Net::run`] runs the test body on a thread that entered the switch namespace and the plain HTTP helpers of
//! `support` work unchanged, with no client process per request.
//!
//! Names: `sdh-<pid>-<n>-<host>` (`<n>` counts the networks of one test process, `sw` is the switch), unique
//! per run so that parallel runs and leftovers never collide.

use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

const PREFIX: &str = "sdh-";
/// The first three octets of every address: each network has its own namespaces, so they all can use it.
const SUBNET: &str = "10.77.0";
/// The switch namespace's address on the bridge: where the test's requests come from.
const CLIENT: u8 = 254;

/// A bridge and hosts on it, each in a network namespace of its own; deleted when dropped.
pub struct Net {
    /// `sdh-<pid>-<n>-`: the names of this network's namespaces start with it.
    prefix: String,
    hosts: Vec<String>,
}

impl Net {
    /// A switch namespace with a bridge, and a namespace for each of `hosts` (addresses `.1`, `.2`, … in
    /// order), loopback up everywhere. Fails the test, saying what is missing, when namespaces cannot be made.
    pub fn new(hosts: &[&str]) -> Net {
        static NETS: AtomicU32 = AtomicU32::new(0);
        assert!(hosts.len() < usize::from(CLIENT), "at most {} hosts", CLIENT - 1);
        remove_leftovers();
        let prefix = format!("{PREFIX}{}-{}-", std::process::id(), NETS.fetch_add(1, Ordering::SeqCst));
        let net = Net { prefix, hosts: hosts.iter().map(|h| h.to_string()).collect() };
        let sw = net.switch();
        // The first command says whether this machine lets the test make namespaces at all.
        let probe = Command::new("ip").args(["netns", "add", &sw]).output();
        match probe {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "`ip netns add {sw}` failed: {}; the cluster tests need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!("cannot run `ip` ({e}): the cluster tests need iproute2"),
        }
        ip(&["-n", &sw, "link", "set", "lo", "up"]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        ip(&["-n", &sw, "addr", "add", &format!("{SUBNET}.{CLIENT}/24"), "dev", "br0"]);
        for (i, host) in hosts.iter().enumerate() {
            let ns = net.ns(host);
            let port = format!("v{i}");
            ip(&["netns", "add", &ns]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
            ip(&["-n", &sw, "link", "set", &port, "master", "br0", "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", net.ip(host)), "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        }
        net
    }

    fn switch(&self) -> String {
        format!("{}sw", self.prefix)
    }

    /// The namespace of `host`.
    pub fn ns(&self, host: &str) -> String {
        assert!(self.hosts.iter().any(|h| h == host), "no host {host} in this network");
        format!("{}{host}", self.prefix)
    }

    /// The address of `host` on the bridge.
    pub fn ip(&self, host: &str) -> String {
        let i = self.hosts.iter().position(|h| h == host).unwrap_or_else(|| panic!("no host {host}"));
        format!("{SUBNET}.{}", i + 1)
    }

    /// `program` run inside `host`'s namespace (`ip netns exec` becomes the program: its pid is the program's).
    pub fn command(&self, host: &str, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns(host)]).arg(program);
        cmd
    }

    /// Brings `host`'s only link down (cut off: packets to and from it are lost, no connection is refused) or
    /// up again.
    pub fn set_link(&self, host: &str, up: bool) {
        ip(&["-n", &self.ns(host), "link", "set", "eth0", if up { "up" } else { "down" }]);
    }

    /// Runs `f` on a thread inside the switch namespace (and so do the threads it spawns), where every host's
    /// address is reachable; a panic in `f` is passed on.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let switch = self.switch();
        std::thread::scope(|scope| {
            let body = scope.spawn(move || {
                enter(&switch);
                f()
            });
            body.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Hosts first: deleting a host's namespace destroys its veth and so the bridge port.
        for host in &self.hosts {
            remove(&format!("{}{host}", self.prefix));
        }
        remove(&self.switch());
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("cannot run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
}

/// Moves the calling thread into the namespace `ns`.
fn enter(ns: &str) {
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    // SAFETY: setns(2) only reads the descriptor, which stays open for the call; moving one thread into
    // another network namespace is allowed in a multi-threaded process (unlike a mount or user namespace).
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
}

/// Kills every process in namespace `ns`, then deletes it; errors are ignored (it may be gone already).
fn remove(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()) {
            // SAFETY: kill(2) with a pid read just now from the namespace's process list.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    let _ = Command::new("ip").args(["netns", "delete", ns]).output();
}

/// Deletes the namespaces of test processes that no longer run (killed before their guard could).
fn remove_leftovers() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // `name` or `name (id: N)`.
        let Some(name) = line.split_whitespace().next() else { continue };
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|r| r.split('-').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove(name);
        }
    }
}
