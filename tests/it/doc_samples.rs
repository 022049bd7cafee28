//! docs/operations.md's samples are real output: the `wait` and `list`
//! sample is compared with what the current binary prints for the same
//! kind of run, after normalizing what changes from run to run (the run id,
//! the elapsed time, how long ago). The `doctor` sample is compared under a
//! real user manager in tests/it/systemd_user.rs.

use crate::common;

use common::*;
use std::time::Duration;

/// The lines of the console block that starts with `$ {command}`, up to the next `$ ` or the block's end.
fn sample(doc: &str, command: &str) -> Vec<String> {
    let start = doc.find(&format!("$ {command}")).unwrap_or_else(|| panic!("docs/operations.md has no `$ {command}`"));
    doc[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("$ ") && !l.starts_with("```"))
        .map(str::to_string)
        .collect()
}

/// The run id (or its 8-character short form in `list`) as `<id>`, `after MM:SS` as `after <t>`, `took 2s`/`for 1m05s` as `took <t>`/`for <t>`, `Ns ago`/`Nm ago` as `<ago>`, runs of spaces as one.
fn normalize(line: &str, id: &str) -> String {
    let l = line.replace(id, "<id>").replace(&id[..id.len().min(8)], "<id>");
    let mut words: Vec<String> = Vec::new();
    let mut it = l.split_whitespace().peekable();
    while let Some(w) = it.next() {
        let timeish = |w: &str| w.chars().all(|c| c.is_ascii_digit() || c == ':');
        let span = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_digit() || "smh".contains(c));
        let last = words.last().map(String::as_str);
        if (last == Some("after") && timeish(w)) || (matches!(last, Some("took" | "for")) && span(w)) {
            words.push("<t>".into());
        } else if it.peek() == Some(&"ago")
            && w.trim_end_matches(['s', 'm', 'h', 'd']).chars().all(|c| c.is_ascii_digit())
        {
            it.next();
            words.push("<ago>".into());
        } else {
            words.push(w.to_string());
        }
    }
    words.join(" ")
}

#[test]
fn operations_wait_and_list_sample_is_real_output() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md")).unwrap();
    let block = sample(&doc, "runspool wait ");
    let doc_id = doc[doc.find("$ runspool wait ").unwrap() + "$ runspool wait ".len()..]
        .split(|c: char| c == ';' || c.is_whitespace())
        .next()
        .unwrap()
        .to_string();

    let mut env = TestEnv::new();
    env.start_daemon();
    let o = env.cli(&["submit", "--", "sh", "-c", "sleep 2; echo done"]);
    assert!(o.status.success(), "{}", describe(&o));
    let id = String::from_utf8_lossy(&o.stdout).trim().to_string();
    // The sample waits on a run that is already running.
    wait_until(Duration::from_secs(60), "the run runs", || env.state(&id).as_deref() == Some("running"));
    let w = env.cli(&["wait", &id]);
    assert!(w.status.success(), "{}", describe(&w));
    let mut real: Vec<String> = String::from_utf8_lossy(&w.stderr).lines().map(str::to_string).collect();
    let mut listed = String::new();
    wait_until(Duration::from_secs(30), "list shows the finished run", || {
        listed = String::from_utf8_lossy(&env.cli(&["list"]).stdout).to_string();
        // `list` shows the id's shortest unique prefix: 8 characters in this root of one run.
        listed.contains(&id[..8])
    });
    real.extend(listed.lines().map(str::to_string));

    let want: Vec<String> = block.iter().map(|l| normalize(l, &doc_id)).collect();
    let got: Vec<String> = real.iter().map(|l| normalize(l, &id)).collect();
    assert_eq!(
        got, want,
        "docs/operations.md's `runspool wait; runspool list` sample drifted from the binary's output"
    );
}
