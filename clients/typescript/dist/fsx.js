/**
 * File access for directories that other programs write (PROTOCOL §3, §11):
 * never a symbolic link followed, never a FIFO waited on, never more read
 * than a cap; writes are atomic (a dot-named temp file renamed into place).
 */
import { constants as C, promises as fsp } from "node:fs";
import { randomBytes } from "node:crypto";
import * as path from "node:path";
import { RunspoolError, UnsafeFileError } from "./errors.js";
const O_NOFOLLOW = C.O_NOFOLLOW ?? 0;
const O_NONBLOCK = C.O_NONBLOCK ?? 0;
/** Read only, never through a final symlink, never blocking on a FIFO. */
export const READ_FLAGS = C.O_RDONLY | O_NOFOLLOW | O_NONBLOCK;
export function errno(e) {
    return typeof e === "object" && e !== null && typeof e.code === "string"
        ? e.code
        : undefined;
}
function isMissing(e) {
    const c = errno(e);
    return c === "ENOENT" || c === "ENOTDIR";
}
/** The final component was a symbolic link opened with O_NOFOLLOW (ELOOP; EMLINK on FreeBSD, EFTYPE on some BSDs). */
function isLink(e) {
    const c = errno(e);
    return c === "ELOOP" || c === "EMLINK" || c === "EFTYPE";
}
/**
 * Open `p` for reading as a regular file: undefined when it does not exist;
 * an UnsafeFileError when it is a symbolic link or not a regular file.
 */
export async function openRegular(p) {
    let fh;
    try {
        fh = await fsp.open(p, READ_FLAGS);
    }
    catch (e) {
        if (isMissing(e))
            return undefined;
        if (isLink(e)) {
            throw new UnsafeFileError(`${p} is a symbolic link; runspool's files are never read through a link: remove it (the run's own writer recreates the file)`, p);
        }
        throw new RunspoolError(`cannot open ${p}: ${e.message}; check its permissions`, "RUNSPOOL_IO", p, {
            cause: e,
        });
    }
    try {
        const st = await fh.stat();
        if (!st.isFile()) {
            throw new UnsafeFileError(`${p} is not a regular file (a FIFO, device or directory); the client does not read it: remove it`, p);
        }
    }
    catch (e) {
        await fh.close().catch(() => undefined);
        throw e;
    }
    return fh;
}
/** Read `len` bytes (fewer at the end of the file) from `offset`. */
export async function readAt(fh, offset, len) {
    const buf = Buffer.alloc(len);
    let got = 0;
    while (got < len) {
        const { bytesRead } = await fh.read(buf, got, len - got, offset + got);
        if (bytesRead === 0)
            break;
        got += bytesRead;
    }
    return got === len ? buf : buf.subarray(0, got);
}
/**
 * The whole of the regular file `p`, at most `cap` bytes: undefined when it
 * does not exist; UnsafeFileError when it is a link, not a regular file, or
 * larger than `cap`.
 */
export async function readSmall(p, cap) {
    const fh = await openRegular(p);
    if (!fh)
        return undefined;
    const tooLarge = () => new UnsafeFileError(`${p} is larger than ${cap} bytes, more than runspool ever writes there; the client does not read it: ` +
        "look at what wrote it, and remove it", p);
    try {
        const { size } = await fh.stat();
        if (size > cap)
            throw tooLarge();
        // Sized by the file, grown while it grows, never past the cap.
        const chunks = [];
        let total = 0;
        let want = size + 1;
        for (;;) {
            const part = await readAt(fh, total, Math.min(want, cap + 1 - total));
            chunks.push(part);
            total += part.length;
            if (total > cap)
                throw tooLarge();
            if (part.length === 0 || total < size + 1)
                break;
            want = Math.max(4096, total);
        }
        return chunks.length === 1 ? chunks[0] : Buffer.concat(chunks, total);
    }
    finally {
        await fh.close().catch(() => undefined);
    }
}
/** `readSmall` parsed as a JSON object; undefined when missing. Throws on bad JSON. */
export async function readJsonObject(p, cap) {
    const data = await readSmall(p, cap);
    if (data === undefined)
        return undefined;
    let v;
    try {
        v = JSON.parse(data.toString("utf8"));
    }
    catch (e) {
        throw new RunspoolError(`${p} is not valid JSON (${e.message}); it may be being replaced: read it again, or look at what wrote it`, "RUNSPOOL_BAD_JSON", p);
    }
    if (typeof v !== "object" || v === null || Array.isArray(v)) {
        throw new RunspoolError(`${p} does not hold a JSON object; look at what wrote it`, "RUNSPOOL_BAD_JSON", p);
    }
    return v;
}
/** lstat, undefined when missing. */
export async function lstatOrUndefined(p) {
    try {
        return await fsp.lstat(p);
    }
    catch (e) {
        if (isMissing(e))
            return undefined;
        throw e;
    }
}
/** Is `p` a real directory (not a link)? */
export async function isRealDir(p) {
    const st = await lstatOrUndefined(p);
    return st !== undefined && st.isDirectory();
}
/** Is `p` a regular file (not a link)? */
export async function isRegular(p) {
    const st = await lstatOrUndefined(p);
    return st !== undefined && st.isFile();
}
function myUid() {
    if (typeof process.geteuid !== "function") {
        throw new RunspoolError("runspool-client needs a POSIX system (process.geteuid is missing)", "RUNSPOOL_PLATFORM");
    }
    return process.geteuid();
}
/**
 * Refuse a root, spool or runs root that is a symbolic link, not a
 * directory, another user's, or writable by group or others (PROTOCOL §1),
 * with the daemon's own advice. False: it does not exist.
 */
export async function checkDir(p) {
    const st = await lstatOrUndefined(p);
    if (!st)
        return false;
    if (st.isSymbolicLink()) {
        throw new UnsafeFileError(`${p} is a symbolic link; runspool refuses it so nobody can redirect its files: replace it with a real directory (mkdir -m 700 ${p})`, p);
    }
    if (!st.isDirectory()) {
        throw new UnsafeFileError(`${p} is not a directory; remove it or choose another root`, p);
    }
    const me = myUid();
    if (st.uid !== me) {
        throw new UnsafeFileError(`${p} is owned by uid ${st.uid}, not by you (uid ${me}); use a root you own (the root option or RUNSPOOL_ROOT)`, p);
    }
    if ((st.mode & 0o022) !== 0) {
        throw new UnsafeFileError(`${p} is writable by group or others (mode ${(st.mode & 0o7777).toString(8)}); fix it with: chmod 700 ${p}`, p);
    }
    return true;
}
/** mkdir -p with mode 0700 for what is missing. */
export async function mkdirPrivate(p) {
    try {
        await fsp.mkdir(p, { recursive: true, mode: 0o700 });
    }
    catch (e) {
        throw new RunspoolError(`cannot create ${p}: ${e.message}; check that its parent is a directory you can write`, "RUNSPOOL_IO", p, { cause: e });
    }
}
/**
 * `dir/name`, created 0700 when missing; refused when it is a link or not a
 * directory (the client never writes through a link in a run directory).
 */
export async function subdir(dir, name) {
    const p = path.join(dir, name);
    try {
        await fsp.mkdir(p, { mode: 0o700 });
    }
    catch (e) {
        if (errno(e) !== "EEXIST") {
            throw new RunspoolError(`cannot create ${p}: ${e.message}`, "RUNSPOOL_IO", p, { cause: e });
        }
    }
    const st = await fsp.lstat(p);
    if (!st.isDirectory()) {
        throw new UnsafeFileError(`${p} is ${st.isSymbolicLink() ? "a symbolic link" : "not a directory"}; the client never writes through it: remove it`, p);
    }
    return p;
}
/**
 * Write `bytes` to `dir/name` atomically (PROTOCOL §11): a dot-named temp
 * file, mode 0600, created exclusively and never through a link, fsynced,
 * then renamed over the target. The temp file never survives a failure.
 */
export async function writeAtomic(dir, name, bytes) {
    const target = path.join(dir, name);
    const tmp = path.join(dir, `.${name}.${process.pid}.${Date.now()}.${randomBytes(6).toString("hex")}.tmp`);
    let fh;
    try {
        fh = await fsp.open(tmp, C.O_WRONLY | C.O_CREAT | C.O_EXCL | O_NOFOLLOW, 0o600);
        let done = 0;
        while (done < bytes.length) {
            const { bytesWritten } = await fh.write(bytes, done, bytes.length - done);
            done += bytesWritten;
        }
        await fh.sync();
        await fh.close();
        fh = undefined;
        await fsp.rename(tmp, target);
    }
    catch (e) {
        if (fh)
            await fh.close().catch(() => undefined);
        await fsp.unlink(tmp).catch(() => undefined);
        throw new RunspoolError(`cannot write ${target}: ${e.message}; check that ${dir} is a directory you can write and that the disk has room`, "RUNSPOOL_IO", target, { cause: e });
    }
    return target;
}
export const sleep = (ms, signal) => new Promise((resolve, reject) => {
    if (signal?.aborted)
        return reject(abortError(signal));
    const t = setTimeout(() => {
        signal?.removeEventListener("abort", onAbort);
        resolve();
    }, ms);
    const onAbort = () => {
        clearTimeout(t);
        reject(abortError(signal));
    };
    signal?.addEventListener("abort", onAbort, { once: true });
});
export function abortError(signal) {
    const r = signal.reason;
    if (r instanceof Error)
        return r;
    const e = new Error("the operation was aborted");
    e.name = "AbortError";
    return e;
}
