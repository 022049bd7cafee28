//! `runspool completions` and `runspool man`, generated from the clap
//! definition: the bash script parses and completes, the man pages render
//! without a groff warning and name every command. groff comes from
//! scripts/fixtures.sh when it is missing and we are root (as in CI).

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use clap::CommandFactory as _;

const BIN: &str = env!("CARGO_BIN_EXE_runspool");

fn runspool(args: &[&str]) -> std::process::Output {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "runspool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn has(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The names of the visible commands, nested ones as `service install`.
fn visible_commands() -> Vec<String> {
    fn walk(c: &clap::Command, prefix: &str, out: &mut Vec<String>) {
        for s in c.get_subcommands().filter(|s| !s.is_hide_set()) {
            let name = format!("{prefix}{}", s.get_name());
            out.push(name.clone());
            walk(s, &format!("{name} "), out);
        }
    }
    let mut out = Vec::new();
    walk(&runspool::cli::Cli::command(), "", &mut out);
    out
}

fn run_with_stdin(cmd: &mut Command, input: &[u8]) -> std::process::Output {
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn bash_completion_parses_and_completes() {
    let script = runspool(&["completions", "bash"]).stdout;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("runspool.bash");
    std::fs::write(&file, &script).unwrap();
    let n = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(n.status.success() && n.stderr.is_empty(), "bash -n: {}", String::from_utf8_lossy(&n.stderr));

    // Source it and ask the completion function what it offers, as bash
    // would on `runspool <TAB>` and `runspool service <TAB>`.
    let probe = r#"
        source "$1"
        complete -p runspool
        f=$(complete -p runspool | sed -n 's/.*-F \([^ ]*\) .*/\1/p')
        ask() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE};
                COMPREPLY=(); "$f" runspool "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}";
                echo "$* => ${COMPREPLY[*]}"; }
        ask runspool ""
        ask runspool service ""
        ask runspool completions ""
    "#;
    let out = Command::new("bash").arg("-c").arg(probe).arg("probe").arg(&file).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && out.stderr.is_empty(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let offered = |prefix: &str| -> Vec<String> {
        let line = text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` in\n{text}"));
        line.split(" => ").nth(1).unwrap_or("").split_whitespace().map(String::from).collect()
    };
    let top = offered("runspool  =>");
    for c in visible_commands().iter().filter(|c| !c.contains(' ')) {
        assert!(top.contains(c), "`runspool <TAB>` does not offer {c}: {top:?}");
    }
    assert!(!top.iter().any(|c| c == "runner"), "the hidden runner command is offered: {top:?}");
    let svc = offered("runspool service  =>");
    for c in ["install", "uninstall", "start", "stop", "restart", "status", "logs", "unit"] {
        assert!(svc.contains(&c.to_string()), "`runspool service <TAB>` does not offer {c}: {svc:?}");
    }
    let shells = offered("runspool completions  =>");
    for s in ["bash", "zsh", "fish", "elvish", "powershell"] {
        assert!(shells.contains(&s.to_string()), "{shells:?}");
    }
}

#[test]
fn every_shell_gets_a_script() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef runspool"),
        ("fish", "complete -c runspool"),
        ("elvish", "edit:completion"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let out = runspool(&["completions", shell]).stdout;
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains(marker), "{shell}: no `{marker}`");
        assert!(text.contains("submit") && text.contains("service"), "{shell}: commands missing");
    }
    // A shell's own parser, where one is installed (not in CI by default).
    let tmp = tempfile::tempdir().unwrap();
    for (shell, check) in [("zsh", vec!["-n"]), ("fish", vec!["--no-execute"])] {
        if !has(shell) {
            eprintln!("SKIP: {shell} is not installed; its completion script was not parsed by {shell}");
            continue;
        }
        let f = tmp.path().join(shell);
        std::fs::write(&f, runspool(&["completions", shell]).stdout).unwrap();
        let o = Command::new(shell).args(&check).arg(&f).output().unwrap();
        assert!(o.status.success(), "{shell} {check:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let bad = Command::new(BIN).args(["completions", "tcsh"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("possible values"));
}

/// Render roff as plain text, with groff's warnings; None (after saying so)
/// when neither man nor groff is there and cannot be installed.
fn render(roff: &[u8]) -> Option<(String, String)> {
    if !has("groff") && is_root() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures.sh");
        let st = Command::new("bash").arg(script).arg("groff").status().unwrap();
        assert!(st.success(), "scripts/fixtures.sh groff failed");
    }
    let out = if has("man") && has("groff") {
        // man-db's own pipeline (preconv, tbl, the Debian tmac); --warnings is groff -ww.
        run_with_stdin(
            Command::new("man")
                .args(["--warnings", "-l", "-"])
                .env("MANWIDTH", "100")
                .env("MANPAGER", "cat")
                .env("PAGER", "cat")
                .env("LC_ALL", "C.UTF-8"),
            roff,
        )
    } else if has("groff") {
        run_with_stdin(Command::new("groff").args(["-man", "-Tutf8", "-ww", "-P-cbou", "-rLL=100n"]), roff)
    } else {
        eprintln!("SKIP: neither man nor groff is installed (and not root to install groff-base); the man page was not rendered");
        return None;
    };
    assert!(out.status.success(), "rendering failed: {}", String::from_utf8_lossy(&out.stderr));
    // groff may print \- as U+2212 and hyphens as U+2010; compare in ASCII.
    let text = String::from_utf8_lossy(&out.stdout).replace(['\u{2212}', '\u{2010}'], "-");
    Some((text, String::from_utf8_lossy(&out.stderr).into_owned()))
}

#[test]
fn man_page_renders_and_names_every_command() {
    let roff = runspool(&["man"]).stdout;
    assert!(roff.starts_with(b".ie") || roff.starts_with(b".TH"), "not roff");
    let Some((text, warnings)) = render(&roff) else { return };
    assert!(warnings.is_empty(), "groff warnings:\n{warnings}");
    for section in ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "SUBCOMMANDS", "EXAMPLES"] {
        assert!(text.lines().any(|l| l == section), "no {section} section in\n{text}");
    }
    for c in visible_commands().iter().filter(|c| !c.contains(' ')) {
        assert!(text.contains(&format!("runspool-{c}(1)")), "runspool(1) does not mention {c}:\n{text}");
    }
    assert!(!text.contains("runspool-runner") && !text.contains("runspool-help"), "{text}");
    assert!(text.contains("runspool submit --wait -- make test"), "examples are not kept line for line:\n{text}");
}

#[test]
fn man_dir_writes_a_page_per_command_and_each_renders() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("man1");
    runspool(&["man", "--dir", dir.to_str().unwrap()]);
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let mut want: Vec<String> =
        visible_commands().iter().map(|c| format!("runspool-{}.1", c.replace(' ', "-"))).collect();
    want.push("runspool.1".into());
    want.sort();
    assert_eq!(names, want);
    assert_eq!(std::fs::read(dir.join("runspool.1")).unwrap(), runspool(&["man"]).stdout, "--dir and stdout differ");
    for n in &names {
        let roff = std::fs::read(dir.join(n)).unwrap();
        let Some((text, warnings)) = render(&roff) else { return };
        assert!(warnings.is_empty(), "{n}: groff warnings:\n{warnings}");
        let page = n.trim_end_matches(".1");
        assert!(text.starts_with(&format!("{page}(1)")), "{n} renders with another title:\n{text}");
    }
}

#[test]
fn service_unit_prints_what_a_package_ships() {
    let unit = String::from_utf8(runspool(&["service", "unit", "--bin", "/usr/bin/runspool"]).stdout).unwrap();
    assert_eq!(
        unit.lines().filter(|l| l.starts_with("ExecStart=")).collect::<Vec<_>>(),
        ["ExecStart=/usr/bin/runspool daemon"]
    );
    let template =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/runspool.service")).unwrap();
    assert_eq!(
        unit, template,
        "the repo unit already points at /usr/bin/runspool; rendering must not change anything else"
    );
    let own = String::from_utf8(runspool(&["service", "unit"]).stdout).unwrap();
    assert!(own.contains(&format!("ExecStart={BIN} daemon\n")), "{own}");
}

/// The exit-code rule (README.md "exit | when") is in the `--help` of every
/// command that follows a run to its end, with the codes for a stopped, a
/// timed-out and a refused run (tests/it/cli_wait.rs checks they hold).
#[test]
fn help_shows_the_exit_code_table() {
    for cmd in ["wait", "submit", "logs"] {
        let help = String::from_utf8(runspool(&[cmd, "--help"]).stdout).unwrap();
        for row in [
            "  0    the run completed",
            "  143  it timed out",
            "  1    it was stopped",
            "  2    the request was refused",
            "  124  ",
        ] {
            assert!(help.contains(row), "`runspool {cmd} --help` lacks `{row}`:\n{help}");
        }
    }
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    assert!(
        readme.contains("| 143 | it timed out") && readme.contains("| 1 | it was stopped"),
        "README lacks the table"
    );
}
