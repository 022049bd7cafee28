/**
 * The errors the client throws. Each message names the file or field
 * concerned and what to do about it.
 */
import type { Status } from "./types.js";
/** Every error of this package. `code` is a stable identifier of its kind. */
export declare class RunspoolError extends Error {
    /** A stable identifier: `RUNSPOOL_NOT_FOUND`, `RUNSPOOL_UNSAFE_FILE`, ... (for `RejectedError`, the rejection code). */
    readonly code: string;
    /** The file or directory the error is about, when there is one. */
    readonly path: string | undefined;
    constructor(message: string, code?: string, path?: string, options?: {
        cause?: unknown;
    });
}
/** No run, pending request or rejection of that id under the root. */
export declare class NotFoundError extends RunspoolError {
    readonly runId: string;
    constructor(runId: string, root: string);
}
/**
 * The request was refused by the daemon (PROTOCOL §2.3) or withdrawn before
 * it ran (`runspool stop` of a request still in the spool): it never runs.
 * `code` is the rejection code (`invalid-field`, `cwd-missing`, ...,
 * `withdrawn`), `reason` the daemon's own message.
 */
export declare class RejectedError extends RunspoolError {
    readonly runId: string;
    /** The daemon's message, naming the field at fault. */
    readonly reason: string;
    /** The error file in spool/rejected/, or the rejected run's status.json. */
    readonly errorFile: string | undefined;
    constructor(runId: string, code: string, reason: string, errorFile?: string);
}
/** `wait` gave up; the run (or the request still in the spool) goes on. */
export declare class WaitTimeoutError extends RunspoolError {
    readonly runId: string;
    readonly timeoutMs: number;
    /** What the run looked like when the wait gave up. */
    readonly lastStatus: Status | undefined;
    constructor(runId: string, timeoutMs: number, lastStatus: Status | undefined, where: string);
}
/**
 * A file or directory that runspool's protocol says must be a regular file
 * (or a real directory) is something else: a symbolic link, a FIFO, a
 * device, a file that is too large. The client never follows or waits on it.
 */
export declare class UnsafeFileError extends RunspoolError {
    constructor(message: string, path: string);
}
