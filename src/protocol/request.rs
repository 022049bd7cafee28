//! Launch requests (PROTOCOL §2.2): parsing and validation with every limit.
//!
//! Parsing happens in two passes: a syntax pass into `serde_json::Value`
//! (anything failing it is `invalid-json`) and a typed pass with
//! `deny_unknown_fields` whose errors carry the JSON path of the field.

use serde::{de, Deserialize, Deserializer, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;

use super::ids::{run_id_grammar, LaneName, RequestedRunId};

pub const MAX_REQUEST_BYTES: u64 = 1024 * 1024;
pub const MAX_STEPS: usize = 256;
/// The run limit of a request without `timeoutMs` when the daemon's
/// `default_timeout_ms` is not configured: none (PROTOCOL §2.2): a long
/// build or agent run is not killed by a default nobody chose.
pub const DEFAULT_TIMEOUT_MS: u64 = 0;
pub const MAX_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;

/// The rejection codes of PROTOCOL §2.3, written as `code` in
/// `spool/rejected/<name>.error.json` and in a rejected run's `error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectionCode {
    BadName,
    NotRegularFile,
    BadOwner,
    BadPermissions,
    TooLarge,
    InvalidJson,
    UnsupportedVersion,
    InvalidField,
    DuplicateRunId,
    CwdMissing,
    UnknownProvider,
    /// A pending request withdrawn by its client (`runspool stop`).
    Withdrawn,
    /// An `after` entry names neither a run nor a request in the spool (§15).
    UnknownDependency,
}

impl RejectionCode {
    /// Every code, in PROTOCOL §2.3's order (`Withdrawn`, a client's act, then §15's).
    pub const ALL: [RejectionCode; 13] = [
        RejectionCode::BadName,
        RejectionCode::NotRegularFile,
        RejectionCode::BadOwner,
        RejectionCode::BadPermissions,
        RejectionCode::TooLarge,
        RejectionCode::InvalidJson,
        RejectionCode::UnsupportedVersion,
        RejectionCode::InvalidField,
        RejectionCode::DuplicateRunId,
        RejectionCode::CwdMissing,
        RejectionCode::UnknownProvider,
        RejectionCode::Withdrawn,
        RejectionCode::UnknownDependency,
    ];

    /// The code as written on disk.
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectionCode::BadName => "bad-name",
            RejectionCode::NotRegularFile => "not-regular-file",
            RejectionCode::BadOwner => "bad-owner",
            RejectionCode::BadPermissions => "bad-permissions",
            RejectionCode::TooLarge => "too-large",
            RejectionCode::InvalidJson => "invalid-json",
            RejectionCode::UnsupportedVersion => "unsupported-version",
            RejectionCode::InvalidField => "invalid-field",
            RejectionCode::DuplicateRunId => "duplicate-run-id",
            RejectionCode::CwdMissing => "cwd-missing",
            RejectionCode::UnknownProvider => "unknown-provider",
            RejectionCode::Withdrawn => "withdrawn",
            RejectionCode::UnknownDependency => "unknown-dependency",
        }
    }

    /// The code spelled `s` on disk, if it is one.
    pub fn parse(s: &str) -> Option<RejectionCode> {
        RejectionCode::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for RejectionCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for RejectionCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// A rejection code and a message naming the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub code: RejectionCode,
    pub message: String,
}

impl Rejection {
    pub fn new(code: RejectionCode, message: impl Into<String>) -> Self {
        Rejection { code, message: message.into() }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

pub type Env = BTreeMap<String, String>;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Request {
    pub version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_owner_id: Option<String>,
    pub cwd: String,
    #[serde(default, deserialize_with = "unique_map")]
    pub env: Env,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub priority: i64,
    /// The run this one was restarted from (`runspool restart`): a run id,
    /// recorded as `restartOf` in the new run's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_of: Option<String>,
    /// Scheduling (PROTOCOL §15): the lane, default `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// Runs that must end before this one starts (1 to 64 run ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Vec<String>>,
    /// `success` (default): a dependency that ended other than `complete`
    /// fails this run; `any`: it starts regardless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_policy: Option<AfterPolicy>,
    /// Not started before this time (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<i64>,
    /// Queued held: never started until `control/release.json` arrives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<bool>,
    pub steps: Vec<Item>,
}

/// `afterPolicy` (PROTOCOL §15).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AfterPolicy {
    #[default]
    Success,
    Any,
}

impl AfterPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            AfterPolicy::Success => "success",
            AfterPolicy::Any => "any",
        }
    }
}

/// The lane of a request or run without one.
pub const DEFAULT_LANE: &str = "default";
/// Most entries in `after`.
pub const MAX_AFTER: usize = 64;
/// Latest `notBefore` accepted: the year 9999.
pub const MAX_NOT_BEFORE_MS: i64 = 253_402_300_799_999;

/// A top-level entry of `steps`: a plain step or a parallel group.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Item {
    Step(Step),
    Parallel(Parallel),
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Parallel {
    pub parallel: Vec<Step>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Step {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, deserialize_with = "unique_map")]
    pub env: Env,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_job: Option<ExternalJob>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ExternalJob {
    pub provider: String,
    pub prompt: String,
    #[serde(default)]
    pub options: serde_json::Map<String, Value>,
}

// The variant is chosen by the presence of `parallel`, so that errors name the
// real field instead of serde's "did not match any variant".
impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        let named = |e: serde_path_to_error::Error<serde_json::Error>| {
            let path = e.path().to_string();
            let msg = strip_position(&e.into_inner().to_string());
            match super::wording::plain(&msg, super::wording::Format::Json) {
                _ if path == "." => de::Error::custom(msg),
                Some(p) => de::Error::custom(format!("`{path}` {p}")),
                None => de::Error::custom(format!("`{path}`: {msg}")),
            }
        };
        if v.get("parallel").is_some() {
            serde_path_to_error::deserialize(v).map(Item::Parallel).map_err(named)
        } else {
            serde_path_to_error::deserialize(v).map(Item::Step).map_err(named)
        }
    }
}

/// A string map that refuses duplicate keys (serde's maps keep the last one).
fn unique_map<'de, D: Deserializer<'de>>(d: D) -> Result<Env, D::Error> {
    struct V;
    impl<'de> de::Visitor<'de> for V {
        type Value = Env;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object of string values")
        }
        fn visit_map<A: de::MapAccess<'de>>(self, mut m: A) -> Result<Env, A::Error> {
            let mut out = Env::new();
            while let Some((k, v)) = m.next_entry::<String, String>()? {
                if out.contains_key(&k) {
                    return Err(de::Error::custom(format!("duplicate key `{k}`")));
                }
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    d.deserialize_map(V)
}

super::open_enum! {
    /// `mode` of a run: runspool derives single, chain or parallel (§2.2);
    /// pi-subagents 0.67 also writes `workflow`.
    pub enum Mode {
        Single => "single",
        Chain => "chain",
        Parallel => "parallel",
        Workflow => "workflow",
    }
}

impl Request {
    pub fn mode(&self) -> Mode {
        match self.steps.as_slice() {
            [Item::Step(_)] => Mode::Single,
            [Item::Parallel(_)] => Mode::Parallel,
            _ => Mode::Chain,
        }
    }

    /// Flat steps in request order (plain steps and every group member).
    pub fn flat_steps(&self) -> Vec<&Step> {
        let mut out = Vec::new();
        for item in &self.steps {
            match item {
                Item::Step(s) => out.push(s),
                Item::Parallel(p) => out.extend(p.parallel.iter()),
            }
        }
        out
    }

    pub fn session(&self) -> &str {
        self.session_id.as_deref().unwrap_or("default")
    }

    /// The run's lane (§15).
    pub fn lane(&self) -> &str {
        self.lane.as_deref().unwrap_or(DEFAULT_LANE)
    }

    /// The run ids of `after`, each once, in request order.
    pub fn dependencies(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for id in self.after.iter().flatten() {
            if !out.contains(id) {
                out.push(id.clone());
            }
        }
        out
    }

    /// The run time limit in ms; 0 means none (config `default_timeout_ms = 0`).
    pub fn timeout(&self) -> u64 {
        self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS)
    }
}

impl Step {
    /// The step's label: `agent`, else the provider or the command's basename.
    pub fn label(&self, index: usize) -> String {
        if let Some(a) = &self.agent {
            return a.clone();
        }
        if let Some(j) = &self.external_job {
            return j.provider.clone();
        }
        match self.command.as_ref().and_then(|c| c.first()) {
            Some(a) => a.rsplit('/').next().unwrap_or(a).to_string(),
            None => format!("step-{index}"),
        }
    }
}

/// What the validator needs to know about the daemon.
pub trait Context {
    fn provider_configured(&self, name: &str) -> bool;
    /// The run time limit of a request without `timeoutMs` (config
    /// `default_timeout_ms`); 0 means none.
    fn default_timeout_ms(&self) -> u64 {
        DEFAULT_TIMEOUT_MS
    }
    fn is_dir(&self, path: &str) -> bool {
        std::fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false)
    }
}

/// Parse the bytes of a request. `Err(None)` means "not JSON at all" so the
/// caller can apply the 2-second grace for writers still at work.
pub fn parse(bytes: &[u8]) -> Result<Value, Rejection> {
    serde_json::from_slice::<Value>(bytes).map_err(|e| {
        Rejection::new(
            RejectionCode::InvalidJson,
            format!("the file is not valid JSON: {e}; rewrite it as one JSON object"),
        )
    })
}

/// Full validation of a parsed request (PROTOCOL §2.2).
pub fn validate(raw: &[u8], value: &Value, ctx: &dyn Context) -> Result<Request, Rejection> {
    let obj = value
        .as_object()
        .ok_or_else(|| Rejection::new(RejectionCode::InvalidField, "the request must be a JSON object"))?;
    match obj.get("version") {
        Some(Value::Number(n)) if n.as_u64() == Some(1) => {}
        Some(v) => {
            return Err(Rejection::new(
                RejectionCode::UnsupportedVersion,
                format!("field `version` is {v}; this daemon speaks protocol version 1: set \"version\": 1"),
            ))
        }
        None => {
            return Err(Rejection::new(
                RejectionCode::UnsupportedVersion,
                "field `version` is missing; add \"version\": 1",
            ))
        }
    }
    if let Some(path) = find_nul(value, "") {
        return Err(Rejection::new(
            RejectionCode::InvalidField,
            format!("field `{path}` contains a NUL character; remove it"),
        ));
    }
    // serde keeps the last of duplicate keys inside `steps` and `options`
    // (they pass through `Value`), so duplicates are refused everywhere first.
    if let Some(path) = find_duplicate_key(raw) {
        return Err(Rejection::new(
            RejectionCode::InvalidField,
            format!("field `{path}` appears twice; give each key once"),
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(raw);
    let req: Request = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = strip_position(&inner.to_string());
        if path == "." || path.is_empty() {
            Rejection::new(
                RejectionCode::InvalidField,
                format!("{msg}; see docs/protocol.md §2.2 for the request fields"),
            )
        } else {
            match super::wording::plain(&msg, super::wording::Format::Json) {
                Some(p) => Rejection::new(RejectionCode::InvalidField, format!("field `{path}` {p}")),
                None => Rejection::new(RejectionCode::InvalidField, format!("field `{path}`: {msg}")),
            }
        }
    })?;
    check(&req, ctx)?;
    let mut req = req;
    // The default is the claimer's: settled here, once, into the run's status.
    req.timeout_ms = req.timeout_ms.or(Some(ctx.default_timeout_ms()));
    Ok(req)
}

/// The path of the first key that repeats within one JSON object, if any.
/// Walks the raw bytes with serde_json's own (depth-limited) parser.
pub fn find_duplicate_key(raw: &[u8]) -> Option<String> {
    struct Walk<'p>(&'p str);
    impl<'de> de::DeserializeSeed<'de> for Walk<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> de::Visitor<'de> for Walk<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
            let mut i = 0usize;
            while a.next_element_seed(Walk(&format!("{}[{i}]", self.0)))?.is_some() {
                i += 1;
            }
            Ok(())
        }
        fn visit_map<A: de::MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(k) = m.next_key::<String>()? {
                let path = if self.0.is_empty() { k.clone() } else { format!("{}.{k}", self.0) };
                if !seen.insert(k) {
                    return Err(de::Error::custom(DUP_MARK.to_string() + &path));
                }
                m.next_value_seed(Walk(&path))?;
            }
            Ok(())
        }
    }
    const DUP_MARK: &str = "duplicate key at ";
    let mut d = serde_json::Deserializer::from_slice(raw);
    match de::DeserializeSeed::deserialize(Walk(""), &mut d) {
        Err(e) => {
            let msg = strip_position(&e.to_string());
            msg.strip_prefix(DUP_MARK).map(|p| p.escape_debug().to_string())
        }
        Ok(()) => None,
    }
}

fn strip_position(s: &str) -> String {
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s.to_string(),
    }
}

fn find_nul(v: &Value, path: &str) -> Option<String> {
    match v {
        Value::String(s) if s.contains('\0') => Some(path.trim_start_matches('.').to_string()),
        Value::Array(a) => a.iter().enumerate().find_map(|(i, x)| find_nul(x, &format!("{path}[{i}]"))),
        Value::Object(m) => m.iter().find_map(|(k, x)| {
            if k.contains('\0') {
                Some(format!("{path}.{}", k.replace('\0', "\\u0000")).trim_start_matches('.').to_string())
            } else {
                find_nul(x, &format!("{path}.{k}"))
            }
        }),
        _ => None,
    }
}

fn field(msg: String) -> Rejection {
    Rejection::new(RejectionCode::InvalidField, msg)
}

fn check_len(name: &str, v: &Option<String>, max: usize) -> Result<(), Rejection> {
    if let Some(s) = v {
        if s.len() > max {
            return Err(field(format!("field `{name}` is {} bytes; the limit is {max}", s.len())));
        }
    }
    Ok(())
}

fn check_env(name: &str, env: &Env) -> Result<(), Rejection> {
    if env.len() > 256 {
        return Err(field(format!("field `{name}` has {} entries; the limit is 256", env.len())));
    }
    for k in env.keys() {
        let b = k.as_bytes();
        let ok = !b.is_empty()
            && (b[0].is_ascii_alphabetic() || b[0] == b'_')
            && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
        if !ok {
            return Err(field(format!(
                "field `{name}` has the variable name `{k}`; names must match [A-Za-z_][A-Za-z0-9_]*"
            )));
        }
    }
    Ok(())
}

fn check_timeout(name: &str, t: Option<u64>) -> Result<(), Rejection> {
    if let Some(t) = t {
        if !(1..=MAX_TIMEOUT_MS).contains(&t) {
            return Err(field(format!("field `{name}` is {t}; it must be 1 to {MAX_TIMEOUT_MS} milliseconds")));
        }
    }
    Ok(())
}

fn check_cwd(name: &str, cwd: &str, ctx: &dyn Context) -> Result<(), Rejection> {
    if !cwd.starts_with('/') {
        return Err(field(format!("field `{name}` is `{cwd}`; it must be an absolute path")));
    }
    if !ctx.is_dir(cwd) {
        return Err(Rejection::new(
            RejectionCode::CwdMissing,
            format!("field `{name}`: `{cwd}` is not an existing directory; create it or fix the path"),
        ));
    }
    Ok(())
}

fn check_step(path: &str, s: &Step, ctx: &dyn Context) -> Result<(), Rejection> {
    check_len(&format!("{path}.agent"), &s.agent, 256)?;
    check_env(&format!("{path}.env"), &s.env)?;
    check_timeout(&format!("{path}.timeoutMs"), s.timeout_ms)?;
    match (&s.command, &s.external_job) {
        (Some(_), Some(_)) => {
            return Err(field(format!("{path} has both `command` and `externalJob`; give exactly one")))
        }
        (None, None) => return Err(field(format!("{path} needs a `command` (or an `externalJob`)"))),
        (Some(c), None) => {
            if c.is_empty() || c.len() > 4096 {
                return Err(field(format!("field `{path}.command` has {} arguments; it needs 1 to 4096", c.len())));
            }
            if c[0].is_empty() {
                return Err(field(format!("field `{path}.command[0]` is empty; name the program to run")));
            }
        }
        (None, Some(j)) => {
            if !ctx.provider_configured(&j.provider) {
                return Err(Rejection::new(
                    RejectionCode::UnknownProvider,
                    format!(
                        "field `{path}.externalJob.provider` names `{}`, which is not configured; add [providers.{}] to the daemon's config",
                        j.provider, j.provider
                    ),
                ));
            }
        }
    }
    if let Some(cwd) = &s.cwd {
        check_cwd(&format!("{path}.cwd"), cwd, ctx)?;
    }
    Ok(())
}

/// `lane`, `after`, `notBefore` (PROTOCOL §15). Whether each dependency
/// exists is the claimer's to check (`unknown-dependency`).
fn check_scheduling(r: &Request) -> Result<(), Rejection> {
    if let Some(l) = &r.lane {
        if !LaneName::is_valid(l) {
            return Err(field(format!(
                "field `lane` is `{}`; it must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}",
                l.escape_debug()
            )));
        }
    }
    if let Some(after) = &r.after {
        if after.is_empty() || after.len() > MAX_AFTER {
            return Err(field(format!(
                "field `after` has {} run ids; it needs 1 to {MAX_AFTER} (leave it out for none)",
                after.len()
            )));
        }
        for (i, id) in after.iter().enumerate() {
            if !run_id_grammar(id) {
                return Err(field(format!(
                    "field `after[{i}]` is `{}`; it must be a run id matching [A-Za-z0-9][A-Za-z0-9._-]*",
                    id.escape_debug()
                )));
            }
            if r.run_id.as_deref() == Some(id.as_str()) {
                return Err(field(format!(
                    "field `after[{i}]` names this request's own runId `{id}`; a run cannot wait for itself"
                )));
            }
        }
    } else if r.after_policy.is_some() {
        return Err(field("field `afterPolicy` is set without `after`; add `after` or remove `afterPolicy`".into()));
    }
    if let Some(t) = r.not_before {
        if !(0..=MAX_NOT_BEFORE_MS).contains(&t) {
            return Err(field(format!(
                "field `notBefore` is {t}; it must be a time in milliseconds since the Unix epoch (0 to {MAX_NOT_BEFORE_MS})"
            )));
        }
    }
    Ok(())
}

fn check(r: &Request, ctx: &dyn Context) -> Result<(), Rejection> {
    if let Some(id) = &r.run_id {
        if !RequestedRunId::is_valid(id) {
            return Err(field(format!(
                "field `runId` is `{}`; it must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}",
                id.escape_debug()
            )));
        }
    }
    if let Some(id) = &r.restart_of {
        if !RequestedRunId::is_valid(id) {
            return Err(field(format!(
                "field `restartOf` is `{}`; it must be a run id matching [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}",
                id.escape_debug()
            )));
        }
    }
    check_scheduling(r)?;
    check_len("sessionId", &r.session_id, 4096)?;
    check_len("toolCallId", &r.tool_call_id, 4096)?;
    check_len("completionOwnerId", &r.completion_owner_id, 256)?;
    check_env("env", &r.env)?;
    check_timeout("timeoutMs", r.timeout_ms)?;
    if !(-1000..=1000).contains(&r.priority) {
        return Err(field(format!("field `priority` is {}; it must be -1000 to 1000", r.priority)));
    }
    let total: usize = r
        .steps
        .iter()
        .map(|i| match i {
            Item::Step(_) => 1,
            Item::Parallel(p) => p.parallel.len(),
        })
        .sum();
    if total == 0 || total > MAX_STEPS {
        return Err(field(format!("field `steps` holds {total} steps in all; it needs 1 to {MAX_STEPS}")));
    }
    for (i, item) in r.steps.iter().enumerate() {
        match item {
            Item::Step(s) => check_step(&format!("steps[{i}]"), s, ctx)?,
            Item::Parallel(p) => {
                if p.parallel.is_empty() {
                    return Err(field(format!("field `steps[{i}].parallel` is empty; give it at least one step")));
                }
                if let Some(c) = p.concurrency {
                    if !(1..=64).contains(&c) {
                        return Err(field(format!("field `steps[{i}].concurrency` is {c}; it must be 1 to 64")));
                    }
                }
                for (j, s) in p.parallel.iter().enumerate() {
                    check_step(&format!("steps[{i}].parallel[{j}]"), s, ctx)?;
                }
            }
        }
    }
    check_cwd("cwd", &r.cwd, ctx)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    struct Ctx;
    impl Context for Ctx {
        fn provider_configured(&self, n: &str) -> bool {
            n == "slurm"
        }
    }
    fn v(s: &str) -> Result<Request, Rejection> {
        let val = parse(s.as_bytes())?;
        validate(s.as_bytes(), &val, &Ctx)
    }
    fn code(s: &str) -> &'static str {
        v(s).unwrap_err().code.as_str()
    }

    #[test]
    fn minimal_and_modes() {
        let r = v(r#"{"version":1,"cwd":"/","steps":[{"command":["true"]}]}"#).unwrap();
        assert_eq!(r.mode(), Mode::Single);
        let r = v(
            r#"{"version":1,"cwd":"/","steps":[{"parallel":[{"command":["a"]},{"command":["b"]}],"concurrency":1}]}"#,
        )
        .unwrap();
        assert_eq!(r.mode(), Mode::Parallel);
        assert_eq!(r.flat_steps().len(), 2);
        let r = v(r#"{"version":1,"cwd":"/","steps":[{"command":["a"]},{"command":["b"]}]}"#).unwrap();
        assert_eq!(r.mode(), Mode::Chain);
    }

    #[test]
    fn codes_are_spelled_as_protocol_2_3_writes_them() {
        let spelled: Vec<&str> = RejectionCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            spelled,
            [
                "bad-name",
                "not-regular-file",
                "bad-owner",
                "bad-permissions",
                "too-large",
                "invalid-json",
                "unsupported-version",
                "invalid-field",
                "duplicate-run-id",
                "cwd-missing",
                "unknown-provider",
                "withdrawn",
                "unknown-dependency",
            ]
        );
        for c in RejectionCode::ALL {
            assert_eq!(RejectionCode::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        assert_eq!(RejectionCode::parse("no-such-code"), None);
    }

    #[test]
    fn codes() {
        assert_eq!(code("{"), "invalid-json");
        assert_eq!(code(r#"{"version":2,"cwd":"/","steps":[]}"#), "unsupported-version");
        assert_eq!(code(r#"{"cwd":"/","steps":[]}"#), "unsupported-version");
        assert_eq!(code(r#"{"version":1,"cwd":"/","steps":[{"command":["a"]}],"bogus":1}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"/","steps":[]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"rel","steps":[{"command":["a"]}]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"/nonexistent-xyz","steps":[{"command":["a"]}]}"#), "cwd-missing");
        assert_eq!(
            code(r#"{"version":1,"cwd":"/","steps":[{"externalJob":{"provider":"k8s","prompt":"x"}}]}"#),
            "unknown-provider"
        );
        assert!(v(r#"{"version":1,"cwd":"/","steps":[{"externalJob":{"provider":"slurm","prompt":"x"}}]}"#).is_ok());
        assert_eq!(code(r#"{"version":1,"cwd":"/","cwd":"/","steps":[{"command":["a"]}]}"#), "invalid-field");
        assert_eq!(
            code(r#"{"version":1,"cwd":"/","env":{"A":"1","A":"2"},"steps":[{"command":["a"]}]}"#),
            "invalid-field"
        );
        assert_eq!(code(r#"{"version":1,"cwd":"/","env":{"1A":"1"},"steps":[{"command":["a"]}]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"/","steps":[{"command":[""]}]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"/","steps":[{"command":["a\u0000"]}]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"runId":"../x","cwd":"/","steps":[{"command":["a"]}]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"/","restartOf":"../x","steps":[{"command":["a"]}]}"#), "invalid-field");
        assert!(v(r#"{"version":1,"cwd":"/","restartOf":"run-1","steps":[{"command":["a"]}]}"#).is_ok());
        assert_eq!(code(r#"{"version":1,"cwd":"/","priority":1001,"steps":[{"command":["a"]}]}"#), "invalid-field");
        assert_eq!(code(r#"{"version":1,"cwd":"/","timeoutMs":0,"steps":[{"command":["a"]}]}"#), "invalid-field");
        assert_eq!(
            code(r#"{"version":1,"cwd":"/","timeoutMs":604800001,"steps":[{"command":["a"]}]}"#),
            "invalid-field"
        );
        assert_eq!(
            code(r#"{"version":1,"cwd":"/","steps":[{"parallel":[{"command":["a"]}],"concurrency":65}]}"#),
            "invalid-field"
        );
        assert_eq!(code(r#"{"version":1,"cwd":"/","steps":[{"command":"a"}]}"#), "invalid-field");
        let steps: Vec<String> = (0..257).map(|_| r#"{"command":["a"]}"#.to_string()).collect();
        assert_eq!(code(&format!(r#"{{"version":1,"cwd":"/","steps":[{}]}}"#, steps.join(","))), "invalid-field");
        // Duplicates are refused at every depth, not only where serde would notice.
        assert_eq!(code(r#"{"version":1,"cwd":"/","steps":[{"command":["a"],"command":["b"]}]}"#), "invalid-field");
        assert_eq!(
            code(r#"{"version":1,"cwd":"/","steps":[{"command":["a"],"env":{"X":"1","X":"2"}}]}"#),
            "invalid-field"
        );
        assert_eq!(
            code(r#"{"version":1,"cwd":"/","steps":[{"parallel":[{"command":["a"]}],"parallel":[]}]}"#),
            "invalid-field"
        );
        assert_eq!(
            code(
                r#"{"version":1,"cwd":"/","steps":[{"externalJob":{"provider":"slurm","prompt":"x","options":{"a":1,"a":2}}}]}"#
            ),
            "invalid-field"
        );
        let deep = format!("{}{}", "[".repeat(10000), "]".repeat(10000));
        assert_eq!(code(&deep), "invalid-json");
    }

    #[test]
    fn scheduling_fields() {
        let base =
            |extra: &str| format!(r#"{{"version":1,"runId":"me","cwd":"/",{extra}"steps":[{{"command":["a"]}}]}}"#);
        let r =
            v(&base(r#""lane":"gpu","after":["x","y","x"],"afterPolicy":"any","notBefore":5,"hold":true,"#)).unwrap();
        assert_eq!(
            (r.lane(), r.dependencies(), r.after_policy),
            ("gpu", vec!["x".into(), "y".into()], Some(AfterPolicy::Any))
        );
        assert_eq!((r.not_before, r.hold), (Some(5), Some(true)));
        assert_eq!(v(&base("")).unwrap().lane(), "default");
        for bad in [
            r#""lane":"a/b","#,
            r#""lane":"","#,
            r#""after":[],"#,
            r#""after":["../x"],"#,
            r#""after":["me"],"#,
            r#""afterPolicy":"any","#,
            r#""after":["x"],"afterPolicy":"some","#,
            r#""notBefore":-1,"#,
            r#""hold":"yes","#,
        ] {
            let e = v(&base(bad)).unwrap_err();
            assert_eq!(e.code, RejectionCode::InvalidField, "{bad}: {e}");
        }
        let many: Vec<String> = (0..65).map(|i| format!("\"r{i}\"")).collect();
        let e = v(&base(&format!(r#""after":[{}],"#, many.join(",")))).unwrap_err();
        assert!(e.message.contains("after") && e.message.contains("64"), "{e}");
    }

    #[test]
    fn messages_name_the_field() {
        let e = v(r#"{"version":1,"cwd":"/","steps":[{"command":["a"],"timeoutMs":"x"}]}"#).unwrap_err();
        assert!(e.message.contains("steps[0]") && e.message.contains("timeoutMs"), "{}", e.message);
        let e = v(r#"{"version":1,"cwd":"/","steps":[{"command":["a"],"env":{"X":"1","X":"2"}}]}"#).unwrap_err();
        assert!(e.message.contains("steps[0].env.X"), "{}", e.message);
        let e = v(r#"{"version":1,"cwd":"/","steps":[{"command":["a"]}],"sesionId":"x"}"#).unwrap_err();
        assert!(e.message.contains("sesionId"), "{}", e.message);
        // A missing field points at the protocol's list of request fields.
        let e = v(r#"{"version":1,"steps":[{"command":["a"]}]}"#).unwrap_err();
        assert!(e.message.contains("`cwd`") && e.message.contains("docs/protocol.md §2.2"), "{}", e.message);
    }
}
