//! The hostile corpus (tests/corpus/manifest.json): every entry is dropped into
//! the spool at once, among valid requests, and each must end in
//! spool/rejected/ with its expected code, none may stay in the spool or become
//! a run, nothing outside the temp root may change, and the daemon must still
//! serve a valid request afterwards. Also: file modes under a permissive umask,
//! and the step environment.

use crate::common;

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsString};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Every code a spool file can provoke: all but `withdrawn`, a client's act.
fn file_codes() -> Vec<&'static str> {
    RejectionCode::ALL.iter().filter(|c| **c != RejectionCode::Withdrawn).map(|c| c.as_str()).collect()
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

fn manifest() -> Vec<Value> {
    let m: Value = serde_json::from_slice(&fs::read(corpus_dir().join("manifest.json")).unwrap()).unwrap();
    m["entries"].as_array().unwrap().clone()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(hay.len());
    let mut i = 0;
    while i < hay.len() {
        if hay[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    out
}

/// The spool file name of an entry (raw bytes: one entry's name is not UTF-8).
fn entry_name(e: &Value) -> OsString {
    match e["file_hex"].as_str() {
        Some(h) => OsString::from_vec(hex(h)),
        None => OsString::from(e["file"].as_str().unwrap()),
    }
}

/// The name it must have in rejected/, and its error file.
fn rejected_names(e: &Value) -> (String, String) {
    let entry = e["rejected_as"].as_str().or(e["file"].as_str()).unwrap().to_string();
    let stem = entry.strip_suffix(".json").unwrap_or(&entry).to_string();
    (entry, format!("{stem}.error.json"))
}

fn mkfifo(p: &Path) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
}

fn mknod_null(p: &Path) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) };
    assert_eq!(r, 0, "mknod {}: {}", p.display(), std::io::Error::last_os_error());
}

/// What a file outside the root looks like, to prove that nothing changed it.
fn fingerprint(p: &Path) -> String {
    match fs::symlink_metadata(p) {
        Err(_) => "absent".into(),
        Ok(m) => {
            let ft = m.file_type();
            let content = if ft.is_file() {
                sha256_hex(&fs::read(p).unwrap_or_default())
            } else if ft.is_symlink() {
                fs::read_link(p).map(|t| t.display().to_string()).unwrap_or_default()
            } else {
                String::new()
            };
            format!(
                "{:?} mode={:o} uid={} len={} mtime={}.{} {}",
                ft,
                m.mode(),
                m.uid(),
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
                content
            )
        }
    }
}

fn snapshot(paths: &[PathBuf], trees: &[PathBuf]) -> BTreeMap<PathBuf, String> {
    let mut all: Vec<PathBuf> = paths.to_vec();
    for t in trees {
        all.push(t.clone());
        all.extend(walk_all(t));
    }
    all.into_iter()
        .map(|p| {
            let f = fingerprint(&p);
            (p, f)
        })
        .collect()
}

fn flock_ex(f: &fs::File) {
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
}

#[test]
fn corpus_manifest_is_well_formed() {
    let entries = manifest();
    assert!(entries.len() >= 40, "the corpus holds {} entries; at least 40 are required", entries.len());
    let mut names = BTreeSet::new();
    for e in &entries {
        let name = entry_name(e);
        assert!(names.insert(name.clone()), "duplicate corpus name {:?}", name);
        let codes: Vec<&str> = match e["codes"].as_array() {
            Some(a) => a.iter().map(|c| c.as_str().unwrap()).collect(),
            None => vec![e["code"].as_str().unwrap()],
        };
        for c in codes {
            assert!(file_codes().contains(&c), "{:?}: unknown code {c}", name);
        }
        if let Some(b) = e["body"].as_str() {
            assert!(corpus_dir().join("bodies").join(b).is_file(), "{:?}: body {b} missing", name);
        }
    }
    // Every rejection code that a file can provoke is covered.
    for c in file_codes() {
        assert!(entries.iter().any(|e| e["code"] == c), "no corpus entry expects {c}");
    }
}

#[test]
fn hostile_corpus_is_rejected_and_nothing_else_happens() {
    run_corpus(DEFAULT_CONFIG);
}

/// The same with the polling watcher (network filesystems, no inotify left).
/// The poller reports the dangling-symlink entry as an error on every pass;
/// that must stay a rescan hint and never starve the claim loop.
#[test]
fn hostile_corpus_with_the_poll_watcher() {
    run_corpus(&format!("{DEFAULT_CONFIG}strategy = \"poll\"\npoll_interval_ms = 100\n"));
}

fn run_corpus(config: &str) {
    let mut env = TestEnv::with_config(config);
    let root_user = is_root();
    let work = env.work.clone();
    let canary = work.join("canary");
    mkdir_0700(&canary);
    let subst = |b: &[u8]| {
        let b = replace_all(b, b"@CANARY@", canary.as_os_str().as_bytes());
        replace_all(&b, b"@WORK@", work.as_os_str().as_bytes())
    };
    let valid_body = |name: &str| -> Vec<u8> {
        serde_json::to_vec(&request(
            Some(name),
            &work,
            vec![sh_step("a", &format!("touch {}/{name}", canary.display()))],
        ))
        .unwrap()
    };

    // Things planted before the drop: a run id already in use, a run id that
    // names a symlink to a directory outside the root, and one that names a file.
    let outside_run = work.join("outside-run");
    mkdir_0700(&outside_run);
    write_file_mode(&outside_run.join("sentinel"), b"outside", 0o600);
    std::os::unix::fs::symlink(&outside_run, env.run_dir("linked-run")).unwrap();
    write_file_mode(&env.run_dir("file-run"), b"not a run", 0o600);
    // Targets outside the root that entries point at.
    write_file_mode(&work.join("symlink-target.json"), &valid_body("via-symlink"), 0o600);

    env.start_daemon();
    env.submit(&request(Some("taken-run"), &work, vec![cmd_step("a", &["true"])]));
    assert_eq!(env.wait_terminal("taken-run")["state"], "complete");
    let entries = manifest();

    // Prepare every entry under a dot name (never read), then publish all at once.
    let stage = |i: usize| env.spool().join(format!(".stage-{i}"));
    let mut publish: Vec<(PathBuf, PathBuf)> = vec![];
    let mut skipped = vec![];
    let mut writers: Vec<(Value, Vec<u8>)> = vec![];
    let mut race: Option<Value> = None;
    let mut sockets = vec![];
    let mut expected_bytes: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        let kind = e["kind"].as_str().unwrap_or("file");
        if e["root_only"].as_bool() == Some(true) && !root_user {
            skipped.push(e["file"].as_str().unwrap().to_string());
            continue;
        }
        let mut body = e["body"]
            .as_str()
            .map(|b| subst(&fs::read(corpus_dir().join("bodies").join(b)).unwrap()))
            .unwrap_or_default();
        if let Some(n) = e["pad_to"].as_u64() {
            assert!(body.len() as u64 <= n);
            body.resize(n as usize, b' ');
        }
        let mode = e["mode"].as_str().map(|m| u32::from_str_radix(m, 8).unwrap()).unwrap_or(0o600);
        let st = stage(i);
        match kind {
            "file" => {
                write_file_mode(&st, &body, mode);
                expected_bytes.insert(rejected_names(e).0, body.clone());
            }
            "other-owner" => {
                write_file_mode(&st, &body, mode);
                std::os::unix::fs::chown(&st, Some(65534), Some(65534)).unwrap();
                expected_bytes.insert(rejected_names(e).0, body.clone());
            }
            "fifo" => mkfifo(&st),
            "chardev" => mknod_null(&st),
            "socket" => sockets.push(std::os::unix::net::UnixListener::bind(&st).unwrap()),
            "dir" => {
                mkdir_0700(&st);
                write_file_mode(&st.join("inner.json"), &valid_body("inside-dir"), 0o600);
            }
            "symlink" => {
                let target = String::from_utf8(subst(e["target"].as_str().unwrap().as_bytes())).unwrap();
                std::os::unix::fs::symlink(target, &st).unwrap();
            }
            "hardlink" => {
                let outside = work.join("hardlink-target.json");
                write_file_mode(&outside, &body, 0o600);
                fs::hard_link(&outside, &st).unwrap();
            }
            "writing-flock" | "writing-partial" => {
                writers.push((e.clone(), body));
                continue;
            }
            "race" => {
                race = Some(e.clone());
                continue;
            }
            other => panic!("unknown corpus kind {other}"),
        }
        publish.push((st, env.spool().join(entry_name(e))));
    }
    if !skipped.is_empty() {
        report(&format!("hostile corpus: skipped: needs root: entries {skipped:?}"));
    }

    let before = snapshot(&[PathBuf::from("/etc/passwd"), PathBuf::from("/etc/hostname")], std::slice::from_ref(&work));
    let base_names_before: BTreeSet<String> = list_names(&env.base()).into_iter().collect();

    // Valid requests interleaved with the corpus, one with hostile-looking but
    // legal session and tool-call ids (they only reach the disk through seg()).
    let mut valid_ids = vec![];
    for i in 0..8 {
        let id = format!("valid-{i}");
        let mut req = request(Some(&id), &work, vec![sh_step("a", &format!("touch {}/{id}", canary.display()))]);
        if i == 7 {
            req["sessionId"] = json!("../../../escape-session");
            req["toolCallId"] = json!("../tc/../../x");
        }
        let tmp = env.spool().join(format!(".stage-valid-{i}"));
        write_file_mode(&tmp, &serde_json::to_vec(&req).unwrap(), 0o600);
        publish.insert((i * publish.len() / 8).min(publish.len()), (tmp, env.spool().join(format!("{id}.json"))));
        valid_ids.push(id);
    }

    // In-place writers: one holds flock and gives up half way, one never finishes.
    let mut writer_threads = vec![];
    for (e, body) in writers {
        let p = env.spool().join(entry_name(&e));
        let locked = e["kind"] == "writing-flock";
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p).unwrap();
        if locked {
            flock_ex(&f);
        }
        f.write_all(&body).unwrap();
        f.sync_all().unwrap();
        expected_bytes.insert(rejected_names(&e).0, body);
        writer_threads.push(std::thread::spawn(move || {
            if locked {
                std::thread::sleep(Duration::from_secs(3));
            }
            drop(f);
        }));
    }

    // The racer swaps a regular file and a FIFO under one name for a while.
    let stop = Arc::new(AtomicBool::new(false));
    let racer = race.as_ref().map(|e| {
        let body = subst(&fs::read(corpus_dir().join("bodies").join(e["body"].as_str().unwrap())).unwrap());
        let spool = env.spool();
        let name = entry_name(e);
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut i = 0u64;
            let target = spool.join(&name);
            loop {
                i += 1;
                let reg = spool.join(format!(".race-reg-{i}"));
                write_file_mode(&reg, &body, 0o600);
                fs::rename(&reg, &target).unwrap();
                std::thread::sleep(Duration::from_millis(3));
                let fifo = spool.join(format!(".race-fifo-{i}"));
                mkfifo(&fifo);
                fs::rename(&fifo, &target).unwrap();
                // Stop when told, or when the test has given up (its root is gone).
                if stop.load(Ordering::SeqCst) || i > 100_000 {
                    return i;
                }
                std::thread::sleep(Duration::from_millis(3));
            }
        })
    });

    for (from, to) in &publish {
        fs::rename(from, to).unwrap();
    }
    let t0 = now_ms();

    // Every valid request runs.
    for id in &valid_ids {
        let st = env.wait_terminal(id);
        assert_eq!(st["state"], "complete", "{id}: {st}");
    }
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    let swaps = racer.map(|r| r.join().unwrap());
    for t in writer_threads {
        t.join().unwrap();
    }

    // Every entry is rejected with its code; the entry itself is kept, byte for byte.
    let mut failures = vec![];
    for e in &entries {
        let kind = e["kind"].as_str().unwrap_or("file");
        if kind == "race" || (e["root_only"].as_bool() == Some(true) && !root_user) {
            continue;
        }
        let (entry, err) = rejected_names(e);
        let mut v = None;
        poll_until(LONG, || {
            v = read_json(&env.rejected().join(&err));
            v.is_some()
        });
        let Some(v) = v else {
            failures.push(format!("{entry:?}: no {err} in rejected/ (spool holds {:?})", list_names(&env.spool())));
            continue;
        };
        if v["code"] != e["code"] {
            failures.push(format!(
                "{entry:?}: code {} but the manifest expects {} ({})",
                v["code"], e["code"], v["message"]
            ));
        }
        if v["file"].as_str() != Some(entry.as_str()) || v["version"] != 1 || !v["rejectedAt"].is_i64() {
            failures.push(format!("{entry:?}: malformed error file {v}"));
        }
        if v["message"].as_str().unwrap_or("").is_empty() {
            failures.push(format!("{entry:?}: empty message"));
        }
        let moved = env.rejected().join(&entry);
        match fs::symlink_metadata(&moved) {
            Err(_) => failures.push(format!("{entry:?}: the rejected entry itself is missing from rejected/")),
            Ok(m) => {
                let ok_type = match kind {
                    "fifo" => m.file_type().is_fifo(),
                    "socket" => m.file_type().is_socket(),
                    "chardev" => m.file_type().is_char_device(),
                    "dir" => m.is_dir(),
                    "symlink" => m.file_type().is_symlink(),
                    _ => m.is_file(),
                };
                if !ok_type {
                    failures.push(format!("{entry:?}: rejected entry has type {:?}", m.file_type()));
                }
                if let Some(b) = expected_bytes.get(&entry) {
                    if &fs::read(&moved).unwrap_or_default() != b {
                        failures
                            .push(format!("{entry:?}: the rejected entry is not byte-identical to what was published"));
                    }
                }
            }
        }
        let at = v["rejectedAt"].as_i64().unwrap_or(0);
        if at < t0 - 5_000 {
            failures.push(format!("{entry:?}: rejectedAt {at} is before the drop"));
        }
    }

    // The race: every version of the name that the daemon took was rejected
    // with one of the codes the manifest allows, and none of them ran.
    if let Some(e) = &race {
        let allowed: Vec<&str> = e["codes"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
        let stem = e["file"].as_str().unwrap().strip_suffix(".json").unwrap();
        wait_until(LONG, "the racer's last entry to leave the spool", || {
            !list_names(&env.spool()).iter().any(|n| n.starts_with(stem))
        });
        let mut seen = 0;
        for n in list_names(&env.rejected()) {
            if !n.starts_with(stem) || n.ends_with(".error.json") {
                continue;
            }
            seen += 1;
            let err = format!("{}.error.json", n.strip_suffix(".json").unwrap_or(&n));
            let mut v = None;
            poll_until(LONG, || {
                v = read_json(&env.rejected().join(&err));
                v.is_some()
            });
            match v {
                None => failures.push(format!("race entry {n}: no {err}")),
                Some(v) if !allowed.contains(&v["code"].as_str().unwrap_or("")) => {
                    failures.push(format!("race entry {n}: code {} not in {allowed:?}", v["code"]))
                }
                Some(_) => {}
            }
        }
        if seen == 0 {
            failures.push("the race entry never reached rejected/".into());
        }
        report(&format!("hostile corpus: race entry swapped {} times, {seen} versions rejected", swaps.unwrap_or(0)));
    }
    assert!(
        failures.is_empty(),
        "{} corpus failures:\n  {}\n{}",
        failures.len(),
        failures.join("\n  "),
        env.log_tail(80)
    );

    // Nothing is left in the spool (dot names are our own staging, all consumed).
    let left: Vec<String> = list_names(&env.spool()).into_iter().filter(|n| n != "rejected").collect();
    assert!(left.is_empty(), "spool still holds {left:?}");

    // The daemon still serves.
    assert!(env.daemon_exited().is_none(), "the daemon died\n{}", env.log_tail(80));
    let (after, _) = env.submit(&request(
        Some("after-corpus"),
        &work,
        vec![sh_step("a", &format!("touch {}/after-corpus", canary.display()))],
    ));
    assert_eq!(env.wait_terminal(&after)["state"], "complete");

    // No corpus entry became a run: the only commands that ran are the valid ones.
    let mut want_canaries: Vec<String> = valid_ids.clone();
    want_canaries.push("after-corpus".into());
    want_canaries.sort();
    assert_eq!(list_names(&canary), want_canaries, "steps that ran (one canary file per run)");
    let rejected_runs: BTreeMap<String, String> = entries
        .iter()
        .filter_map(|e| Some((e["run_id"].as_str()?.to_string(), e["code"].as_str()?.to_string())))
        .collect();
    for id in env.run_ids() {
        if valid_ids.contains(&id)
            || id == "after-corpus"
            || id == "taken-run"
            || id == "linked-run"
            || id == "file-run"
        {
            continue;
        }
        let Some(code) = rejected_runs.get(&id) else {
            panic!("run directory {id} appeared for no valid request: {:?}", env.status(&id));
        };
        let st = env.wait_terminal(&id);
        assert_eq!(st["state"], "rejected", "{id}: {st}");
        assert!(st["error"].as_str().unwrap_or("").starts_with(code.as_str()), "{id}: error names {code}: {st}");
        assert!(!env.run_dir(&id).join("request.json").exists(), "{id}: a rejected run owns no request");
        assert!(!env.run_dir(&id).join("output-0.log").exists(), "{id}: no step ran");
    }
    for id in rejected_runs.keys() {
        assert!(env.run_dir(id).is_dir(), "{id}: a rejected request with a valid runId leaves a rejected run");
    }
    assert_eq!(fs::read_link(env.run_dir("linked-run")).unwrap(), outside_run, "the planted symlink is untouched");
    assert_eq!(file_bytes(&env.run_dir("file-run")), b"not a run");

    // The hostile session/tool-call ids stayed inside the indexes.
    let st = env.status("valid-7").unwrap();
    assert_eq!(st["sessionId"], "../../../escape-session");
    assert!(env.terminal_dir().join(seg("../../../escape-session")).is_dir());

    // Nothing outside the temp root changed; nothing new appeared beside it or in it.
    let after_snap =
        snapshot(&[PathBuf::from("/etc/passwd"), PathBuf::from("/etc/hostname")], std::slice::from_ref(&work));
    let changed: Vec<String> = after_snap
        .iter()
        .filter(|(p, f)| !p.starts_with(&canary) && before.get(*p) != Some(*f))
        .map(|(p, f)| format!("{}: {} -> {}", p.display(), before.get(p).map(|s| s.as_str()).unwrap_or("absent"), f))
        .chain(before.keys().filter(|p| !after_snap.contains_key(*p)).map(|p| format!("{} vanished", p.display())))
        .collect();
    assert!(changed.is_empty(), "files outside the root changed:\n  {}", changed.join("\n  "));
    let new_beside: Vec<String> = list_names(&env.base())
        .into_iter()
        .filter(|n| !base_names_before.contains(n) && !n.ends_with(".out") && !n.starts_with("cli-"))
        .collect();
    assert!(new_beside.is_empty(), "new files beside the root: {new_beside:?}");
    let top: BTreeSet<String> = list_names(&env.root).into_iter().collect();
    let layout: BTreeSet<String> =
        ["spool", "async-subagent-runs", "async-subagent-results", "runspool"].iter().map(|s| s.to_string()).collect();
    assert!(
        top.is_subset(&layout),
        "unexpected entries at the top of the root: {:?}",
        top.difference(&layout).collect::<Vec<_>>()
    );
    assert!(!env.runs().join("..").join("x").exists() && !env.root.join("x").exists(), "runId ../x created nothing");

    drop(sockets);
    fs::remove_file(env.run_dir("linked-run")).unwrap();
    fs::remove_file(env.run_dir("file-run")).unwrap();
    env.check_consistency();
}

/// A run id that names a symlink to a directory outside the root, or a file,
/// is refused; without that check the claim would move the request (and the
/// run's files) out of the root. Checked on its own so a failure is obvious.
#[test]
fn run_directory_symlink_is_never_followed() {
    let mut env = TestEnv::new();
    let outside = env.work.join("elsewhere");
    mkdir_0700(&outside);
    std::os::unix::fs::symlink(&outside, env.run_dir("redirected")).unwrap();
    env.start_daemon();
    let t0 = now_ms();
    let req = request(Some("redirected"), &env.work, vec![cmd_step("a", &["true"])]);
    let bytes = env.drop_request("redirected", &req);
    let e = env.wait_rejection("redirected");
    assert_eq!(e["code"], RejectionCode::DuplicateRunId.as_str(), "{e}");
    assert!(e["rejectedAt"].as_i64().unwrap() >= t0 - 2000);
    assert_eq!(file_bytes(&env.rejected().join("redirected.json")), bytes);
    assert!(list_names(&outside).is_empty(), "nothing was written through the symlink: {:?}", list_names(&outside));
    // A dangling symlink with a run id: the rejected run is not written through it.
    let dangling = env.work.join("not-there");
    std::os::unix::fs::symlink(&dangling, env.run_dir("dangling")).unwrap();
    let mut bad = request(Some("dangling"), &env.work, vec![cmd_step("a", &["true"])]);
    bad["priority"] = json!(5000);
    env.drop_request("dangling", &bad);
    let e = env.wait_rejection("dangling");
    assert_eq!(e["code"], RejectionCode::InvalidField.as_str(), "{e}");
    std::thread::sleep(Duration::from_millis(500));
    assert!(fs::symlink_metadata(&dangling).is_err(), "nothing was created through a dangling symlink");
    assert!(env.daemon_exited().is_none());
}

/// Whatever the umask, the daemon and the runner create directories 0700 and
/// files 0600 (PROTOCOL §3, SECURITY.md "Files created").
#[test]
fn file_modes_are_private_even_with_umask_000() {
    let mut env = TestEnv::new();
    let mut cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    env.start_daemon_command(cmd);
    let mut req = request(Some("modes-ok"), &env.work, vec![sh_step("a", "echo out; echo err >&2")]);
    req["toolCallId"] = json!("tc/modes");
    req["sessionId"] = json!("modes-session");
    env.submit(&req);
    let mut bad = request(Some("modes-bad"), &env.work, vec![cmd_step("a", &["true"])]);
    bad["timeoutMs"] = json!(0);
    env.submit(&bad);
    env.drop_bytes("modes-garbage", b"{not json");
    set_mtime_ago(&env.spool().join("modes-garbage.json"), 10);
    assert_eq!(env.wait_terminal("modes-ok")["state"], "complete");
    assert_eq!(env.wait_terminal("modes-bad")["state"], "rejected");
    env.wait_rejection("modes-garbage");
    env.check_consistency();
    let mut wrong = vec![];
    for p in walk_all(&env.root) {
        let m = fs::symlink_metadata(&p).unwrap();
        let mode = m.mode() & 0o7777;
        let rel = p.strip_prefix(&env.root).unwrap().display().to_string();
        // Entries moved into rejected/ are the clients' own files, kept as they were.
        if p.parent() == Some(env.rejected().as_path()) && !rel.ends_with(".error.json") {
            continue;
        }
        if m.is_dir() && mode != 0o700 {
            wrong.push(format!("dir {rel} {mode:o}"));
        }
        if m.is_file() && mode != 0o600 && !(rel.ends_with("request.json") && mode & 0o077 == 0) {
            wrong.push(format!("file {rel} {mode:o}"));
        }
        if m.file_type().is_symlink() {
            wrong.push(format!("symlink {rel}"));
        }
    }
    assert!(wrong.is_empty(), "modes other than 0700/0600 under umask 000:\n  {}", wrong.join("\n  "));
}

/// Steps get the documented environment: the service manager's variables
/// (NOTIFY_SOCKET, WATCHDOG_*, LISTEN_*, JOURNAL_STREAM, INVOCATION_ID, ...)
/// never leak into them; the daemon's other variables do.
#[test]
fn step_environment_is_scrubbed() {
    let mut env = TestEnv::new();
    let mut cmd = env.daemon_command_for(Path::new(BIN), &env.root);
    let leaks = [
        ("NOTIFY_SOCKET", "/nonexistent/notify.sock"),
        ("WATCHDOG_PID", "1"),
        ("WATCHDOG_USEC", "600000000"),
        ("LISTEN_PID", "1"),
        ("LISTEN_FDS", "3"),
        ("LISTEN_FDNAMES", "leak"),
        ("JOURNAL_STREAM", "8:12345"),
        ("INVOCATION_ID", "0123456789abcdef0123456789abcdef"),
        ("SYSTEMD_EXEC_PID", "1"),
        ("MANAGERPID", "1"),
        ("MEMORY_PRESSURE_WATCH", "/sys/fs/cgroup/leak/memory.pressure"),
        ("MEMORY_PRESSURE_WRITE", "c29tZSAyMDAwMDAgMjAwMDAwMAA="),
        ("CREDENTIALS_DIRECTORY", "/run/credentials/leak.service"),
        ("FDSTORE", "16"),
        ("TRIGGER_UNIT", "leak.timer"),
    ];
    for (k, v) in leaks {
        cmd.env(k, v);
    }
    cmd.env("RUNSPOOL_SECURITY_PROBE", "kept");
    env.start_daemon_command(cmd);
    let mut req = request(Some("env-probe"), &env.work, vec![cmd_step("a", &["env"])]);
    req["env"] = json!({"FROM_REQUEST": "yes"});
    env.submit(&req);
    assert_eq!(env.wait_terminal("env-probe")["state"], "complete");
    let out = env.output_log("env-probe", 0);
    let vars: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    for (k, _) in leaks {
        assert!(!vars.contains_key(k), "{k} leaked into the step environment:\n{out}");
    }
    assert_eq!(vars.get("FROM_REQUEST"), Some(&"yes"), "{out}");
    assert_eq!(vars.get("RUNSPOOL_RUN_ID"), Some(&"env-probe"), "{out}");
    assert!(vars.contains_key("RUNSPOOL_RUN_DIR") && vars.contains_key("RUNSPOOL_STEP_INDEX"), "{out}");
    assert_eq!(vars.get("RUNSPOOL_SECURITY_PROBE"), Some(&"kept"), "the daemon's own environment is inherited:\n{out}");
}

/// Inputs kept from fuzzing (fuzz/regressions/<target>/) replayed on stable
/// Rust through the same entry points the fuzz targets use: none may panic.
#[test]
fn fuzz_regressions_replay() {
    use runspool::protocol::{bridge, request, seg, status::Status};
    struct Ctx;
    impl request::Context for Ctx {
        fn provider_configured(&self, n: &str) -> bool {
            n == "slurm"
        }
        fn is_dir(&self, p: &str) -> bool {
            matches!(p, "/" | "/tmp" | "/work")
        }
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
    let mut replayed = 0;
    for target in ["request", "seg", "status", "bridge"] {
        for name in list_names(&dir.join(target)) {
            let data = fs::read(dir.join(target).join(&name)).unwrap();
            let r = std::panic::catch_unwind(|| match target {
                "request" => {
                    if let Ok(v) = request::parse(&data) {
                        let _ = request::validate(&data, &v, &Ctx);
                    }
                }
                "seg" => {
                    let v = String::from_utf8_lossy(&data);
                    let s = seg::seg(&v);
                    assert!(s.len() <= 255 && !s.contains('/') && s != "." && s != "..", "{s:?}");
                    assert!(seg::seg250(&v).len() <= 250);
                }
                "status" => {
                    let disk = data.split(|b| *b == 0).next().unwrap();
                    if let Ok(s) = serde_json::from_slice::<Status>(disk) {
                        let mut back: Status = serde_json::from_slice(&serde_json::to_vec(&s).unwrap()).unwrap();
                        let mut s = s;
                        // Foreign fields are kept (their floats may move by one ulp).
                        assert_eq!(back.extra.keys().collect::<Vec<_>>(), s.extra.keys().collect::<Vec<_>>());
                        back.extra.clear();
                        s.extra.clear();
                        assert_eq!(back, s);
                    }
                }
                _ => {
                    if let Some((sel, rest)) = data.split_first() {
                        let ops = [
                            bridge::Operation::Start,
                            bridge::Operation::Status,
                            bridge::Operation::Result,
                            bridge::Operation::Reattach,
                            bridge::Operation::Cancel,
                        ];
                        let _ = bridge::parse_handle(rest, ops[*sel as usize % 5]);
                        let _ = bridge::parse_failure(rest);
                        let _ = bridge::parse_request(rest, "req-1", "run-1");
                    }
                }
            });
            assert!(r.is_ok(), "fuzz regression {target}/{name} panics");
            replayed += 1;
        }
    }
    assert!(replayed > 0, "no fuzz regression inputs found under {}", dir.display());
}
