#!/usr/bin/env bash
# Make (once) the project's Python virtual environment target/py-venv and
# pip-install the package specs given as arguments into it, e.g.
#   scripts/pyenv.sh pytest==8.3.4 ./clients/python
# Idempotent: an existing venv is reused and pip skips what is installed.
# Prints the venv's python on the last line of stdout. Exits 3 when python3
# or its venv module is missing (callers skip with a message then).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/py-venv
mkdir -p target
# Test binaries may call this at once: one of them makes the venv at a time.
if command -v flock >/dev/null 2>&1; then
    exec 9>target/py-venv.lock
    flock 9
fi
if ! command -v python3 >/dev/null 2>&1; then
    echo "pyenv.sh: python3 is not installed; install it (apt-get install python3 python3-venv)" >&2
    exit 3
fi
if [ ! -x "$venv/bin/python" ]; then
    rm -rf "$venv"
    if ! python3 -m venv "$venv" >&2; then
        rm -rf "$venv"
        echo "pyenv.sh: python3 cannot make a virtual environment; install its venv module (apt-get install python3-venv)" >&2
        exit 3
    fi
fi
if [ "$#" -gt 0 ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >&2
fi
echo "$PWD/$venv/bin/python"
