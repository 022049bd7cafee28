//! Where log lines go and at which level (docs/logging.md).
//!
//! The daemon writes to the systemd journal through its native protocol when
//! its stderr *is* the journal (the service manager says so in
//! `JOURNAL_STREAM`), or when `RUNSPOOL_LOG_OUTPUT=journald` asks for it;
//! otherwise human-readable lines go to stderr. Nothing is ever logged on
//! stdout. The level comes from `RUNSPOOL_LOG` if set, else from the
//! config's `[log] level`, and a SIGHUP can change the latter at run time
//! through the reload handle kept here.

use std::sync::OnceLock;

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// Sets the level filter (`info`, `debug`, or any `EnvFilter` directive);
/// wins over `[log] level`.
pub const LEVEL_ENV: &str = "RUNSPOOL_LOG";
/// Picks the output: `auto` (the default), `journald` or `stderr`.
pub const OUTPUT_ENV: &str = "RUNSPOOL_LOG_OUTPUT";
/// The journal's native-protocol socket (what tracing-journald sends to).
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Stderr,
    Journald,
}

impl Output {
    pub fn name(self) -> &'static str {
        match self {
            Output::Stderr => "stderr",
            Output::Journald => "journald",
        }
    }
}

struct State {
    filter: reload::Handle<EnvFilter, Registry>,
    output: Output,
}

static STATE: OnceLock<State> = OnceLock::new();

/// Decide the output from `RUNSPOOL_LOG_OUTPUT`, `JOURNAL_STREAM` and the
/// (device, inode) of our stderr. Pure, so the rule is testable. Returns the
/// output and why, for the startup log line.
pub fn choose(
    requested: Option<&str>,
    journal_stream: Option<&str>,
    stderr_id: Option<(u64, u64)>,
) -> (Output, String) {
    match requested.map(str::trim).filter(|v| !v.is_empty()) {
        Some("journald") => return (Output::Journald, format!("{OUTPUT_ENV}=journald")),
        Some("stderr") => return (Output::Stderr, format!("{OUTPUT_ENV}=stderr")),
        Some("auto") | None => {}
        Some(other) => {
            return (
                Output::Stderr,
                format!("{OUTPUT_ENV}=`{other}` is not auto, journald or stderr; logging to stderr"),
            )
        }
    }
    // systemd sets JOURNAL_STREAM=<dev>:<ino> of the stream it connected to
    // stdout/stderr. A child with redirected stderr inherits the variable but
    // not the stream, hence the comparison (systemd.exec(5), JOURNAL_STREAM).
    let Some(js) = journal_stream.filter(|v| !v.is_empty()) else {
        return (Output::Stderr, "JOURNAL_STREAM is not set".into());
    };
    let parsed = js.split_once(':').and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)));
    match (parsed, stderr_id) {
        (Some(js_id), Some(fd2)) if js_id == fd2 => {
            (Output::Journald, format!("stderr is the journal stream JOURNAL_STREAM={js}"))
        }
        (Some(_), _) => (Output::Stderr, format!("JOURNAL_STREAM={js} is not our stderr")),
        (None, _) => (Output::Stderr, format!("JOURNAL_STREAM={js} is not <dev>:<ino>")),
    }
}

/// (st_dev, st_ino) of file descriptor 2.
fn stderr_id() -> Option<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a whole `stat` on success and nothing is read otherwise.
    if unsafe { libc::fstat(libc::STDERR_FILENO, st.as_mut_ptr()) } != 0 {
        return None;
    }
    let st = unsafe { st.assume_init() };
    #[allow(clippy::unnecessary_cast)]
    Some((st.st_dev as u64, st.st_ino as u64))
}

/// The value of `RUNSPOOL_LOG`, when set and not empty: it wins over the config.
pub fn env_level() -> Option<String> {
    std::env::var(LEVEL_ENV).ok().filter(|v| !v.trim().is_empty())
}

/// Where the daemon's log goes (stderr until `init` ran).
pub fn output() -> Output {
    STATE.get().map(|s| s.output).unwrap_or(Output::Stderr)
}

/// Set up logging for this process. `config_level` is `[log] level` (or the
/// default); `journald_allowed` is false for the runner, whose stderr is a
/// file of its run directory and always stays so.
pub fn init(config_level: &str, journald_allowed: bool) {
    let env = env_level();
    let mut warnings = Vec::new();
    let filter = match EnvFilter::try_new(env.as_deref().unwrap_or(config_level)) {
        Ok(f) => f,
        Err(e) => {
            warnings.push(format!(
                "{LEVEL_ENV}=`{}` is not a level or filter ({e}); using info",
                env.as_deref().unwrap_or(config_level)
            ));
            EnvFilter::new("info")
        }
    };
    let (filter, handle) = reload::Layer::new(filter);
    let (mut output, why) = if journald_allowed {
        let requested = std::env::var(OUTPUT_ENV).ok();
        let js = std::env::var("JOURNAL_STREAM").ok();
        let (o, why) = choose(requested.as_deref(), js.as_deref(), stderr_id());
        if requested.as_deref().is_some_and(|r| !matches!(r.trim(), "" | "auto" | "journald" | "stderr")) {
            warnings.push(why.clone());
        }
        (o, why)
    } else {
        (Output::Stderr, "runner".into())
    };
    let journald = match output {
        Output::Journald => match journald_layer() {
            Ok(l) => Some(l),
            Err(e) => {
                warnings.push(format!(
                    "cannot send to the journal socket {JOURNAL_SOCKET} ({e}); logging to stderr instead"
                ));
                output = Output::Stderr;
                None
            }
        },
        Output::Stderr => None,
    };
    let fmt = (output == Output::Stderr).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            // On a full disk a runner's stderr (a file) cannot be written: the
            // default would report that with eprintln!, which panics.
            .log_internal_errors(false)
    });
    if Registry::default().with(filter).with(journald).with(fmt).try_init().is_ok() {
        let _ = STATE.set(State { filter: handle, output });
    }
    for w in warnings {
        tracing::warn!("{w}");
    }
    if journald_allowed {
        tracing::debug!(output = output.name(), reason = %why, "log output chosen");
    }
}

/// The runner's logging: what the shared storage code reports (capacity
/// errors, dropped events) goes to its stderr, `runner.stderr.log`, at the
/// level of `RUNSPOOL_LOG` (a plain level: `error` … `trace`; default `info`).
/// Perf: no EnvFilter or reload layer, and no tracing-subscriber at all (see
/// `RunnerLog`), since a runner starts for every run and never reloads.
pub fn init_runner() {
    let max = env_level().and_then(|l| l.trim().parse::<LevelFilter>().ok()).unwrap_or(LevelFilter::INFO);
    let _ = tracing::subscriber::set_global_default(RunnerLog { max });
}

/// What runs before a line goes to stderr (`before_stderr`).
static BEFORE_STDERR: OnceLock<fn()> = OnceLock::new();

/// Run `f` before every line written to stderr through `crate::note!` or
/// the runner's log: the runner opens its log files there, so a run that
/// never logs creates none.
pub fn before_stderr(f: fn()) {
    let _ = BEFORE_STDERR.set(f);
}

#[doc(hidden)]
pub fn stderr_opening() {
    if let Some(f) = BEFORE_STDERR.get() {
        f();
    }
}

/// The runner's subscriber: one line per event on stderr,
/// `2026-12-03T10:00:00.123456Z  WARN target: message key=value`, like the
/// daemon's stderr lines. Perf: tracing-subscriber's registry allocates its
/// span slab at start-up (a tenth of a runner's page faults); a runner logs a
/// handful of lines and opens no spans, so it needs none of that.
struct RunnerLog {
    max: LevelFilter,
}

impl tracing::Subscriber for RunnerLog {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        self.max >= *m.level()
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.max)
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        use std::io::Write as _;
        let m = e.metadata();
        let mut f = LineFields::default();
        e.record(&mut f);
        let line = format!(
            "{} {:>5} {}: {}{}\n",
            utc_timestamp(std::time::SystemTime::now()),
            m.level(),
            m.target(),
            f.message,
            f.rest
        );
        stderr_opening();
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[derive(Default)]
struct LineFields {
    message: String,
    rest: String,
}

impl tracing::field::Visit for LineFields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }
}

/// RFC 3339 UTC with microseconds (civil-from-days, proleptic Gregorian).
pub fn utc_timestamp(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        sod / 3600,
        sod / 60 % 60,
        sod % 60,
        d.subsec_micros()
    )
}

#[cfg(target_os = "linux")]
type JournaldLayer = tracing_journald::Layer;
#[cfg(not(target_os = "linux"))]
type JournaldLayer = tracing_subscriber::layer::Identity;

/// The journald layer: fields keep their own names, upper-cased (`run_id` is
/// `RUN_ID`, no prefix), and the priority follows syslog: error 3, warning 4,
/// info 6, debug and trace 7.
#[cfg(target_os = "linux")]
fn journald_layer() -> std::io::Result<JournaldLayer> {
    use tracing_journald::{Priority, PriorityMappings};
    Ok(tracing_journald::layer()?
        .with_field_prefix(None)
        .with_syslog_identifier("runspool".into())
        .with_priority_mappings(PriorityMappings {
            error: Priority::Error,
            warn: Priority::Warning,
            info: Priority::Informational,
            debug: Priority::Debug,
            trace: Priority::Debug,
        }))
}

#[cfg(not(target_os = "linux"))]
fn journald_layer() -> std::io::Result<JournaldLayer> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "the journal exists on Linux only"))
}

/// What a reload did to the level, for the reload report.
#[derive(Debug, PartialEq, Eq)]
pub enum LevelChange {
    Applied,
    /// `RUNSPOOL_LOG` is set and wins; the config's level is kept for later.
    OverriddenByEnv(String),
    Failed(String),
}

/// Apply a new `[log] level` at run time.
pub fn set_config_level(level: &str) -> LevelChange {
    if let Some(v) = env_level() {
        return LevelChange::OverriddenByEnv(v);
    }
    let Some(state) = STATE.get() else { return LevelChange::Failed("logging is not initialised".into()) };
    match EnvFilter::try_new(level) {
        Ok(f) => match state.filter.reload(f) {
            Ok(()) => LevelChange::Applied,
            Err(e) => LevelChange::Failed(e.to_string()),
        },
        Err(e) => LevelChange::Failed(e.to_string()),
    }
}

/// Report a fatal startup error: through the journal with priority 3 when
/// that is where the log goes, else one plain line on stderr.
pub fn fatal(msg: &str) {
    match output() {
        Output::Journald => tracing::error!("{msg}"),
        Output::Stderr => crate::note!("runspool daemon: {msg}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_timestamps_match_the_calendar() {
        use std::time::{Duration, UNIX_EPOCH};
        let at = |us: u64| utc_timestamp(UNIX_EPOCH + Duration::from_micros(us));
        assert_eq!(at(0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(at(951_782_400_000_000), "2000-02-29T00:00:00.000000Z");
        assert_eq!(at(1_796_302_885_976_543), "2026-12-03T13:01:25.976543Z");
        assert_eq!(at(4_102_444_799_999_999), "2099-12-31T23:59:59.999999Z");
    }

    #[test]
    fn journal_stream_must_be_our_stderr() {
        let fd2 = Some((64769, 1234));
        assert_eq!(choose(None, Some("64769:1234"), fd2).0, Output::Journald);
        assert_eq!(choose(Some("auto"), Some("64769:1234"), fd2).0, Output::Journald);
        // Inherited by a process whose stderr was redirected elsewhere.
        assert_eq!(choose(None, Some("64769:999"), fd2).0, Output::Stderr);
        assert_eq!(choose(None, Some("garbage"), fd2).0, Output::Stderr);
        assert_eq!(choose(None, None, fd2).0, Output::Stderr);
        assert_eq!(choose(None, Some("64769:1234"), None).0, Output::Stderr);
    }

    #[test]
    fn the_variable_overrides_detection() {
        assert_eq!(choose(Some("journald"), None, None).0, Output::Journald);
        assert_eq!(choose(Some("stderr"), Some("1:2"), Some((1, 2))).0, Output::Stderr);
        let (o, why) = choose(Some("syslog"), Some("1:2"), Some((1, 2)));
        assert_eq!(o, Output::Stderr);
        assert!(why.contains("syslog"), "{why}");
    }
}
