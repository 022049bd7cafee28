//! Shared harness for the runspool integration tests.
//!
//! Every test gets its own temporary root (mode 0700) and, when it needs one,
//! its own daemon. The harness never trusts timing: it waits on conditions with
//! generous deadlines. On drop it checks that the root is consistent (a test
//! that leaves it otherwise on purpose says why with `leaves_root_inconsistent`),
//! then SIGKILLs the daemon and every process that belongs to the root (runners
//! and step processes), so no test leaks processes.
#![allow(dead_code)]

mod cli;
mod consistency;
mod daemon;
mod env;
mod fixtures;
mod inspect;
pub mod pi;
mod process;
mod seg;
mod util;
mod waits;

// Each test binary uses a subset of the harness, so some of these re-exports go
// unused in any one of them (the reason for `dead_code` above, too).
#[allow(unused_imports)]
pub use self::{
    cli::*, consistency::*, daemon::*, env::*, fixtures::*, inspect::*, process::*, seg::*, util::*, waits::*,
};
