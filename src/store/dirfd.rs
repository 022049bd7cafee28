//! Directories under a run, by descriptor. A step or a client can turn any
//! directory of a run (its control inbox, say) into a symlink to a directory
//! of the user's, or swap one in between a check and a use. So each directory
//! is opened once with `O_DIRECTORY|O_NOFOLLOW`, relative to its parent's
//! descriptor, and everything below is listed, read, written and removed
//! relative to that descriptor (`openat`, `unlinkat`, `renameat`): whatever
//! the path names later, the operation lands in the directory that was checked.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::dir::Dir;
use nix::fcntl::{openat, renameat, OFlag};
use nix::sys::stat::{fstat, fstatat, mkdirat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

/// How deep [`DirFd::remove`] goes into a directory planted where a file belongs.
const MAX_REMOVE_DEPTH: usize = 16;

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// What an entry of a directory is, without following it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// A FIFO, socket or device.
    Other,
}

impl Kind {
    fn of(mode: libc::mode_t) -> Kind {
        match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
            SFlag::S_IFREG => Kind::File,
            SFlag::S_IFDIR => Kind::Dir,
            SFlag::S_IFLNK => Kind::Symlink,
            _ => Kind::Other,
        }
    }

    /// For messages: "a symbolic link", "a FIFO, socket or device", ...
    pub fn describe(self) -> &'static str {
        match self {
            Kind::File => "a regular file",
            Kind::Dir => "a directory",
            Kind::Symlink => "a symbolic link",
            Kind::Other => "a FIFO, socket or device",
        }
    }
}

/// An open directory that was not reached through a symlink.
#[derive(Debug)]
pub struct DirFd {
    fd: OwnedFd,
    path: PathBuf,
}

impl DirFd {
    /// Open `path`, refusing it when its last component is a symlink or not a
    /// directory (`InvalidInput`, naming the path and the fix).
    pub fn open(path: &Path) -> io::Result<DirFd> {
        match nix::fcntl::open(path, dir_flags(), Mode::empty()) {
            Ok(fd) => Ok(DirFd { fd, path: path.to_path_buf() }),
            Err(e) => Err(refusal(path, e, std::fs::symlink_metadata(path).ok().map(|m| kind_of_md(&m)))),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Open the subdirectory `name`, never following a symlink there.
    pub fn open_sub(&self, name: &str) -> io::Result<DirFd> {
        let path = self.path.join(name);
        check_name(&path, name)?;
        match openat(self.fd.as_fd(), name, dir_flags(), Mode::empty()) {
            Ok(fd) => Ok(DirFd { fd, path }),
            Err(e) => Err(refusal(&path, e, self.kind(name).ok())),
        }
    }

    /// [`open_sub`](Self::open_sub), creating it (0700) first when missing.
    pub fn create_sub(&self, name: &str) -> io::Result<DirFd> {
        let path = self.path.join(name);
        check_name(&path, name)?;
        match mkdirat(self.fd.as_fd(), name, Mode::S_IRWXU) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(with_path(&path, e.into())),
        }
        self.open_sub(name)
    }

    /// The names in this directory (not `.` and `..`; names that are not
    /// UTF-8 are left out: runspool writes none).
    pub fn names(&self) -> io::Result<Vec<String>> {
        let mut dir = Dir::openat(self.fd.as_fd(), ".", dir_flags(), Mode::empty())
            .map_err(|e| with_path(&self.path, e.into()))?;
        let mut out = Vec::new();
        for entry in dir.iter() {
            let entry = entry.map_err(|e| with_path(&self.path, e.into()))?;
            if let Ok(n) = entry.file_name().to_str() {
                if n != "." && n != ".." {
                    out.push(n.to_string());
                }
            }
        }
        Ok(out)
    }

    /// What the entry `name` is, not following it (`NotFound` when missing).
    pub fn kind(&self, name: &str) -> io::Result<Kind> {
        let path = self.path.join(name);
        check_name(&path, name)?;
        let st = fstatat(self.fd.as_fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| with_path(&path, e.into()))?;
        Ok(Kind::of(st.st_mode))
    }

    /// Read the regular file `name`, at most `max` bytes. Never follows a
    /// symlink, never blocks on a FIFO: anything but a regular file is
    /// `InvalidInput`, naming the path.
    pub fn read(&self, name: &str, max: u64) -> io::Result<Vec<u8>> {
        let path = self.path.join(name);
        let mut buf = Vec::new();
        self.open_file(name)?.take(max).read_to_end(&mut buf).map_err(|e| with_path(&path, e))?;
        Ok(buf)
    }

    /// Open the regular file `name` for reading, as [`read`](Self::read)
    /// does: never through a symlink, never blocking on a FIFO; anything
    /// but a regular file is `InvalidInput`, naming the path.
    pub fn open_file(&self, name: &str) -> io::Result<File> {
        let path = self.path.join(name);
        check_name(&path, name)?;
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        let fd = match openat(self.fd.as_fd(), name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(e) => return Err(refusal(&path, e, self.kind(name).ok())),
        };
        let kind = Kind::of(fstat(&fd).map_err(|e| with_path(&path, e.into()))?.st_mode);
        if kind != Kind::File {
            return Err(not_regular(&path, kind));
        }
        Ok(File::from(fd))
    }

    /// Which directory this is (device, inode): to notice one replaced
    /// under the same name.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        let st = fstat(&self.fd).map_err(|e| with_path(&self.path, e.into()))?;
        Ok((st.st_dev as u64, st.st_ino as u64))
    }

    /// Remove the entry `name` if it is not a directory (a symlink is
    /// removed, never its target). `NotFound` when it is already gone.
    pub fn unlink(&self, name: &str) -> io::Result<()> {
        let path = self.path.join(name);
        check_name(&path, name)?;
        unlinkat(self.fd.as_fd(), name, UnlinkatFlags::NoRemoveDir).map_err(|e| with_path(&path, e.into()))
    }

    /// Remove the entry `name` whatever it is; a directory with what is in
    /// it (a few levels deep), each level opened like [`open_sub`](Self::open_sub).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        self.remove_at(name, 0)
    }

    fn remove_at(&self, name: &str, depth: usize) -> io::Result<()> {
        if self.kind(name)? != Kind::Dir {
            return self.unlink(name);
        }
        if depth >= MAX_REMOVE_DEPTH {
            return Err(io::Error::other(format!(
                "{} is nested more than {MAX_REMOVE_DEPTH} levels deep; remove it by hand",
                self.path.join(name).display()
            )));
        }
        let sub = self.open_sub(name)?;
        for n in sub.names()? {
            sub.remove_at(&n, depth + 1)?;
        }
        let path = self.path.join(name);
        unlinkat(self.fd.as_fd(), name, UnlinkatFlags::RemoveDir).map_err(|e| with_path(&path, e.into()))
    }

    /// Write `name` atomically (PROTOCOL §11): a dot-named temp (0600)
    /// created in this directory, then renamed over `name`. The temp never
    /// survives a failure.
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let path = self.path.join(name);
        check_name(&path, name)?;
        let tmp = format!(".{name}.{}.{}.{:08x}.tmp", std::process::id(), crate::now_ms(), rand32());
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(self.fd.as_fd(), tmp.as_str(), flags, Mode::S_IRUSR | Mode::S_IWUSR)
            .map_err(|e| with_path(&self.path.join(&tmp), e.into()))?;
        let written = File::from(fd)
            .write_all(bytes)
            .and_then(|()| renameat(self.fd.as_fd(), tmp.as_str(), self.fd.as_fd(), name).map_err(io::Error::from));
        if written.is_err() {
            let _ = unlinkat(self.fd.as_fd(), tmp.as_str(), UnlinkatFlags::NoRemoveDir);
        }
        written.map_err(|e| with_path(&path, e))
    }
}

/// The descriptor itself, for what takes one (an inotify watch through
/// `/proc/self/fd`, which lands on the directory that was checked).
impl AsFd for DirFd {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Log `e` (a refusal to follow or use something planted in a run) once per
/// path for the life of the process: a refused inbox is looked at every
/// second, and one line says all there is to say.
pub fn warn_once(path: &Path, e: &io::Error) {
    static SEEN: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let set = seen.get_or_insert_with(HashSet::new);
    if set.len() >= 4096 {
        set.clear(); // bounded: at worst a path is reported again
    }
    if set.insert(path.to_path_buf()) {
        tracing::warn!(path = %path.display(), "{e}");
    }
}

fn rand32() -> u32 {
    uuid::Uuid::new_v4().as_u128() as u32
}

fn kind_of_md(m: &std::fs::Metadata) -> Kind {
    use std::os::unix::fs::MetadataExt;
    Kind::of(m.mode() as libc::mode_t)
}

/// One path component, not `.` or `..`: nothing escapes the directory.
fn check_name(path: &Path, name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: `{}` is not a plain file name", path.display(), name.escape_debug()),
        ));
    }
    Ok(())
}

fn with_path(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// An open that failed: `ELOOP`/`ENOTDIR` (a symlink, or not a directory)
/// and `ENXIO` become `InvalidInput` naming what is there; the rest keep
/// their errno (`NotFound`, capacity) with the path.
fn refusal(path: &Path, e: nix::errno::Errno, kind: Option<Kind>) -> io::Error {
    use nix::errno::Errno;
    match (e, kind) {
        (Errno::ELOOP | Errno::ENOTDIR | Errno::ENXIO | Errno::EISDIR, Some(k)) => not_followed(path, k),
        _ => with_path(path, e.into()),
    }
}

fn not_followed(path: &Path, kind: Kind) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is {}; runspool neither follows nor uses it here: remove it (`rm {}`)",
            path.display(),
            kind.describe(),
            path.display()
        ),
    )
}

fn not_regular(path: &Path, kind: Kind) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is {}, not a regular file; runspool does not read it: remove it", path.display(), kind.describe()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn symlinked_directories_are_refused_and_their_targets_untouched() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("x.json"), b"{}").unwrap();
        let run = d.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink(&outside, run.join("control")).unwrap();
        let e = DirFd::open(&run.join("control")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("symbolic link") && e.to_string().contains("control"), "{e}");
        let r = DirFd::open(&run).unwrap();
        assert_eq!(r.open_sub("control").unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(r.create_sub("control").unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(r.kind("control").unwrap(), Kind::Symlink);
        r.remove("control").unwrap();
        assert!(outside.join("x.json").exists(), "removing a link never touches its target");
        assert_eq!(r.open_sub("nope").unwrap_err().kind(), io::ErrorKind::NotFound);
        assert_eq!(r.open_sub("../outside").unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn entries_are_read_written_and_removed_relative_to_the_directory() {
        let d = tempfile::tempdir().unwrap();
        let root = DirFd::open(d.path()).unwrap();
        let c = root.create_sub("control").unwrap();
        let again = root.create_sub("control").unwrap();
        c.write_atomic("a.json", b"hello").unwrap();
        assert_eq!(again.read("a.json", 3).unwrap(), b"hel");
        mkfifo(&d.path().join("control/fifo"));
        let e = c.read("fifo", 10).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        std::fs::create_dir_all(d.path().join("control/dir.json/a/b")).unwrap();
        std::fs::write(d.path().join("control/dir.json/a/b/f"), b"x").unwrap();
        let mut names = c.names().unwrap();
        names.sort();
        assert_eq!(names, ["a.json", "dir.json", "fifo"]);
        // The directory was moved after it was opened: its descriptor still names it.
        std::fs::rename(d.path().join("control"), d.path().join("moved")).unwrap();
        std::fs::create_dir(d.path().join("control")).unwrap();
        std::fs::write(d.path().join("control/a.json"), b"decoy").unwrap();
        for n in ["a.json", "dir.json", "fifo"] {
            c.remove(n).unwrap();
        }
        assert!(c.names().unwrap().is_empty());
        assert_eq!(std::fs::read(d.path().join("control/a.json")).unwrap(), b"decoy");
        assert_eq!(c.unlink("a.json").unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
