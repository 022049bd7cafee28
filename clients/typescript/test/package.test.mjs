// The package as a user gets it: dist/ is what src/ compiles to; `npm pack`
// holds dist/ and no dependency; installed from the tarball (and from the
// folder) into a new project it imports, type-checks, and runs a command
// through a real daemon, from plain ESM and from TypeScript loaded by jiti
// (as a pi extension is).

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import * as fs from "node:fs";
import { createRequire } from "node:module";
import * as path from "node:path";
import { pathToFileURL } from "node:url";

import { PKG_DIR, startDaemon, tempDir } from "./helpers.mjs";

const require = createRequire(path.join(PKG_DIR, "package.json"));

function devTool(name) {
	try {
		return require.resolve(name);
	} catch {
		return undefined;
	}
}

function files(dir, rel = "") {
	const out = [];
	for (const e of fs.readdirSync(path.join(dir, rel), { withFileTypes: true })) {
		const p = path.join(rel, e.name);
		if (e.isDirectory()) out.push(...files(dir, p));
		else out.push(p);
	}
	return out.sort();
}

const npm = (args, cwd) =>
	execFileSync("npm", [...args, "--no-audit", "--no-fund", "--loglevel=error"], {
		cwd,
		encoding: "utf8",
		stdio: ["ignore", "pipe", "pipe"],
	});

test("dist/ is what src/ compiles to (rebuild with `npm run build` after changing src/)", (t) => {
	const tsc = devTool("typescript/bin/tsc");
	if (!tsc) return t.skip("typescript is not installed here: run `npm ci` in clients/typescript");
	const out = tempDir("dist");
	try {
		execFileSync(process.execPath, [tsc, "-p", path.join(PKG_DIR, "tsconfig.json"), "--outDir", out], { stdio: "inherit" });
		const dist = path.join(PKG_DIR, "dist");
		assert.deepEqual(files(dist), files(out), "the same files");
		for (const f of files(out)) {
			assert.equal(
				fs.readFileSync(path.join(dist, f), "utf8"),
				fs.readFileSync(path.join(out, f), "utf8"),
				`dist/${f} is stale: run \`npm run build\` in clients/typescript and commit dist/`,
			);
		}
	} finally {
		fs.rmSync(out, { recursive: true, force: true });
	}
});

test("npm pack, then npm install <tgz> into a new project: import, type-check, submit and wait", async (t) => {
	const work = tempDir("pack");
	const d = await startDaemon({ label: "pack" });
	try {
		const tgz = path.join(work, npm(["pack", "--pack-destination", work], PKG_DIR).trim().split("\n").pop());
		const listing = execFileSync("tar", ["tzf", tgz], { encoding: "utf8" }).trim().split("\n").sort();
		for (const f of ["package/package.json", "package/README.md", "package/dist/index.js", "package/dist/index.d.ts"]) {
			assert.ok(listing.includes(f), `${f} in the tarball: ${listing.join(", ")}`);
		}
		assert.deepEqual(
			listing.filter((f) => !/^package\/(package\.json|README\.md|dist\/[a-z]+\.(js|d\.ts))$/.test(f)),
			[],
			"nothing but dist/, README.md and package.json",
		);

		const proj = path.join(work, "project");
		fs.mkdirSync(proj);
		fs.writeFileSync(path.join(proj, "package.json"), JSON.stringify({ name: "consumer", private: true, type: "module" }));
		npm(["install", "--offline", tgz], proj);
		const installed = JSON.parse(fs.readFileSync(path.join(proj, "node_modules/runspool-client/package.json"), "utf8"));
		assert.equal(installed.dependencies, undefined, "no runtime dependencies");
		assert.deepEqual(fs.readdirSync(path.join(proj, "node_modules")).filter((n) => !n.startsWith(".")), ["runspool-client"]);

		fs.writeFileSync(
			path.join(proj, "use.mjs"),
			`import { Client } from "runspool-client";
const c = new Client();
const id = await c.submit(["sh", "-c", "echo hello from $0", "esm"]);
const lines = [];
for await (const l of c.follow(id)) lines.push(l);
const s = await c.wait(id, { timeoutMs: 60000 });
console.log(JSON.stringify({ state: s.state, lines }));
`,
		);
		const out = execFileSync(process.execPath, ["use.mjs"], {
			cwd: proj,
			encoding: "utf8",
			env: { ...process.env, RUNSPOOL_ROOT: d.root },
		});
		assert.deepEqual(JSON.parse(out), { state: "complete", lines: ["hello from esm"] });

		// A pi extension is TypeScript: the same through jiti, and its types check.
		const ext = `import { Client, RejectedError, type RunStatus, type Status } from "runspool-client";
export async function run(root: string): Promise<string> {
	const c = new Client({ root });
	const id: string = await c.submit(["sh", "-c", "echo from ts"], { sessionId: "pi" });
	const first: Status = await c.status(id);
	if (first.kind === "refused") throw new RejectedError(id, first.code, first.message);
	const s: RunStatus = await c.wait(id, { timeoutMs: 60000 });
	return s.state + ":" + (s.exitCode ?? -1);
}
`;
		fs.writeFileSync(path.join(proj, "extension.ts"), ext);
		const jitiPath = devTool("jiti");
		if (jitiPath) {
			const { createJiti } = await import(pathToFileURL(jitiPath).href);
			const jiti = createJiti(pathToFileURL(path.join(proj, "extension.ts")).href, { fsCache: false });
			const mod = await jiti.import(path.join(proj, "extension.ts"));
			assert.equal(await mod.run(d.root), "complete:0");
		} else {
			t.diagnostic("jiti is not installed here (run `npm ci` in clients/typescript): the jiti load was not tried");
		}
		const tsc = devTool("typescript/bin/tsc");
		if (tsc) {
			fs.writeFileSync(
				path.join(proj, "tsconfig.json"),
				JSON.stringify({
					compilerOptions: {
						module: "NodeNext",
						moduleResolution: "NodeNext",
						target: "ES2022",
						strict: true,
						noEmit: true,
						types: ["node"],
						typeRoots: [path.join(PKG_DIR, "node_modules", "@types")],
					},
					files: ["extension.ts"],
				}),
			);
			execFileSync(process.execPath, [tsc, "-p", path.join(proj, "tsconfig.json")], { stdio: "inherit" });
		} else {
			t.diagnostic("typescript is not installed here: the consumer's type check was not run");
		}

		// `npm install ./clients/typescript` (from the folder) works the same.
		const proj2 = path.join(work, "project2");
		fs.mkdirSync(proj2);
		fs.writeFileSync(path.join(proj2, "package.json"), JSON.stringify({ name: "consumer2", private: true, type: "module" }));
		npm(["install", "--offline", PKG_DIR], proj2);
		fs.copyFileSync(path.join(proj, "use.mjs"), path.join(proj2, "use.mjs"));
		const out2 = execFileSync(process.execPath, ["use.mjs"], {
			cwd: proj2,
			encoding: "utf8",
			env: { ...process.env, RUNSPOOL_ROOT: d.root },
		});
		assert.equal(JSON.parse(out2).state, "complete");
	} finally {
		await d.stop();
		fs.rmSync(work, { recursive: true, force: true });
	}
});
