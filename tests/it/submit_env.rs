//! What environment a step gets: by default the daemon's plus the request's
//! `env`; `submit --env-all` captures the submitter's environment,
//! `--env-file` adds NAME=value lines, `--env` wins over both; the §2.2
//! limits are said before anything is published.

use crate::common;

use std::process::{Command, Output, Stdio};

use common::*;

/// `runspool submit ...` with extra variables in the submitter's environment only.
fn submit_with_env(env: &TestEnv, args: &[&str], vars: &[(String, String)]) -> Output {
    Command::new(BIN)
        .arg("submit")
        .arg("--root")
        .arg(&env.root)
        .args(args)
        .env("RUNSPOOL_ROOT", &env.root)
        .env("XDG_CONFIG_HOME", env.base().join("xdg"))
        .envs(vars.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .expect("spawn runspool submit")
}

fn step_saw(env: &TestEnv, id: &str, file: &str) -> String {
    let st = env.wait_terminal(id);
    assert_eq!(st["state"], "complete", "{st}");
    std::fs::read_to_string(env.work.join(file)).expect("the step wrote what it saw")
}

#[test]
fn env_all_and_env_file_reach_the_step_and_explicit_wins() {
    let mut env = TestEnv::new();
    env.start_daemon();
    let cwd = env.work.to_str().unwrap().to_string();
    let show = "printf '%s|%s|%s|%s' \"${ONLY_SUBMITTER-unset}\" \"${FROM_FILE-unset}\" \"${BOTH-unset}\" \"${BAD_NAME_OK-unset}\" > saw-$RUN";

    // The default stays explicit: a variable only the submitter has is not the step's.
    let mine = vec![("ONLY_SUBMITTER".to_string(), "from-my-shell".to_string())];
    let o =
        submit_with_env(&env, &["--cwd", &cwd, "--run-id", "dflt", "--env", "RUN=dflt", "--", "sh", "-c", show], &mine);
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert_eq!(step_saw(&env, "dflt", "saw-dflt"), "unset|unset|unset|unset");

    // --env-all: the submitter's variable reaches the step; a name outside the grammar is skipped with a note.
    let mut vars = mine.clone();
    vars.push(("NOT-A-NAME".to_string(), "x".to_string()));
    vars.push(("BOTH".to_string(), "from-shell".to_string()));
    let o = submit_with_env(
        &env,
        &["--cwd", &cwd, "--run-id", "all", "--env-all", "--env", "RUN=all", "--", "sh", "-c", show],
        &vars,
    );
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains("NOT-A-NAME") && err.contains("[A-Za-z_][A-Za-z0-9_]*"), "{err}");
    assert_eq!(step_saw(&env, "all", "saw-all"), "from-my-shell|unset|from-shell|unset");

    // --env-file: comments and blank lines; the file wins over --env-all, --env over both.
    let file = env.base().join("vars.env");
    std::fs::write(&file, "# for the step\n\nFROM_FILE=a=b c\nBOTH=from-file\n").unwrap();
    let f = file.to_str().unwrap();
    let o = submit_with_env(
        &env,
        &["--cwd", &cwd, "--run-id", "file", "--env-all", "--env-file", f, "--env", "RUN=file", "--", "sh", "-c", show],
        &vars,
    );
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert_eq!(step_saw(&env, "file", "saw-file"), "from-my-shell|a=b c|from-file|unset");
    let o = submit_with_env(
        &env,
        &[
            "--cwd",
            &cwd,
            "--run-id",
            "flag",
            "--env-file",
            f,
            "--env",
            "BOTH=flag",
            "--env",
            "RUN=flag",
            "--",
            "sh",
            "-c",
            show,
        ],
        &mine,
    );
    assert_eq!(o.status.code(), Some(0), "{}", describe(&o));
    assert_eq!(step_saw(&env, "flag", "saw-flag"), "unset|a=b c|flag|unset");
}

#[test]
fn env_limits_and_bad_env_files_are_refused_with_what_to_do() {
    let env = TestEnv::new();
    let cwd = env.work.to_str().unwrap().to_string();
    // More than 256 variables: --env-all says the limit and the way out, and publishes nothing.
    let many: Vec<(String, String)> = (0..300).map(|i| (format!("MANY_{i}"), "v".to_string())).collect();
    let o = submit_with_env(&env, &["--cwd", &cwd, "--run-id", "big", "--env-all", "--", "true"], &many);
    assert_ne!(o.status.code(), Some(0), "{}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains("256") && err.contains("--env-file") && err.contains("--env NAME=value"), "{err}");
    assert!(!env.spool().join("big.json").exists(), "nothing is published");

    // A bad line names the file and the line.
    let file = env.base().join("bad.env");
    std::fs::write(&file, "# ok\nGOOD=1\n\nthis line has no equals\n").unwrap();
    let o = submit_with_env(
        &env,
        &["--cwd", &cwd, "--run-id", "bad", "--env-file", file.to_str().unwrap(), "--", "true"],
        &[],
    );
    assert_ne!(o.status.code(), Some(0), "{}", describe(&o));
    let err = stderr_str(&o);
    assert!(err.contains(&format!("{}:4", file.display())) && err.contains("NAME=value"), "{err}");
    assert!(!env.spool().join("bad.json").exists(), "nothing is published");

    // The help says what a step gets by default.
    let o = submit_with_env(&env, &["--help"], &[]);
    let help = stdout_str(&o);
    assert!(
        help.contains("--env-all") && help.contains("--env-file") && help.contains("DAEMON's environment"),
        "{help}"
    );
}
