//! The filesystem layer: every path (`layout`), atomic writes and locks
//! (`fsutil`), the capacity-resilient writer (`writer`), status/events
//! (`run`), the indexes (`index`), result files (`results`) and the
//! ownership/mode checks of the directories it writes into (`safety`),
//! directories under a run by descriptor (`dirfd`) and the control inbox
//! built on them (`inbox`), and the Linux watcher of queued runs' inboxes
//! (`inbox_watch`); the one reader of daemon.json (`daemon_json`).

pub mod daemon_json;
pub mod deps;
pub mod dirfd;
pub mod fsutil;
pub mod inbox;
#[cfg(target_os = "linux")]
pub mod inbox_watch;
pub mod index;
pub mod layout;
pub mod queue;
pub mod repaired;
pub mod results;
pub mod run;
pub mod safety;
pub mod spool;
pub mod writer;

pub use layout::{Layout, RunId};
pub use writer::Writer;
