//! The TOML configuration (PROTOCOL §13). Unknown keys are refused by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::platform::watch::Strategy;
use crate::protocol::daemon::{ConfigInfo, ProviderInfo};
use crate::protocol::ids::{LaneName, ProviderName};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
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
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Lane {
    pub max_running: usize,
}

/// `[hooks]`: commands run when a run ends (see src/daemon/hooks.rs).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
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

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Watch {
    pub strategy: Strategy,
    pub poll_interval_ms: u64,
    pub rescan_interval_s: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Storage {
    pub min_free_bytes: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    pub level: LogLevel,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Provider {
    #[serde(rename = "type")]
    pub kind: ProviderKind,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default = "default_provider_timeout")]
    pub timeout_ms: u64,
}

fn default_provider_timeout() -> u64 {
    120_000
}

/// A closed set of names the config accepts for one key: serde reads the
/// name into the value, or refuses it with an error that names the value
/// and every accepted name (the key is added by `Config::parse`).
pub trait Named: Sized + Copy + 'static {
    /// Every value, in the order the error lists them.
    const ALL: &'static [Self];
    /// The name in the config file (and in daemon.json, the CLI's output).
    fn name(self) -> &'static str;
}

/// `is `X`; use "a", "b" or "c"`: the refusal of a name outside `T::ALL`.
fn refusal<T: Named>(got: &str) -> String {
    let names: Vec<String> = T::ALL.iter().map(|v| format!("\"{}\"", v.name())).collect();
    let accepted = match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    format!("is `{got}`; use {accepted}")
}

macro_rules! named_serde {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let got = String::deserialize(d)?;
                <$t as Named>::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name() == got)
                    .ok_or_else(|| serde::de::Error::custom(refusal::<$t>(&got)))
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.pad(self.name())
            }
        }
    )*};
}

/// `[log] level`, quietest first (so `>` means more verbose).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

impl Named for LogLevel {
    const ALL: &'static [Self] = &[LogLevel::Error, LogLevel::Warn, LogLevel::Info, LogLevel::Debug, LogLevel::Trace];
    fn name(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// `[providers.NAME] type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderKind {
    Command,
    Slurm,
}

impl Named for ProviderKind {
    const ALL: &'static [Self] = &[ProviderKind::Command, ProviderKind::Slurm];
    fn name(self) -> &'static str {
        match self {
            ProviderKind::Command => "command",
            ProviderKind::Slurm => "slurm",
        }
    }
}

/// `[watch] strategy` (the choice itself is `platform::watch::choose`).
impl Named for Strategy {
    const ALL: &'static [Self] = &[Strategy::Auto, Strategy::Native, Strategy::Poll];
    fn name(self) -> &'static str {
        self.as_str()
    }
}

named_serde!(LogLevel, ProviderKind, Strategy);

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
        Watch { strategy: Strategy::Auto, poll_interval_ms: 250, rescan_interval_s: 30 }
    }
}
impl Default for Storage {
    fn default() -> Self {
        Storage { min_free_bytes: 16 * 1024 * 1024 }
    }
}
impl Default for Log {
    fn default() -> Self {
        Log { level: LogLevel::Info }
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
        self.providers.iter().map(|(name, p)| ProviderInfo { name: name.clone(), kind: p.kind.name().into() }).collect()
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
                    _ if key.is_empty() || key == "." => format!("{}{at}", e.message()),
                    Some(p) => format!("{key} {p}{at}"),
                    None => format!("{key}{}{at}", keyed(e.message())),
                }
            })
            .map_err(ConfigError::Parse)?;
        c.check()?;
        Ok(c)
    }

    /// What differs from `old`, one `key old -> new` item per change, for
    /// the SIGHUP report, computed from the serialized configurations, so a
    /// new key is reported without being listed here. Keys that only a
    /// restart applies say so; `root` says instead that it is ignored when
    /// `root_override` (the flag or variable that chose the root, see
    /// `Layout::root_override`) wins.
    pub fn changes_from(&self, old: &Config, root_override: Option<&str>) -> Vec<String> {
        let mut out = Vec::new();
        let (Ok(a), Ok(b)) = (serde_json::to_value(old), serde_json::to_value(self)) else {
            return vec!["the configuration changed (it cannot be compared key by key)".into()];
        };
        diff(&mut out, "", Some(&a), Some(&b));
        for item in &mut out {
            let key = item.split(' ').next().unwrap_or_default();
            if key == "root" {
                item.push_str(&match root_override {
                    Some(w) => format!(" (not applied: {w} wins; the config's root is ignored)"),
                    None => " (applies at the next daemon start)".into(),
                });
            } else if RESTART_KEYS.contains(&key) {
                item.push_str(" (applies at the next daemon start)");
            }
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
            if !LaneName::is_valid(name) {
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
        if self.watch.poll_interval_ms == 0 || self.watch.rescan_interval_s == 0 {
            out.push("watch.poll_interval_ms and watch.rescan_interval_s must be at least 1".into());
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
            if p.kind == ProviderKind::Command && p.command.first().is_none_or(|c| c.is_empty()) {
                out.push(format!("providers.{name}.command is empty; give the executable and its arguments"));
                continue;
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
                None => format!("{shown}{}{line}", keyed(&msg)),
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

/// Keys a reload does not apply: the daemon reads them once, at start.
const RESTART_KEYS: [&str; 2] = ["watch.strategy", "watch.poll_interval_ms"];

/// Tables whose entries are reported whole (`added`, `changed`, `removed`),
/// not key by key: a provider's command line is not for the log.
const WHOLE_ENTRIES: [&str; 1] = ["providers"];

/// The reload report's items for the key `path` going from `a` to `b`
/// (None: absent). Tables recurse key by key (the new file's keys first,
/// then those only the old one has); a list is `added`, `removed` or
/// `changed`; a value is `old -> new`, an unset one `(none)` (the root's
/// `(default)`).
fn diff(out: &mut Vec<String>, path: &str, a: Option<&Value>, b: Option<&Value>) {
    if a == b {
        return;
    }
    let key = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}.{k}") };
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) if WHOLE_ENTRIES.contains(&path) => {
            for (k, v) in y {
                match x.get(k) {
                    None => out.push(format!("{} added", key(k))),
                    Some(o) if o != v => out.push(format!("{} changed", key(k))),
                    Some(_) => {}
                }
            }
            for k in x.keys().filter(|k| !y.contains_key(*k)) {
                out.push(format!("{} removed", key(k)));
            }
        }
        (x @ (Some(Value::Object(_)) | None), Some(Value::Object(y))) => {
            let x = x.and_then(Value::as_object);
            for (k, v) in y {
                diff(out, &key(k), x.and_then(|x| x.get(k)), Some(v));
            }
            for (k, v) in x.into_iter().flatten().filter(|(k, _)| !y.contains_key(*k)) {
                diff(out, &key(k), Some(v), None);
            }
        }
        (Some(Value::Object(_)), None) => out.push(format!("{path} removed")),
        (a, b) if matches!(a, Some(Value::Array(_))) || matches!(b, Some(Value::Array(_))) => {
            let empty = |v: Option<&Value>| v.and_then(Value::as_array).is_none_or(Vec::is_empty);
            out.push(match (empty(a), empty(b)) {
                (true, false) => format!("{path} added"),
                (false, true) => format!("{path} removed"),
                _ => format!("{path} changed"),
            });
        }
        (a, b) => {
            let shown = |v: Option<&Value>| match v {
                None | Some(Value::Null) if path == "root" => "(default)".to_string(),
                None | Some(Value::Null) => "(none)".to_string(),
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
            };
            out.push(format!("{path} {} -> {}", shown(a), shown(b)));
        }
    }
}

/// How a message follows the key it is about: a closed set's refusal
/// (`is `X`; use ...`) reads on from the key, serde's own messages after a colon.
fn keyed(msg: &str) -> String {
    if msg.starts_with("is `") {
        format!(" {msg}")
    } else {
        format!(": {msg}")
    }
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
    if !ProviderName::is_valid(name) {
        return Err(format!(
            "providers.{name}: the provider name must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}; rename the table"
        ));
    }
    match p.kind {
        ProviderKind::Slurm if !p.command.is_empty() => Err(format!(
            "providers.{name}.command is set, but type = \"slurm\" uses sbatch, squeue, sacct/scontrol and scancel from PATH; remove the command key"
        )),
        ProviderKind::Command if p.command.iter().any(|a| a.contains('\0')) => {
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
    fn closed_sets_are_parsed_once_and_refusals_name_key_value_and_choices() {
        let c =
            Config::parse("[watch]\nstrategy = \"poll\"\n[log]\nlevel = \"trace\"\n[providers.s]\ntype = \"slurm\"\n")
                .unwrap();
        assert_eq!(
            (c.watch.strategy, c.log.level, c.providers["s"].kind),
            (Strategy::Poll, LogLevel::Trace, ProviderKind::Slurm)
        );
        for (text, want) in [
            (
                "[watch]\nstrategy = \"fast\"\n",
                "watch.strategy is `fast`; use \"auto\", \"native\" or \"poll\" (line 2)",
            ),
            (
                "[log]\nlevel = \"loud\"\n",
                "log.level is `loud`; use \"error\", \"warn\", \"info\", \"debug\" or \"trace\" (line 2)",
            ),
            ("[providers.x]\ntype = \"magic\"\n", "providers.x.type is `magic`; use \"command\" or \"slurm\" (line 2)"),
        ] {
            assert_eq!(Config::parse(text).unwrap_err().to_string(), want);
            assert_eq!(Config::parse_all(text), [want]);
        }
        // A value of the wrong type keeps serde's plain wording.
        let e = Config::parse("[log]\nlevel = 3\n").unwrap_err().to_string();
        assert!(e.starts_with("log.level must be a string in quotes (got 3)"), "{e}");
        // Each value reads back as the name it was written with.
        for &s in Strategy::ALL {
            let text = format!("[watch]\nstrategy = \"{s}\"\n");
            assert_eq!(Config::parse(&text).unwrap().watch.strategy, s);
        }
        for &l in LogLevel::ALL {
            let c = Config::parse(&format!("[log]\nlevel = \"{l}\"\n")).unwrap();
            assert_eq!((c.log.level, serde_json::to_value(l).unwrap()), (l, serde_json::json!(l.name())));
        }
        assert!(LogLevel::Debug > LogLevel::Info && LogLevel::Error < LogLevel::Warn, "ordered by verbosity");
        assert_eq!(format!("[{:<8}]", ProviderKind::Slurm), "[slurm   ]", "padding applies");
    }

    /// Every key of the configuration, found from the serialized defaults
    /// (not from a list), is reported when it alone changes.
    #[test]
    fn a_change_of_every_key_is_reported() {
        fn leaves(path: &str, v: &Value, out: &mut Vec<(String, Value)>) {
            match v {
                Value::Object(m) if !m.is_empty() => {
                    for (k, v) in m {
                        let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                        leaves(&p, v, out);
                    }
                }
                _ => out.push((path.to_string(), v.clone())),
            }
        }
        fn set(v: &mut Value, path: &str, to: Value) {
            let mut at = v;
            for k in path.split('.') {
                at = &mut at[k];
            }
            *at = to;
        }
        let base = serde_json::to_value(Config::default()).unwrap();
        let mut keys = Vec::new();
        leaves("", &base, &mut keys);
        // The strings of the closed sets: each leaf that holds one tries the others.
        let names: Vec<&str> = Strategy::ALL
            .iter()
            .map(|s| s.name())
            .chain(LogLevel::ALL.iter().map(|l| l.name()))
            .chain(ProviderKind::ALL.iter().map(|k| k.name()))
            .collect();
        assert!(keys.len() >= 15, "{keys:?}");
        for (key, was) in keys {
            let candidates: Vec<Value> = match &was {
                Value::Number(n) => vec![serde_json::json!(n.as_u64().unwrap() + 1)],
                Value::Bool(b) => vec![Value::Bool(!b)],
                Value::Null => vec![serde_json::json!("/changed/path")],
                Value::String(_) => names.iter().map(|n| serde_json::json!(n)).collect(),
                Value::Array(_) => vec![serde_json::json!(["changed"])],
                Value::Object(_) => {
                    vec![serde_json::json!({"p": {"type": "slurm"}}), serde_json::json!({"l": {"max_running": 1}})]
                }
            };
            let changed = candidates.into_iter().filter(|c| *c != was).find_map(|c| {
                let mut v = base.clone();
                set(&mut v, &key, c);
                serde_json::from_value::<Config>(v).ok()
            });
            let changed = changed.unwrap_or_else(|| panic!("no changed value of {key} deserializes"));
            assert_ne!(changed, Config::default(), "{key}");
            let report = changed.changes_from(&Config::default(), None);
            assert_eq!(report.len(), 1, "{key}: {report:?}");
            assert!(report[0].starts_with(&key), "{key} is not named: {report:?}");
            // And back: the change is reported in the other direction too.
            let back = Config::default().changes_from(&changed, None);
            assert!(back.len() == 1 && back[0].starts_with(&key), "{key}: {back:?}");
        }
    }

    #[test]
    fn table_entries_are_added_changed_and_removed() {
        let old = Config::parse("[providers.a]\ntype = \"slurm\"\n[providers.b]\ntype = \"slurm\"\n[lanes.x]\nmax_running = 2\n[lanes.y]\nmax_running = 1\n").unwrap();
        let new = Config::parse("[providers.a]\ntype = \"slurm\"\ntimeout_ms = 5\n[providers.c]\ntype = \"command\"\ncommand = [\"/bin/x\"]\n[lanes.x]\nmax_running = 3\n").unwrap();
        assert_eq!(
            new.changes_from(&old, None),
            [
                "providers.a changed",
                "providers.c added",
                "providers.b removed",
                "lanes.x.max_running 2 -> 3",
                "lanes.y removed",
            ]
        );
        let old = Config::parse("[hooks]\non_complete = [\"a\"]\n").unwrap();
        let new = Config::parse("[hooks]\non_complete = [\"a\", \"b\"]\n").unwrap();
        assert_eq!(new.changes_from(&old, None), ["hooks.on_complete changed"]);
    }

    #[test]
    fn validation_names_the_key() {
        let p = Provider { kind: ProviderKind::Slurm, command: vec!["/x".into()], timeout_ms: 1 };
        assert!(validate_provider("s", &p).unwrap_err().contains("providers.s.command"));
        let p = Provider { kind: ProviderKind::Command, command: vec!["a\0".into()], timeout_ms: 1 };
        assert!(validate_provider("k", &p).unwrap_err().contains("providers.k.command"));
        let p = Provider { kind: ProviderKind::Command, command: vec!["/bin/true".into()], timeout_ms: 1 };
        assert!(validate_provider("k", &p).is_ok());
    }
}
