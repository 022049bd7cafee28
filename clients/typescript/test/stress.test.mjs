// Submit, then at once status / follow / wait, and submit-then-stop, 200
// times in a row while a burst of 500 other requests is being claimed and
// run: nothing lost, nothing reported wrong, no error anywhere. Once with
// the daemon's native watcher, once with its poll strategy.

import { describe, test } from "node:test";
import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";

import { collect, errorLines, startDaemon } from "./helpers.mjs";

const ROUNDS = Number(process.env.RUNSPOOL_TS_ROUNDS || 200);
const BURST = Number(process.env.RUNSPOOL_TS_BURST || 500);

// The two daemons are independent: run both at once.
describe("stress", { concurrency: 2 }, () => {
for (const strategy of ["native", "poll"]) {
	test(`submit then status/follow/wait/stop, ${ROUNDS} times under a burst of ${BURST} (watch strategy ${strategy})`, async () => {
		const d = await startDaemon({
			label: `stress-${strategy}`,
			config: `max_running = 8\nretention_days = 0\n[watch]\nstrategy = "${strategy}"\npoll_interval_ms = 50\n`,
		});
		const c = d.client;
		try {
			const t0 = Date.now();
			// The burst: published all at once, claimed and run while the rounds go on.
			const burst = Promise.all(
				Array.from({ length: BURST }, (_, i) => c.submit(["true"], { sessionId: "burst", agent: `burst-${i}` })),
			);
			for (let i = 0; i < ROUNDS; i++) {
				// Higher priority: the rounds go through while the burst is still queued.
				const id = await c.submit(["sh", "-c", `echo line-${i}; echo >&2 err-${i}; printf done-${i}`], { priority: 10 });
				const [st, lines, final] = await Promise.all([
					c.status(id),
					collect(c.follow(id)),
					c.wait(id, { timeoutMs: 120_000 }),
				]);
				assert.ok(["pending", "claimed", "run"].includes(st.kind), `round ${i}: status right after submit: ${JSON.stringify(st)}`);
				assert.equal(final.state, "complete", `round ${i}: ${JSON.stringify(final)}`);
				assert.equal(final.exitCode, 0);
				// stdout and stderr of a step share its output file; their order between the two pipes is not fixed.
				assert.deepEqual([...lines].sort(), [`done-${i}`, `err-${i}`, `line-${i}`], `round ${i}: output ${JSON.stringify(lines)}`);

				const sid = await c.submit(["sleep", "60"], { priority: 10 });
				const stopped = await c.stop(sid, `round ${i}`);
				assert.equal(stopped.outcome, "requested");
				const end = await c.wait(sid, { timeoutMs: 120_000 });
				assert.equal(end.state, "stopped", `round ${i}: stopped run: ${JSON.stringify(end)}`);
			}
			const ids = await burst;
			console.log(`# ${strategy}: ${ROUNDS} rounds done in ${Date.now() - t0} ms`);
			assert.equal(new Set(ids).size, BURST);
			for (const id of ids) {
				const s = await c.wait(id, { timeoutMs: 120_000 });
				assert.equal(s.state, "complete", JSON.stringify(s));
			}
			// Nothing refused, nothing left in the spool, no error in the daemon's log.
			const rejected = path.join(d.root, "spool", "rejected");
			assert.deepEqual(fs.existsSync(rejected) ? fs.readdirSync(rejected) : [], []);
			assert.deepEqual(fs.readdirSync(path.join(d.root, "spool")).filter((n) => n !== "rejected"), []);
			assert.deepEqual(errorLines(d.log()), []);
			console.log(`# ${strategy}: burst done in ${Date.now() - t0} ms`);
			const runs = fs.readdirSync(c.runsDir).filter((n) => !n.startsWith("."));
			assert.equal(runs.length, BURST + 2 * ROUNDS);
		} catch (e) {
			console.error(d.log().split("\n").slice(-60).join("\n"));
			throw e;
		} finally {
			await d.stop();
		}
	});
}
});
