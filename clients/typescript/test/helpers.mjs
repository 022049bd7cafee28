// A real runspool daemon on a temporary root, for the tests: started from
// $RUNSPOOL_BIN, stopped (SIGTERM, then SIGKILL after a deadline) by the
// test that started it, never anything else.

import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import { fileURLToPath } from "node:url";

import { Client } from "../dist/index.js";

export const PKG_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");

export function runspoolBin() {
	const bin = process.env.RUNSPOOL_BIN;
	if (!bin) {
		throw new Error(
			"RUNSPOOL_BIN is not set: build runspool (`cargo build`) and run the suite with RUNSPOOL_BIN=<repo>/target/debug/runspool " +
				"(`cargo test --test it clients::typescript_client_suite` does this)",
		);
	}
	if (!fs.existsSync(bin)) throw new Error(`RUNSPOOL_BIN=${bin} does not exist: build it with \`cargo build\``);
	return bin;
}

export function tempDir(label) {
	return fs.mkdtempSync(path.join(os.tmpdir(), `runspool-ts-${label}-`));
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Poll `fn` until it returns a truthy value, or fail after `ms` naming `what`. */
export async function until(what, fn, ms = 60_000) {
	const start = Date.now();
	for (;;) {
		const v = await fn();
		if (v) return v;
		if (Date.now() - start > ms) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
		await sleep(25);
	}
}

/**
 * Start `runspool daemon` on a new root. `config`: the TOML text. Returns
 * {root, base, client, log(), stop()}; ready once daemon.json names its pid.
 */
export async function startDaemon({ label = "daemon", config = "", pollIntervalMs } = {}) {
	const base = tempDir(label);
	const root = path.join(base, "root");
	const configPath = path.join(base, "config.toml");
	fs.writeFileSync(configPath, config);
	const logPath = path.join(base, "daemon.log");
	const logFd = fs.openSync(logPath, "a");
	const env = { ...process.env, XDG_CONFIG_HOME: path.join(base, "xdg"), RUNSPOOL_LOG: "info" };
	delete env.RUNSPOOL_ROOT;
	delete env.PI_SUBAGENTS_TEMP_ROOT;
	const child = spawn(runspoolBin(), ["daemon", "--root", root, "--config", configPath], {
		env,
		stdio: ["ignore", logFd, logFd],
	});
	fs.closeSync(logFd);
	let exited = null;
	const exit = new Promise((resolve) => child.on("exit", (code, signal) => resolve((exited = { code, signal }))));
	const log = () => fs.readFileSync(logPath, "utf8");
	const start = Date.now();
	for (;;) {
		if (exited) throw new Error(`runspool daemon exited during startup (${JSON.stringify(exited)}):\n${log()}`);
		try {
			const d = JSON.parse(fs.readFileSync(path.join(root, "runspool", "daemon.json"), "utf8"));
			if (d.pid === child.pid) break;
		} catch {
			// not written yet
		}
		if (Date.now() - start > 60_000) {
			child.kill("SIGKILL");
			throw new Error(`runspool daemon not ready after 60 s:\n${log()}`);
		}
		await sleep(25);
	}
	const client = new Client({ root, pollIntervalMs });
	return {
		base,
		root,
		client,
		log,
		/** Stop the runs still active, then the daemon this call started; remove the root. */
		async stop({ keep = false } = {}) {
			try {
				for (const r of await client.list({ active: true })) {
					await client.stop(r.runId, "test cleanup").catch(() => undefined);
				}
				await until("the runs to end", async () => (await client.list({ active: true })).length === 0, 30_000).catch(
					() => undefined,
				);
			} finally {
				if (!exited) {
					child.kill("SIGTERM");
					const t = setTimeout(() => child.kill("SIGKILL"), 30_000);
					await exit;
					clearTimeout(t);
				}
				if (!keep) fs.rmSync(base, { recursive: true, force: true });
			}
		},
	};
}

/** Every line of `it`. */
export async function collect(it) {
	const out = [];
	for await (const x of it) out.push(x);
	return out;
}

/** The daemon log's ERROR lines. */
export function errorLines(log) {
	return log.split("\n").filter((l) => / ERROR /.test(l));
}
