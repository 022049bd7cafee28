/**
 * runspool-client: submit, watch and stop runspool runs from Node through
 * runspool's on-disk protocol (PROTOCOL.md), with no runtime dependencies.
 *
 * ```ts
 * import { Client } from "runspool-client";
 * const client = new Client();
 * const id = await client.submit(["make", "test"]);
 * for await (const line of client.follow(id)) console.log(line);
 * const status = await client.wait(id);
 * ```
 */
export { Client, defaultRoot, isActiveState, isRequestRunId, MAX_REQUEST_BYTES } from "./client.js";
export { NotFoundError, RejectedError, RunspoolError, UnsafeFileError, WaitTimeoutError } from "./errors.js";
