//! The TOML configuration (PROTOCOL §13). Unknown keys are refused by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::protocol::daemon::{ConfigInfo, ProviderInfo};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub root: Option<PathBuf>,
    pub max_running: usize,
    pub retention_days: u64,
    /// Run time limit of a request without `timeoutMs`, in ms; 0 means none.
    pub default_timeout_ms: u64,
    /// The steward (PROTOCOL §14.1): reconcile pi-subagents runs whose
    /// runner is gone, as pi-subagents 0.67 would. On by default.
    pub steward: bool,
    /// A Prometheus text file the daemon keeps up to date (for
    /// node_exporter's textfile collector); unset: none.
    pub metrics_file: Option<PathBuf>,
    pub watch: Watch,
    pub storage: Storage,
    pub log: Log,
    pub hooks: Hooks,
    pub providers: BTreeMap<String, Provider>,
    /// `[lanes.NAME]`: per-lane limits (PROTOCOL §15).
    pub lanes: BTreeMap<String, Lane>,
}

/// `[lanes.NAME]`: at most `max_running` runs of lane NAME have a live
/// runner at once (the global `max_running` still caps them all).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Lane {
    pub max_running: usize,
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
            steward: true,
            metrics_file: None,
            watch: Watch::default(),
            storage: Storage::default(),
            log: Log::default(),
            hooks: Hooks::default(),
            providers: BTreeMap::new(),
            lanes: BTreeMap::new(),
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
    /// daemon.json `config`: `explicit` is the daemon's `--config`; else the
    /// default path when that file exists, else none (the defaults).
    pub fn info(&self, explicit: Option<&Path>) -> ConfigInfo {
        let path = match explicit {
            Some(p) => Some(p.to_path_buf()),
            None => default_path().filter(|p| p.exists()),
        };
        ConfigInfo {
            path: path.map(|p| std::path::absolute(&p).unwrap_or(p).display().to_string()),
            providers: self.provider_infos(),
        }
    }

    /// The configured providers as daemon.json names them.
    pub fn provider_infos(&self) -> Vec<ProviderInfo> {
        self.providers.iter().map(|(name, p)| ProviderInfo { name: name.clone(), kind: p.kind.clone() }).collect()
    }

    /// Load: an explicit file must exist; a missing default file means defaults.
    pub fn load(explicit: Option<&Path>) -> Result<Config, ConfigError> {
        let (path, required) = match explicit {
            Some(p) => (p.to_path_buf(), true),
            None => match default_path() {
                Some(p) => (p, false),
                None => return Ok(Config::default()),
            },
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Config::parse(&text).map_err(|e| ConfigError::Invalid { path, message: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Ok(Config::default()),
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        // The path names the key of a value of the wrong type (toml's own
        // message does not); for an unknown key it names the table.
        let de = toml::Deserializer::parse(text)
            .map_err(|e| ConfigError::Parse(format!("{}{}", e.message(), span_hint(text, &e))))?;
        let c: Config = serde_path_to_error::deserialize(de)
            .map_err(|e| {
                let key = e.path().to_string();
                let e = e.into_inner();
                let at = span_hint(text, &e);
                let plain = crate::protocol::wording::plain(e.message(), crate::protocol::wording::Format::Toml);
                match plain {
                    Some(p) if !(key.is_empty() || key == ".") => format!("{key} {p}{at}"),
                    _ if key.is_empty() || key == "." => format!("{}{at}", e.message()),
                    _ => format!("{key}: {}{at}", e.message()),
                }
            })
            .map_err(ConfigError::Parse)?;
        c.check()?;
        Ok(c)
    }

    /// What differs from `old`, one `key old -> new` item per change, for
    /// the SIGHUP report. Keys that only a restart applies say so; `root`
    /// says instead that it is ignored when `root_override` (the flag or
    /// variable that chose the root, see `Layout::root_override`) wins.
    /// One comparison per configuration key, hence its length.
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
        item(&mut out, "steward", old.steward.to_string(), self.steward.to_string(), false);
        let metrics =
            |m: &Option<PathBuf>| m.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(none)".into());
        item(&mut out, "metrics_file", metrics(&old.metrics_file), metrics(&self.metrics_file), false);
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
        for (name, l) in &self.lanes {
            let was = old.lanes.get(name).map(|o| o.max_running.to_string()).unwrap_or_else(|| "(none)".into());
            item(&mut out, &format!("lanes.{name}.max_running"), was, l.max_running.to_string(), false);
        }
        for name in old.lanes.keys().filter(|n| !self.lanes.contains_key(*n)) {
            out.push(format!("lanes.{name} removed"));
        }
        out
    }

    fn check(&self) -> Result<(), ConfigError> {
        match self.problems().into_iter().next() {
            Some(e) => Err(ConfigError::Parse(e)),
            None => Ok(()),
        }
    }

    /// The cap of `lane`'s runs with a live runner, when `[lanes.NAME]` sets one.
    pub fn lane_max_running(&self, lane: &str) -> Option<usize> {
        self.lanes.get(lane).map(|l| l.max_running)
    }

    /// Every value the daemon refuses, in file order of the checks.
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.max_running == 0 {
            out.push("max_running is 0; set it to 1 or more".into());
        }
        for (name, l) in &self.lanes {
            if !crate::protocol::is_id(name, 64) {
                out.push(format!(
                    "lanes.{name}: the lane name must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}; rename the table"
                ));
            } else if l.max_running == 0 {
                out.push(format!(
                    "lanes.{name}.max_running is 0; set it to 1 or more (a lane cannot be closed; hold its runs instead)"
                ));
            }
        }
        if self.default_timeout_ms > crate::protocol::request::MAX_TIMEOUT_MS {
            out.push(format!(
                "default_timeout_ms is {}; use at most {} (7 days), or 0 for no limit",
                self.default_timeout_ms,
                crate::protocol::request::MAX_TIMEOUT_MS
            ));
        }
        if let Some(m) = self.metrics_file.as_ref().filter(|m| !m.is_absolute()) {
            out.push(format!(
                "metrics_file is `{}`, not an absolute path; give the full path of the file, e.g. \
                 \"/var/lib/prometheus/node-exporter/runspool.prom\"",
                m.display()
            ));
        }
        if !matches!(self.watch.strategy.as_str(), "auto" | "native" | "poll") {
            out.push(format!("watch.strategy is `{}`; use auto, native or poll", self.watch.strategy));
        }
        if self.watch.poll_interval_ms == 0 || self.watch.rescan_interval_s == 0 {
            out.push("watch.poll_interval_ms and watch.rescan_interval_s must be at least 1".into());
        }
        if !matches!(self.log.level.as_str(), "error" | "warn" | "info" | "debug" | "trace") {
            out.push(format!("log.level is `{}`; use error, warn, info, debug or trace", self.log.level));
        }
        for (key, cmd) in [("hooks.on_complete", &self.hooks.on_complete), ("hooks.on_failure", &self.hooks.on_failure)]
        {
            if cmd.first().is_some_and(|c| c.is_empty()) {
                out.push(format!("{key} starts with an empty program name; give the executable first, e.g. [\"notify-send\", \"runspool\"]"));
            }
        }
        if self.hooks.max_parallel == 0 {
            out.push("hooks.max_parallel is 0; set it to 1 or more".into());
        }
        if self.hooks.timeout_s == 0 {
            out.push("hooks.timeout_s is 0; set a positive number of seconds".into());
        }
        for (name, p) in &self.providers {
            match p.kind.as_str() {
                "command" if p.command.is_empty() || p.command[0].is_empty() => {
                    out.push(format!("providers.{name}.command is empty; give the executable and its arguments"));
                    continue;
                }
                "command" | "slurm" => {}
                other => {
                    out.push(format!("providers.{name}.type is `{other}`; use \"command\" or \"slurm\""));
                    continue;
                }
            }
            if p.timeout_ms == 0 {
                out.push(format!("providers.{name}.timeout_ms is 0; set a positive number of milliseconds"));
                continue;
            }
            if let Err(e) = validate_provider(name, p) {
                out.push(e);
            }
        }
        out
    }

    /// Every error in `text`, not only the first `parse` stops at (for
    /// `runspool config check`): each unknown key, each value of the wrong
    /// type (every provider table among them) and each refused value. The
    /// first is `parse`'s own message; the others name the key and, where
    /// the key is found in the text, its line. Empty: `parse` accepts it.
    pub fn parse_all(text: &str) -> Vec<String> {
        let first = match Config::parse(text) {
            Ok(_) => return vec![],
            Err(e) => e.to_string(),
        };
        let Ok(mut table) = text.parse::<toml::Table>() else {
            return vec![first]; // A syntax error: nothing after it can be read.
        };
        let mut out = Vec::new();
        // Each round drops the offending key (its default applies) and deserializes again.
        for _ in 0..256 {
            let e = match serde_path_to_error::deserialize::<_, Config>(toml::Value::Table(table.clone())) {
                Ok(c) => {
                    out.extend(c.problems());
                    break;
                }
                Err(e) => e,
            };
            let mut path: Vec<String> =
                e.path().iter().map(|seg| seg.to_string()).filter(|seg| seg != "." && !seg.is_empty()).collect();
            let msg = e.into_inner().to_string();
            // toml's Value deserializer appends "\nin `table`": the path says it already.
            let msg = msg.split("\nin `").next().unwrap_or_default().trim().to_string();
            let unknown = msg.strip_prefix("unknown field `").and_then(|r| r.split('`').next()).map(str::to_string);
            let shown = path.join(".");
            let line = line_of(text, &path, unknown.as_deref().filter(|u| path.last().map(String::as_str) != Some(u)));
            let plain = crate::protocol::wording::plain(&msg, crate::protocol::wording::Format::Toml);
            out.push(match plain {
                _ if shown.is_empty() || shown == "." => format!("{msg}{line}"),
                Some(p) => format!("{shown} {p}{line}"),
                None => format!("{shown}: {msg}{line}"),
            });
            // serde_path_to_error may or may not include an unknown key in the path.
            if let Some(u) = unknown.filter(|u| path.last() != Some(u)) {
                path.push(u);
            }
            // A bad provider table goes whole: what is left of it would only add follow-on errors.
            if path.first().is_some_and(|p| p == "providers" || p == "lanes") {
                path.truncate(2);
            }
            if path.is_empty() || path.iter().any(|p| p.starts_with('[') || p == ".") || !remove(&mut table, &path) {
                break;
            }
        }
        if out.is_empty() {
            out.push(first.clone());
        }
        // The first error keeps `parse`'s own wording (and line); the others follow in file order.
        out[0] = first;
        let line = |e: &String| {
            e.rsplit_once(" (line ")
                .and_then(|(_, n)| n.trim_end_matches(')').parse::<usize>().ok())
                .unwrap_or(usize::MAX)
        };
        out[1..].sort_by_key(line);
        out.dedup();
        out
    }
}

/// Why a configuration is refused. Each message names the file or key and
/// the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the config file {}: {source}; fix the path given to --config", .path.display())]
    Read { path: PathBuf, source: std::io::Error },
    /// The file was read; its text is refused (`message` is `Parse`'s).
    #[error("{}: {message}", .path.display())]
    Invalid { path: PathBuf, message: String },
    /// The text is refused: syntax, an unknown key, a wrong type or value.
    #[error("{0}")]
    Parse(String),
}

/// Remove the key at `path` from `table`; false when it is not there.
fn remove(table: &mut toml::Table, path: &[String]) -> bool {
    match path {
        [] => false,
        [last] => table.remove(last).is_some(),
        [first, rest @ ..] => match table.get_mut(first) {
            Some(toml::Value::Table(t)) => remove(t, rest),
            _ => false,
        },
    }
}

/// ` (line N)` for the line that sets the key `path` (+ `field`), when the
/// text has one: a `key =` line after its table header, or the header itself.
fn line_of(text: &str, path: &[String], field: Option<&str>) -> String {
    let mut keys: Vec<&str> = path.iter().map(String::as_str).collect();
    if let Some(f) = field {
        keys.push(f);
    }
    let Some((last, tables)) = keys.split_last() else { return String::new() };
    let header = format!("[{}]", tables.join("."));
    let full_header = format!("[{}]", keys.join("."));
    let mut in_table = tables.is_empty();
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            if t == full_header {
                return format!(" (line {})", i + 1);
            }
            in_table = t == header;
            continue;
        }
        if in_table {
            if let Some(rest) = t.strip_prefix(last) {
                if rest.trim_start().starts_with('=') {
                    return format!(" (line {})", i + 1);
                }
            }
        }
    }
    String::new()
}

fn span_hint(text: &str, e: &toml::de::Error) -> String {
    e.span()
        .map(|s| {
            let before = &text[..s.start.min(text.len())];
            format!(" (line {})", before.matches('\n').count() + 1)
        })
        .unwrap_or_default()
}

/// Checks on one `[providers.NAME]` table beyond its types (serde does
/// those); part of `errors`, so it runs at start, on every reload and in
/// `runspool config check`, and errors name the key.
fn validate_provider(name: &str, p: &Provider) -> Result<(), String> {
    if !crate::protocol::is_id(name, 128) {
        return Err(format!(
            "providers.{name}: the provider name must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}; rename the table"
        ));
    }
    match p.kind.as_str() {
        "slurm" if !p.command.is_empty() => Err(format!(
            "providers.{name}.command is set, but type = \"slurm\" uses sbatch, squeue, sacct/scontrol and scancel from PATH; remove the command key"
        )),
        "command" if p.command.iter().any(|a| a.contains('\0')) => {
            Err(format!("providers.{name}.command contains a NUL character; remove it"))
        }
        _ => Ok(()),
    }
}

/// What request validation needs of the configuration (PROTOCOL §2.3).
impl crate::protocol::request::Context for Config {
    fn provider_configured(&self, name: &str) -> bool {
        self.providers.contains_key(name)
    }
    fn default_timeout_ms(&self) -> u64 {
        self.default_timeout_ms
    }
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
            "steward",
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
    fn parse_all_reports_every_error() {
        let text = "max_runing = 3\nmax_running = 0\n[watch]\nstrategi = \"poll\"\nstrategy = \"fast\"\n\
[providers.a]\ntype = \"command\"\ncommand = \"not-a-list\"\n\
[providers.b]\ntype = \"nope\"\ncommand = [\"x\"]\n\
[providers.c]\ntype = \"command\"\ncommand = [\"x\"]\ntimeout = 5\n\
[providers.ok]\ntype = \"command\"\ncommand = [\"x\"]\n";
        let all = Config::parse_all(text);
        assert_eq!(all[0], Config::parse(text).unwrap_err().to_string(), "the first is parse's own message");
        for want in [
            "max_runing",
            "strategi",
            "providers.a",
            "providers.b.type is `nope`",
            "`timeout`",
            "max_running is 0",
            "watch.strategy is `fast`",
        ] {
            assert!(all.iter().any(|e| e.contains(want)), "no error mentions {want}: {all:#?}");
        }
        assert!(all.iter().any(|e| e.contains("strategi") && e.contains("(line 4)")), "{all:#?}");
        assert!(!all.iter().any(|e| e.contains("providers.ok")), "{all:#?}");
        assert!(Config::parse_all("max_running = 2\n").is_empty());
        assert_eq!(Config::parse_all("max_running = [").len(), 1, "a syntax error is one error");
    }
    #[test]
    fn metrics_file_is_an_absolute_path() {
        let c = Config::parse("metrics_file = \"/srv/prom/runspool.prom\"\n").unwrap();
        assert_eq!(c.metrics_file.as_deref(), Some(Path::new("/srv/prom/runspool.prom")));
        let e = Config::parse("metrics_file = \"runspool.prom\"\n").unwrap_err().to_string();
        assert!(e.contains("metrics_file") && e.contains("absolute"), "{e}");
        assert_eq!(c.changes_from(&Config::default(), None), ["metrics_file (none) -> /srv/prom/runspool.prom"]);
    }
    #[test]
    fn unknown_keys_are_named() {
        let e = Config::parse("max_runing = 3").unwrap_err().to_string();
        assert!(e.contains("max_runing"), "{e}");
        let e = Config::parse("[watch]\nstrategi = \"poll\"").unwrap_err().to_string();
        assert!(e.contains("strategi"), "{e}");
    }
    #[test]
    fn errors_name_the_key_and_line() {
        let e = Config::parse("max_running = 2\nno_such_key = 1\n").unwrap_err().to_string();
        assert!(e.contains("no_such_key") && e.contains("line 2"), "{e}");
        let e = Config::parse("[log]\nlevel = 3\n").unwrap_err().to_string();
        assert!(e.contains("log.level"), "{e}");
        let e = Config::parse("max_running = \"two\"").unwrap_err().to_string();
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
    fn lanes() {
        let c = Config::parse("max_running = 8\n[lanes.gpu]\nmax_running = 1\n").unwrap();
        assert_eq!((c.lane_max_running("gpu"), c.lane_max_running("default")), (Some(1), None));
        let e = Config::parse("[lanes.gpu]\nmax_runing = 1\n").unwrap_err().to_string();
        assert!(e.contains("max_runing"), "{e}");
        let e = Config::parse("[lanes.gpu]\nmax_running = 0\n").unwrap_err().to_string();
        assert!(e.contains("lanes.gpu.max_running"), "{e}");
        let old = Config::parse("").unwrap();
        assert_eq!(c.changes_from(&old, None), ["max_running 4 -> 8", "lanes.gpu.max_running (none) -> 1"]);
    }

    #[test]
    fn providers() {
        let c = Config::parse(
            "[providers.slurm]\ntype = \"slurm\"\n[providers.k8s]\ntype = \"command\"\ncommand = [\"/bin/true\"]\n",
        )
        .unwrap();
        assert_eq!(c.providers.len(), 2);
        assert!(Config::parse("[providers.x]\ntype = \"magic\"").unwrap_err().to_string().contains("providers.x.type"));
    }

    #[test]
    fn validation_names_the_key() {
        let p = Provider { kind: "slurm".into(), command: vec!["/x".into()], timeout_ms: 1 };
        assert!(validate_provider("s", &p).unwrap_err().contains("providers.s.command"));
        let p = Provider { kind: "command".into(), command: vec!["a\0".into()], timeout_ms: 1 };
        assert!(validate_provider("k", &p).unwrap_err().contains("providers.k.command"));
        let p = Provider { kind: "command".into(), command: vec!["/bin/true".into()], timeout_ms: 1 };
        assert!(validate_provider("k", &p).is_ok());
    }
}
