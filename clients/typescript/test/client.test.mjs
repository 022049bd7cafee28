// The client's API against a real daemon: rejections, timeouts, stop,
// list, every event exactly once, hostile files, root resolution.

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";

import {
	Client,
	NotFoundError,
	RejectedError,
	RunspoolError,
	UnsafeFileError,
	WaitTimeoutError,
	defaultRoot,
} from "../dist/index.js";
import { collect, errorLines, sleep, startDaemon, tempDir, until } from "./helpers.mjs";

describe("against a daemon", () => {
	let d;
	let c;
	before(async () => {
		d = await startDaemon({ label: "client", config: "max_running = 8\n" });
		c = d.client;
	});
	after(async () => {
		await d?.stop();
	});

	test("a refused request rejects wait and follow with RejectedError and its code", async () => {
		// An unknown top-level field: refused, never silently ignored (PROTOCOL §2.2).
		const bad = await c.submit({ cwd: "/", steps: [{ command: ["true"] }], bogus: 1 });
		await assert.rejects(c.wait(bad, { timeoutMs: 60_000 }), (e) => {
			assert.ok(e instanceof RejectedError && e instanceof RunspoolError);
			assert.equal(e.code, "invalid-field");
			assert.equal(e.runId, bad);
			assert.match(e.reason, /bogus/);
			assert.match(e.message, /spool\/rejected\/.*\.error\.json/);
			return true;
		});
		await assert.rejects(collect(c.follow(bad)), (e) => e instanceof RejectedError && e.code === "invalid-field");
		await assert.rejects(c.stop(bad), (e) => e instanceof RejectedError && e.code === "invalid-field");
		const s = await c.status(bad);
		assert.equal(s.state, "rejected");

		const missing = await c.submit(["true"], { cwd: path.join(d.base, "no-such-dir") });
		await assert.rejects(c.wait(missing, { timeoutMs: 60_000 }), (e) => e instanceof RejectedError && e.code === "cwd-missing");
	});

	test("wait gives up with WaitTimeoutError and the run goes on; stop ends it", async () => {
		const id = await c.submit(["sleep", "60"]);
		await assert.rejects(c.wait(id, { timeoutMs: 300 }), (e) => {
			assert.ok(e instanceof WaitTimeoutError);
			assert.equal(e.runId, id);
			assert.equal(e.timeoutMs, 300);
			assert.ok(e.lastStatus, "the status seen last");
			return true;
		});
		await until("the run to start", async () => (await c.status(id)).state === "running");
		const r = await c.stop(id, "enough");
		assert.equal(r.outcome, "requested");
		assert.match(r.file, /control\/stop-requests\/\d{13}-[0-9a-f-]{36}\.json$/);
		const end = await c.wait(id, { timeoutMs: 60_000 });
		assert.equal(end.state, "stopped");
		assert.match(String(end.error), /enough/);
		// Stopping an ended run writes nothing.
		const again = await c.stop(id);
		assert.equal(again.outcome, "ended");
		assert.equal(again.status.state, "stopped");
	});

	test("status of an unknown run is a NotFoundError naming the root", async () => {
		await assert.rejects(c.status("no-such-run"), (e) => e instanceof NotFoundError && e.message.includes(d.root));
		await assert.rejects(c.status("../etc"), (e) => e instanceof RunspoolError && /run-id grammar/.test(e.message));
	});

	test("follow yields each step's lines, the last one without a newline too", async () => {
		const id = await c.submit({
			cwd: "/",
			steps: [{ command: ["sh", "-c", "echo a; echo b"] }, { command: ["sh", "-c", "printf 'c\\nd'"] }],
		});
		assert.deepEqual(await collect(c.follow(id)), ["a", "b", "c", "d"]);
		const s = await c.wait(id);
		assert.equal(s.state, "complete");
		assert.equal(s.mode, "chain");
	});

	test("list shows active runs, then the recent terminal ones, like runspool list", async () => {
		const done = await c.submit(["true"], { sessionId: "list-s" });
		await c.wait(done, { timeoutMs: 60_000 });
		const live = await c.submit(["sleep", "60"], { sessionId: "list-s" });
		await until("the run to be queued or running", async () => (await c.status(live)).kind === "run");
		const active = await c.list({ active: true });
		assert.ok(active.some((r) => r.runId === live && r.launchedBy === "runspool"));
		assert.ok(!active.some((r) => r.runId === done));
		const recent = await c.list({ recent: 50, session: "list-s" });
		assert.deepEqual(
			recent.map((r) => r.runId),
			[done],
		);
		const all = await c.list({ session: "list-s" });
		assert.deepEqual(
			all.map((r) => r.runId),
			[live, done],
		);
		// The CLI sees the same.
		const cli = JSON.parse(
			execFileSync(process.env.RUNSPOOL_BIN, ["--root", d.root, "list", "--session", "list-s", "--json"], {
				encoding: "utf8",
			}),
		);
		assert.deepEqual(
			cli.map((r) => r.runId),
			all.map((r) => r.runId),
		);
		await c.stop(live);
		await c.wait(live, { timeoutMs: 60_000 });
	});

	test("events: every line of every run exactly once, runs starting and ending while it follows", async () => {
		const ac = new AbortController();
		const seen = [];
		const following = (async () => {
			try {
				for await (const ev of c.events({ follow: true, signal: ac.signal })) seen.push(ev);
			} catch (e) {
				if (!ac.signal.aborted) throw e;
			}
		})();
		const ids = [];
		const submits = [];
		for (let i = 0; i < 40; i++) {
			const steps =
				i % 3 === 0
					? [{ parallel: [{ command: ["true"] }, { command: ["sh", "-c", "echo x"] }] }]
					: [{ command: ["sh", "-c", `echo ${i}`] }, { command: ["true"] }];
			submits.push(c.submit({ cwd: "/", sessionId: "events", steps }).then((id) => ids.push(id)));
			if (i % 10 === 9) await sleep(50);
		}
		await Promise.all(submits);
		const stopMe = await c.submit(["sleep", "60"], { sessionId: "events" });
		ids.push(stopMe);
		await c.stop(stopMe);
		for (const id of ids) await c.wait(id, { timeoutMs: 60_000 });
		const onDisk = (id) =>
			fs
				.readFileSync(path.join(c.runsDir, id, "events.jsonl"), "utf8")
				.split("\n")
				.filter((l) => l)
				.map((l) => JSON.parse(l));
		const mine = (id) => seen.filter((e) => e.runId === id);
		// The files may still grow a moment after the terminal status (indexes, results): compare once they agree.
		await until(
			"the follower to catch up with every events.jsonl",
			() => ids.every((id) => mine(id).length === onDisk(id).length),
			30_000,
		);
		await sleep(500); // a few more looks: nothing comes twice
		ac.abort();
		await following;
		for (const id of ids) {
			assert.deepEqual(mine(id), onDisk(id), `events of ${id}`);
			const types = mine(id).map((e) => e.type);
			assert.equal(types.filter((t) => t === "subagent.run.queued").length, 1);
		}
		// One pass without follow gives the same; `since` keeps what is at or after it.
		const again = await collect(c.events());
		for (const id of ids) assert.deepEqual(again.filter((e) => e.runId === id), onDisk(id));
		const all = ids.flatMap(onDisk);
		const cut = all.map((e) => e.ts).sort((a, b) => a - b)[Math.floor(all.length / 2)];
		const since = (await collect(c.events({ since: cut }))).filter((e) => ids.includes(e.runId));
		assert.equal(since.length, all.filter((e) => e.ts >= cut).length);
		assert.ok(since.every((e) => e.ts >= cut));
		assert.deepEqual(errorLines(d.log()), []);
	});
});

describe("without a daemon", () => {
	test("stop of a request nobody claims gives up naming the spool file and the fix; the request stays", async () => {
		const base = tempDir("noclaim");
		try {
			const c = new Client({ root: path.join(base, "root") });
			const id = await c.submit(["true"]);
			assert.equal(fs.statSync(path.join(base, "root")).mode & 0o777, 0o700);
			const file = path.join(base, "root", "spool", `${id}.json`);
			assert.equal(fs.statSync(file).mode & 0o777, 0o600);
			assert.equal(JSON.parse(fs.readFileSync(file, "utf8")).runId, id);
			// Only the published file: no temp left behind.
			assert.deepEqual(fs.readdirSync(path.join(base, "root", "spool")), [`${id}.json`]);
			const s = await c.status(id);
			assert.equal(s.kind, "pending");
			assert.equal(s.spoolFile, file);
			await assert.rejects(c.stop(id, undefined, { claimTimeoutMs: 200 }), (e) => {
				assert.equal(e.code, "RUNSPOOL_STOP_TIMEOUT");
				assert.ok(e.message.includes(file));
				assert.match(e.message, /runspool stop/);
				return true;
			});
			await assert.rejects(c.wait(id, { timeoutMs: 200 }), (e) => e instanceof WaitTimeoutError && e.lastStatus.kind === "pending");
			assert.ok(fs.existsSync(file));
			await assert.rejects(c.submit(["true"], { runId: id }), /already exists/);
		} finally {
			fs.rmSync(base, { recursive: true, force: true });
		}
	});

	test("hostile files are refused at once, never followed or waited on", async () => {
		const base = tempDir("hostile");
		try {
			const root = path.join(base, "root");
			const c = new Client({ root });
			fs.mkdirSync(c.runsDir, { recursive: true, mode: 0o700 });
			const secret = path.join(base, "secret.json");
			fs.writeFileSync(secret, JSON.stringify({ runId: "link", state: "complete" }));
			const mk = (id) => {
				fs.mkdirSync(path.join(c.runsDir, id), { mode: 0o700 });
				return path.join(c.runsDir, id);
			};
			execFileSync("mkfifo", [path.join(mk("fifo"), "status.json")]);
			execFileSync("mkfifo", [path.join(c.runsDir, "fifo", "events.jsonl")]);
			fs.symlinkSync(secret, path.join(mk("link"), "status.json"));
			fs.symlinkSync(secret, path.join(c.runsDir, "link", "events.jsonl"));
			fs.symlinkSync(path.join(c.runsDir, "link"), path.join(c.runsDir, "dirlink"));
			// A run directory that is a link to a directory elsewhere: never read through.
			const elsewhere = path.join(base, "elsewhere");
			fs.mkdirSync(elsewhere);
			fs.writeFileSync(path.join(elsewhere, "events.jsonl"), `${JSON.stringify({ type: "x", ts: 1, runId: "outside" })}\n`);
			fs.writeFileSync(path.join(elsewhere, "status.json"), JSON.stringify({ runId: "outside", state: "complete" }));
			fs.symlinkSync(elsewhere, path.join(c.runsDir, "outside"));
			fs.mkdirSync(path.join(mk("dir"), "status.json"));
			fs.writeFileSync(path.join(mk("huge"), "status.json"), Buffer.alloc(17 << 20, 0x20));
			fs.writeFileSync(path.join(mk("other"), "status.json"), JSON.stringify({ runId: "someone-else", state: "complete" }));
			for (const id of ["fifo", "link", "dirlink", "outside", "dir", "huge"]) {
				await assert.rejects(c.status(id), (e) => e instanceof UnsafeFileError && e.message.includes(id), id);
			}
			await assert.rejects(c.status("other"), (e) => e.code === "RUNSPOOL_IDENTITY_MISMATCH" && /someone-else/.test(e.message));
			assert.deepEqual(await collect(c.events()), []);
			assert.deepEqual(await c.list(), []);
			// A root others can write is refused before anything is published into it.
			fs.chmodSync(root, 0o777);
			await assert.rejects(c.submit(["true"]), (e) => e instanceof UnsafeFileError && e.message.includes(`chmod 700 ${root}`));
			assert.ok(!fs.existsSync(c.spoolDir));
		} finally {
			fs.rmSync(base, { recursive: true, force: true });
		}
	});

	test("events: a line being written comes once it is whole; over-long and foreign lines are skipped", async () => {
		const base = tempDir("partial");
		const ac = new AbortController();
		try {
			const c = new Client({ root: path.join(base, "root") });
			fs.mkdirSync(path.join(c.runsDir, "r1"), { recursive: true, mode: 0o700 });
			const f1 = path.join(c.runsDir, "r1", "events.jsonl");
			const ev = (type, ts, runId = "r1") => JSON.stringify({ type, ts, runId });
			fs.writeFileSync(f1, `${ev("a", 1)}\n${ev("b", 2).slice(0, 10)}`);
			const seen = [];
			const following = (async () => {
				try {
					for await (const e of c.events({ follow: true, signal: ac.signal })) seen.push(`${e.runId}:${e.type}`);
				} catch (e) {
					if (!ac.signal.aborted) throw e;
				}
			})();
			await until("the first event", () => seen.length === 1);
			await sleep(400);
			assert.deepEqual(seen, ["r1:a"], "half a line is not an event yet");
			fs.appendFileSync(f1, `${ev("b", 2).slice(10)}\n`);
			await until("the completed line", () => seen.length === 2);
			// Over 1 MiB on one line, a line naming another run, a line that is not JSON: skipped.
			const long = JSON.stringify({ type: "long", ts: 3, runId: "r1", pad: "x".repeat(3 << 20) });
			fs.appendFileSync(f1, `${long.slice(0, 1 << 19)}`);
			await sleep(300);
			fs.appendFileSync(f1, `${long.slice(1 << 19)}\n${ev("foreign", 4, "r9")}\nnot json\n${ev("c", 5)}\n`);
			await until("the line after the skipped ones", () => seen.length === 3);
			// A run that appears while following: from its first line.
			fs.mkdirSync(path.join(c.runsDir, "r2"), { mode: 0o700 });
			fs.writeFileSync(path.join(c.runsDir, "r2", "events.jsonl"), `${ev("d", 6, "r2")}\n`);
			await until("the new run's event", () => seen.length === 4);
			await sleep(400);
			ac.abort();
			await following;
			assert.deepEqual(seen, ["r1:a", "r1:b", "r1:c", "r2:d"]);
		} finally {
			ac.abort();
			fs.rmSync(base, { recursive: true, force: true });
		}
	});

	test("the root is resolved as PROTOCOL §1 says", () => {
		const uid = process.getuid();
		assert.equal(defaultRoot({ RUNSPOOL_ROOT: "/a", PI_SUBAGENTS_TEMP_ROOT: "/b" }), "/a");
		assert.equal(defaultRoot({ RUNSPOOL_ROOT: "", PI_SUBAGENTS_TEMP_ROOT: "/b" }), "/b");
		assert.equal(defaultRoot({ TMPDIR: "/t" }), `/t/pi-subagents-uid-${uid}`);
		assert.equal(defaultRoot({}), `/tmp/pi-subagents-uid-${uid}`);
		const saved = process.env.RUNSPOOL_ROOT;
		process.env.RUNSPOOL_ROOT = path.join(os.tmpdir(), "x-root");
		try {
			assert.equal(new Client().root, path.join(os.tmpdir(), "x-root"));
			assert.equal(new Client({ root: "/explicit" }).root, "/explicit");
		} finally {
			if (saved === undefined) delete process.env.RUNSPOOL_ROOT;
			else process.env.RUNSPOOL_ROOT = saved;
		}
	});
});
