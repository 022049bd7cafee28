//! What the benchmark reads about a daemon from /proc.

use std::fs;

/// (own CPU ms, CPU ms of its children) of `pid`: its own from
/// `/proc/<pid>/stat` (utime+stime), its children's from the same file
/// (cutime+cstime: the ones it reaped) plus, recursively, the CPU of the
/// children still alive (runspool's runner fork server, whose reaped
/// runners count there).
pub fn cpu_ms(pid: u32) -> Option<(f64, f64)> {
    let (own, reaped) = stat_cpu_ms(pid)?;
    let live: f64 = live_children(pid).into_iter().filter_map(cpu_ms).map(|(o, c)| o + c).sum();
    Some((own, reaped + live))
}

/// The children of `pid` that are alive, from `/proc/<pid>/task/*/children`.
fn live_children(pid: u32) -> Vec<u32> {
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    rd.flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| s.split_whitespace().filter_map(|x| x.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

fn stat_cpu_ms(pid: u32) -> Option<(f64, f64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name start at field 3 (state).
    let f: Vec<u64> =
        s.rsplit_once(')')?.1.split_whitespace().skip(11).take(4).filter_map(|x| x.parse().ok()).collect();
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as f64;
    (f.len() == 4).then(|| ((f[0] + f[1]) as f64 * 1000.0 / tick, (f[2] + f[3]) as f64 * 1000.0 / tick))
}

/// A `VmHWM:`-style line of `/proc/<pid>/status`, in KiB.
pub fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

/// Scheduler counters summed over a process's threads.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sched {
    /// Time on CPU, ns.
    pub cpu_ns: u64,
    /// Times scheduled in (wake-ups).
    pub slices: u64,
    pub threads: usize,
}

/// [`Sched`] of `pid` from `/proc/<pid>/task/*/schedstat` (zeros when it is gone).
pub fn sched(pid: u32) -> Sched {
    let mut s = Sched::default();
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/task")) else { return s };
    for t in rd.flatten() {
        s.threads += 1;
        if let Ok(text) = fs::read_to_string(t.path().join("schedstat")) {
            let f: Vec<u64> = text.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            if f.len() >= 3 {
                s.cpu_ns += f[0];
                s.slices += f[2];
            }
        }
    }
    s
}
