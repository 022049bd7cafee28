//! runspool: a per-user resident supervisor for background runs.
//!
//! The filesystem is the API (see docs/protocol-notes.md and PROTOCOL.md):
//! `protocol` holds the pure types and validation, `store` every file
//! operation, `daemon` the resident loop, `runner` one run, `client` what a
//! program needs to drive runspool (submit, status, wait, follow, stop, list,
//! events; see [`client::Client`]), `cli` the user-facing commands on top of it.

/// Print a line on stderr, ignoring errors: a runner's stderr is a file in
/// its run directory, and a full disk must not turn a diagnostic into a
/// panic (which `eprintln!` would).
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        $crate::logging::stderr_opening();
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod cli;
#[warn(missing_docs)]
pub mod client;
pub mod config;
pub mod daemon;
pub mod logging;
pub mod platform;
pub mod protocol;
pub mod providers;
pub mod runner;
pub mod service;
pub mod store;

/// Milliseconds since the Unix epoch, the only clock the protocol uses.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
