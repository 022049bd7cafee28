// Drives a runspool root with pi-subagents' own TypeScript modules.
//
// Usage: node driver.mjs <action> '<json argument>'
// Environment: PI_SUBAGENTS_INSTALL_DIR is the directory where
// `npm install pi-subagents@<version>` ran (it holds node_modules/pi-subagents
// and node_modules/jiti). The modules are loaded from that package by path
// through jiti, exactly as a pi host would run them.
//
// One action per invocation. The result is one JSON value on stdout. On
// failure the exit status is 1 and stderr holds one JSON object
// {"error": message, "code"?: code} (code is set for pi's
// ExternalJobProviderError, e.g. "bridge-timeout").

import { createRequire } from "node:module";
import * as fs from "node:fs";
import * as path from "node:path";
import { pathToFileURL } from "node:url";
import { randomUUID } from "node:crypto";

// PI_DRIVER_NOW_MS freezes Date.now (pi's clock) at that instant, so a test
// can compare what pi writes with what runspool writes at the same time.
if (process.env.PI_DRIVER_NOW_MS) {
	const frozen = Number(process.env.PI_DRIVER_NOW_MS);
	Date.now = () => frozen;
}

const installDir = process.env.PI_SUBAGENTS_INSTALL_DIR;
if (!installDir) fail(new Error("PI_SUBAGENTS_INSTALL_DIR is not set"));
const pkgDir = path.join(installDir, "node_modules", "pi-subagents");
const require = createRequire(path.join(installDir, "package.json"));

let jiti;
async function pi(relative) {
	if (!jiti) {
		const { createJiti } = await import(pathToFileURL(require.resolve("jiti")).href);
		jiti = createJiti(import.meta.url, { fsCache: path.join(installDir, ".jiti-cache") });
	}
	return jiti.import(path.join(pkgDir, relative));
}

function fail(error) {
	const out = { error: error instanceof Error ? error.message : String(error) };
	if (error && typeof error === "object" && typeof error.code === "string") out.code = error.code;
	process.stderr.write(`${JSON.stringify(out)}\n`);
	process.exit(1);
}

function print(value) {
	process.stdout.write(`${JSON.stringify(value === undefined ? null : value)}\n`);
}

// A run directory as a pi host leaves it: status.json through pi's atomic
// writer, the active marker (and tool-call alias) through pi's index, and for
// terminal states the terminal marker and the result file through pi's own
// writers. `spec`: {asyncDirRoot, resultsDir, runId, sessionId, toolCallId,
// state, mode, pid?, steps?, extra?}.
async function writePiRun(spec) {
	const { writeAtomicJson } = await pi("src/shared/atomic-json.ts");
	const { updateActiveRunIndex } = await pi("src/runs/background/active-run-index.ts");
	const { writeAsyncResultFile, resultFilePath } = await pi("src/runs/background/result-files.ts");
	const { state, mode = "chain", runId, sessionId, toolCallId } = spec;
	const asyncDir = path.join(spec.asyncDirRoot, runId);
	const now = Date.now();
	const startedAt = now - 60_000;
	const active = state === "queued" || state === "running";
	fs.mkdirSync(asyncDir, { recursive: true });
	const steps = spec.steps ?? [
		{ agent: "scout", status: "completed", startedAt, endedAt: startedAt + 20_000, durationMs: 20_000, exitCode: 0, model: "anthropic/claude-sonnet-4", tokens: { input: 1200, output: 340, total: 1540 }, piStepFutureField: { kept: true } },
		active
			? { agent: "worker", status: "running", startedAt: startedAt + 20_000, activityState: "active", lastActivityAt: now - 1000, currentTool: "bash", recentOutput: ["working"] }
			: { agent: "worker", status: state === "partial" ? "failed" : state, startedAt: startedAt + 20_000, endedAt: now - 500, durationMs: 39_500, exitCode: state === "paused" ? 0 : 1, error: `worker ended ${state}` },
	];
	const status = {
		lifecycleArtifactVersion: 3,
		runId,
		sessionId,
		toolCallId,
		completionOwnerId: `owner-${sessionId}`,
		mode,
		state,
		steering: { requested: 0, scheduled: 0, pending: 0, delivered: 0, failed: 0, recovered: 0, recent: [] },
		lastActivityAt: now - 1000,
		startedAt,
		lastUpdate: active ? now : now - 500,
		...(active ? {} : { endedAt: now - 500 }),
		...(spec.pid !== undefined ? { pid: spec.pid } : {}),
		cwd: spec.cwd ?? spec.asyncDirRoot,
		currentStep: active ? 1 : steps.length - 1,
		chainStepCount: steps.length,
		steps,
		outputFile: path.join(asyncDir, "output-1.log"),
		piHostFutureField: { note: "unknown to runspool; must survive byte for byte", n: 7 },
		...(spec.extra ?? {}),
	};
	fs.writeFileSync(path.join(asyncDir, "output-1.log"), `pi run ${runId} output\n`);
	fs.appendFileSync(path.join(asyncDir, "events.jsonl"), `${JSON.stringify({ type: "subagent.run.started", ts: startedAt, runId, mode, lifecycleArtifactVersion: 3 })}\n`);
	// The launch writes a running status and its active marker first, as pi does.
	writeAtomicJson(path.join(asyncDir, "status.json"), active ? status : { ...status, state: "running", endedAt: undefined });
	updateActiveRunIndex(asyncDir, "running", toolCallId);
	if (active) return { asyncDir, status };
	writeAtomicJson(path.join(asyncDir, "status.json"), status);
	fs.appendFileSync(path.join(asyncDir, "events.jsonl"), `${JSON.stringify({ type: "subagent.run.completed", ts: now - 500, runId, status: state })}\n`);
	// Releases the active marker and aliases, then writes the terminal marker.
	updateActiveRunIndex(asyncDir, state, toolCallId);
	const resultPath = resultFilePath(spec.resultsDir, runId);
	const written = writeAsyncResultFile(resultPath, {
		id: runId,
		runId,
		agent: steps[steps.length - 1].agent,
		mode,
		sessionId,
		toolCallId,
		completionOwnerId: `owner-${sessionId}`,
		success: state === "complete",
		state,
		summary: `pi run ${runId} ended ${state}`,
		results: steps.map((step) => ({ agent: step.agent, output: "", success: step.status === "completed" || step.status === "complete", ...(step.error ? { error: step.error } : {}) })),
		exitCode: state === "complete" ? 0 : 1,
		timestamp: now - 500,
		durationMs: 59_500,
		asyncDir,
	});
	return { asyncDir, status, resultPath, resultState: written.state };
}

async function withDeadline(promise, ms, what) {
	let timer;
	const deadline = new Promise((_, reject) => {
		timer = setTimeout(() => reject(Object.assign(new Error(`${what}: no answer within ${ms} ms`), { code: "driver-deadline" })), ms);
	});
	try {
		return await Promise.race([promise, deadline]);
	} finally {
		clearTimeout(timer);
	}
}

const actions = {
	// Load every module the other actions use, so jiti's transform cache is
	// filled once (under the installer's lock) instead of by parallel tests.
	async warm() {
		for (const m of ["src/shared/utils.ts", "src/shared/atomic-json.ts", "src/runs/background/async-status.ts", "src/runs/background/active-run-index.ts", "src/runs/background/terminal-run-index.ts", "src/runs/background/result-files.ts", "src/runs/background/stale-run-reconciler.ts", "src/runs/background/control-channel.ts", "src/runs/shared/external-job-bridge.ts"]) await pi(m);
		return { ok: true };
	},
	async readStatus(a) {
		const { readStatus } = await pi("src/shared/utils.ts");
		return readStatus(a.asyncDir);
	},
	async readActiveRunIndex(a) {
		const { readActiveRunIndex } = await pi("src/runs/background/active-run-index.ts");
		return readActiveRunIndex(a.asyncDirRoot) ?? null;
	},
	async readRecentTerminalRunIndex(a) {
		const { readRecentTerminalRunIndex } = await pi("src/runs/background/terminal-run-index.ts");
		return readRecentTerminalRunIndex(a.asyncDirRoot, a.options ?? {});
	},
	async listAsyncRuns(a) {
		const { listAsyncRuns } = await pi("src/runs/background/async-status.ts");
		return listAsyncRuns(a.asyncDirRoot, a.options ?? {});
	},
	async resultPayloadPathForSessionRun(a) {
		const { resultPayloadPathForSessionRun } = await pi("src/runs/background/result-files.ts");
		return resultPayloadPathForSessionRun(a.resultsDir, a.sessionId, a.runId) ?? null;
	},
	// Result files indexed under a tool call (bare names, as pi reads them).
	async resultFilesForToolCall(a) {
		const { resultFilesForToolCall } = await pi("src/runs/background/result-files.ts");
		return resultFilesForToolCall(a.resultsDir, a.toolCallId);
	},
	async resultPayloadPathForIndexedRun(a) {
		const { resultPayloadPathForIndexedRun } = await pi("src/runs/background/result-files.ts");
		return resultPayloadPathForIndexedRun(a.resultsDir, a.runId) ?? null;
	},
	async reconcileAsyncRun(a) {
		const { reconcileAsyncRun } = await pi("src/runs/background/stale-run-reconciler.ts");
		return reconcileAsyncRun(a.asyncDir, { resultsDir: a.resultsDir });
	},
	// reconcileAsyncRun on each of `asyncDirs` in order; a throw is reported
	// per run ({error}), as a pi host logs it and goes on.
	async reconcileAll(a) {
		const { reconcileAsyncRun } = await pi("src/runs/background/stale-run-reconciler.ts");
		return a.asyncDirs.map((asyncDir) => {
			try {
				const r = reconcileAsyncRun(asyncDir, { resultsDir: a.resultsDir });
				return { repaired: r.repaired, state: r.status?.state ?? null };
			} catch (error) {
				return { error: error instanceof Error ? error.message : String(error) };
			}
		});
	},
	// A result as pi's runner publishes it (pending, indexes, promotion).
	async writeResult(a) {
		const { writeAsyncResultFile, resultFilePath } = await pi("src/runs/background/result-files.ts");
		return writeAsyncResultFile(resultFilePath(a.resultsDir, a.runId), a.data);
	},
	async requestAsyncStop(a) {
		const { requestAsyncStop } = await pi("src/runs/background/control-channel.ts");
		return { requestPath: requestAsyncStop(a.asyncDir, a.payload ?? {}) };
	},
	// Awaits the bridge response. `timeoutMs` is pi's own deadline (pi applies
	// it to status/result/reattach only: start and follow-up wait forever), so
	// `waitMs` bounds the whole call.
	async requestExternalJobOperation(a) {
		const { requestExternalJobOperation } = await pi("src/runs/shared/external-job-bridge.ts");
		const result = await withDeadline(
			requestExternalJobOperation(a.asyncDir, a.request, a.timeoutMs ?? 60_000),
			a.waitMs ?? 90_000,
			`${a.request.operation} for provider ${a.request.provider}`,
		);
		return { result };
	},
	// pi's retention pass (cleanupAsyncRetention) as a pi host runs it, with
	// its clock moved by `nowOffsetMs`. With `waitOnRunId`, a wait
	// subscription for that run appears right after the pass picked its
	// first tombstone name (its second randomId), so that run passes the
	// first check on the pass's old wait set and fails the recheck on the
	// fresh one: pi renames its tombstone back (the keep-after-recheck path).
	async cleanupAsyncRetention(a) {
		const { cleanupAsyncRetention } = await pi("src/runs/background/async-retention.ts");
		const offset = a.nowOffsetMs ?? 0;
		let calls = 0;
		const randomId = () => {
			calls += 1;
			if (calls === 2 && a.waitOnRunId) {
				const dir = path.join(path.dirname(a.asyncDirRoot), "wait-subscriptions");
				fs.mkdirSync(dir, { recursive: true });
				fs.writeFileSync(path.join(dir, "driver-wait.json"), JSON.stringify({ runId: a.waitOnRunId, expiresAt: Date.now() + 3_600_000 }));
			}
			return randomUUID();
		};
		return cleanupAsyncRetention({ asyncDirRoot: a.asyncDirRoot, resultsDir: a.resultsDir, now: () => Date.now() + offset, randomId });
	},
	// What a pi retention pass killed between its rename and its removal
	// leaves: the tombstone marker (written first, as pi does) and the run
	// renamed to `.deleting-run-<uuid>`.
	async leaveRunTombstone(a) {
		const { writeAtomicJson } = await pi("src/shared/atomic-json.ts");
		const { encodeIndexSegment } = await pi("src/runs/background/index-segment.ts");
		const tombstonePath = path.join(a.asyncDirRoot, `.deleting-run-${randomUUID()}`);
		const marker = path.join(path.dirname(a.asyncDirRoot), "async-retention-run-tombstones", `${encodeIndexSegment(a.runId)}.json`);
		fs.mkdirSync(path.dirname(marker), { recursive: true });
		writeAtomicJson(marker, { version: 1, runId: a.runId, tombstonePath, createdAt: Date.now() });
		fs.renameSync(path.join(a.asyncDirRoot, a.runId), tombstonePath);
		return { tombstonePath, marker };
	},
	writePiRun,
};

const [action, arg] = process.argv.slice(2);
try {
	if (!actions[action]) throw new Error(`unknown action '${action}'`);
	print(await actions[action](JSON.parse(arg ?? "{}")));
	process.exit(0);
} catch (error) {
	fail(error);
}
