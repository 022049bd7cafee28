#!/usr/bin/env bash
# Create, idempotently, the unprivileged user that the second-user tests
# (tests/it/second_user.rs) run the daemon as. Needs root; does nothing otherwise.
# Only this user is added: no other machine-wide setting is touched.
set -euo pipefail
user="${RUNSPOOL_TEST_USER:-runspool-ci}"
if [ "$(id -u)" -ne 0 ]; then
    echo "ci-user.sh: skipped: needs root (the second-user tests skip too)"
    exit 0
fi
if id -u "$user" >/dev/null 2>&1; then
    echo "ci-user.sh: user $user already exists (uid $(id -u "$user"))"
    exit 0
fi
nologin=/usr/sbin/nologin
[ -x "$nologin" ] || nologin=/bin/false
# --system: no aging, no mail spool; no home: the tests give it a temp root.
if ! err=$(useradd --system --user-group --no-create-home --home-dir /nonexistent --shell "$nologin" "$user" 2>&1); then
    # A concurrent run may have created it between our check and useradd.
    if ! id -u "$user" >/dev/null 2>&1; then
        echo "ci-user.sh: useradd $user failed: $err" >&2
        exit 1
    fi
fi
echo "ci-user.sh: created user $user (uid $(id -u "$user"))"
