//! The spool's shared rules (PROTOCOL §2): what an entry name means, the
//! checks on an entry's lstat, which file an entry is, the run id of a
//! request without one, rejecting an entry (`reject`) and a client's
//! withdrawal of a pending request (`withdraw`), and what follows a claim's
//! commit (`claimed`). The daemon's claim
//! (`daemon::spool`) and every client (`client`, the CLI) use these.

pub mod claimed;
pub mod reject;
pub mod withdraw;

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::platform::rename_noreplace;
use crate::protocol::ids::RequestName;
use crate::protocol::request::{Rejection, RejectionCode, MAX_REQUEST_BYTES};
use crate::store::RunId;

/// What a spool entry name means.
#[derive(Debug, PartialEq, Eq)]
pub enum Name {
    /// `<name>.json` with `<name>` in the grammar: a request to claim.
    Candidate,
    /// A dot name, or a grammatical name not ending in `.json`: never read.
    Ignored,
    /// Neither grammatical nor a dot name: moved to rejected/ (`bad-name`).
    Bad,
}

pub fn classify_name(name: &str) -> Name {
    if name.starts_with('.') {
        return Name::Ignored;
    }
    if let Some(stem) = name.strip_suffix(".json") {
        if RequestName::is_valid(stem) {
            return Name::Candidate;
        }
    }
    if RequestName::is_valid(name) {
        Name::Ignored
    } else {
        Name::Bad
    }
}

/// PROTOCOL §2.3 step 1: checks on the lstat of a spool entry.
pub fn check_entry(path: &Path, md: &std::fs::Metadata) -> Result<(), Rejection> {
    let p = path.display();
    let ft = md.file_type();
    if !ft.is_file() {
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_symlink() {
            "a symbolic link"
        } else {
            "not a regular file (FIFO, socket or device)"
        };
        return Err(Rejection::new(
            RejectionCode::NotRegularFile,
            format!("{p} is {kind}; publish requests as regular files"),
        ));
    }
    let uid = nix::unistd::geteuid().as_raw();
    if md.uid() != uid {
        return Err(Rejection::new(
            RejectionCode::BadOwner,
            format!(
                "{p} is owned by uid {}, not by the daemon's uid {uid}; only the daemon's own user may submit requests",
                md.uid()
            ),
        ));
    }
    if md.nlink() != 1 {
        return Err(Rejection::new(
            RejectionCode::NotRegularFile,
            format!("{p} has {} hard links; publish a fresh file (write a dot file, then rename it)", md.nlink()),
        ));
    }
    if md.mode() & 0o022 != 0 {
        return Err(Rejection::new(
            RejectionCode::BadPermissions,
            format!("{p} has mode {:o}, writable by group or others; create it with mode 0600", md.mode() & 0o7777),
        ));
    }
    if md.len() > MAX_REQUEST_BYTES {
        return Err(Rejection::new(
            RejectionCode::TooLarge,
            format!("{p} is {} bytes; a request may be at most {MAX_REQUEST_BYTES} bytes", md.len()),
        ));
    }
    Ok(())
}

/// Which file a spool entry is, to notice one replaced under us: device and
/// inode. FUSE and a few network filesystems may report a different inode
/// number for the same file on each lookup (`platform::inode_numbers_stable`);
/// there, and only there, an equal size and mtime (which a rename keeps) count
/// as the same file, and the claim compares the committed bytes with the
/// validated ones before the run owns them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    /// On a filesystem with unstable inode numbers.
    loose: bool,
}

impl FileId {
    /// The identity of `md`, the metadata of `path`.
    pub fn at(path: &Path, md: &std::fs::Metadata) -> FileId {
        let dir = path.parent().unwrap_or(path);
        FileId {
            dev: md.dev(),
            ino: md.ino(),
            size: md.len(),
            mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
            loose: loose_on(md.dev(), dir),
        }
    }
    pub fn same(&self, o: &FileId) -> bool {
        self.dev == o.dev
            && (self.ino == o.ino || (self.loose && o.loose && self.size == o.size && self.mtime_ns == o.mtime_ns))
    }
}

/// Are inode numbers unstable on device `dev` (which holds `dir`)? Asked of
/// the filesystem once per device and remembered: a device number names one
/// mounted filesystem for as long as it is mounted. Perf: a claim compares
/// file identities several times, each a statfs before.
fn loose_on(dev: u64, dir: &Path) -> bool {
    use std::sync::Mutex;
    static SEEN: Mutex<Vec<(u64, bool)>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, loose)) = seen.iter().find(|(d, _)| *d == dev) {
        return loose;
    }
    let loose = !crate::platform::inode_numbers_stable(dir);
    seen.push((dev, loose));
    loose
}

/// Does `path` (not followed) name the same file as `md`?
pub fn same_file(path: &Path, md: &std::fs::Metadata) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| FileId::at(path, &m).same(&FileId::at(path, md)))
}

/// Put an entry that was replaced under us back into the spool, under its
/// own name if free, else under a fresh valid name: never lose it, never
/// reject it for another file's reason.
pub fn republish(from: &Path, spool: &Path, name: &str) -> io::Result<()> {
    let stem = name.strip_suffix(".json").unwrap_or(name);
    let mut candidates = vec![name.to_string()];
    candidates.extend((1..=8).map(|n| format!("{stem}-{n}")).filter(|s| RequestName::is_valid(s)).map(|s| s + ".json"));
    candidates.push(format!("r{}.json", uuid::Uuid::new_v4().simple()));
    let mut last = io::Error::other("no free name in the spool");
    for c in candidates {
        match rename_noreplace(from, &spool.join(&c)) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// The run id of a request without `runId`: UUID v4-shaped bits drawn from
/// the entry's identity (device, inode, ctime to the nanosecond, name), which
/// stay fixed while the entry waits in the spool and change when a new file
/// takes the name. FNV-1a rather than std's hasher: the id must not change
/// when the daemon is rebuilt with another Rust between a crash and a retry.
pub fn claim_id(md: &std::fs::Metadata, name: &str) -> RunId {
    fn fnv(seed: u64, parts: &[&[u8]]) -> u64 {
        let mut h = seed;
        for b in parts.iter().flat_map(|p| p.iter().chain(&[0xff])) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }
    let (dev, ino) = (md.dev().to_le_bytes(), md.ino().to_le_bytes());
    let (cs, cn) = (md.ctime().to_le_bytes(), md.ctime_nsec().to_le_bytes());
    let parts: [&[u8]; 5] = [&dev, &ino, &cs, &cn, name.as_bytes()];
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325, &parts).to_le_bytes());
    bytes[8..].copy_from_slice(&fnv(0x6c62_272e_07bb_0142, &parts).to_le_bytes());
    RunId::parse(&uuid::Builder::from_random_bytes(bytes).into_uuid().to_string()).expect("a UUID is a run id")
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn names() {
        assert_eq!(classify_name("a.json"), Name::Candidate);
        assert_eq!(classify_name(".a.json"), Name::Ignored);
        assert_eq!(classify_name("rejected"), Name::Ignored);
        assert_eq!(classify_name("x.txt"), Name::Ignored);
        assert_eq!(classify_name("bad name.json"), Name::Bad);
        assert_eq!(classify_name("-x.json"), Name::Bad);
        assert_eq!(classify_name(&format!("{}.json", "a".repeat(200))), Name::Candidate);
        assert_eq!(classify_name(&format!("{}.json", "a".repeat(201))), Name::Bad);
    }

    #[test]
    fn same_size_and_mtime_is_another_file_where_inodes_are_stable() {
        let d = tempfile::tempdir().unwrap();
        assert!(crate::platform::inode_numbers_stable(d.path()), "local filesystems keep inode numbers");
        let (a, b) = (d.path().join("a.json"), d.path().join("b.json"));
        std::fs::write(&a, "{\"x\":1}").unwrap();
        std::fs::write(&b, "{\"x\":2}").unwrap();
        let t =
            std::fs::FileTimes::new().set_modified(std::time::UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5));
        for p in [&a, &b] {
            std::fs::File::options().write(true).open(p).unwrap().set_times(t).unwrap();
        }
        let (ma, mb) = (std::fs::metadata(&a).unwrap(), std::fs::metadata(&b).unwrap());
        assert_eq!((ma.len(), ma.mtime_nsec()), (mb.len(), mb.mtime_nsec()));
        assert!(!FileId::at(&a, &ma).same(&FileId::at(&b, &mb)), "only dev and inode identify a file here");
        assert!(FileId::at(&a, &ma).same(&FileId::at(&a, &std::fs::metadata(&a).unwrap())));
    }

    #[test]
    fn generated_ids_are_stable_per_entry_and_fresh_per_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        std::fs::write(&p, "{}").unwrap();
        let md = std::fs::metadata(&p).unwrap();
        let id = claim_id(&md, "a.json");
        // A retried claim of the same entry lands in the same directory.
        assert_eq!(id, claim_id(&std::fs::metadata(&p).unwrap(), "a.json"));
        let u = uuid::Uuid::parse_str(&id).unwrap();
        assert_eq!(u.get_version_num(), 4, "{id} must look like the UUID v4 docs/protocol.md §2.2 promises");
        assert!(crate::protocol::ids::RequestedRunId::is_valid(&id));
        assert_ne!(id, claim_id(&md, "b.json"));
        // A new file under the same name is a new request.
        let keep = d.path().join("keep");
        std::fs::rename(&p, &keep).unwrap();
        std::fs::write(&p, "{}").unwrap();
        assert_ne!(id, claim_id(&std::fs::metadata(&p).unwrap(), "a.json"));
    }
}
