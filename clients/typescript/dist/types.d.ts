/**
 * The shapes the client reads and writes (PROTOCOL §2.2, §4, §5, §2.3).
 * Files are other programs' words: every field is optional unless the
 * client checked it, and unknown fields are kept.
 */
/** A plain step: a command run in its own process group. */
export interface CommandStep {
    agent?: string;
    command: string[];
    cwd?: string;
    env?: Record<string, string>;
    timeoutMs?: number;
}
/** A step run by an external job engine the daemon has configured (PROTOCOL §8). */
export interface ExternalJobStep {
    agent?: string;
    externalJob: {
        provider: string;
        prompt: string;
        options?: Record<string, unknown>;
    };
    timeoutMs?: number;
}
export type Step = CommandStep | ExternalJobStep;
/** A group of steps run at once. */
export interface ParallelGroup {
    parallel: Step[];
    concurrency?: number;
}
/** A launch request as published in the spool (PROTOCOL §2.2). */
export interface Request {
    version?: 1;
    runId?: string;
    sessionId?: string;
    toolCallId?: string;
    completionOwnerId?: string;
    cwd: string;
    env?: Record<string, string>;
    timeoutMs?: number;
    priority?: number;
    steps: Array<Step | ParallelGroup>;
    /** Fields of later protocol versions, passed through as they are (the daemon refuses those it does not know). */
    [field: string]: unknown;
}
/** The options of `submit` for a command line (for a whole request, only `runId`). */
export interface SubmitOptions {
    /** The run id, `[A-Za-z0-9][A-Za-z0-9._-]{0,127}`; default a new UUID. */
    runId?: string;
    /** Working directory (absolute, or resolved against process.cwd()); default process.cwd(). */
    cwd?: string;
    env?: Record<string, string>;
    sessionId?: string;
    toolCallId?: string;
    completionOwnerId?: string;
    /** The step's label. */
    agent?: string;
    /** The run's time limit; default the daemon's `default_timeout_ms`. */
    timeoutMs?: number;
    /** -1000 to 1000, higher first. */
    priority?: number;
}
/** The states runspool writes; other hosts (pi-subagents) may write others. */
export type RunState = "queued" | "running" | "complete" | "failed" | "paused" | "stopped" | "rejected";
export interface StepStatus {
    agent?: string;
    status?: string;
    startedAt?: number;
    endedAt?: number;
    durationMs?: number;
    exitCode?: number;
    signal?: string;
    error?: string;
    timedOut?: boolean;
    stopped?: boolean;
    pid?: number;
    outputFile?: string;
    externalJob?: Record<string, unknown>;
    [field: string]: unknown;
}
/** A run's status.json (PROTOCOL §4), with `kind: "run"`. */
export interface RunStatus {
    kind: "run";
    runId: string;
    state: RunState | (string & {});
    sessionId?: string;
    toolCallId?: string;
    completionOwnerId?: string;
    mode?: string;
    startedAt?: number;
    lastUpdate?: number;
    endedAt?: number;
    timeoutMs?: number;
    deadlineAt?: number;
    timedOut?: boolean;
    stopped?: boolean;
    error?: string;
    exitCode?: number;
    pid?: number;
    runner?: {
        pid?: number;
        hostname?: string;
        startIdentity?: string;
        processInstanceId?: string;
    };
    cwd?: string;
    currentStep?: number;
    chainStepCount?: number;
    queue?: {
        priority?: number;
        claimedAt?: number;
    };
    outputFile?: string;
    steps: StepStatus[];
    /** Why a queued run waits (PROTOCOL §15). */
    waiting?: string;
    [field: string]: unknown;
}
/** A request still in the spool: no daemon has claimed it yet. */
export interface PendingStatus {
    kind: "pending";
    state: "pending";
    runId: string;
    /** Its file in the spool. */
    spoolFile: string;
    /** When it was published (the file's mtime), ms since the epoch. */
    publishedAt: number;
}
/** Claimed a moment ago: its run directory holds request.json, status.json follows. */
export interface ClaimedStatus {
    kind: "claimed";
    state: "claimed";
    runId: string;
    runDir: string;
}
/** Refused by the daemon, or withdrawn, before any run directory existed: its error file. */
export interface RefusedStatus {
    kind: "refused";
    state: "rejected" | "withdrawn";
    runId: string;
    code: string;
    message: string;
    errorFile: string;
    rejectedAt?: number;
}
export type Status = PendingStatus | ClaimedStatus | RefusedStatus | RunStatus;
/** One line of a run's events.jsonl (PROTOCOL §5); `runId` is always its run directory's name. */
export interface RunEvent {
    type: string;
    ts: number;
    runId: string;
    [field: string]: unknown;
}
/** A run from the indexes (`list`), as `runspool list --json` shows it. */
export type ListedRun = RunStatus & {
    /** "runspool" when runspool claimed it, "other" for another host's run (pi-subagents), read only. */
    launchedBy: "runspool" | "other";
};
/** What `stop` did. */
export type StopResult = {
    /** A stop request is in the run's control inbox; the daemon or runner acts on it. */
    outcome: "requested";
    runId: string;
    file: string;
} | {
    /** The run had already ended: nothing was written. */
    outcome: "ended";
    runId: string;
    status: RunStatus;
};
/** daemon.json (PROTOCOL §10), with whether its pid is alive. */
export interface DaemonInfo {
    pid?: number;
    hostname?: string;
    startedAt?: number;
    updatedAt?: number;
    runspoolVersion?: string;
    watch?: {
        strategy?: string;
        backend?: string;
        reason?: string;
    };
    storage?: {
        state?: string;
        reason?: string;
        since?: number;
    };
    runs?: {
        queued?: number;
        running?: number;
    };
    /** Its pid answers signal 0 on this host (a hint: pids are reused). */
    alive: boolean;
    [field: string]: unknown;
}
