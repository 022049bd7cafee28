//! `runspool completions` and `runspool man`: both are generated from the
//! clap definition in `mod.rs`, so they cannot drift from the real options.
//! Packaging (scripts/build-deb.sh, the RPM spec, the Homebrew formula)
//! calls these instead of keeping copies.

use std::io::Write as _;
use std::path::Path;

use anyhow::Context as _;

pub fn completions(shell: clap_complete::Shell, cmd: clap::Command) -> i32 {
    let mut cmd = visible_only(&cmd);
    let name = cmd.get_name().to_string();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, name.clone(), &mut script);
    let script = with_run_ids(shell, &String::from_utf8_lossy(&script), &name, &run_commands(&cmd));
    let _ = std::io::stdout().write_all(script.as_bytes());
    0
}

/// The subcommands whose positional argument names runs (`run` or `runs`).
fn run_commands(cmd: &clap::Command) -> Vec<String> {
    cmd.get_subcommands()
        .filter(|s| s.get_positionals().any(|a| matches!(a.get_id().as_str(), "run" | "runs")))
        .map(|s| s.get_name().to_string())
        .collect()
}

/// Teach the generated script to complete run arguments with the ids
/// `<bin> __complete-runs` lists (runs and pending requests under the root
/// of the environment: $RUNSPOOL_ROOT and the rest, as every command).
fn with_run_ids(shell: clap_complete::Shell, script: &str, bin: &str, cmds: &[String]) -> String {
    use clap_complete::Shell;
    let list = cmds.join(" ");
    match shell {
        Shell::Bash => {
            let alts = cmds.join("|");
            format!(
                r#"{script}
_{bin}_with_run_ids() {{
    _{bin} "$@"
    local i w sub=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        case "$w" in
            --root) ((i++)) ;;
            -*) ;;
            *) sub="$w"; break ;;
        esac
    done
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    case "$sub" in
        {alts}) ;;
        *) return 0 ;;
    esac
    case "$prev" in --root|--reason|--step|--timeout|--lines|-n) return 0 ;; esac
    [[ "$cur" == -* ]] && return 0
    local ids
    ids=$({bin} __complete-runs 2>/dev/null)
    COMPREPLY=( $(compgen -W "$ids" -- "$cur") )
}}
complete -F _{bin}_with_run_ids -o bashdefault -o default {bin}
"#
            )
        }
        Shell::Zsh => {
            let mut out = String::new();
            for line in script.lines() {
                let is_run = ["':run -- ", "'::run -- ", "'*::runs -- ", "'*:runs -- "].iter().any(|p| line.starts_with(p));
                match line.strip_suffix(":_default' \\").filter(|_| is_run) {
                    Some(head) => out.push_str(&format!("{head}:_{bin}_run_ids' \\")),
                    None => out.push_str(line),
                }
                out.push('\n');
                if line.starts_with("#compdef") {
                    out.push_str(&format!(
                        "\n_{bin}_run_ids() {{\n    local -a ids\n    ids=(${{(f)\"$({bin} __complete-runs 2>/dev/null)\"}})\n    \
                         compadd -a ids\n}}\n"
                    ));
                }
            }
            out
        }
        Shell::Fish => format!(
            "{script}complete -c {bin} -n \"__fish_{bin}_using_subcommand {list}\" -f -a \"({bin} __complete-runs 2>/dev/null)\"\n"
        ),
        _ => script.to_string(),
    }
}

/// `cmd` without its hidden subcommands (`runner`): clap_complete offers
/// them, unlike --help and clap_mangen. Command has no way to remove one, so
/// this rebuilds each level from its own arguments, groups and visible
/// subcommands: nothing of the CLI is restated here.
fn visible_only(cmd: &clap::Command) -> clap::Command {
    let mut out = clap::Command::new(cmd.get_name().to_string())
        .args(cmd.get_arguments().cloned())
        .groups(cmd.get_groups().cloned())
        .subcommands(cmd.get_subcommands().filter(|s| !s.is_hide_set()).map(visible_only));
    if let Some(v) = cmd.get_version() {
        out = out.version(v.to_string());
    }
    if let Some(a) = cmd.get_about() {
        out = out.about(a.clone());
    }
    out
}

/// Every visible page: the top-level one first, then one per subcommand
/// (nested ones too, e.g. runspool-service-install), as (file name, roff).
fn pages(cmd: clap::Command) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    // `help` is clap's own; man pages do not list it.
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let version = cmd.get_version().unwrap_or_default().to_string();
    let mut out = Vec::new();
    let mut todo = vec![cmd];
    while let Some(c) = todo.pop() {
        let man = clap_mangen::Man::new(c.clone());
        let mut roff = Vec::new();
        man.render(&mut roff)?;
        let name = man.get_filename();
        let title = name.trim_end_matches(".1");
        out.push((
            name.clone(),
            polish(&String::from_utf8_lossy(&roff), title, &version, c.get_after_help().map(|h| h.to_string())),
        ));
        // Reversed so pages come out in declaration order.
        todo.extend(c.get_subcommands().filter(|s| !s.is_hide_set()).cloned().collect::<Vec<_>>().into_iter().rev());
    }
    Ok(out)
}

/// Escape one line of plain text for roff.
fn esc(line: &str) -> String {
    let s = line.replace('\\', "\\e").replace('-', "\\-").replace('\'', "\\(aq");
    if s.starts_with('.') {
        format!("\\&{s}")
    } else {
        s
    }
}

/// Fixes to clap_mangen's page: a `.TH` whose empty date field is quoted
/// (unquoted, the source lands in the date's place), no hyphenation or
/// justification (the text is full of paths and variable names), and
/// `after_help` as an EXAMPLES section kept line for line (clap_mangen fills
/// it, under EXTRA), with any other paragraph of it under NOTES.
fn polish(roff: &str, title: &str, version: &str, after_help: Option<String>) -> Vec<u8> {
    let mut out = String::new();
    let (head, rest) = match roff.find("\n.SH EXTRA\n") {
        Some(i) => {
            let tail = &roff[i + 1..];
            let end = tail[1..].find("\n.SH ").map(|j| j + 2).unwrap_or(tail.len());
            (&roff[..i + 1], &tail[end..])
        }
        None => (roff, ""),
    };
    for line in head.lines() {
        if line.starts_with(".TH ") {
            out.push_str(&format!(".TH {title} 1 \"\" \"runspool {version}\" \"runspool manual\"\n.nh\n.ad l\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if let Some(text) = after_help {
        let (mut examples, mut notes) = (String::new(), String::new());
        for para in text.split("\n\n").map(str::trim_end).filter(|p| !p.trim().is_empty()) {
            if let Some(body) = para.strip_prefix("Examples:\n") {
                examples.push_str(".PP\n.nf\n");
                for l in body.lines() {
                    examples.push_str(&esc(l));
                    examples.push('\n');
                }
                examples.push_str(".fi\n");
            } else {
                notes.push_str(".PP\n");
                notes.push_str(&esc(&para.lines().map(str::trim).collect::<Vec<_>>().join(" ")));
                notes.push('\n');
            }
        }
        if !examples.is_empty() {
            out.push_str(".SH EXAMPLES\n");
            out.push_str(&examples);
        }
        if !notes.is_empty() {
            out.push_str(".SH NOTES\n");
            out.push_str(&notes);
        }
    }
    out.push_str(rest);
    out.into_bytes()
}

pub fn man(cmd: clap::Command, dir: Option<&Path>) -> i32 {
    let r = (|| -> anyhow::Result<()> {
        let pages = pages(cmd)?;
        match dir {
            None => {
                let mut so = std::io::stdout().lock();
                so.write_all(&pages[0].1)?;
                so.flush()?;
            }
            Some(dir) => {
                std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
                for (name, roff) in &pages {
                    let p = dir.join(name);
                    std::fs::write(&p, roff).with_context(|| format!("cannot write {}", p.display()))?;
                }
            }
        }
        Ok(())
    })();
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("runspool man: {e:#}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn completions_leave_out_hidden_commands_only() {
        let full = crate::cli::Cli::command();
        let vis = visible_only(&full);
        let names = |c: &clap::Command| c.get_subcommands().map(|s| s.get_name().to_string()).collect::<Vec<_>>();
        let want: Vec<String> = names(&full).into_iter().filter(|n| n != "runner" && n != "__complete-runs").collect();
        assert_eq!(names(&vis), want);
        let svc = |c: &clap::Command| c.find_subcommand("service").map(names).unwrap();
        assert_eq!(svc(&vis), svc(&full));
        let submit = |c: &clap::Command| {
            c.find_subcommand("submit").unwrap().get_arguments().map(|a| a.get_id().to_string()).collect::<Vec<_>>()
        };
        assert_eq!(submit(&vis), submit(&full));
        assert!(vis.get_arguments().any(|a| a.get_id() == "root" && a.is_global_set()));
    }

    #[test]
    fn one_page_per_visible_command() {
        let names: Vec<String> = pages(crate::cli::Cli::command()).unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[0], "runspool.1");
        for want in ["runspool-submit.1", "runspool-service.1", "runspool-service-install.1", "runspool-man.1"] {
            assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
        }
        assert!(!names.iter().any(|n| n.contains("runner") || n.contains("help")), "{names:?}");
    }

    #[test]
    fn examples_get_their_own_section() {
        let (_, roff) = pages(crate::cli::Cli::command()).unwrap().remove(0);
        let roff = String::from_utf8(roff).unwrap();
        assert!(roff.contains("\n.SH EXAMPLES\n.PP\n.nf\n") && !roff.contains(".SH EXTRA"), "{roff}");
        assert!(roff.contains("\n.SH NOTES\n.PP\nThe root is \\-\\-root"), "{roff}");
        assert!(roff.contains("\n.TH runspool 1 \"\" \"runspool "), "{roff}");
    }
}
