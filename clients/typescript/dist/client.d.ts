/**
 * The client: runspool through its files only (PROTOCOL §1-§9). It never
 * talks to the daemon, and needs no daemon to publish a request: one
 * started later claims it.
 */
import type { DaemonInfo, ListedRun, Request, RunEvent, RunStatus, Status, StopResult, SubmitOptions } from "./types.js";
/** A request is at most 1 MiB (PROTOCOL §2.2). */
export declare const MAX_REQUEST_BYTES: number;
/** A run id as a request may set it (PROTOCOL §2.2). */
export declare function isRequestRunId(s: unknown): s is string;
/** queued and running are active; every other state (also another host's) is terminal. */
export declare function isActiveState(state: string): boolean;
/** The root as PROTOCOL §1 resolves it, without a `--root`: RUNSPOOL_ROOT, PI_SUBAGENTS_TEMP_ROOT, else `<TMPDIR or /tmp>/pi-subagents-uid-<uid>`. */
export declare function defaultRoot(env?: Record<string, string | undefined>): string;
export interface ClientOptions {
    /** The runspool root; default as PROTOCOL §1 (RUNSPOOL_ROOT, PI_SUBAGENTS_TEMP_ROOT, `<TMPDIR>/pi-subagents-uid-<uid>`). */
    root?: string;
    /** How often waits and follows look at the files, ms (default 50). */
    pollIntervalMs?: number;
}
export interface WaitOptions {
    /** Give up after this long with a WaitTimeoutError (the run goes on). Default: wait for ever. */
    timeoutMs?: number;
    signal?: AbortSignal;
}
export interface FollowOptions {
    signal?: AbortSignal;
}
export interface StopOptions {
    /**
     * For a request still in the spool: how long to wait for the daemon to
     * claim it (the stop goes into its run's inbox), ms; default 30000.
     */
    claimTimeoutMs?: number;
    signal?: AbortSignal;
}
export interface ListOptions {
    /** Only active (queued or running) runs. */
    active?: boolean;
    /** Only the N most recent terminal runs. Default (without `active`): active runs, then the 20 most recent terminal ones. */
    recent?: number;
    /** Only runs of this session. */
    session?: string;
}
export interface EventsOptions {
    /** Only events whose `ts` is at or after this time (ms since the epoch). */
    since?: number;
    /** Keep going: yield events as runs write them, until the loop breaks or `signal` aborts. */
    follow?: boolean;
    signal?: AbortSignal;
}
export declare class Client {
    /** The root directory (absolute). */
    readonly root: string;
    readonly pollIntervalMs: number;
    constructor(options?: ClientOptions);
    get spoolDir(): string;
    get rejectedDir(): string;
    get runsDir(): string;
    get resultsDir(): string;
    /** `<runs>/<id>`: only for an id of the run-id grammar (never a path from a file). */
    runDir(id: string): string;
    /**
     * Publish a request (PROTOCOL §2.1): a command line (`["make", "test"]`)
     * with `opts`, or a whole request object. Returns its run id. The file
     * appears complete (dot temp + rename, mode 0600); no daemon is needed
     * for this, one claims it when it runs.
     */
    submit(argvOrRequest: readonly string[] | Request, opts?: SubmitOptions): Promise<string>;
    /** PROTOCOL §1: the root, spool/ and the runs root, when they exist, are real directories of ours nobody else can write. */
    private checkLayout;
    /**
     * Where the request or run `id` is: `pending` while in the spool,
     * `claimed` between the claim and its first status.json, the run's
     * status.json (`kind: "run"`) once written, `refused` (state `rejected`
     * or `withdrawn`) from the error file of a request that never got a run
     * directory. A NotFoundError when none of them exists.
     */
    status(id: string): Promise<Status>;
    /** `spool/<id>.json`, the name `submit` (and `runspool submit`) publishes under. */
    private pendingEntry;
    /** A request published by another client under another name whose body says `runId: id`. */
    private pendingByBody;
    /**
     * The run's status.json, undefined while it has none. Refused: a run
     * directory that is a link, and a status naming another run.
     */
    private runStatus;
    /** The error file `spool/rejected/<id>.error.json` of a request refused or withdrawn before it had a run. */
    private refusal;
    /** The RejectedError of a refused request or a `rejected` run. */
    private rejection;
    /**
     * Wait until the run ends; resolves with its final status.json. Rejects
     * with RejectedError when the request was refused or withdrawn, with
     * WaitTimeoutError after `timeoutMs` (the run goes on).
     */
    wait(id: string, options?: WaitOptions): Promise<RunStatus>;
    /** Where `s` is, for messages. */
    private whereIs;
    /**
     * The run's output (every step's `output-<i>.log`), line by line as it is
     * written, until the run ends. A request still in the spool is waited on
     * through its claim; a refused one throws RejectedError. Lines are
     * decoded as UTF-8 (invalid bytes become U+FFFD), without their newline;
     * a line longer than 1 MiB comes in 1 MiB pieces; the last line of a step
     * without a final newline comes once the run has ended.
     */
    follow(id: string, options?: FollowOptions): AsyncGenerator<string, void, undefined>;
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
    stop(id: string, reason?: string, options?: StopOptions): Promise<StopResult>;
    /**
     * Runs from the indexes, like `runspool list --json`: active runs
     * (oldest claim first), then the most recent terminal ones (newest
     * first). Stale index entries are skipped, never removed: the indexes
     * are the daemon's to repair.
     */
    list(options?: ListOptions): Promise<ListedRun[]>;
    private listed;
    private listActive;
    private listRecent;
    /** A terminal marker checked against its run's status (PROTOCOL §6.2); undefined when stale or unreadable. */
    private validMarker;
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
    events(options?: EventsOptions): AsyncGenerator<RunEvent, void, undefined>;
    /** daemon.json (PROTOCOL §10) and whether its pid is alive here; undefined when there is none. */
    daemon(): Promise<DaemonInfo | undefined>;
}
