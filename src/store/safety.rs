//! The directories runspool writes into must be the user's own, real
//! directories that nobody else can write (PROTOCOL §1): checked by the
//! daemon at start and each scan, and by clients before they write.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::Layout;

/// Why a root, spool or runs root is refused. Each message names the path and the fix.
#[derive(Debug, thiserror::Error)]
pub enum SafetyError {
    #[error("{} is a symbolic link; runspool refuses it so nobody can redirect its files: replace it with a real directory (mkdir -m 700 {})", .0.display(), .0.display())]
    Symlink(PathBuf),
    #[error("{} is not a directory; remove it or choose another --root", .0.display())]
    NotADirectory(PathBuf),
    #[error("{} is owned by uid {owner}, not by you (uid {me}); use a root you own (--root or RUNSPOOL_ROOT)", .path.display())]
    NotOwned { path: PathBuf, owner: u32, me: u32 },
    #[error("{} is writable by group or others (mode {mode:o}); fix it with: chmod 700 {}", .path.display(), .path.display())]
    Writable { path: PathBuf, mode: u32 },
    #[error("{}: {error}; check that the directory is writable by you", .path.display())]
    Io { path: PathBuf, error: std::io::Error },
}

/// Refuse a root, spool or runs root that is a symlink, not a directory,
/// someone else's, or writable by group/others. Ok(false): it does not exist.
pub fn check_dir(path: &Path) -> Result<bool, SafetyError> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(error) => return Err(SafetyError::Io { path: path.to_path_buf(), error }),
    };
    if md.file_type().is_symlink() {
        return Err(SafetyError::Symlink(path.to_path_buf()));
    }
    if !md.is_dir() {
        return Err(SafetyError::NotADirectory(path.to_path_buf()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if md.uid() != me {
        return Err(SafetyError::NotOwned { path: path.to_path_buf(), owner: md.uid(), me });
    }
    if md.permissions().mode() & 0o022 != 0 {
        return Err(SafetyError::Writable { path: path.to_path_buf(), mode: md.permissions().mode() & 0o7777 });
    }
    Ok(true)
}

/// `check_dir` of the root, `spool/` and the runs root, in the daemon's
/// order: what a client checks before it writes into a root the daemon
/// would refuse, with the daemon's own message. Missing directories pass.
pub fn check_layout(layout: &Layout) -> Result<(), SafetyError> {
    for p in [layout.root.clone(), layout.spool(), layout.runs()] {
        check_dir(&p)?;
    }
    Ok(())
}
