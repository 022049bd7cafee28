//! Finding and starting the programs runspool runs: runners, steps, hooks
//! and provider commands.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why `find_executable` found nothing to run. The messages name the path
/// (or `PATH`) and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum ExecutableError {
    #[error("{}: {source}", .path.display())]
    Unreadable { path: PathBuf, source: std::io::Error },
    #[error("{} is not a regular file", .path.display())]
    NotAFile { path: PathBuf },
    #[error("{} is not executable (chmod +x {})", .path.display(), .path.display())]
    NotExecutable { path: PathBuf },
    #[error("`{name}` is not on PATH ({path})")]
    NotOnPath { name: String, path: String },
}

/// Find an executable: a path containing `/` is taken as is, else searched on PATH.
pub fn find_executable(name: &str) -> Result<PathBuf, ExecutableError> {
    let check = |p: &Path| -> Result<(), ExecutableError> {
        let md = std::fs::metadata(p).map_err(|source| ExecutableError::Unreadable { path: p.into(), source })?;
        if !md.is_file() {
            return Err(ExecutableError::NotAFile { path: p.into() });
        }
        if md.permissions().mode() & 0o111 == 0 {
            return Err(ExecutableError::NotExecutable { path: p.into() });
        }
        Ok(())
    };
    if name.contains('/') {
        let p = Path::new(name).to_path_buf();
        check(&p)?;
        return Ok(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for d in std::env::split_paths(&path) {
        let p = d.join(name);
        if check(&p).is_ok() {
            return Ok(p);
        }
    }
    Err(ExecutableError::NotOnPath { name: name.to_string(), path: path.to_string_lossy().into_owned() })
}

/// How a child of runspool is set apart from it (`command`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Detach {
    /// A process group of its own (steps, hooks, provider commands), so the
    /// whole group can be signalled. A runner makes its own session instead.
    pub own_group: bool,
    /// SIGKILL when the spawning thread exits (PR_SET_PDEATHSIG; Linux). It
    /// costs the pre_exec hook, so std forks instead of using posix_spawn:
    /// only for children the thread waits for (provider commands).
    pub die_with_thread: bool,
}

/// A `Command` for `program` with none of the service manager's variables
/// (`SCRUBBED_ENV`) and the detachment asked for. Descriptors: std opens
/// its own with O_CLOEXEC, and so does everything runspool opens, so a
/// child inherits only its stdio.
pub fn command(program: impl AsRef<OsStr>, detach: Detach) -> Command {
    let mut cmd = Command::new(program);
    if detach.own_group {
        cmd.process_group(0);
    }
    // Perf: only the variables present are removed; removing an absent one
    // would still make std copy the whole environment for the child.
    for k in super::SCRUBBED_ENV.iter().filter(|k| std::env::var_os(k).is_some()) {
        cmd.env_remove(k);
    }
    if detach.die_with_thread {
        let parent = std::process::id();
        // SAFETY: `die_with_parent` makes only async-signal-safe system calls.
        unsafe {
            cmd.pre_exec(move || super::procs::die_with_parent(parent));
        }
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executables_are_found_and_refusals_say_why() {
        assert!(find_executable("sh").is_ok_and(|p| p.ends_with("sh")));
        let e = find_executable("no-such-program-runspool").unwrap_err();
        assert!(e.to_string().starts_with("`no-such-program-runspool` is not on PATH ("), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        assert_eq!(find_executable(&d).unwrap_err().to_string(), format!("{d} is not a regular file"));
        let f = dir.path().join("script");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        let f = f.display().to_string();
        assert_eq!(find_executable(&f).unwrap_err().to_string(), format!("{f} is not executable (chmod +x {f})"));
        let missing = format!("{d}/missing");
        assert!(matches!(find_executable(&missing), Err(ExecutableError::Unreadable { .. })));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_command_runs_in_its_own_group_when_asked() {
        let out = command("sh", Detach { own_group: true, die_with_thread: true })
            .args(["-c", "cut -d' ' -f5 /proc/$$/stat; echo $$"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Vec<&str> = text.split_whitespace().collect();
        assert_eq!(v.len(), 2, "{text}");
        assert_eq!(v[0], v[1], "the child leads its own process group");
    }
}
