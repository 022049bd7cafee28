//! External-job providers (PROTOCOL §8.4): the `Provider` trait, the
//! `command` provider and the built-in `slurm` provider (`api.rs` what a
//! provider is, `bounded.rs` the process runner both use), the registry
//! built from the config, and `runspool providers`.

mod api;
mod bounded;
pub mod command;
pub mod slurm;

pub use api::{failure, Call, CheckError, Provider, ProviderError};
pub use bounded::{run_bounded, tail_text, Output};

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config;

pub type Providers = BTreeMap<String, (Arc<dyn Provider>, Duration)>;

/// Build every configured provider with its time limit.
pub fn build_all(cfg: &config::Config) -> Providers {
    cfg.providers
        .iter()
        .map(|(name, p)| (name.clone(), (build(name, p), Duration::from_millis(p.timeout_ms))))
        .collect()
}

/// Check every provider on a thread of its own, logging each outcome:
/// checks can take seconds (sinfo on an unreachable cluster), never in the
/// daemon's loop.
pub fn check_in_background(providers: &Providers) {
    let checks: Vec<(String, Arc<dyn Provider>)> = providers.iter().map(|(n, (p, _))| (n.clone(), p.clone())).collect();
    let _ = std::thread::Builder::new().name("provider-checks".into()).spawn(move || {
        for (name, p) in checks {
            match p.check() {
                Ok(what) => tracing::info!(provider = %name, kind = p.kind(), check = %what, "provider ready"),
                Err(e) => tracing::warn!(provider = %name, error = %e, "provider check failed; its operations will fail until it is fixed"),
            }
        }
    });
}

pub fn build(name: &str, p: &config::Provider) -> Arc<dyn Provider> {
    match p.kind {
        config::ProviderKind::Slurm => Arc::new(slurm::Slurm::new(name)),
        config::ProviderKind::Command => Arc::new(command::CommandProvider::new(name, p.command.clone())),
    }
}

/// `runspool providers`: list the configured providers and check each.
/// The config a running daemon on `layout` reports it loaded (daemon.json
/// `config`), with its pid; None when no daemon holds the lock or it does
/// not say.
fn running_daemon_config(layout: &crate::store::Layout) -> Option<(u64, crate::protocol::daemon::ConfigInfo)> {
    if !crate::store::fsutil::lock_held(&layout.daemon_lock()).unwrap_or(false) {
        return None;
    }
    let d = crate::store::daemon_json::read(layout)?;
    Some((d.pid as u64, d.config?))
}

/// `runspool providers`: without `--config`, and with a daemon running on
/// the root, the providers of the config that daemon loaded.
pub fn cli_main(config_path: Option<&Path>, json: bool, layout: &crate::store::Layout) -> i32 {
    let daemon = if config_path.is_none() { running_daemon_config(layout) } else { None };
    let loaded = match &daemon {
        Some((pid, info)) => {
            let shown = info.path.as_deref().unwrap_or("no config file (the defaults)");
            eprintln!("runspool providers: the config of the running daemon (pid {pid}): {shown}");
            match &info.path {
                Some(p) => config::Config::load(Some(Path::new(p))),
                None => Ok(config::Config::default()),
            }
        }
        None => config::Config::load(config_path),
    };
    let cfg = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("runspool providers: {e}");
            if let Some((pid, info)) = &daemon {
                let names: Vec<String> = info.providers.iter().map(|p| format!("{} ({})", p.name, p.kind)).collect();
                eprintln!(
                    "runspool providers: the daemon (pid {pid}) still runs with the providers it loaded before: {}",
                    if names.is_empty() { "none".to_string() } else { names.join(", ") }
                );
            }
            return 1;
        }
    };
    if let Some((pid, info)) = &daemon {
        if cfg.provider_infos() != info.providers {
            let names: Vec<String> = info.providers.iter().map(|p| format!("{} ({})", p.name, p.kind)).collect();
            eprintln!(
                "runspool providers: warning: the file changed since the daemon loaded it; the daemon runs with: {}; \
apply the file with `systemctl --user reload runspool` or `kill -HUP {pid}`",
                if names.is_empty() { "no providers".to_string() } else { names.join(", ") }
            );
        }
    }
    let checks: Vec<(String, &config::Provider, Result<String, String>)> = cfg
        .providers
        .iter()
        .map(|(name, p)| (name.clone(), p, build(name, p).check().map_err(|e| e.to_string())))
        .collect();
    let failed = checks.iter().filter(|c| c.2.is_err()).count();
    if json {
        let v: Vec<serde_json::Value> = checks
            .iter()
            .map(|(name, p, r)| {
                serde_json::json!({
                    "name": name, "type": p.kind, "command": p.command, "timeoutMs": p.timeout_ms,
                    "ok": r.is_ok(), "check": match r { Ok(t) | Err(t) => t },
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else if checks.is_empty() {
        println!("no providers configured; add [providers.NAME] tables to the config file (see docs/external-jobs.md)");
    } else {
        println!("{:<16} {:<8} {:>10}  CHECK", "NAME", "TYPE", "TIMEOUT");
        for (name, p, r) in &checks {
            let (mark, text) = match r {
                Ok(t) => ("ok", t),
                Err(e) => ("FAILED", e),
            };
            println!("{:<16} {:<8} {:>8}ms  {mark}: {text}", name, p.kind, p.timeout_ms);
        }
    }
    if failed > 0 {
        eprintln!("runspool providers: {failed} provider(s) failed their check");
        1
    } else {
        0
    }
}
