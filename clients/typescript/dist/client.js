/**
 * The client: runspool through its files only (PROTOCOL §1-§9). It never
 * talks to the daemon, and needs no daemon to publish a request: one
 * started later claims it.
 */
import { promises as fsp } from "node:fs";
import { randomUUID } from "node:crypto";
import * as os from "node:os";
import * as path from "node:path";
import { NotFoundError, RejectedError, RunspoolError, UnsafeFileError, WaitTimeoutError } from "./errors.js";
import { checkDir, errno, isRegular, lstatOrUndefined, mkdirPrivate, openRegular, readAt, readJsonObject, sleep, subdir, writeAtomic, abortError, } from "./fsx.js";
/** A request is at most 1 MiB (PROTOCOL §2.2). */
export const MAX_REQUEST_BYTES = 1 << 20;
const MAX_STATUS_BYTES = 16 << 20;
const MAX_SMALL_JSON = 1 << 20;
const MAX_MARKER_BYTES = 64 << 10;
/** A line of output or events longer than this is cut (output) or skipped (events). */
const MAX_LINE_BYTES = 1 << 20;
const READ_CHUNK = 1 << 20;
const DEFAULT_RECENT = 20;
const ID = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
/** A run id as a request may set it (PROTOCOL §2.2). */
export function isRequestRunId(s) {
    return typeof s === "string" && s.length <= 128 && ID.test(s);
}
/** A name that can be a run directory's (runspool's, or another host's: up to 255). */
function isRunDirName(s) {
    return s.length <= 255 && ID.test(s);
}
/** queued and running are active; every other state (also another host's) is terminal. */
export function isActiveState(state) {
    return state === "queued" || state === "running";
}
/** The root as PROTOCOL §1 resolves it, without a `--root`: RUNSPOOL_ROOT, PI_SUBAGENTS_TEMP_ROOT, else `<TMPDIR or /tmp>/pi-subagents-uid-<uid>`. */
export function defaultRoot(env = process.env) {
    for (const v of [env.RUNSPOOL_ROOT, env.PI_SUBAGENTS_TEMP_ROOT]) {
        if (v)
            return path.resolve(v);
    }
    if (typeof process.getuid !== "function") {
        throw new RunspoolError("cannot find the default root: process.getuid is missing (not a POSIX system); pass the root option", "RUNSPOOL_PLATFORM");
    }
    return path.join(env.TMPDIR || "/tmp", `pi-subagents-uid-${process.getuid()}`);
}
/** seg(v) of PROTOCOL §6.3, or undefined for a string with a lone surrogate. */
async function seg(v, max = 255) {
    let e;
    try {
        e = encodeURIComponent(v);
    }
    catch {
        return undefined;
    }
    const portable = e.length > 0 &&
        e !== "." &&
        e !== ".." &&
        !e.endsWith(".") &&
        !/^(con|prn|aux|nul|com[1-9]|lpt[1-9])(\.|$)/i.test(e) &&
        !/%5c/i.test(e) &&
        !/\.[A-Za-z][A-Za-z0-9]{0,7}$/.test(e);
    if (Buffer.byteLength(e) <= max && portable)
        return e;
    const { createHash } = await import("node:crypto");
    return `~sha256-${createHash("sha256").update(v, "utf8").digest("hex")}`;
}
export class Client {
    /** The root directory (absolute). */
    root;
    pollIntervalMs;
    constructor(options = {}) {
        this.root = options.root !== undefined ? path.resolve(options.root) : defaultRoot();
        this.pollIntervalMs = Math.max(5, options.pollIntervalMs ?? 50);
    }
    get spoolDir() {
        return path.join(this.root, "spool");
    }
    get rejectedDir() {
        return path.join(this.root, "spool", "rejected");
    }
    get runsDir() {
        return path.join(this.root, "async-subagent-runs");
    }
    get resultsDir() {
        return path.join(this.root, "async-subagent-results");
    }
    /** `<runs>/<id>`: only for an id of the run-id grammar (never a path from a file). */
    runDir(id) {
        checkId(id, isRunDirName(id), "run id");
        return path.join(this.runsDir, id);
    }
    /**
     * Publish a request (PROTOCOL §2.1): a command line (`["make", "test"]`)
     * with `opts`, or a whole request object. Returns its run id. The file
     * appears complete (dot temp + rename, mode 0600); no daemon is needed
     * for this, one claims it when it runs.
     */
    async submit(argvOrRequest, opts = {}) {
        const body = Array.isArray(argvOrRequest)
            ? fromArgv(argvOrRequest, opts)
            : fromRequest(argvOrRequest, opts);
        const runId = body.runId;
        const bytes = Buffer.from(`${JSON.stringify(body, null, 2)}\n`, "utf8");
        if (bytes.length > MAX_REQUEST_BYTES) {
            throw new RunspoolError(`the request is ${bytes.length} bytes, over the limit of ${MAX_REQUEST_BYTES} (PROTOCOL §2.2): ` +
                "pass large inputs through files named in the command instead", "RUNSPOOL_INVALID_REQUEST");
        }
        // The daemon refuses such a root; a request there would never be claimed.
        await this.checkLayout();
        await mkdirPrivate(this.spoolDir);
        await this.checkLayout();
        const name = `${runId}.json`;
        const target = path.join(this.spoolDir, name);
        if (await lstatOrUndefined(target)) {
            throw new RunspoolError(`${target} already exists: a request with run id \`${runId}\` is waiting to be claimed; choose another runId`, "RUNSPOOL_DUPLICATE", target);
        }
        const dir = path.join(this.runsDir, runId);
        if (await lstatOrUndefined(dir)) {
            throw new RunspoolError(`run id \`${runId}\` is taken: ${dir} exists (the daemon would reject the request as duplicate-run-id); choose another runId`, "RUNSPOOL_DUPLICATE", dir);
        }
        await writeAtomic(this.spoolDir, name, bytes);
        return runId;
    }
    /** PROTOCOL §1: the root, spool/ and the runs root, when they exist, are real directories of ours nobody else can write. */
    async checkLayout() {
        for (const p of [this.root, this.spoolDir, this.runsDir])
            await checkDir(p);
    }
    /**
     * Where the request or run `id` is: `pending` while in the spool,
     * `claimed` between the claim and its first status.json, the run's
     * status.json (`kind: "run"`) once written, `refused` (state `rejected`
     * or `withdrawn`) from the error file of a request that never got a run
     * directory. A NotFoundError when none of them exists.
     */
    async status(id) {
        checkId(id, isRunDirName(id), "run id");
        // Each move (spool -> run, spool -> rejected/) is one rename, and the
        // looks follow the moves' order, so a request on its way is never missed.
        for (let attempt = 0;; attempt++) {
            const pending = await this.pendingEntry(id);
            if (pending)
                return pending;
            const run = await this.runStatus(id);
            if (run)
                return run;
            if (await isRegular(path.join(this.runDir(id), "request.json"))) {
                return { kind: "claimed", state: "claimed", runId: id, runDir: this.runDir(id) };
            }
            const refused = await this.refusal(id);
            if (refused)
                return refused;
            // Moved to rejected/ a moment before its error file (or its rejected run) appears.
            const inRejected = await lstatOrUndefined(path.join(this.rejectedDir, `${id}.json`));
            if (inRejected && attempt < 100) {
                await sleep(20);
                continue;
            }
            const other = await this.pendingByBody(id);
            if (other)
                return other;
            throw new NotFoundError(id, this.root);
        }
    }
    /** `spool/<id>.json`, the name `submit` (and `runspool submit`) publishes under. */
    async pendingEntry(id) {
        if (!isRequestRunId(id))
            return undefined;
        const spoolFile = path.join(this.spoolDir, `${id}.json`);
        const st = await lstatOrUndefined(spoolFile);
        if (!st || !st.isFile())
            return undefined;
        return { kind: "pending", state: "pending", runId: id, spoolFile, publishedAt: Math.floor(st.mtimeMs) };
    }
    /** A request published by another client under another name whose body says `runId: id`. */
    async pendingByBody(id) {
        if (!isRequestRunId(id))
            return undefined;
        let names;
        try {
            names = await fsp.readdir(this.spoolDir);
        }
        catch {
            return undefined;
        }
        for (const n of names) {
            if (n.startsWith(".") || !n.endsWith(".json") || !ID.test(n))
                continue;
            const spoolFile = path.join(this.spoolDir, n);
            try {
                const st = await lstatOrUndefined(spoolFile);
                if (!st || !st.isFile() || st.size > MAX_REQUEST_BYTES)
                    continue;
                const body = await readJsonObject(spoolFile, MAX_REQUEST_BYTES);
                if (body?.runId === id) {
                    return { kind: "pending", state: "pending", runId: id, spoolFile, publishedAt: Math.floor(st.mtimeMs) };
                }
            }
            catch {
                // Another client's file, unreadable or half written: not this request.
            }
        }
        return undefined;
    }
    /**
     * The run's status.json, undefined while it has none. Refused: a run
     * directory that is a link, and a status naming another run.
     */
    async runStatus(id) {
        const dir = this.runDir(id);
        const st = await lstatOrUndefined(dir);
        if (!st)
            return undefined;
        if (!st.isDirectory()) {
            throw new UnsafeFileError(`${dir} is ${st.isSymbolicLink() ? "a symbolic link" : "not a directory"}, not a run directory; runspool never follows it: remove it`, dir);
        }
        const file = path.join(dir, "status.json");
        let v;
        // A status.json is replaced by rename, never rewritten in place; a
        // parse error is another host's writer at work: look again shortly.
        for (let attempt = 0;; attempt++) {
            try {
                v = await readJsonObject(file, MAX_STATUS_BYTES);
                break;
            }
            catch (e) {
                if (!(e instanceof RunspoolError) || e.code !== "RUNSPOOL_BAD_JSON" || attempt >= 10)
                    throw e;
                await sleep(20);
            }
        }
        if (v === undefined)
            return undefined;
        if (v.runId !== id) {
            throw new RunspoolError(`${file} names run ${JSON.stringify(v.runId)}, not ${id}; the client never reports another run's status ` +
                "under this one's name: look at what wrote it", "RUNSPOOL_IDENTITY_MISMATCH", file);
        }
        if (typeof v.state !== "string") {
            throw new RunspoolError(`${file} has no string \`state\`; look at what wrote it`, "RUNSPOOL_BAD_STATUS", file);
        }
        return { ...v, kind: "run", runId: id, state: v.state, steps: Array.isArray(v.steps) ? v.steps : [] };
    }
    /** The error file `spool/rejected/<id>.error.json` of a request refused or withdrawn before it had a run. */
    async refusal(id) {
        if (!isRequestRunId(id))
            return undefined;
        const errorFile = path.join(this.rejectedDir, `${id}.error.json`);
        let v;
        try {
            v = await readJsonObject(errorFile, MAX_SMALL_JSON);
        }
        catch (e) {
            if (e instanceof RunspoolError && e.code === "RUNSPOOL_BAD_JSON") {
                v = {};
            }
            else {
                throw e;
            }
        }
        if (!v)
            return undefined;
        const code = typeof v.code === "string" ? v.code : "unknown";
        return {
            kind: "refused",
            state: code === "withdrawn" ? "withdrawn" : "rejected",
            runId: id,
            code,
            message: typeof v.message === "string" ? v.message : `see ${errorFile}`,
            errorFile,
            ...(typeof v.rejectedAt === "number" ? { rejectedAt: v.rejectedAt } : {}),
        };
    }
    /** The RejectedError of a refused request or a `rejected` run. */
    async rejection(s) {
        if (s.kind === "refused")
            return new RejectedError(s.runId, s.code, s.message, s.errorFile);
        // The error file has the code and message apart; the run has `error` = "<code>: <message>".
        const file = await this.refusal(s.runId).catch(() => undefined);
        if (file)
            return new RejectedError(s.runId, file.code, file.message, file.errorFile);
        const text = typeof s.error === "string" ? s.error : "";
        const m = /^([a-z][a-z0-9-]*): ([\s\S]*)$/.exec(text);
        return new RejectedError(s.runId, m ? m[1] : "unknown", m ? m[2] : text || "no reason recorded", path.join(this.runDir(s.runId), "status.json"));
    }
    /**
     * Wait until the run ends; resolves with its final status.json. Rejects
     * with RejectedError when the request was refused or withdrawn, with
     * WaitTimeoutError after `timeoutMs` (the run goes on).
     */
    async wait(id, options = {}) {
        const start = Date.now();
        let last;
        for (;;) {
            if (options.signal?.aborted)
                throw abortError(options.signal);
            last = await this.status(id);
            if (last.kind === "refused" || (last.kind === "run" && last.state === "rejected")) {
                throw await this.rejection(last);
            }
            if (last.kind === "run" && !isActiveState(last.state))
                return last;
            if (options.timeoutMs !== undefined && Date.now() - start >= options.timeoutMs) {
                throw new WaitTimeoutError(id, options.timeoutMs, last, this.whereIs(last, id));
            }
            await sleep(this.pollIntervalMs, options.signal);
        }
    }
    /** Where `s` is, for messages. */
    whereIs(s, id) {
        if (s.kind === "pending")
            return `still pending in ${s.spoolFile}`;
        return `see ${this.runDir(id)}`;
    }
    /**
     * The run's output (every step's `output-<i>.log`), line by line as it is
     * written, until the run ends. A request still in the spool is waited on
     * through its claim; a refused one throws RejectedError. Lines are
     * decoded as UTF-8 (invalid bytes become U+FFFD), without their newline;
     * a line longer than 1 MiB comes in 1 MiB pieces; the last line of a step
     * without a final newline comes once the run has ended.
     */
    async *follow(id, options = {}) {
        let s;
        for (;;) {
            if (options.signal?.aborted)
                throw abortError(options.signal);
            s = await this.status(id);
            if (s.kind === "refused" || (s.kind === "run" && s.state === "rejected"))
                throw await this.rejection(s);
            if (s.kind === "run")
                break;
            await sleep(this.pollIntervalMs, options.signal);
        }
        const dir = this.runDir(id);
        const offsets = [];
        const partial = [];
        const decoder = new TextDecoder("utf-8");
        for (;;) {
            if (options.signal?.aborted)
                throw abortError(options.signal);
            const status = await this.runStatus(id);
            if (!status)
                throw new NotFoundError(id, this.root);
            const ended = !isActiveState(status.state);
            const steps = Math.max(status.steps.length, offsets.length);
            for (let i = 0; i < steps; i++) {
                offsets[i] ??= 0;
                partial[i] ??= Buffer.alloc(0);
                const file = path.join(dir, `output-${i}.log`);
                let fh;
                try {
                    fh = await openRegular(file);
                }
                catch (e) {
                    if (e instanceof UnsafeFileError)
                        continue; // not output the runner wrote
                    throw e;
                }
                if (!fh)
                    continue;
                try {
                    for (;;) {
                        const data = await readAt(fh, offsets[i], READ_CHUNK);
                        if (data.length === 0)
                            break;
                        offsets[i] += data.length;
                        let buf = partial[i].length ? Buffer.concat([partial[i], data]) : data;
                        let nl;
                        while ((nl = buf.indexOf(10)) >= 0) {
                            yield decoder.decode(buf.subarray(0, nl));
                            buf = buf.subarray(nl + 1);
                        }
                        while (buf.length >= MAX_LINE_BYTES) {
                            yield decoder.decode(buf.subarray(0, MAX_LINE_BYTES));
                            buf = buf.subarray(MAX_LINE_BYTES);
                        }
                        partial[i] = Buffer.from(buf);
                        if (data.length < READ_CHUNK)
                            break;
                    }
                }
                finally {
                    await fh.close().catch(() => undefined);
                }
            }
            // The status was read before this pass: what the run wrote before it ended is in.
            if (ended) {
                for (const p of partial)
                    if (p && p.length)
                        yield decoder.decode(p);
                return;
            }
            await sleep(this.pollIntervalMs, options.signal);
        }
    }
    /**
     * Ask a run to stop: a stop request in its control inbox
     * (`control/stop-requests/<ts>-<uuid>.json`, PROTOCOL §9), written
     * atomically; the daemon acts on it while the run is queued, the runner
     * once it runs. A request still in the spool is waited on until the
     * daemon claims it (at most `claimTimeoutMs`), then stopped the same way:
     * it never starts a step. (`runspool stop` withdraws such a request
     * instead, under the spool file's flock, which Node cannot take; see
     * README.md.) A run that already ended gives `outcome: "ended"`. A
     * refused request throws RejectedError; another host's run, an error.
     */
    async stop(id, reason, options = {}) {
        const claimTimeoutMs = options.claimTimeoutMs ?? 30_000;
        const start = Date.now();
        for (;;) {
            if (options.signal?.aborted)
                throw abortError(options.signal);
            const s = await this.status(id);
            if (s.kind === "refused" || (s.kind === "run" && s.state === "rejected"))
                throw await this.rejection(s);
            if (s.kind === "pending") {
                if (Date.now() - start >= claimTimeoutMs) {
                    const daemon = await this.daemon().catch(() => undefined);
                    throw new RunspoolError(`nothing was stopped: ${s.spoolFile} was not claimed within ${claimTimeoutMs} ms` +
                        (daemon?.alive
                            ? "; the daemon is busy or storage is low (`runspool status`): try again"
                            : `; no daemon runs under ${this.root}: start one (\`runspool daemon\` or \`runspool service start\`), or withdraw the request with \`runspool stop ${id}\``), "RUNSPOOL_STOP_TIMEOUT", s.spoolFile);
                }
                await sleep(this.pollIntervalMs, options.signal);
                continue;
            }
            const dir = this.runDir(id);
            if (s.kind === "run") {
                if (!(await isRegular(path.join(dir, "request.json")))) {
                    throw new RunspoolError(`run ${id} was launched by another host (pi-subagents), not by runspool; runspool never writes into it: ` +
                        "stop it from the host that launched it", "RUNSPOOL_NOT_OURS", dir);
                }
                if (!isActiveState(s.state))
                    return { outcome: "ended", runId: id, status: s };
            }
            // Queued, running, or mid-claim (request.json, status.json to follow):
            // the daemon reads the inbox while the run is queued, the runner at its start.
            const ts = Date.now();
            const body = { type: "stop", ts, source: "runspool-client" };
            if (reason !== undefined)
                body.reason = reason;
            const control = await subdir(dir, "control");
            const inbox = await subdir(control, "stop-requests");
            const name = `${String(ts).padStart(13, "0")}-${randomUUID()}.json`;
            const file = await writeAtomic(inbox, name, Buffer.from(JSON.stringify(body), "utf8"));
            return { outcome: "requested", runId: id, file };
        }
    }
    /**
     * Runs from the indexes, like `runspool list --json`: active runs
     * (oldest claim first), then the most recent terminal ones (newest
     * first). Stale index entries are skipped, never removed: the indexes
     * are the daemon's to repair.
     */
    async list(options = {}) {
        if (options.active && options.recent !== undefined) {
            throw new RunspoolError("list: `active` and `recent` exclude each other; pass one", "RUNSPOOL_INVALID_ARGUMENT");
        }
        const out = [];
        if (options.recent === undefined) {
            out.push(...(await this.listActive(options.session)));
        }
        if (!options.active) {
            out.push(...(await this.listRecent(options.session, options.recent ?? DEFAULT_RECENT)));
        }
        return out;
    }
    async listed(s) {
        const ours = (await isRegular(path.join(this.runDir(s.runId), "request.json"))) ||
            (s.state === "rejected" && s.launchedBy === "runspool");
        return { ...s, launchedBy: ours ? "runspool" : "other" };
    }
    async listActive(session) {
        const dir = path.join(this.runsDir, ".active-runs");
        let names;
        try {
            names = await fsp.readdir(dir);
        }
        catch (e) {
            if (errno(e) === "ENOENT")
                return [];
            throw new RunspoolError(`cannot read ${dir}: ${e.message}`, "RUNSPOOL_IO", dir, { cause: e });
        }
        const out = [];
        for (const n of names) {
            if (!isRunDirName(n) || !(await isRegular(path.join(dir, n))))
                continue;
            const s = await this.runStatus(n).catch(() => undefined);
            if (!s || !isActiveState(s.state))
                continue;
            if (session !== undefined && s.sessionId !== session)
                continue;
            out.push(await this.listed(s));
        }
        const claimed = (s) => (typeof s.queue?.claimedAt === "number" ? s.queue.claimedAt : 0);
        out.sort((a, b) => claimed(a) - claimed(b) || (a.runId < b.runId ? -1 : a.runId > b.runId ? 1 : 0));
        return out;
    }
    async listRecent(session, limit) {
        const terminal = path.join(this.runsDir, ".terminal-runs");
        let sessions;
        if (session !== undefined) {
            const s = await seg(session);
            sessions = s ? [s] : [];
        }
        else {
            try {
                sessions = [];
                for (const e of await fsp.readdir(terminal, { withFileTypes: true })) {
                    if (e.isDirectory())
                        sessions.push(e.name);
                }
            }
            catch (e) {
                if (errno(e) === "ENOENT")
                    return [];
                throw new RunspoolError(`cannot read ${terminal}: ${e.message}`, "RUNSPOOL_IO", terminal, {
                    cause: e,
                });
            }
        }
        const markers = [];
        for (const sd of sessions) {
            let names = [];
            try {
                names = await fsp.readdir(path.join(terminal, sd));
            }
            catch {
                continue;
            }
            for (const name of names) {
                if (!name.startsWith(".") && /^\d{16}-.*\.json$/.test(name))
                    markers.push({ name, session: sd });
            }
        }
        // Names start with the zero-padded end time: descending name order is newest first.
        markers.sort((a, b) => (a.name < b.name ? 1 : a.name > b.name ? -1 : 0));
        const seen = new Set();
        const out = [];
        for (const m of markers) {
            if (out.length >= limit)
                break;
            const s = await this.validMarker(path.join(terminal, m.session, m.name), m.session, m.name);
            if (!s || seen.has(s.runId))
                continue;
            seen.add(s.runId);
            out.push(await this.listed(s));
        }
        return out;
    }
    /** A terminal marker checked against its run's status (PROTOCOL §6.2); undefined when stale or unreadable. */
    async validMarker(file, sessionDir, name) {
        try {
            const m = await readJsonObject(file, MAX_MARKER_BYTES);
            // A marker is a hint, never a path: only an id of the grammar is looked up.
            if (!m || typeof m.runId !== "string" || !isRunDirName(m.runId))
                return undefined;
            const s = await this.runStatus(m.runId);
            if (!s || isActiveState(s.state))
                return undefined;
            if (await isRegular(path.join(this.runDir(s.runId), "request.json"))) {
                const ended = Math.floor(Math.max(0, typeof s.endedAt === "number" ? s.endedAt : -1));
                const ok = m.version === 1 &&
                    typeof s.sessionId === "string" &&
                    m.sessionId === s.sessionId &&
                    m.endedAt === ended &&
                    typeof s.endedAt === "number" &&
                    sessionDir === (await seg(s.sessionId)) &&
                    name === `${String(ended).padStart(16, "0")}-${await seg(s.runId)}.json`;
                if (!ok)
                    return undefined;
            }
            return s;
        }
        catch {
            return undefined;
        }
    }
    /**
     * Every run's events (PROTOCOL §5), each line exactly once: per run, the
     * client keeps the offset it has read events.jsonl to and yields complete
     * lines only, so a line being appended comes whole on a later look. Runs
     * that start while it follows are picked up from their first event.
     * Order: file order within a run; across runs, the order of the looks.
     * Lines that are not JSON objects with a string `type`, that name
     * another run, or are over 1 MiB are skipped. Without `follow`, ends
     * after one pass over what is written.
     */
    async *events(options = {}) {
        const cursors = new Map();
        const decoder = new TextDecoder("utf-8");
        for (;;) {
            if (options.signal?.aborted)
                throw abortError(options.signal);
            let names = [];
            try {
                // Run directories only: a link in the runs root is never followed.
                names = (await fsp.readdir(this.runsDir, { withFileTypes: true }))
                    .filter((e) => e.isDirectory())
                    .map((e) => e.name);
            }
            catch (e) {
                if (errno(e) !== "ENOENT") {
                    throw new RunspoolError(`cannot read ${this.runsDir}: ${e.message}`, "RUNSPOOL_IO", this.runsDir, {
                        cause: e,
                    });
                }
            }
            for (const id of names) {
                if (!isRunDirName(id))
                    continue; // dot names: indexes, tombstones, temps
                const file = path.join(this.runsDir, id, "events.jsonl");
                const st = await lstatOrUndefined(file).catch(() => undefined);
                if (!st || !st.isFile())
                    continue;
                let c = cursors.get(id);
                if (c && c.dev === st.dev && c.ino === st.ino && st.size <= c.offset)
                    continue;
                if (!c || c.dev !== st.dev || c.ino !== st.ino) {
                    // A new file (a new run of that name): from its start.
                    c = { dev: st.dev, ino: st.ino, offset: 0, skipping: false };
                    cursors.set(id, c);
                }
                let fh;
                try {
                    fh = await openRegular(file);
                }
                catch {
                    continue;
                }
                if (!fh)
                    continue;
                try {
                    const fst = await fh.stat();
                    if (fst.dev !== c.dev || fst.ino !== c.ino)
                        continue; // swapped since the lstat: next look
                    while (c.offset < fst.size) {
                        const data = await readAt(fh, c.offset, Math.min(READ_CHUNK, fst.size - c.offset));
                        if (data.length === 0)
                            break;
                        let pos = 0;
                        let nl;
                        while ((nl = data.indexOf(10, pos)) >= 0) {
                            const line = data.subarray(pos, nl);
                            pos = nl + 1;
                            if (c.skipping) {
                                c.skipping = false;
                                continue;
                            }
                            const ev = parseEvent(decoder.decode(line), id);
                            if (ev && (options.since === undefined || ev.ts >= options.since))
                                yield ev;
                        }
                        if (pos === 0 && data.length >= MAX_LINE_BYTES) {
                            // A line over the cap: skip it whole.
                            c.skipping = true;
                            c.offset += data.length;
                            continue;
                        }
                        c.offset += pos;
                        if (pos < data.length)
                            break; // an incomplete last line: whole on a later look
                    }
                }
                finally {
                    await fh.close().catch(() => undefined);
                }
            }
            if (!options.follow)
                return;
            await sleep(Math.max(this.pollIntervalMs, 100), options.signal);
        }
    }
    /** daemon.json (PROTOCOL §10) and whether its pid is alive here; undefined when there is none. */
    async daemon() {
        const v = await readJsonObject(path.join(this.root, "runspool", "daemon.json"), MAX_SMALL_JSON);
        if (!v)
            return undefined;
        let alive = false;
        if (typeof v.pid === "number" && Number.isInteger(v.pid) && v.pid > 0 && v.hostname === os.hostname()) {
            try {
                process.kill(v.pid, 0);
                alive = true;
            }
            catch (e) {
                alive = errno(e) === "EPERM";
            }
        }
        return { ...v, alive };
    }
}
function checkId(id, ok, what) {
    if (typeof id !== "string" || !ok) {
        throw new RunspoolError(`${what} ${JSON.stringify(id)} is not in the run-id grammar [A-Za-z0-9][A-Za-z0-9._-]* (at most 128 characters in a request)`, "RUNSPOOL_INVALID_ARGUMENT");
    }
}
/** One events.jsonl line as an event of run `id`, or undefined to skip it. */
function parseEvent(text, id) {
    let v;
    try {
        v = JSON.parse(text);
    }
    catch {
        return undefined;
    }
    if (typeof v !== "object" || v === null || Array.isArray(v))
        return undefined;
    const o = v;
    if (typeof o.type !== "string")
        return undefined;
    if (o.runId !== undefined && o.runId !== id)
        return undefined;
    return { ...o, runId: id, type: o.type, ts: typeof o.ts === "number" ? o.ts : 0 };
}
function fromArgv(argv, opts) {
    if (argv.length === 0 || !argv.every((a) => typeof a === "string")) {
        throw new RunspoolError("submit: the command must be a non-empty array of strings, e.g. [\"make\", \"test\"]", "RUNSPOOL_INVALID_REQUEST");
    }
    if (argv[0] === "") {
        throw new RunspoolError("submit: the command's argv0 (its first element) is empty", "RUNSPOOL_INVALID_REQUEST");
    }
    const runId = opts.runId ?? randomUUID();
    checkId(runId, isRequestRunId(runId), "submit: runId");
    const step = { command: [...argv] };
    if (opts.agent !== undefined)
        step.agent = opts.agent;
    const req = { version: 1, runId, cwd: path.resolve(opts.cwd ?? process.cwd()), steps: [step] };
    const optional = [
        "sessionId",
        "toolCallId",
        "completionOwnerId",
        "env",
        "timeoutMs",
        "priority",
    ];
    for (const k of optional) {
        if (opts[k] !== undefined)
            req[k] = opts[k];
    }
    return req;
}
function fromRequest(request, opts) {
    if (typeof request !== "object" || request === null) {
        throw new RunspoolError("submit: pass a command (array of strings) or a request object", "RUNSPOOL_INVALID_REQUEST");
    }
    const extra = Object.keys(opts).filter((k) => k !== "runId" && opts[k] !== undefined);
    if (extra.length) {
        throw new RunspoolError(`submit: with a whole request, only the runId option applies (got ${extra.join(", ")}): set those fields in the request`, "RUNSPOOL_INVALID_ARGUMENT");
    }
    if (request.runId !== undefined && opts.runId !== undefined && request.runId !== opts.runId) {
        throw new RunspoolError(`submit: the request has runId \`${String(request.runId)}\` but the runId option says \`${opts.runId}\`; drop one`, "RUNSPOOL_INVALID_ARGUMENT");
    }
    const runId = request.runId ?? opts.runId ?? randomUUID();
    checkId(runId, isRequestRunId(runId), "submit: runId");
    return { version: 1, ...request, runId };
}
