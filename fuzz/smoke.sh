#!/usr/bin/env bash
# Fuzz smoke run: every cargo-fuzz target for FUZZ_SECONDS (default 60) each,
# seeded with the hostile spool corpus and the kept regression cases. Prints a
# clear skip line and exits 0 when cargo-fuzz or a nightly toolchain is missing.
# A crash fails the run; its input lands in fuzz/artifacts/<target>/: fix the
# bug, then keep the input in fuzz/regressions/<target>/.
set -euo pipefail
cd "$(dirname "$0")"
secs="${FUZZ_SECONDS:-60}"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "fuzz smoke: skipped: cargo-fuzz is not installed (cargo install cargo-fuzz)"
    exit 0
fi
toolchain=""
if [ -n "${RUSTUP_TOOLCHAIN:-}" ] && rustc --version 2>/dev/null | grep -q nightly; then
    toolchain=""
elif cargo +nightly --version >/dev/null 2>&1; then
    toolchain="+nightly"
elif rustc --version 2>/dev/null | grep -q nightly; then
    toolchain=""
else
    echo "fuzz smoke: skipped: cargo-fuzz needs a nightly toolchain (rustup toolchain install nightly)"
    exit 0
fi

targets=$(cargo $toolchain fuzz list)
echo "fuzz smoke: building targets: $(echo $targets)"
cargo $toolchain fuzz build
for t in $targets; do
    work="corpus/$t"
    mkdir -p "$work"
    # Seeds: the regression cases, and for request parsing the hostile spool corpus.
    if [ -d "regressions/$t" ]; then
        cp -f regressions/"$t"/* "$work"/ 2>/dev/null || true
    fi
    if [ "$t" = request ]; then
        cp -f ../tests/corpus/bodies/* "$work"/
    fi
    echo "fuzz smoke: $t for ${secs}s"
    log="artifacts/$t-smoke.log"
    mkdir -p artifacts
    status=0
    cargo $toolchain fuzz run "$t" "$work" -- -max_total_time="$secs" -rss_limit_mb=2048 -max_len=1100000 \
        -print_final_stats=1 >"$log" 2>&1 || status=$?
    grep -E "^(#[0-9]+ *DONE|stat::number_of_executed_units|SUMMARY)|panicked|ERROR" "$log" || true
    if [ "$status" -ne 0 ]; then
        tail -40 "$log"
        echo "fuzz smoke: $t FAILED (exit $status); the input is in fuzz/artifacts/$t/"
        exit 1
    fi
    echo "fuzz smoke: $t ok"
done
echo "fuzz smoke: all targets ran ${secs}s without a crash"
