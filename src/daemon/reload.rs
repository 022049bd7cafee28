//! SIGHUP: re-read the config file and say what changed, or why the new
//! file was refused (the running configuration then stays). Each part is
//! told what concerns it.

use std::time::Duration;

use super::Daemon;
use crate::config::Config;
use crate::logging::{self, LevelChange};
use crate::store::queue;

impl Daemon {
    pub(super) fn reload(&mut self) {
        let file = self
            .config_path
            .clone()
            .or_else(crate::config::default_path)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "(no config file: defaults)".into());
        let new = match Config::load(self.config_path.as_deref()) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(config = %file, "configuration refused, keeping the running one: {e}");
                return;
            }
        };
        let mut changes = new.changes_from(&self.cfg, self.root_override.as_deref());
        if changes.is_empty() {
            tracing::info!(config = %file, "configuration reloaded: nothing changed");
            return;
        }
        // A quieter level is applied after the report, a louder one before,
        // so the report itself is never filtered out.
        let (old_level, new_level) = (self.cfg.log.level, new.log.level);
        let mut quieter_later = false;
        if old_level != new_level {
            if let Some(v) = logging::env_level() {
                note_level(&mut changes, &format!("not applied: {} = {v} is set and wins", logging::LEVEL_ENV));
            } else if new_level >= old_level {
                if let LevelChange::Failed(e) = logging::set_config_level(&new_level.to_string()) {
                    note_level(&mut changes, &format!("not applied: {e}"));
                }
            } else {
                quieter_later = true;
            }
        }
        tracing::info!(config = %file, "configuration reloaded: {}", changes.join("; "));
        if quieter_later {
            if let LevelChange::Failed(e) = logging::set_config_level(&new_level.to_string()) {
                tracing::warn!(config = %file, "log.level {new_level} not applied: {e}");
            }
        }
        self.apply_config(new);
    }

    /// Hand a new configuration to the parts it concerns.
    fn apply_config(&mut self, new: Config) {
        if new.providers != self.cfg.providers {
            self.providers = crate::providers::build_all(&new);
            self.bridge.providers_changed();
        }
        if new.watch.rescan_interval_s != self.cfg.watch.rescan_interval_s {
            self.recovery.set_rescan_interval(Duration::from_secs(new.watch.rescan_interval_s));
        }
        if new.retention_days != self.cfg.retention_days {
            self.retention.sweep_soon();
        }
        if new.hooks != self.cfg.hooks {
            // Hooks apply at once: added hooks are owed by every run active now.
            let active: Vec<crate::store::RunId> = self.scheduler.ids().chain(self.supervisor.ids()).cloned().collect();
            self.hooks.reconfigure(&new.hooks, &active);
        }
        if let Some(n) = self.scheduler.ctl.overriding() {
            if new.max_running != self.cfg.max_running {
                tracing::info!(
                    queue = %queue::path(&self.layout).display(),
                    "max_running = {} from the config is not applied: the queue file's maxRunning = {n} overrides it until `runspool max-running --clear`",
                    new.max_running
                );
            }
        }
        self.metrics.set_path(new.metrics_file.clone());
        // A new max_running or storage floor takes effect in the next turn.
        self.intake.mark_dirty();
        self.cfg = new;
        self.report.set_config(self.cfg.info(self.config_path.as_deref()));
        self.write_report(true);
    }
}

/// Append a remark to the `log.level` item of a reload report.
fn note_level(changes: &mut [String], remark: &str) {
    if let Some(c) = changes.iter_mut().find(|c| c.starts_with("log.level ")) {
        c.push_str(&format!(" ({remark})"));
    }
}
