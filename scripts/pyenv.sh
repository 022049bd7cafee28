#!/bin/sh
# A private Python environment for the tests that need Python packages
# (tests/it/schemas.rs validates runspool's files with `jsonschema`).
#
#   scripts/pyenv.sh [--venv DIR] PACKAGE==VERSION|./LOCAL/DIR...
#
# (tests/it/clients.rs installs pytest and ./clients/python with it: a local
# directory is installed every time, so the venv holds the tree's code.)
#
# Creates DIR (default: $CARGO_TARGET_DIR/py-venv, else <repo>/target/py-venv)
# with `python3 -m venv` when it is missing, then installs from PyPI, with
# the venv's own pip, every pinned package that is not already installed at
# that version. Idempotent: a second call with the same packages installs
# nothing and needs no network. Concurrent calls wait for each other (flock on
# DIR.lock when flock(1) exists). Prints the venv's python on stdout.
#
# Exit status: 0 ready; 3 python3, its venv module or pip is unavailable (the
# caller skips); anything else: the installation failed (the caller fails).
# Nothing is written outside DIR, DIR.lock and DIR.log (venv's output).
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
venv="${CARGO_TARGET_DIR:-$here/target}/py-venv"
if [ "${1:-}" = "--venv" ]; then
    venv=$2
    shift 2
fi
for p in "$@"; do
    case "$p" in
    *==* | ./* | /*) ;;
    *) echo "pyenv.sh: package \`$p\` is not pinned; write NAME==VERSION (or give a local directory)" >&2; exit 2 ;;
    esac
done

if ! command -v python3 >/dev/null 2>&1; then
    echo "pyenv.sh: python3 is not on PATH" >&2
    exit 3
fi

mkdir -p "$(dirname "$venv")"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$venv.lock"
    flock 9
fi

py="$venv/bin/python"
if [ ! -x "$py" ] || ! "$py" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    if ! python3 -m venv "$venv" >"$venv.log" 2>&1; then
        echo "pyenv.sh: python3 -m venv $venv failed (no venv/ensurepip module?):" >&2
        cat "$venv.log" >&2
        rm -rf "$venv"
        exit 3
    fi
    if ! "$py" -m pip --version >/dev/null 2>&1; then
        echo "pyenv.sh: the venv $venv has no pip" >&2
        rm -rf "$venv"
        exit 3
    fi
fi

missing=""
for p in "$@"; do
    case "$p" in
    ./* | /*)
        missing="$missing $p"
        continue
        ;;
    esac
    name=${p%%==*}
    want=${p#*==}
    have=$("$py" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$name")
    [ "$have" = "$want" ] || missing="$missing $p"
done
if [ -n "$missing" ]; then
    # shellcheck disable=SC2086 # one word per package
    "$py" -m pip install --disable-pip-version-check --no-input --quiet $missing >&2
fi
echo "$py"
