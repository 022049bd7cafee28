#!/usr/bin/env bash
# Install the system tools the fault tests use, when missing. Idempotent;
# needs root (apt-get). Tests call it themselves, so `cargo test` as root
# on a fresh Debian machine has what it needs.
#   scripts/fixtures.sh [TOOL...]     tools: bindfs btrfs strace prlimit journald xmllint
#                                     tmux (tests/it/top.rs), groff ruby rpm rpmlint (packaging tests;
#                                     not in the default set)
set -euo pipefail
want=("$@")
[ ${#want[@]} -eq 0 ] && want=(bindfs btrfs strace prlimit)
pkgs=()
for t in "${want[@]}"; do
  case "$t" in
    bindfs)  command -v bindfs >/dev/null || pkgs+=(bindfs fuse3) ;;
    btrfs)   command -v mkfs.btrfs >/dev/null || pkgs+=(btrfs-progs) ;;
    strace)  command -v strace >/dev/null || pkgs+=(strace) ;;
    prlimit) command -v prlimit >/dev/null || pkgs+=(util-linux) ;;
    groff)   command -v groff >/dev/null || pkgs+=(groff-base) ;;
    ruby)    command -v ruby >/dev/null || pkgs+=(ruby) ;;
    rpm)     command -v rpmspec >/dev/null || pkgs+=(rpm) ;;
    rpmlint) command -v rpmlint >/dev/null || pkgs+=(rpmlint) ;;
    journald) { [ -x /lib/systemd/systemd-journald ] || [ -x /usr/lib/systemd/systemd-journald ]; } && command -v journalctl >/dev/null || pkgs+=(systemd) ;;
    xmllint) command -v xmllint >/dev/null || pkgs+=(libxml2-utils) ;;
    tmux)    command -v tmux >/dev/null || pkgs+=(tmux) ;;
    *) echo "fixtures.sh: unknown tool $t" >&2; exit 2 ;;
  esac
done
[ ${#pkgs[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "fixtures.sh: need root to install ${pkgs[*]}" >&2
  exit 1
fi
# One installer at a time: test binaries run this concurrently. The lock
# file is removed as the lock is let go (so nothing is left in /tmp); a
# waiter that wins the lock on the removed file locks the path anew.
lock=/tmp/runspool-fixtures.lock
while :; do
  exec 9>>"$lock"
  flock 9
  [ "$(stat -L -c %d:%i /proc/self/fd/9)" = "$(stat -c %d:%i "$lock" 2>/dev/null)" ] && break
  exec 9>&-
done
trap 'rm -f "$lock"' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${pkgs[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${pkgs[@]}" >/dev/null; }
