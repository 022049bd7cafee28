"""Filesystem helpers: hostile-file-safe reads, atomic writes, no-replace renames.

Files under the root can be written by steps, other clients and other hosts:
every read opens with O_NOFOLLOW|O_NONBLOCK (never follows a symlink, never
blocks on a FIFO), checks that it got a regular file and caps what it reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import secrets
import stat
import sys
import time
from typing import NamedTuple, Optional

from .errors import RunspoolError

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_DIRECTORY | _O_CLOEXEC


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class FileId(NamedTuple):
    """A file's identity: device and inode."""

    dev: int
    ino: int

    @staticmethod
    def of(st: os.stat_result) -> "FileId":
        return FileId(st.st_dev, st.st_ino)


def open_regular(path: str, dir_fd: Optional[int] = None, shown: Optional[str] = None) -> Optional[int]:
    """Open `path` for reading without following a symlink or blocking on a
    FIFO; None when it does not exist. Anything but a regular file raises an
    error that names the path (`shown`, when `path` is relative to `dir_fd`)."""
    shown = shown or path
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunspoolError(f"{shown} is a symbolic link; runspool files are never followed: remove the link") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunspoolError(
                f"{shown} is not a regular file (a FIFO, directory or device?); remove it, runspool only reads regular files"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, cap: int, offset: int = 0) -> bytes:
    """Up to `cap` bytes of `fd` from `offset`."""
    chunks = []
    got = 0
    while got < cap:
        try:
            b = os.pread(fd, min(cap - got, 1 << 20), offset + got)
        except BlockingIOError:
            break
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_regular(
    path: str, cap: int, dir_fd: Optional[int] = None, shown: Optional[str] = None
) -> Optional[bytes]:
    """The whole content of the regular file `path`, or None when it is
    missing. Larger than `cap` bytes: an error naming the path."""
    shown = shown or path
    fd = open_regular(path, dir_fd, shown)
    if fd is None:
        return None
    try:
        data = read_fd(fd, cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise RunspoolError(f"{shown} is larger than {cap} bytes, more than any runspool file of its kind; remove it")
    return data


def temp_name(base: str) -> str:
    """PROTOCOL §11: `.<base>.<pid>.<ms>.<random>.tmp`, hashed when too long."""
    name = f".{base}.{os.getpid()}.{now_ms()}.{secrets.token_hex(4)}.tmp"
    if len(name.encode()) > 255:
        digest = hashlib.sha256(base.encode()).hexdigest()
        name = f".{digest}.{os.getpid()}.{now_ms()}.{secrets.token_hex(4)}.tmp"
    return name


def fsync_dir(path: str, dir_fd: Optional[int] = None) -> None:
    fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, durable: bool = True, dir_fd: Optional[int] = None) -> None:
    """Write `data` to `path` (mode 0600) through a dot-named temp file in the
    same directory and a rename: readers see all of it or nothing. With
    `dir_fd`, `path` is a name in that directory."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, temp_name(base))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if durable:
        if dir_fd is not None and not directory:
            os.fsync(dir_fd)
        else:
            fsync_dir(directory or ".", dir_fd)


def mkdir_private_all(path: str) -> None:
    """Create `path` and its missing parents with mode 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)


_libc: Optional[ctypes.CDLL] = None


def _c() -> Optional[ctypes.CDLL]:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    return _libc


def _link_unlink(src: str, dst: str) -> None:
    os.link(src, dst)  # FileExistsError when taken
    os.unlink(src)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename `src` to `dst`, failing with FileExistsError when `dst` exists
    (renameat2 RENAME_NOREPLACE on Linux, renamex_np RENAME_EXCL on macOS,
    link + unlink elsewhere or where the filesystem lacks the flag)."""
    libc = _c()
    a, b = os.fsencode(src), os.fsencode(dst)
    rc = None
    if libc is not None and sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_noreplace_flag = -100, 1
        rc = libc.renameat2(at_fdcwd, a, at_fdcwd, b, ctypes.c_uint(rename_noreplace_flag))
    elif libc is not None and sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_excl = 0x4
        rc = libc.renamex_np(a, b, ctypes.c_uint(rename_excl))
    if rc is None:
        _link_unlink(src, dst)
        return
    if rc == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _link_unlink(src, dst)
        return
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), dst)
    raise OSError(err, os.strerror(err), src)
