//! `runspool config check|path`: validate the configuration a daemon would
//! load, the same way it loads it, before a restart or SIGHUP finds out.

use std::path::Path;

use serde_json::json;

use crate::config::{self, Config};

/// Exit 0 when the file is valid (warnings are printed but do not fail), 1 when
/// the daemon would refuse it.
pub fn check(explicit: Option<&Path>, json_out: bool) -> i32 {
    let path = explicit.map(Path::to_path_buf).or_else(config::default_path);
    let exists = path.as_ref().is_some_and(|p| p.exists());
    let source = match (explicit, exists) {
        (Some(_), _) => "--config",
        (None, true) => "default file",
        (None, false) => "defaults (no file)",
    };
    let shown = path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(none: HOME is unset)".into());
    match Config::load(explicit) {
        Ok(c) => {
            let warnings = warnings(&c);
            if json_out {
                let v = json!({"ok": true, "path": shown, "source": source, "warnings": warnings,
                               "maxRunning": c.max_running, "providers": c.providers.keys().collect::<Vec<_>>(),
                               "hooks": c.hooks.enabled()});
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!("{shown}: ok ({source})");
                println!(
                    "  max_running = {}, retention_days = {}, watch.strategy = {}, log.level = {}",
                    c.max_running, c.retention_days, c.watch.strategy, c.log.level
                );
                if !c.providers.is_empty() {
                    println!("  providers: {}", c.providers.keys().cloned().collect::<Vec<_>>().join(", "));
                }
                if c.hooks.enabled() {
                    println!("  hooks: on_complete {:?}, on_failure {:?}", c.hooks.on_complete, c.hooks.on_failure);
                }
                for w in &warnings {
                    eprintln!("warning: {w}");
                }
            }
            0
        }
        Err(e) => {
            let e = e.to_string();
            // `load` stops at the first error; list them all, each under the file's name as `load` does.
            let text = path.as_ref().filter(|_| exists).and_then(|p| std::fs::read_to_string(p).ok());
            let all: Vec<String> = text
                .map(|t| Config::parse_all(&t).into_iter().map(|x| format!("{shown}: {x}")).collect())
                .unwrap_or_default();
            let errors = if all.is_empty() || all[0] != e { vec![e.clone()] } else { all };
            if json_out {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"ok": false, "path": shown, "source": source, "error": e, "errors": errors})
                    )
                    .unwrap_or_default()
                );
            }
            if errors.len() == 1 {
                eprintln!("runspool: the daemon would refuse this configuration: {e}");
            } else {
                eprintln!("runspool: the daemon would refuse this configuration; {} errors:", errors.len());
                for x in &errors {
                    eprintln!("  {x}");
                }
            }
            eprintln!("  (a running daemon keeps its current configuration on SIGHUP until this is fixed)");
            1
        }
    }
}

/// Things that load but will likely not work.
fn warnings(c: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for (key, cmd) in [("hooks.on_complete", &c.hooks.on_complete), ("hooks.on_failure", &c.hooks.on_failure)] {
        if let Some(prog) = cmd.first() {
            if let Err(e) = crate::platform::exec::find_executable(prog) {
                out.push(format!(
                    "{key}: {e}; the hook will fail until it is installed (the service's PATH may differ from yours)"
                ));
            }
        }
    }
    out
}

pub fn path() -> i32 {
    match config::default_path() {
        Some(p) => {
            println!("{}", p.display());
            0
        }
        None => {
            eprintln!("runspool: neither XDG_CONFIG_HOME nor HOME is set; pass --config FILE");
            1
        }
    }
}
