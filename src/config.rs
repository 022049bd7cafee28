//! The TOML configuration (PROTOCOL §13). Unknown keys are refused by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub root: Option<PathBuf>,
    pub max_running: usize,
    pub retention_days: u64,
    /// Run time limit of a request without `timeoutMs`, in ms; 0 means none.
    pub default_timeout_ms: u64,
    pub watch: Watch,
    pub storage: Storage,
    pub log: Log,
    pub hooks: Hooks,
    pub providers: BTreeMap<String, Provider>,
}

/// `[hooks]`: commands run when a run ends (see src/daemon/hooks.rs).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Hooks {
    /// Run when a run ends `complete`: program and arguments.
    pub on_complete: Vec<String>,
    /// Run when a run ends in any other state (failed, stopped, paused).
    pub on_failure: Vec<String>,
    /// Hooks running at once; more wait their turn.
    pub max_parallel: usize,
    /// A hook still running after this long gets SIGTERM, then SIGKILL.
    pub timeout_s: u64,
}

impl Hooks {
    pub fn enabled(&self) -> bool {
        !self.on_complete.is_empty() || !self.on_failure.is_empty()
    }
}

impl Default for Hooks {
    fn default() -> Self {
        Hooks { on_complete: vec![], on_failure: vec![], max_parallel: 2, timeout_s: 60 }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Watch {
    pub strategy: String,
    pub poll_interval_ms: u64,
    pub rescan_interval_s: u64,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Storage {
    pub min_free_bytes: u64,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    pub level: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Provider {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default = "default_provider_timeout")]
    pub timeout_ms: u64,
}

fn default_provider_timeout() -> u64 {
    120_000
}

impl Default for Config {
    fn default() -> Self {
        Config {
            root: None,
            max_running: 4,
            retention_days: 30,
            default_timeout_ms: crate::protocol::request::DEFAULT_TIMEOUT_MS,
            watch: Watch::default(),
            storage: Storage::default(),
            log: Log::default(),
            hooks: Hooks::default(),
            providers: BTreeMap::new(),
        }
    }
}
impl Default for Watch {
    fn default() -> Self {
        Watch { strategy: "auto".into(), poll_interval_ms: 250, rescan_interval_s: 30 }
    }
}
impl Default for Storage {
    fn default() -> Self {
        Storage { min_free_bytes: 16 * 1024 * 1024 }
    }
}
impl Default for Log {
    fn default() -> Self {
        Log { level: "info".into() }
    }
}

/// Where the config comes from: `--config`, else the XDG default.
pub fn default_path() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("runspool/config.toml"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/runspool/config.toml"))
}

impl Config {
    /// Load: an explicit file must exist; a missing default file means defaults.
    pub fn load(explicit: Option<&Path>) -> Result<Config, String> {
        let (path, required) = match explicit {
            Some(p) => (p.to_path_buf(), true),
            None => match default_path() {
                Some(p) => (p, false),
                None => return Ok(Config::default()),
            },
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Config::parse(&text).map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Ok(Config::default()),
            Err(e) => {
                Err(format!("cannot read the config file {}: {e}; fix the path given to --config", path.display()))
            }
        }
    }

    pub fn parse(text: &str) -> Result<Config, String> {
        // The path names the key of a value of the wrong type (toml's own
        // message does not); for an unknown key it names the table.
        let c: Config = serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
            let key = e.path().to_string();
            let e = e.into_inner();
            let at = span_hint(text, &e);
            if key.is_empty() || key == "." {
                format!("{}{at}", e.message())
            } else {
                format!("{key}: {}{at}", e.message())
            }
        })?;
        c.check()?;
        Ok(c)
    }

    /// What differs from `old`, one `key old -> new` item per change, for
    /// the SIGHUP report. Keys that only a restart applies say so; `root`
    /// says instead that it is ignored when `root_override` (the flag or
    /// variable that chose the root, see `Layout::root_override`) wins.
    pub fn changes_from(&self, old: &Config, root_override: Option<&str>) -> Vec<String> {
        let mut out = Vec::new();
        fn item(out: &mut Vec<String>, key: &str, a: String, b: String, restart: bool) {
            if a != b {
                out.push(format!(
                    "{key} {a} -> {b}{}",
                    if restart { " (applies at the next daemon start)" } else { "" }
                ));
            }
        }
        let root =
            |r: &Option<PathBuf>| r.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(default)".into());
        if old.root != self.root {
            let note = match root_override {
                Some(w) => format!("not applied: {w} wins; the config's root is ignored"),
                None => "applies at the next daemon start".into(),
            };
            out.push(format!("root {} -> {} ({note})", root(&old.root), root(&self.root)));
        }
        item(&mut out, "max_running", old.max_running.to_string(), self.max_running.to_string(), false);
        item(&mut out, "retention_days", old.retention_days.to_string(), self.retention_days.to_string(), false);
        item(
            &mut out,
            "default_timeout_ms",
            old.default_timeout_ms.to_string(),
            self.default_timeout_ms.to_string(),
            false,
        );
        item(&mut out, "watch.strategy", old.watch.strategy.clone(), self.watch.strategy.clone(), true);
        item(
            &mut out,
            "watch.poll_interval_ms",
            old.watch.poll_interval_ms.to_string(),
            self.watch.poll_interval_ms.to_string(),
            true,
        );
        item(
            &mut out,
            "watch.rescan_interval_s",
            old.watch.rescan_interval_s.to_string(),
            self.watch.rescan_interval_s.to_string(),
            false,
        );
        item(
            &mut out,
            "storage.min_free_bytes",
            old.storage.min_free_bytes.to_string(),
            self.storage.min_free_bytes.to_string(),
            false,
        );
        item(&mut out, "log.level", old.log.level.clone(), self.log.level.clone(), false);
        for (key, a, b) in [
            ("hooks.on_complete", &old.hooks.on_complete, &self.hooks.on_complete),
            ("hooks.on_failure", &old.hooks.on_failure, &self.hooks.on_failure),
        ] {
            match (a.is_empty(), b.is_empty()) {
                (true, false) => out.push(format!("{key} added")),
                (false, true) => out.push(format!("{key} removed")),
                _ if a != b => out.push(format!("{key} changed")),
                _ => {}
            }
        }
        item(
            &mut out,
            "hooks.max_parallel",
            old.hooks.max_parallel.to_string(),
            self.hooks.max_parallel.to_string(),
            false,
        );
        item(&mut out, "hooks.timeout_s", old.hooks.timeout_s.to_string(), self.hooks.timeout_s.to_string(), false);
        for (name, p) in &self.providers {
            match old.providers.get(name) {
                None => out.push(format!("providers.{name} added")),
                Some(o) if o != p => out.push(format!("providers.{name} changed")),
                Some(_) => {}
            }
        }
        for name in old.providers.keys().filter(|n| !self.providers.contains_key(*n)) {
            out.push(format!("providers.{name} removed"));
        }
        out
    }

    fn check(&self) -> Result<(), String> {
        if self.max_running == 0 {
            return Err("max_running is 0; set it to 1 or more".into());
        }
        if self.default_timeout_ms > crate::protocol::request::MAX_TIMEOUT_MS {
            return Err(format!(
                "default_timeout_ms is {}; use at most {} (7 days), or 0 for no limit",
                self.default_timeout_ms,
                crate::protocol::request::MAX_TIMEOUT_MS
            ));
        }
        if !matches!(self.watch.strategy.as_str(), "auto" | "native" | "poll") {
            return Err(format!("watch.strategy is `{}`; use auto, native or poll", self.watch.strategy));
        }
        if self.watch.poll_interval_ms == 0 || self.watch.rescan_interval_s == 0 {
            return Err("watch.poll_interval_ms and watch.rescan_interval_s must be at least 1".into());
        }
        if !matches!(self.log.level.as_str(), "error" | "warn" | "info" | "debug" | "trace") {
            return Err(format!("log.level is `{}`; use error, warn, info, debug or trace", self.log.level));
        }
        for (key, cmd) in [("hooks.on_complete", &self.hooks.on_complete), ("hooks.on_failure", &self.hooks.on_failure)]
        {
            if cmd.first().is_some_and(|c| c.is_empty()) {
                return Err(format!("{key} starts with an empty program name; give the executable first, e.g. [\"notify-send\", \"runspool\"]"));
            }
        }
        if self.hooks.max_parallel == 0 {
            return Err("hooks.max_parallel is 0; set it to 1 or more".into());
        }
        if self.hooks.timeout_s == 0 {
            return Err("hooks.timeout_s is 0; set a positive number of seconds".into());
        }
        for (name, p) in &self.providers {
            match p.kind.as_str() {
                "command" if p.command.is_empty() || p.command[0].is_empty() => {
                    return Err(format!("providers.{name}.command is empty; give the executable and its arguments"))
                }
                "command" | "slurm" => {}
                other => return Err(format!("providers.{name}.type is `{other}`; use \"command\" or \"slurm\"")),
            }
            if p.timeout_ms == 0 {
                return Err(format!("providers.{name}.timeout_ms is 0; set a positive number of milliseconds"));
            }
            crate::providers::validate(name, p)?;
        }
        Ok(())
    }
}

fn span_hint(text: &str, e: &toml::de::Error) -> String {
    e.span()
        .map(|s| {
            let before = &text[..s.start.min(text.len())];
            format!(" (line {})", before.matches('\n').count() + 1)
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.max_running, 4);
        assert_eq!(c.watch.rescan_interval_s, 30);
    }
    /// docs/config.md shows the whole file at its defaults: it must parse to them.
    #[test]
    fn documented_defaults() {
        let doc = include_str!("../docs/config.md");
        let start = doc.find("## Every key, at its default").expect("section present");
        let rest = &doc[start..];
        let block = rest.split("```toml\n").nth(1).and_then(|b| b.split("```").next()).expect("toml block");
        let c = Config::parse(block).unwrap_or_else(|e| panic!("docs/config.md block does not parse: {e}"));
        assert_eq!(c, Config::default(), "docs/config.md defaults drifted from the code");
        for key in [
            "max_running",
            "retention_days",
            "default_timeout_ms",
            "strategy",
            "poll_interval_ms",
            "rescan_interval_s",
            "min_free_bytes",
            "level",
            "on_complete",
            "on_failure",
            "max_parallel",
            "timeout_s",
        ] {
            assert!(block.contains(&format!("\n{key} = ")), "docs/config.md block lacks {key}");
        }
    }
    #[test]
    fn unknown_keys_are_named() {
        let e = Config::parse("max_runing = 3").unwrap_err();
        assert!(e.contains("max_runing"), "{e}");
        let e = Config::parse("[watch]\nstrategi = \"poll\"").unwrap_err();
        assert!(e.contains("strategi"), "{e}");
    }
    #[test]
    fn errors_name_the_key_and_line() {
        let e = Config::parse("max_running = 2\nno_such_key = 1\n").unwrap_err();
        assert!(e.contains("no_such_key") && e.contains("line 2"), "{e}");
        let e = Config::parse("[log]\nlevel = 3\n").unwrap_err();
        assert!(e.contains("log.level"), "{e}");
        let e = Config::parse("max_running = \"two\"").unwrap_err();
        assert!(e.contains("max_running"), "{e}");
    }
    #[test]
    fn changes_are_listed() {
        let old = Config::parse("max_running = 1\n[providers.a]\ntype = \"slurm\"\n").unwrap();
        let new = Config::parse("max_running = 2\n[log]\nlevel = \"debug\"\n[watch]\nstrategy = \"poll\"\n[providers.b]\ntype = \"slurm\"\n").unwrap();
        assert_eq!(
            new.changes_from(&old, None),
            vec![
                "max_running 1 -> 2",
                "watch.strategy auto -> poll (applies at the next daemon start)",
                "log.level info -> debug",
                "providers.b added",
                "providers.a removed",
            ]
        );
        assert!(old.changes_from(&old, None).is_empty());
    }
    #[test]
    fn root_and_hook_changes_are_listed() {
        let old = Config::parse("[hooks]\non_failure = [\"a\"]\n").unwrap();
        let new = Config::parse("root = \"/r\"\n[hooks]\non_complete = [\"b\"]\ntimeout_s = 5\n").unwrap();
        assert_eq!(
            new.changes_from(&old, None),
            vec![
                "root (default) -> /r (applies at the next daemon start)",
                "hooks.on_complete added",
                "hooks.on_failure removed",
                "hooks.timeout_s 60 -> 5",
            ]
        );
        assert_eq!(
            new.changes_from(&old, Some("--root /x"))[0],
            "root (default) -> /r (not applied: --root /x wins; the config's root is ignored)"
        );
    }
    #[test]
    fn providers() {
        let c = Config::parse(
            "[providers.slurm]\ntype = \"slurm\"\n[providers.k8s]\ntype = \"command\"\ncommand = [\"/bin/true\"]\n",
        )
        .unwrap();
        assert_eq!(c.providers.len(), 2);
        assert!(Config::parse("[providers.x]\ntype = \"magic\"").unwrap_err().contains("providers.x.type"));
    }
}
