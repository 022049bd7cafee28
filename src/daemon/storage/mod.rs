//! May the daemon claim now? The root's directories must still pass the
//! start-up safety check, and the filesystem under the root must have room
//! (PROTOCOL §11). What fails is reported as storage `degraded`. And the
//! reserve (`reserve.rs`) that lets daemon.json say so on a full filesystem.

mod reserve;

use std::path::Path;
use std::time::{Duration, Instant};

use super::part::{Effect, Env};
use crate::store::fsutil::space_shortage;
use crate::store::{Layout, Writer};
use reserve::Reserve;

/// Free space under the root is looked at this often besides before every
/// claim scan, so daemon.json turns `degraded` (and back) within seconds on
/// an idle daemon too. One statvfs.
const SPACE_CHECK_EVERY: Duration = Duration::from_secs(5);

pub struct Storage {
    /// Why the filesystem is too full to claim (`fsutil::space_shortage`).
    low_space: Option<String>,
    next_space_check: Instant,
    /// Why the root, spool/ or the runs root fails `store::safety::check_dir` now.
    unsafe_dir: Option<String>,
    reserve: Reserve,
}

impl Storage {
    pub fn new(l: &Layout) -> Storage {
        Storage {
            low_space: None,
            next_space_check: Instant::now() + SPACE_CHECK_EVERY,
            unsafe_dir: None,
            reserve: Reserve::new(l),
        }
    }

    /// Look at the free space when due (claiming again at once when it came
    /// back above the floor), and grow the reserve back once there is room
    /// (tried every 10 s).
    pub fn turn(&mut self, env: &mut Env, out: &mut Vec<Effect>) {
        if self.space_check_due(Instant::now()) && self.check_space(env.layout, env.cfg.storage.min_free_bytes) {
            out.push(Effect::ClaimAgain);
        }
        self.reserve.ensure();
    }

    /// A write that must not wait for room (daemon.json saying `degraded`)
    /// is deferred in the writer: spend the reserve on it, and keep what
    /// it did not use.
    pub fn spend_reserve(&mut self, w: &mut Writer, path: &Path) {
        if self.reserve.release() {
            w.flush_path(path);
            self.reserve.take_back();
        }
    }

    /// Do the root, spool/ and the runs root still pass the start-up check
    /// (`store::safety::check_dir`)? One replaced by a symlink, or loosened,
    /// while we run is never followed: the error is logged once with the path
    /// and the fix, daemon.json reports storage `degraded` with it, and
    /// nothing is claimed until it is fixed. Three lstat calls.
    pub fn dirs_safe(&mut self, l: &Layout) -> bool {
        let bad = [l.root.clone(), l.spool(), l.runs()].iter().find_map(|p| crate::store::safety::check_dir(p).err());
        match (&self.unsafe_dir, &bad) {
            (None, Some(e)) => tracing::error!(root = %l.root.display(), "claiming stopped: {e}"),
            (Some(_), None) => {
                tracing::info!(root = %l.root.display(), "the root's directories are safe again: claiming resumed")
            }
            _ => {}
        }
        self.unsafe_dir = bad.map(|e| e.to_string());
        self.unsafe_dir.is_none()
    }

    pub fn space_check_due(&self, now: Instant) -> bool {
        now >= self.next_space_check
    }

    /// Look at the free space (one statvfs). True when it just came back
    /// above the floor: what waited in the spool is claimed at once.
    pub fn check_space(&mut self, l: &Layout, min_free_bytes: u64) -> bool {
        self.next_space_check = Instant::now() + SPACE_CHECK_EVERY;
        let low = space_shortage(&l.root, min_free_bytes);
        match (&self.low_space, &low) {
            (None, Some(r)) => tracing::warn!(reason = %r, "storage low: claiming paused"),
            (Some(_), None) => tracing::info!("storage space back above the floor: claiming resumed"),
            _ => {}
        }
        let back = self.low_space.is_some() && low.is_none();
        self.low_space = low;
        back
    }

    /// Is there room to claim? Below the free-space floor, or with writes
    /// still deferred, the spool is left alone.
    pub fn room_to_claim(&mut self, l: &Layout, min_free_bytes: u64, w: &Writer) -> bool {
        self.check_space(l, min_free_bytes);
        self.low_space.is_none() && w.is_idle()
    }

    /// Why storage is `degraded` in daemon.json, if it is.
    pub fn degraded(&self, w: &Writer) -> Option<String> {
        self.unsafe_dir.clone().or_else(|| self.low_space.clone()).or_else(|| w.last_error.clone())
    }

    /// The next space check (once a second while space is low), or the
    /// next try to grow the reserve.
    pub fn next_wake(&self) -> Option<Instant> {
        let soon = self.low_space.as_ref().map(|_| Instant::now() + Duration::from_secs(1));
        let check = soon.map_or(self.next_space_check, |s| s.min(self.next_space_check));
        Some(self.reserve.next_wake().map_or(check, |r| r.min(check)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::part::testing::Root;

    #[test]
    fn a_spool_replaced_by_a_symlink_closes_claiming_until_it_is_fixed() {
        let r = Root::new();
        let mut s = Storage::new(&r.layout);
        assert!(s.dirs_safe(&r.layout));
        assert_eq!(s.degraded(&r.w), None);
        let elsewhere = r.dir.path().join("elsewhere");
        std::fs::rename(r.layout.spool(), &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, r.layout.spool()).unwrap();
        assert!(!s.dirs_safe(&r.layout));
        let why = s.degraded(&r.w).expect("degraded while unsafe");
        assert!(why.contains("spool"), "{why}");
        std::fs::remove_file(r.layout.spool()).unwrap();
        std::fs::rename(&elsewhere, r.layout.spool()).unwrap();
        assert!(s.dirs_safe(&r.layout));
        assert_eq!(s.degraded(&r.w), None);
    }

    #[test]
    fn below_the_floor_nothing_is_claimed_and_the_turn_says_when_space_is_back() {
        let mut cfg = crate::config::Config::default();
        cfg.storage.min_free_bytes = 1;
        let mut r = Root::with(cfg);
        let mut s = Storage::new(&r.layout);
        assert!(!s.room_to_claim(&r.layout, u64::MAX, &r.w), "no filesystem has u64::MAX bytes free");
        assert!(s.degraded(&r.w).is_some());
        // The next check with the configured floor (1 byte): space is back.
        s.next_space_check = Instant::now();
        let mut out = Vec::new();
        s.turn(&mut r.env(), &mut out);
        assert!(matches!(&out[..], [Effect::ClaimAgain]), "{out:?}");
        assert_eq!(s.degraded(&r.w), None);
    }

    #[test]
    fn the_turn_makes_the_reserve_and_spending_it_frees_its_file() {
        let mut r = Root::new();
        let mut s = Storage::new(&r.layout);
        let mut out = Vec::new();
        s.turn(&mut r.env(), &mut out);
        let reserve = r.layout.daemon_dir().join("storage-reserve");
        assert_eq!(std::fs::metadata(&reserve).unwrap().len(), 64 * 1024);
        assert_eq!(s.reserve.next_wake(), None, "a whole reserve needs no turn");
        // With room on this filesystem, what was released is taken back at once.
        s.spend_reserve(&mut r.w, &r.layout.daemon_json());
        assert!(std::fs::symlink_metadata(&reserve).is_ok_and(|m| m.is_file()));
    }
}
