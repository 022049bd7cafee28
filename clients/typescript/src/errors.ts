/**
 * The errors the client throws. Each message names the file or field
 * concerned and what to do about it.
 */

import type { Status } from "./types.js";

/** Every error of this package. `code` is a stable identifier of its kind. */
export class RunspoolError extends Error {
	/** A stable identifier: `RUNSPOOL_NOT_FOUND`, `RUNSPOOL_UNSAFE_FILE`, ... (for `RejectedError`, the rejection code). */
	readonly code: string;
	/** The file or directory the error is about, when there is one. */
	readonly path: string | undefined;

	constructor(message: string, code = "RUNSPOOL_ERROR", path?: string, options?: { cause?: unknown }) {
		super(message, options);
		this.name = "RunspoolError";
		this.code = code;
		this.path = path;
	}
}

/** No run, pending request or rejection of that id under the root. */
export class NotFoundError extends RunspoolError {
	readonly runId: string;
	constructor(runId: string, root: string) {
		super(
			`no run or pending request \`${runId}\` under ${root}: check the run id, and that this client uses the ` +
				"root the request was submitted to (the `root` option, RUNSPOOL_ROOT or PI_SUBAGENTS_TEMP_ROOT)",
			"RUNSPOOL_NOT_FOUND",
			root,
		);
		this.name = "NotFoundError";
		this.runId = runId;
	}
}

/**
 * The request was refused by the daemon (PROTOCOL §2.3) or withdrawn before
 * it ran (`runspool stop` of a request still in the spool): it never runs.
 * `code` is the rejection code (`invalid-field`, `cwd-missing`, ...,
 * `withdrawn`), `reason` the daemon's own message.
 */
export class RejectedError extends RunspoolError {
	readonly runId: string;
	/** The daemon's message, naming the field at fault. */
	readonly reason: string;
	/** The error file in spool/rejected/, or the rejected run's status.json. */
	readonly errorFile: string | undefined;

	constructor(runId: string, code: string, reason: string, errorFile?: string) {
		const what = code === "withdrawn" ? "was withdrawn before it ran" : "was rejected by the daemon";
		super(
			`request ${runId} ${what} (${code}): ${reason}${errorFile ? ` (see ${errorFile})` : ""}; it never runs: ` +
				(code === "withdrawn" ? "submit it again to run it" : "fix the request and submit it again"),
			code,
			errorFile,
		);
		this.name = "RejectedError";
		this.runId = runId;
		this.reason = reason;
		this.errorFile = errorFile;
	}
}

/** `wait` gave up; the run (or the request still in the spool) goes on. */
export class WaitTimeoutError extends RunspoolError {
	readonly runId: string;
	readonly timeoutMs: number;
	/** What the run looked like when the wait gave up. */
	readonly lastStatus: Status | undefined;

	constructor(runId: string, timeoutMs: number, lastStatus: Status | undefined, where: string) {
		const state = lastStatus ? lastStatus.state : "unknown";
		super(
			`gave up waiting for ${runId} after ${timeoutMs} ms (state ${state}, ${where}); the run goes on: ` +
				"wait again with a longer timeoutMs, or stop it with client.stop()",
			"RUNSPOOL_WAIT_TIMEOUT",
			where,
		);
		this.name = "WaitTimeoutError";
		this.runId = runId;
		this.timeoutMs = timeoutMs;
		this.lastStatus = lastStatus;
	}
}

/**
 * A file or directory that runspool's protocol says must be a regular file
 * (or a real directory) is something else: a symbolic link, a FIFO, a
 * device, a file that is too large. The client never follows or waits on it.
 */
export class UnsafeFileError extends RunspoolError {
	constructor(message: string, path: string) {
		super(message, "RUNSPOOL_UNSAFE_FILE", path);
		this.name = "UnsafeFileError";
	}
}
