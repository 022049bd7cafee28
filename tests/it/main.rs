//! The integration tests: one binary, one module per topic, sharing the
//! harness in `common/` (docs/design.md, "Tests"). `cargo test --test it
//! crash_points::` runs one module, `cargo test --test it NAME` one test.
//!
//! One binary links once instead of once per topic; the modules' tests run
//! in parallel threads of this one process, so no test changes process-wide
//! state (environment, umask, cwd, signal dispositions): it sets them on the
//! `Command` it spawns instead, and what is shared across the machine is held
//! under a `MachineLock` (common/process.rs).

mod common;

mod bridge;
mod chaos;
mod claim_hardening;
mod cli_docs;
mod cli_events;
mod cli_manage;
mod cli_table;
mod cli_wait;
mod client_races;
mod clients;
mod containment;
mod control_inbox;
mod core_loop;
mod corpus;
mod crash_points;
mod daemon_health;
mod doc_samples;
mod durability;
mod edit;
mod exhaustion;
mod harness_selftest;
mod hooks;
mod hooks_lifecycle;
mod hostile_files;
mod journald;
mod list_index;
mod list_pending;
mod metrics;
mod ownership;
mod packaging;
mod pending;
mod pi_compat;
mod providers;
mod providers_k8s;
mod queue_control;
mod recovery;
mod rejections;
mod reload;
mod run_identity;
mod scheduling;
mod schemas;
mod second_user;
mod seg_node;
mod service;
mod slurm;
mod steward;
mod stop_requests;
mod storage;
mod submit_env;
mod submit_flags;
mod systemd_user;
mod top;
