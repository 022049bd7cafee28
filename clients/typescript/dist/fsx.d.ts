/**
 * File access for directories that other programs write (PROTOCOL §3, §11):
 * never a symbolic link followed, never a FIFO waited on, never more read
 * than a cap; writes are atomic (a dot-named temp file renamed into place).
 */
import type { FileHandle } from "node:fs/promises";
/** Read only, never through a final symlink, never blocking on a FIFO. */
export declare const READ_FLAGS: number;
export declare function errno(e: unknown): string | undefined;
/**
 * Open `p` for reading as a regular file: undefined when it does not exist;
 * an UnsafeFileError when it is a symbolic link or not a regular file.
 */
export declare function openRegular(p: string): Promise<FileHandle | undefined>;
/** Read `len` bytes (fewer at the end of the file) from `offset`. */
export declare function readAt(fh: FileHandle, offset: number, len: number): Promise<Buffer>;
/**
 * The whole of the regular file `p`, at most `cap` bytes: undefined when it
 * does not exist; UnsafeFileError when it is a link, not a regular file, or
 * larger than `cap`.
 */
export declare function readSmall(p: string, cap: number): Promise<Buffer | undefined>;
/** `readSmall` parsed as a JSON object; undefined when missing. Throws on bad JSON. */
export declare function readJsonObject(p: string, cap: number): Promise<Record<string, unknown> | undefined>;
/** lstat, undefined when missing. */
export declare function lstatOrUndefined(p: string): Promise<import("fs").Stats | undefined>;
/** Is `p` a real directory (not a link)? */
export declare function isRealDir(p: string): Promise<boolean>;
/** Is `p` a regular file (not a link)? */
export declare function isRegular(p: string): Promise<boolean>;
/**
 * Refuse a root, spool or runs root that is a symbolic link, not a
 * directory, another user's, or writable by group or others (PROTOCOL §1),
 * with the daemon's own advice. False: it does not exist.
 */
export declare function checkDir(p: string): Promise<boolean>;
/** mkdir -p with mode 0700 for what is missing. */
export declare function mkdirPrivate(p: string): Promise<void>;
/**
 * `dir/name`, created 0700 when missing; refused when it is a link or not a
 * directory (the client never writes through a link in a run directory).
 */
export declare function subdir(dir: string, name: string): Promise<string>;
/**
 * Write `bytes` to `dir/name` atomically (PROTOCOL §11): a dot-named temp
 * file, mode 0600, created exclusively and never through a link, fsynced,
 * then renamed over the target. The temp file never survives a failure.
 */
export declare function writeAtomic(dir: string, name: string, bytes: Uint8Array): Promise<string>;
export declare const sleep: (ms: number, signal?: AbortSignal) => Promise<void>;
export declare function abortError(signal: AbortSignal): Error;
