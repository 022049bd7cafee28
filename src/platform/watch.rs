//! Which watch strategy suits the root (PROTOCOL §13 `watch.strategy`):
//! the pure choice from the platform, the filesystem under the root and the
//! config. The daemon's watcher (`daemon::watch`) and `runspool doctor` use
//! this one rule.

use std::path::Path;

/// How to watch: `watch.strategy` of the config (`Auto`, `Native`,
/// `Poll`), and the strategy a `Choice` settled on (`Native` or `Poll`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Auto,
    Native,
    Poll,
}

impl Strategy {
    /// The name in the config and in daemon.json's `watch.strategy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Auto => "auto",
            Strategy::Native => "native",
            Strategy::Poll => "poll",
        }
    }
}

/// The watcher behind the chosen strategy, as daemon.json's `watch.backend`
/// names it: a platform's native events, or polling (notify's `PollWatcher`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Inotify,
    FsEvents,
    Kqueue,
    /// Native events of a platform without a name of its own here.
    Native,
    Poll,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Inotify => "inotify",
            Backend::FsEvents => "fsevents",
            Backend::Kqueue => "kqueue",
            Backend::Native => "native",
            Backend::Poll => "poll",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// daemon.json keeps the backend as a string.
impl From<Backend> for String {
    fn from(b: Backend) -> String {
        b.as_str().to_string()
    }
}

/// The outcome of the strategy choice, as shown in daemon.json.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// `Native` or `Poll`, never `Auto`.
    pub strategy: Strategy,
    pub backend: Backend,
    pub reason: String,
}

/// The native backend of a platform (`std::env::consts::OS` names).
pub fn native_backend(os: &str) -> Backend {
    match os {
        "linux" | "android" => Backend::Inotify,
        "macos" | "ios" => Backend::FsEvents,
        "freebsd" | "openbsd" | "netbsd" | "dragonfly" => Backend::Kqueue,
        _ => Backend::Native,
    }
}

/// Filesystems whose changes made elsewhere (another host, a FUSE daemon
/// writing to its backing store) produce no local file events.
pub fn is_remote_fs(fs: &str) -> bool {
    matches!(
        fs,
        "nfs"
            | "nfs4"
            | "smb"
            | "smbfs"
            | "smb2"
            | "cifs"
            | "fuse"
            | "fuseblk"
            | "9p"
            | "afs"
            | "ceph"
            | "gfs2"
            | "ocfs2"
            | "glusterfs"
            | "lustre"
            | "coda"
            | "ncpfs"
            | "webdav"
            | "osxfuse"
            | "macfuse"
            | "vboxsf"
            | "virtiofs"
    ) || fs.starts_with("fuse.")
}

/// Choose the watch strategy. `fs` is the filesystem type name under the
/// watched root (`None` if unknown); `config` is `watch.strategy`.
pub fn choose(os: &str, fs: Option<&str>, config: Strategy) -> Choice {
    let backend = native_backend(os);
    let poll = |reason: String| Choice { strategy: Strategy::Poll, backend: Backend::Poll, reason };
    match config {
        Strategy::Poll => poll("watch.strategy = \"poll\" in the config".into()),
        Strategy::Native => Choice { strategy: Strategy::Native, backend, reason: "watch.strategy = \"native\" in the config".into() },
        Strategy::Auto => match fs {
            Some(f) if is_remote_fs(f) => poll(format!(
                "the root is on {f}, a network or FUSE filesystem whose changes made elsewhere raise no {backend} events"
            )),
            Some(f) => Choice { strategy: Strategy::Native, backend, reason: format!("{backend} on a local filesystem ({f})") },
            None => Choice { strategy: Strategy::Native, backend, reason: format!("{backend} (filesystem type unknown)") },
        },
    }
}

/// The filesystem type name under `path` (statfs magic on Linux, the type
/// name elsewhere).
pub fn fs_type(path: &Path) -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        let s = nix::sys::statfs::statfs(path).ok()?;
        let magic = s.filesystem_type().0 as u64;
        Some(
            match magic {
                0x6969 => "nfs",
                0x517B => "smb",
                0xFE534D42 => "smb2",
                0xFF534D42 => "cifs",
                0x65735546 => "fuse",
                0x01021997 => "9p",
                0x5346414F | 0x6B414653 => "afs",
                0x00C36400 => "ceph",
                0x01161970 => "gfs2",
                0x7461636f => "ocfs2",
                0x0BD00BD0 => "lustre",
                0x73757245 => "coda",
                0x786F4256 => "vboxsf",
                0x6a656a63 => "virtiofs",
                0x01021994 => "tmpfs",
                0xEF53 => "ext4",
                0x58465342 => "xfs",
                0x9123683E => "btrfs",
                0x794C7630 => "overlayfs",
                0x2FC12FC1 => "zfs",
                0xF2F52010 => "f2fs",
                _ => return Some(format!("0x{magic:x}")),
            }
            .to_string(),
        )
    }
    #[cfg(not(target_os = "linux"))]
    {
        let s = nix::sys::statfs::statfs(path).ok()?;
        Some(s.filesystem_type_name().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_per_platform() {
        assert_eq!(choose("linux", Some("ext4"), Strategy::Auto).backend, Backend::Inotify);
        assert_eq!(choose("macos", Some("apfs"), Strategy::Auto).backend, Backend::FsEvents);
        assert_eq!(choose("freebsd", Some("ufs"), Strategy::Auto).backend, Backend::Kqueue);
        assert_eq!(choose("linux", None, Strategy::Auto).strategy, Strategy::Native);
    }

    #[test]
    fn network_and_fuse_poll() {
        for fs in ["nfs", "cifs", "smb2", "fuse", "fuse.bindfs", "9p", "afs", "ceph", "macfuse"] {
            let c = choose("linux", Some(fs), Strategy::Auto);
            assert_eq!(c.strategy, Strategy::Poll, "{fs}");
            assert!(c.reason.contains(fs), "{}", c.reason);
        }
        assert_eq!(choose("linux", Some("tmpfs"), Strategy::Auto).strategy, Strategy::Native);
    }

    #[test]
    fn config_wins() {
        assert_eq!(choose("linux", Some("ext4"), Strategy::Poll).strategy, Strategy::Poll);
        assert_eq!(choose("linux", Some("nfs"), Strategy::Native).strategy, Strategy::Native);
    }
}
