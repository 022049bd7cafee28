//! Spool rejections: every code a test can provoke, the rejected entry, the
//! reason file, and the `rejected` run directory. Also the two in-place writing
//! protocols (fresh mtime, flock) that must not be rejected early.

use crate::common;

use common::*;
use runspool::protocol::request::RejectionCode;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Duration;

/// Wait for `<name>` to be rejected with `code` and check the reason file and the entry.
fn expect_rejected(env: &TestEnv, name: &str, code: &str, original: Option<&[u8]>, t0: i64) -> Value {
    let e = env.wait_rejection(name);
    let keys: BTreeSet<&str> = e.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    assert_eq!(
        keys,
        ["code", "file", "message", "rejectedAt", "version"].into_iter().collect(),
        "{name}: error.json keys: {e}"
    );
    assert_eq!(e["version"], 1, "{name}: {e}");
    assert_eq!(e["file"].as_str(), Some(format!("{name}.json").as_str()), "{name}: {e}");
    assert_eq!(e["code"].as_str(), Some(code), "{name}: wrong code: {e}");
    assert!(!e["message"].as_str().unwrap_or("").trim().is_empty(), "{name}: empty message: {e}");
    let at = e["rejectedAt"].as_i64().unwrap_or_else(|| panic!("{name}: rejectedAt not integer: {e}"));
    assert!(at >= t0 - 2000 && at <= now_ms() + 1000, "{name}: rejectedAt {at} not within the test");
    let entry = env.rejected().join(format!("{name}.json"));
    assert!(fs::symlink_metadata(&entry).is_ok(), "{name}: rejected entry {} missing", entry.display());
    if let Some(bytes) = original {
        assert_eq!(file_bytes(&entry), bytes, "{name}: rejected entry is byte-identical");
    }
    assert!(fs::symlink_metadata(env.spool().join(format!("{name}.json"))).is_err(), "{name}: still in spool");
    e
}

fn expect_rejected_run(env: &TestEnv, id: &str, code: &str) {
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "rejected", "{id}: {st}");
    assert_eq!(st["runId"], id);
    assert!(!st["error"].as_str().unwrap_or("").is_empty(), "{id}: rejected status carries the error: {st}");
    poll_until(LONG, || env.event_types(id).iter().any(|t| t == "subagent.run.rejected"));
    let evs = env.events(id);
    let ev = evs.iter().find(|e| e["type"] == "subagent.run.rejected");
    if let Some(ev) = ev {
        assert_eq!(ev["code"], code, "{id}: rejected event code");
    } else {
        panic!("{id}: no subagent.run.rejected event: {evs:?}");
    }
    assert!(!env.active_dir().join(id).exists(), "{id}: rejected run has no active marker");
}

fn valid(env: &TestEnv, id: &str) -> Value {
    request(Some(id), &env.work, vec![cmd_step("a", &["true"])])
}

#[test]
fn bad_name_and_ignored_names() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let body = serde_json::to_vec(&valid(&env, "bad-name-run")).unwrap();
    env.drop_bytes("bad name", &body);
    env.drop_bytes("-leading-dash", &body);
    // Ignored: dot names and names not ending in .json.
    write_file_mode(&env.spool().join(".hidden.json"), &body, 0o600);
    write_file_mode(&env.spool().join("notes.txt"), &body, 0o600);
    expect_rejected(&env, "bad name", RejectionCode::BadName.as_str(), Some(&body), t0);
    expect_rejected(&env, "-leading-dash", RejectionCode::BadName.as_str(), Some(&body), t0);
    // a valid request afterwards still works and proves a full scan happened
    env.submit(&valid(&env, "after-bad-name"));
    env.wait_terminal("after-bad-name");
    std::thread::sleep(Duration::from_secs(1));
    assert!(env.spool().join(".hidden.json").exists(), "dot names are never read");
    assert!(env.spool().join("notes.txt").exists(), "non-.json names are ignored");
    assert!(!env.run_dir("bad-name-run").exists(), "a bad-name entry is not parsed into a run");
    env.check_consistency();
}

#[test]
fn not_regular_files_dir_symlink_fifo() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    // directory
    fs::create_dir(env.spool().join("a-dir.json")).unwrap();
    // symlink to a perfectly valid request
    let target = env.work.join("target.json");
    let body = serde_json::to_vec(&valid(&env, "via-symlink")).unwrap();
    write_file_mode(&target, &body, 0o600);
    std::os::unix::fs::symlink(&target, env.spool().join("a-link.json")).unwrap();
    // FIFO: opening it without O_NONBLOCK would hang the daemon
    let fifo = std::ffi::CString::new(env.spool().join("a-fifo.json").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

    expect_rejected(&env, "a-dir", RejectionCode::NotRegularFile.as_str(), None, t0);
    expect_rejected(&env, "a-link", RejectionCode::NotRegularFile.as_str(), None, t0);
    expect_rejected(&env, "a-fifo", RejectionCode::NotRegularFile.as_str(), None, t0);
    assert!(fs::symlink_metadata(env.rejected().join("a-dir.json")).unwrap().is_dir());
    let l = fs::symlink_metadata(env.rejected().join("a-link.json")).unwrap();
    assert!(l.file_type().is_symlink(), "the symlink itself is moved, not followed");
    assert_eq!(fs::read_link(env.rejected().join("a-link.json")).unwrap(), target);
    assert!(fs::symlink_metadata(env.rejected().join("a-fifo.json")).unwrap().file_type().is_fifo());
    assert_eq!(file_bytes(&target), body, "symlink target untouched");
    assert!(!env.run_dir("via-symlink").exists(), "a symlinked request never becomes a run");

    // the daemon is not stuck
    env.submit(&valid(&env, "after-fifo"));
    assert_eq!(env.wait_terminal("after-fifo")["state"], "complete");
    env.check_consistency();
}

#[test]
fn bad_permissions_and_owner() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let b1 = serde_json::to_vec(&valid(&env, "perm-622")).unwrap();
    env.drop_bytes_mode("perm-622", &b1, 0o622);
    let b2 = serde_json::to_vec(&valid(&env, "perm-606")).unwrap();
    env.drop_bytes_mode("perm-606", &b2, 0o606);
    // 0644 is fine: readable by others is not writable by them
    let b3 = serde_json::to_vec(&valid(&env, "perm-644")).unwrap();
    env.drop_bytes_mode("perm-644", &b3, 0o644);
    expect_rejected(&env, "perm-622", RejectionCode::BadPermissions.as_str(), Some(&b1), t0);
    expect_rejected(&env, "perm-606", RejectionCode::BadPermissions.as_str(), Some(&b2), t0);
    assert_eq!(env.wait_terminal("perm-644")["state"], "complete");
    assert!(!env.run_dir("perm-622").exists() || env.state("perm-622").as_deref() == Some("rejected"));

    if unsafe { libc::geteuid() } == 0 {
        // As root we can provoke bad-owner too.
        let b4 = serde_json::to_vec(&valid(&env, "owner-other")).unwrap();
        let tmp = env.spool().join(".tmp-owner");
        write_file_mode(&tmp, &b4, 0o600);
        std::os::unix::fs::chown(&tmp, Some(65534), Some(65534)).unwrap();
        fs::rename(&tmp, env.spool().join("owner-other.json")).unwrap();
        expect_rejected(&env, "owner-other", RejectionCode::BadOwner.as_str(), Some(&b4), t0);
    }
    env.check_consistency();
}

#[test]
fn too_large_and_exactly_one_mib() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    // exactly 1 MiB, valid JSON (trailing white space): accepted
    let mut exact = serde_json::to_vec(&valid(&env, "exact-mib")).unwrap();
    exact.resize(1024 * 1024, b' ');
    env.drop_bytes("exact-mib", &exact);
    // one byte more: too large
    let mut big = serde_json::to_vec(&valid(&env, "too-big")).unwrap();
    big.resize(1024 * 1024 + 1, b' ');
    env.drop_bytes("too-big", &big);
    expect_rejected(&env, "too-big", RejectionCode::TooLarge.as_str(), Some(&big), t0);
    assert_eq!(env.wait_terminal("exact-mib")["state"], "complete");
    assert_eq!(file_bytes(&env.run_dir("exact-mib").join("request.json")), exact);
    env.check_consistency();
}

#[test]
fn invalid_json_old_and_unsupported_version() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let bad = br#"{"version": 1, "runId": "never-parsed", "steps": [ "#.to_vec();
    let tmp = env.spool().join(".tmp-badjson");
    write_file_mode(&tmp, &bad, 0o600);
    set_mtime_ago(&tmp, 30);
    fs::rename(&tmp, env.spool().join("old-garbage.json")).unwrap();
    expect_rejected(&env, "old-garbage", RejectionCode::InvalidJson.as_str(), Some(&bad), t0);
    assert!(!env.run_dir("never-parsed").exists(), "unparsable body creates no run");

    let mut v2 = valid(&env, "version-two");
    v2["version"] = json!(2);
    let b = env.drop_request("version-two", &v2);
    expect_rejected(&env, "version-two", RejectionCode::UnsupportedVersion.as_str(), Some(&b), t0);

    let mut v0 = valid(&env, "version-missing");
    v0.as_object_mut().unwrap().remove("version");
    let b = env.drop_request("version-missing", &v0);
    let e = env.wait_rejection("version-missing");
    assert!(
        e["code"] == RejectionCode::UnsupportedVersion.as_str() || e["code"] == RejectionCode::InvalidField.as_str(),
        "missing version is refused: {e}"
    );
    assert_eq!(file_bytes(&env.rejected().join("version-missing.json")), b);
    env.check_consistency();
}

#[test]
fn invalid_fields_each_limit_by_one() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let w = env.work.clone();
    let one = || vec![cmd_step("a", &["true"])];
    // (name/runId, request, tokens one of which the message must name)
    let mut cases: Vec<(String, Value, Vec<&str>)> = vec![];
    let mut add = |name: &str, v: Value, tokens: Vec<&'static str>| cases.push((name.to_string(), v, tokens));

    let mut r = request(Some("inv-unknown"), &w, one());
    r["bogusField"] = json!(true);
    add("inv-unknown", r, vec!["bogusfield"]);

    let many: Vec<Value> = (0..257).map(|_| cmd_step("a", &["true"])).collect();
    add("inv-257-steps", request(Some("inv-257-steps"), &w, many), vec!["steps", "step"]);

    add("inv-0-steps", request(Some("inv-0-steps"), &w, vec![]), vec!["steps", "step"]);

    let mut r = request(Some("inv-agent"), &w, one());
    r["steps"][0]["agent"] = json!("x".repeat(257));
    add("inv-agent", r, vec!["agent"]);

    let mut r = request(Some("inv-timeout-0"), &w, one());
    r["timeoutMs"] = json!(0);
    add("inv-timeout-0", r, vec!["timeoutms"]);

    let mut r = request(Some("inv-timeout-max"), &w, one());
    r["timeoutMs"] = json!(604800001u64);
    add("inv-timeout-max", r, vec!["timeoutms"]);

    let mut r = request(Some("inv-step-timeout-0"), &w, one());
    r["steps"][0]["timeoutMs"] = json!(0);
    add("inv-step-timeout-0", r, vec!["timeoutms"]);

    let mut r = request(Some("inv-prio-high"), &w, one());
    r["priority"] = json!(1001);
    add("inv-prio-high", r, vec!["priority"]);

    let mut r = request(Some("inv-prio-low"), &w, one());
    r["priority"] = json!(-1001);
    add("inv-prio-low", r, vec!["priority"]);

    add(
        "inv-conc-65",
        request(
            Some("inv-conc-65"),
            &w,
            vec![parallel(vec![cmd_step("a", &["true"]), cmd_step("b", &["true"])], Some(65))],
        ),
        vec!["concurrency"],
    );
    add(
        "inv-conc-0",
        request(
            Some("inv-conc-0"),
            &w,
            vec![parallel(vec![cmd_step("a", &["true"]), cmd_step("b", &["true"])], Some(0))],
        ),
        vec!["concurrency"],
    );

    let mut r = request(Some("inv-env-name"), &w, one());
    r["env"] = json!({"1BAD": "x"});
    add("inv-env-name", r, vec!["env", "1bad"]);

    let mut r = request(Some("inv-step-env-name"), &w, one());
    r["steps"][0]["env"] = json!({"A-B": "x"});
    add("inv-step-env-name", r, vec!["env", "a-b"]);

    let mut r = request(Some("inv-env-count"), &w, one());
    let m: serde_json::Map<String, Value> = (0..257).map(|i| (format!("V{i}"), json!("x"))).collect();
    r["env"] = Value::Object(m);
    add("inv-env-count", r, vec!["env"]);

    let mut r = request(Some("inv-argv0"), &w, one());
    r["steps"][0]["command"] = json!([""]);
    add("inv-argv0", r, vec!["command", "argv0", "argv"]);

    let mut r = request(Some("inv-argv-empty"), &w, one());
    r["steps"][0]["command"] = json!([]);
    add("inv-argv-empty", r, vec!["command", "argv0", "argv"]);

    let mut r = request(Some("inv-cwd-rel"), &w, one());
    r["cwd"] = json!("relative/dir");
    add("inv-cwd-rel", r, vec!["cwd"]);

    let mut r = request(Some("inv-step-cwd-rel"), &w, one());
    r["steps"][0]["cwd"] = json!("rel");
    add("inv-step-cwd-rel", r, vec!["cwd"]);

    let mut r = request(Some("inv-nul"), &w, one());
    r["steps"][0]["agent"] = json!("a\u{0}b");
    add("inv-nul", r, vec!["agent", "nul"]);

    let mut r = request(Some("inv-session-len"), &w, one());
    r["sessionId"] = json!("s".repeat(4097));
    add("inv-session-len", r, vec!["sessionid"]);

    let mut r = request(Some("inv-owner-len"), &w, one());
    r["completionOwnerId"] = json!("o".repeat(257));
    add("inv-owner-len", r, vec!["completionownerid"]);

    let mut r = request(Some("inv-priority-type"), &w, one());
    r["priority"] = json!("high");
    add("inv-priority-type", r, vec!["priority"]);

    let mut r = request(Some("inv-toolcall-len"), &w, one());
    r["toolCallId"] = json!("t".repeat(4097));
    add("inv-toolcall-len", r, vec!["toolcallid"]);

    let mut r = request(Some("inv-nul-arg"), &w, one());
    r["steps"][0]["command"] = json!(["echo", "a\u{0}b"]);
    add("inv-nul-arg", r, vec!["command", "nul"]);

    let mut r = request(Some("inv-4097-args"), &w, one());
    let mut args = vec![json!("true")];
    args.extend((0..4096).map(|i| json!(format!("a{i}"))));
    r["steps"][0]["command"] = Value::Array(args);
    add("inv-4097-args", r, vec!["command"]);

    let mut r = request(Some("inv-step-field"), &w, one());
    r["steps"][0]["comand"] = json!(["true"]);
    add("inv-step-field", r, vec!["comand", "steps"]);

    // An invalid runId: rejected, but no run directory can be created for it.
    let long_id = format!("L{}", "x".repeat(128));
    let r = request(Some(&long_id), &w, one());
    add("inv-runid-long", r, vec!["runid"]);
    let r = request(Some("bad run id"), &w, one());
    add("inv-runid", r, vec!["runid"]);

    let mut written = vec![];
    for (name, v, tokens) in &cases {
        let b = env.drop_request(name, v);
        written.push((name.clone(), b, tokens.clone()));
    }
    for (name, b, tokens) in &written {
        let e = expect_rejected(&env, name, RejectionCode::InvalidField.as_str(), Some(b), t0);
        let msg = e["message"].as_str().unwrap().to_lowercase();
        assert!(
            tokens.iter().any(|t| msg.contains(t)),
            "{name}: message {msg:?} should name the field (one of {tokens:?})"
        );
        if name != "inv-runid" && name != "inv-runid-long" {
            expect_rejected_run(&env, name, RejectionCode::InvalidField.as_str());
        }
    }
    assert!(!env.run_dir("bad run id").exists());
    assert!(!env.run_dir(&format!("L{}", "x".repeat(128))).exists());
    env.check_consistency();
}

#[test]
fn limits_at_the_boundary_are_accepted() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let w = env.work.clone();
    let many: Vec<Value> = (0..256).map(|i| cmd_step(&format!("s{i}"), &["true"])).collect();
    env.submit(&request(Some("ok-256-steps"), &w, many));

    let mut r = request(Some("ok-fields"), &w, vec![cmd_step(&"x".repeat(256), &["true"])]);
    r["timeoutMs"] = json!(604800000u64);
    r["priority"] = json!(1000);
    r["sessionId"] = json!("s".repeat(4096));
    r["toolCallId"] = json!("t".repeat(4096));
    r["completionOwnerId"] = json!("o".repeat(256));
    let m: serde_json::Map<String, Value> = (0..256).map(|i| (format!("_V{i}"), json!("x"))).collect();
    r["env"] = Value::Object(m);
    env.submit(&r);

    let id128 = format!("R{}", "9".repeat(127));
    let mut r = request(Some(&id128), &w, vec![cmd_step("a", &["true"])]);
    let mut args = vec![json!("true")];
    args.extend((0..4095).map(|i| json!(format!("a{i}"))));
    r["steps"][0]["command"] = Value::Array(args);
    env.drop_request("ok-runid-128", &r);

    let mut r = request(
        Some("ok-conc-64"),
        &w,
        vec![parallel(vec![cmd_step("a", &["true"]), cmd_step("b", &["true"])], Some(64))],
    );
    r["priority"] = json!(-1000);
    env.submit(&r);

    let mut r = request(
        Some("ok-conc-1"),
        &w,
        vec![parallel(vec![cmd_step("a", &["true"]), cmd_step("b", &["true"])], Some(1))],
    );
    r["steps"][0]["parallel"][0]["timeoutMs"] = json!(1);
    r["steps"][0]["parallel"][1]["timeoutMs"] = json!(604800000u64);
    r["steps"][0]["parallel"][1]["cwd"] = json!("/");
    // the first member may well time out after 1 ms; the request is still valid
    env.submit(&r);

    for id in ["ok-256-steps", "ok-fields", "ok-conc-64", id128.as_str()] {
        let st = env.wait_terminal_for(id, Duration::from_secs(120));
        assert_eq!(st["state"], "complete", "{id}: {st}");
    }
    let st = env.wait_terminal("ok-conc-1");
    assert_ne!(st["state"], "rejected", "{st}");
    let st = env.status("ok-256-steps").unwrap();
    assert_eq!(st["steps"].as_array().unwrap().len(), 256);
    assert_eq!(env.status("ok-fields").unwrap()["sessionId"].as_str().unwrap().len(), 4096);
    env.check_consistency();
}

#[test]
fn duplicate_run_id() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let (_, first) = env.submit(&request(Some("dup-1"), &env.work, vec![sh_step("a", "echo first")]));
    let st1 = env.wait_terminal("dup-1");
    let again = request(Some("dup-1"), &env.work, vec![sh_step("a", "echo second > second-ran")]);
    let b = env.drop_request("dup-1-again", &again);
    expect_rejected(&env, "dup-1-again", RejectionCode::DuplicateRunId.as_str(), Some(&b), t0);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(file_bytes(&env.run_dir("dup-1").join("request.json")), first, "existing run untouched");
    let st2 = env.status("dup-1").unwrap();
    assert_eq!(st2["state"], st1["state"]);
    assert_eq!(st2["endedAt"], st1["endedAt"]);
    assert!(!env.work.join("second-ran").exists());
    env.check_consistency();
}

#[test]
fn cwd_missing_and_unknown_provider() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let mut r = valid(&env, "cwd-gone");
    r["cwd"] = json!("/nonexistent/runspool-test-dir");
    let b1 = env.drop_request("cwd-gone", &r);
    let mut r = valid(&env, "step-cwd-gone");
    r["steps"][0]["cwd"] = json!("/nonexistent/runspool-step-dir");
    let b2 = env.drop_request("step-cwd-gone", &r);
    let file_cwd = env.work.join("a-file");
    fs::write(&file_cwd, b"x").unwrap();
    let mut r = valid(&env, "cwd-is-file");
    r["cwd"] = json!(file_cwd.to_str().unwrap());
    let b3 = env.drop_request("cwd-is-file", &r);
    let r = request(
        Some("no-provider"),
        &env.work,
        vec![
            json!({"agent": "x", "externalJob": {"provider": "nope", "prompt": "#!/bin/sh\necho hi\n", "options": {}}}),
        ],
    );
    let b4 = env.drop_request("no-provider", &r);

    expect_rejected(&env, "cwd-gone", RejectionCode::CwdMissing.as_str(), Some(&b1), t0);
    expect_rejected_run(&env, "cwd-gone", RejectionCode::CwdMissing.as_str());
    expect_rejected(&env, "step-cwd-gone", RejectionCode::CwdMissing.as_str(), Some(&b2), t0);
    expect_rejected_run(&env, "step-cwd-gone", RejectionCode::CwdMissing.as_str());
    expect_rejected(&env, "cwd-is-file", RejectionCode::CwdMissing.as_str(), Some(&b3), t0);
    expect_rejected(&env, "no-provider", RejectionCode::UnknownProvider.as_str(), Some(&b4), t0);
    expect_rejected_run(&env, "no-provider", RejectionCode::UnknownProvider.as_str());
    let r = env.result("cwd-gone").expect("a rejected run publishes a result");
    assert_eq!(r["state"], "rejected");
    assert_eq!(r["success"], json!(false));
    env.check_consistency();
}

#[test]
fn rejected_name_collision_gets_suffix() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    let mut v2 = valid(&env, "collide-run");
    v2["version"] = json!(2);
    let first = env.drop_request("collide", &v2);
    expect_rejected(&env, "collide", RejectionCode::UnsupportedVersion.as_str(), Some(&first), t0);
    let second = b"not json at all".to_vec();
    let tmp = env.spool().join(".tmp-collide");
    write_file_mode(&tmp, &second, 0o600);
    set_mtime_ago(&tmp, 30);
    fs::rename(&tmp, env.spool().join("collide.json")).unwrap();
    wait_until(LONG, "second entry rejected as collide-1.json", || env.rejected().join("collide-1.json").exists());
    assert_eq!(file_bytes(&env.rejected().join("collide.json")), first, "first rejected entry untouched");
    assert_eq!(
        env.wait_rejection("collide")["code"],
        RejectionCode::UnsupportedVersion.as_str(),
        "first reason untouched"
    );
    assert_eq!(file_bytes(&env.rejected().join("collide-1.json")), second);
    let e = env.wait_rejection("collide-1");
    assert_eq!(e["code"], RejectionCode::InvalidJson.as_str());
    assert!(env.pending_spool().is_empty());
    env.check_consistency();
}

#[test]
fn fresh_partial_json_is_not_rejected_early() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let body =
        serde_json::to_vec_pretty(&request(Some("written-in-place"), &env.work, vec![sh_step("a", "echo in-place")]))
            .unwrap();
    let (head, tail) = body.split_at(body.len() / 2);
    let p = env.spool().join("written-in-place.json");
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p).unwrap();
    f.write_all(head).unwrap();
    f.flush().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert!(p.exists(), "a fresh unparsable request is left alone");
    assert!(!env.rejected().join("written-in-place.error.json").exists(), "not rejected within 2 s");
    f.write_all(tail).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let st = env.wait_terminal("written-in-place");
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(file_bytes(&env.run_dir("written-in-place").join("request.json")), body);
    assert!(!env.rejected().join("written-in-place.json").exists());
    env.check_consistency();
}

fn flock_ex(f: &std::fs::File) {
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
}

#[test]
fn flocked_request_is_not_claimed_until_released() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let body =
        serde_json::to_vec_pretty(&request(Some("under-lock"), &env.work, vec![sh_step("a", "echo locked")])).unwrap();
    let (head, tail) = body.split_at(body.len() / 3);
    let p = env.spool().join("under-lock.json");
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p).unwrap();
    flock_ex(&f);
    f.write_all(head).unwrap();
    f.flush().unwrap();
    // Well past the 2 s mtime grace: only the lock protects it now.
    std::thread::sleep(Duration::from_secs(4));
    assert!(p.exists(), "locked request still in the spool");
    assert!(!env.rejected().join("under-lock.json").exists(), "locked request not rejected");
    assert!(!env.run_dir("under-lock").exists(), "locked request not claimed");
    // Finish the body while still holding the lock: complete JSON, yet not claimable.
    f.write_all(tail).unwrap();
    f.sync_all().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert!(p.exists(), "still locked, still not claimed");
    assert!(!env.run_dir("under-lock").exists());
    drop(f); // releases the lock
    let st = env.wait_terminal("under-lock");
    assert_eq!(st["state"], "complete", "{st}");
    assert_eq!(file_bytes(&env.run_dir("under-lock").join("request.json")), body);
    env.check_consistency();
}

#[test]
fn garbage_does_not_stop_valid_requests() {
    // Bad input gets a named error and nothing else stops: interleave good and bad.
    let mut env = TestEnv::new();
    env.start_daemon();
    let t0 = now_ms();
    for i in 0..10 {
        env.submit(&request(Some(&format!("mix-ok-{i}")), &env.work, vec![sh_step("a", &format!("exit {}", i % 3))]));
        let mut bad = valid(&env, &format!("mix-bad-{i}"));
        bad["priority"] = json!(5000);
        env.drop_request(&format!("mix-bad-{i}"), &bad);
    }
    for i in 0..10 {
        let st = env.wait_terminal(&format!("mix-ok-{i}"));
        assert_eq!(st["exitCode"], json!(i % 3), "{st}");
        expect_rejected(&env, &format!("mix-bad-{i}"), RejectionCode::InvalidField.as_str(), None, t0);
    }
    let _ = Path::new("/");
    env.check_consistency();
}

#[test]
fn hard_linked_request_is_not_claimed() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let body = serde_json::to_vec(&valid(&env, "hard-linked")).unwrap();
    let outside = env.spool().join(".keep-outside");
    write_file_mode(&outside, &body, 0o600);
    fs::hard_link(&outside, env.spool().join("hard-linked.json")).unwrap();
    let e = env.wait_rejection("hard-linked");
    assert!(
        [
            RejectionCode::NotRegularFile.as_str(),
            RejectionCode::BadPermissions.as_str(),
            RejectionCode::BadOwner.as_str()
        ]
        .contains(&e["code"].as_str().unwrap_or("")),
        "a request with two links is refused: {e}"
    );
    assert!(!env.run_dir("hard-linked").exists() || env.state("hard-linked").as_deref() == Some("rejected"));
    assert_eq!(file_bytes(&outside), body);
}

#[test]
fn cli_reports_rejection_of_its_request() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let o = env.cli(&["submit", "--run-id", "cli-rejected", "--cwd", "/nonexistent/cli-cwd", "--wait", "--", "true"]);
    assert!(!o.status.success(), "submit --wait of a rejected request fails: {}", describe(&o));
    // (the CLI may refuse it itself before publishing; if it published, the run is rejected)
    std::thread::sleep(Duration::from_millis(500));
    assert!(matches!(env.state("cli-rejected").as_deref(), None | Some("rejected")));
    let mut r = valid(&env, "cli-rejected");
    r["cwd"] = json!("/nonexistent/cli-cwd");
    env.drop_request("cli-rejected-req", &r);
    let o = env.cli(&["wait", "cli-rejected", "--timeout", "30s"]);
    assert!(!o.status.success(), "wait on a rejected run fails: {}", describe(&o));
    let o = env.cli(&["status", "cli-rejected", "--json"]);
    assert!(o.status.success(), "{}", describe(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["state"], "rejected");
}

/// A value of the wrong type is explained in the author's words, never as a
/// Rust type (`expected u64`): in a rejected request's error file and in
/// `runspool config check`.
#[test]
fn wrong_types_are_named_in_plain_words() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let w = env.work.clone();
    let mut r = request(Some("type-timeout"), &w, vec![cmd_step("a", &["true"])]);
    r["timeoutMs"] = json!("soon");
    env.submit(&r);
    let mut r = request(Some("type-command"), &w, vec![cmd_step("a", &["true"])]);
    r["steps"][0]["command"] = json!("make test");
    env.submit(&r);
    for (name, want) in [
        ("type-timeout", "field `timeoutMs` must be a whole number, 0 or more (got \"soon\")"),
        ("type-command", "`command` must be a list ([...]) (got \"make test\")"),
    ] {
        let e = env.wait_rejection(name);
        let msg = e["message"].as_str().unwrap_or_default();
        assert!(msg.contains(want), "{name}: {msg}");
        assert!(!msg.contains("expected u64") && !msg.contains("sequence"), "{name}: {msg}");
    }

    let bad = env.base().join("typed.toml");
    fs::write(&bad, "max_running = \"four\"\n[watch]\nrescan_interval_s = true\n").unwrap();
    let o = env.cli(&["config", "check", "--config", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", describe(&o));
    let text = stderr_str(&o);
    assert!(text.contains("max_running must be a whole number, 0 or more (got \"four\") (line 1)"), "{text}");
    assert!(text.contains("watch.rescan_interval_s must be a whole number, 0 or more (got true) (line 3)"), "{text}");
    assert!(!text.contains("expected u"), "{text}");
}
