//! Reading what is on disk: JSON files, directory listings, a run's status,
//! events, result and logs, the index markers, and the run states.

use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::TestEnv;

pub fn is_active_state(s: &str) -> bool {
    s == "queued" || s == "running"
}

pub fn is_terminal_state(s: &str) -> bool {
    matches!(s, "complete" | "failed" | "paused" | "stopped" | "rejected")
}

/// The JSON in `p` (followed through symlinks), or None: also for what is not
/// a regular file, so a hostile root's FIFO never blocks a reader (the check
/// that ends every test reads every marker and status).
pub fn read_json(p: &Path) -> Option<Value> {
    if !fs::metadata(p).ok()?.is_file() {
        return None;
    }
    let b = fs::read(p).ok()?;
    serde_json::from_slice(&b).ok()
}

pub fn list_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = match fs::read_dir(dir) {
        Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => vec![],
    };
    v.sort();
    v
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            out.push(p.clone());
            if let Ok(ft) = e.file_type() {
                if ft.is_dir() {
                    walk(&p, out);
                }
            }
        }
    }
}

pub fn walk_all(dir: &Path) -> Vec<PathBuf> {
    let mut v = vec![];
    walk(dir, &mut v);
    v
}

pub fn file_bytes(p: &Path) -> Vec<u8> {
    let mut v = vec![];
    File::open(p).unwrap_or_else(|e| panic!("open {}: {}", p.display(), e)).read_to_end(&mut v).unwrap();
    v
}

pub fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

impl TestEnv {
    pub fn status(&self, id: &str) -> Option<Value> {
        read_json(&self.run_dir(id).join("status.json"))
    }

    pub fn state(&self, id: &str) -> Option<String> {
        self.status(id).and_then(|s| s["state"].as_str().map(|x| x.to_string()))
    }

    pub fn result(&self, id: &str) -> Option<Value> {
        read_json(&self.result_path(id))
    }

    pub fn events(&self, id: &str) -> Vec<Value> {
        let s = fs::read_to_string(self.run_dir(id).join("events.jsonl")).unwrap_or_default();
        s.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("events.jsonl line parses"))
            .collect()
    }

    pub fn event_types(&self, id: &str) -> Vec<String> {
        self.events(id).iter().map(|e| e["type"].as_str().unwrap_or("").to_string()).collect()
    }

    pub fn output_log(&self, id: &str, step: usize) -> String {
        fs::read_to_string(self.run_dir(id).join(format!("output-{}.log", step))).unwrap_or_default()
    }

    pub fn active_markers(&self) -> Vec<String> {
        list_names(&self.active_dir()).into_iter().filter(|n| n != "tool-calls" && !n.starts_with('.')).collect()
    }

    /// All terminal markers: (session segment, file name, parsed content or Null).
    pub fn terminal_markers(&self) -> Vec<(String, String, Value)> {
        let mut v = vec![];
        for s in list_names(&self.terminal_dir()) {
            let d = self.terminal_dir().join(&s);
            if !d.is_dir() {
                continue;
            }
            for f in list_names(&d) {
                if f.starts_with('.') {
                    continue;
                }
                let c = read_json(&d.join(&f)).unwrap_or(Value::Null);
                v.push((s.clone(), f, c));
            }
        }
        v
    }

    /// Names of all run directories (dot names excluded).
    pub fn run_ids(&self) -> Vec<String> {
        list_names(&self.runs()).into_iter().filter(|n| !n.starts_with('.')).collect()
    }

    /// Names of entries in spool/ that are still waiting (not dot names, not rejected/).
    pub fn pending_spool(&self) -> Vec<String> {
        list_names(&self.spool()).into_iter().filter(|n| n.ends_with(".json") && !n.starts_with('.')).collect()
    }

    /// State, error and runner stderr of up to `max` runs: what a failing test
    /// needs to tell "the run ended early" from "the index is wrong".
    pub fn runs_summary(&self, max: usize) -> String {
        let mut out = String::from("---- runs ----\n");
        for id in self.run_ids().into_iter().take(max) {
            let dir = self.run_dir(&id);
            let st = read_json(&dir.join("status.json")).unwrap_or(Value::Null);
            let stderr = fs::read_to_string(dir.join("runner.stderr.log")).unwrap_or_default();
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            out.push_str(&format!(
                "{id}: state={} exit={} error={} active_marker={}\n",
                st["state"],
                st["exitCode"],
                st["error"],
                self.runs().join(".active-runs").join(&id).exists()
            ));
            for l in tail.into_iter().rev() {
                out.push_str(&format!("    runner: {l}\n"));
            }
        }
        out.push_str("---- end ----");
        out
    }
}

/// Every entry under each of `dirs`, the directories included (path, mode,
/// size, mtime, and a content hash for files), in order: two snapshots
/// compare equal when nothing under them changed, byte for byte.
pub fn tree_snapshot(dirs: &[PathBuf]) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = vec![];
    for d in dirs {
        let mut all = walk_all(d);
        all.push(d.clone());
        all.sort();
        for p in all {
            let Ok(md) = fs::symlink_metadata(&p) else { continue };
            let body = if md.is_file() { super::sha256_hex(&fs::read(&p).unwrap()) } else { String::new() };
            out.push(format!(
                "{} {:o} {} {}.{} {}",
                p.display(),
                md.mode(),
                md.len(),
                md.mtime(),
                md.mtime_nsec(),
                body
            ));
        }
    }
    out
}
