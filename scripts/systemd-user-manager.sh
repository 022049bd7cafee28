#!/usr/bin/env bash
# Start or stop a real systemd user manager (`systemd --user`) for the
# unprivileged test user (scripts/ci-user.sh), on a host where systemd is
# installed but is not PID 1 (CI machines, containers). Used by
# tests/it/systemd_user.rs; handy by hand too. Needs root.
#
#   scripts/systemd-user-manager.sh start STATE_DIR HOME_DIR
#   scripts/systemd-user-manager.sh stop  STATE_DIR
#
# start: the manager runs as the test user, with HOME=HOME_DIR and
#   XDG_RUNTIME_DIR=/run/user/<uid>, in its own cgroup (a child of this
#   shell's cgroup named runspool-user-manager-<uid>, in the name=systemd
#   hierarchy and in the cgroup2 one, delegated to the user the way systemd
#   delegates user@.service: the directory and its cgroup.procs/threads/
#   subtree_control/tasks files). Only the manager process is moved there.
#   /run/systemd/system is created when absent (the manager refuses to start
#   without it, it is what sd_booted() tests), and so is the runtime dir.
#   Every path created is written to STATE_DIR/created, and the manager's
#   pid to STATE_DIR/pid; its own log goes to STATE_DIR/manager.log.
#   Prints user=, uid=, gid=, home=, runtime_dir=, pid= lines on success.
#   No D-Bus is needed: `systemctl --user` talks to the manager over
#   $XDG_RUNTIME_DIR/systemd/private.
#   Exits 77 after a "SKIP: <why>" line when this host cannot run one.
#
# stop: what logging out without lingering does to user@.service
#   (KillMode=mixed): `systemctl --user exit`, then SIGKILL to whatever is
#   still in the manager's cgroup (runners outlive the daemon by design),
#   then removes the cgroups, the runtime dir and /run/systemd/system if
#   start created them. Idempotent; nothing else is touched.
#
# Callers serialize: one manager per test user at a time.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
user="${RUNSPOOL_TEST_USER:-runspool-ci}"

skip() {
    echo "SKIP: $*"
    exit 77
}
die() {
    echo "systemd-user-manager.sh: $*" >&2
    exit 1
}

# Run a command as the test user with the environment of a login session.
as_user() {
    setpriv --reuid="$uid" --regid="$gid" --init-groups \
        env -i HOME="$home" USER="$user" LOGNAME="$user" XDG_RUNTIME_DIR="$runtime" \
        PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 "$@"
}

alive() {
    [ -n "${1:-}" ] && [ -d "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

# Is $1 a systemd user manager running as $uid (so ours to stop)?
is_manager() {
    alive "$1" || return 1
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = systemd ] || return 1
    [ "$(awk '/^Uid:/ {print $2}' "/proc/$1/status" 2>/dev/null)" = "$uid" ]
}

# The cgroup hierarchies to use, as "mountpoint:path-of-this-shell" lines:
# the named systemd one (cgroup v1/hybrid) and the cgroup2 one.
hierarchies() {
    local mp
    mp=$(awk '$3 == "cgroup" && $4 ~ /(^|,)name=systemd(,|$)/ {print $2; exit}' /proc/self/mounts)
    if [ -n "$mp" ]; then
        echo "$mp:$(awk -F: '$2 == "name=systemd" {print $3; exit}' /proc/self/cgroup)"
    fi
    mp=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/self/mounts)
    if [ -n "$mp" ]; then
        echo "$mp:$(awk -F: '$1 == "0" && $2 == "" {print $3; exit}' /proc/self/cgroup)"
    fi
}

cgroup_pids() {
    local cg
    for cg in "$@"; do
        [ -d "$cg" ] && find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null
    done
    return 0
}

remove_cgroup() {
    local cg=$1 i
    for i in 1 2 3 4 5 6 7 8 9 10; do
        [ -d "$cg" ] || return 0
        find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [ -d "$cg" ] || return 0
        sleep 0.2
    done
    echo "systemd-user-manager.sh: could not remove $cg" >&2
    return 1
}

load_user() {
    if ! id -u "$user" >/dev/null 2>&1; then
        bash "$here/ci-user.sh" >&2
    fi
    uid=$(id -u "$user")
    gid=$(id -g "$user")
    [ "$uid" -ne 0 ] || die "the test user must not be root"
    runtime="/run/user/$uid"
    cgname="runspool-user-manager-$uid"
}

start() {
    local state=$1
    home=$2
    [ "$(id -u)" -eq 0 ] || skip "needs root (to create a test user, its runtime dir and a delegated cgroup)"
    [ "$(uname -s)" = Linux ] || skip "not Linux"
    local systemd=
    for p in /lib/systemd/systemd /usr/lib/systemd/systemd; do
        if [ -x "$p" ]; then
            systemd=$p
            break
        fi
    done
    [ -n "$systemd" ] || skip "systemd is not installed (no /lib/systemd/systemd)"
    command -v systemctl >/dev/null || skip "systemctl is not installed"
    command -v setpriv >/dev/null || skip "setpriv (util-linux) is not installed"
    if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
        skip "systemd is PID 1 here: a user manager belongs under its user@UID.service, not beside it"
    fi
    local hier
    hier=$(hierarchies)
    [ -n "$hier" ] || skip "no name=systemd or cgroup2 hierarchy is mounted"
    [ -d "$home" ] || die "no home directory $home"
    mkdir -p "$state"
    chmod 0700 "$state"
    load_user

    local p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        if is_manager "$p"; then
            die "a systemd user manager for $user is already running (pid $p); not touching it"
        fi
    done

    : >"$state/created"
    echo "$user $uid $gid $home" >"$state/user"

    # The delegated cgroups.
    local cgs=() line mp path parent cg
    while IFS= read -r line; do
        mp=${line%%:*}
        path=${line#*:}
        parent="$mp${path%/}"
        cg="$parent/$cgname"
        if [ -d "$cg" ]; then
            # Left by an interrupted run; refuse if anything still lives in it.
            [ -z "$(cgroup_pids "$cg")" ] || die "$cg still has processes: $(cgroup_pids "$cg" | tr '\n' ' '); run '$0 stop' with that run's state dir"
            remove_cgroup "$cg"
        fi
        mkdir "$cg" 2>/dev/null || skip "cannot create a cgroup under $parent"
        echo "cgroup $cg" >>"$state/created"
        chown "$uid:$gid" "$cg"
        for f in cgroup.procs cgroup.threads cgroup.subtree_control tasks cgroup.clone_children notify_on_release; do
            [ -e "$cg/$f" ] && chown "$uid:$gid" "$cg/$f"
        done
        cgs+=("$cg")
    done <<<"$hier"

    # sd_booted(): the user manager will not start without it.
    if [ ! -d /run/systemd ]; then
        mkdir -m 0755 /run/systemd
        echo "dir /run/systemd" >>"$state/created"
    fi
    if mkdir -m 0755 /run/systemd/system 2>/dev/null; then
        echo "dir /run/systemd/system" >>"$state/created"
    fi

    # The runtime dir, as user-runtime-dir@.service makes it (0700, the user's).
    if [ ! -d /run/user ]; then
        mkdir -m 0755 /run/user
        echo "dir /run/user" >>"$state/created"
    fi
    # One left behind by an interrupted run (no manager runs for this
    # dedicated test user, checked above) is taken over and removed at stop.
    mkdir -p "$runtime"
    echo "runtime $runtime" >>"$state/created"
    chown "$uid:$gid" "$runtime"
    chmod 0700 "$runtime"

    # Move only the manager's own process into the cgroups, then become it.
    : >"$state/manager.log"
    HOME_DIR="$home" M_UID="$uid" M_GID="$gid" M_USER="$user" M_RUNTIME="$runtime" M_SYSTEMD="$systemd" \
        setsid sh -c '
        for cg in "$@"; do echo $$ >"$cg/cgroup.procs" || exit 97; done
        cd "$HOME_DIR" || exit 98
        exec setpriv --reuid="$M_UID" --regid="$M_GID" --init-groups \
            env -i HOME="$HOME_DIR" USER="$M_USER" LOGNAME="$M_USER" XDG_RUNTIME_DIR="$M_RUNTIME" \
            PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
            "$M_SYSTEMD" --user --log-target=console
    ' sh "${cgs[@]}" </dev/null >>"$state/manager.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$state/pid"

    # Up when its private socket answers and the start-up transaction is done.
    local deadline=$((SECONDS + 60)) st=
    while :; do
        if ! alive "$pid"; then
            echo "systemd-user-manager.sh: the user manager exited during start-up; its log:" >&2
            tail -n 40 "$state/manager.log" >&2
            exit 1
        fi
        if [ -S "$runtime/systemd/private" ]; then
            st=$(as_user systemctl --user is-system-running 2>/dev/null || true)
            case "$st" in
            running) break ;;
            degraded)
                echo "systemd-user-manager.sh: the user manager is degraded:" >&2
                as_user systemctl --user --no-pager list-units --failed >&2 || true
                break
                ;;
            esac
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "the user manager (pid $pid) is not up after 60 s (state '$st'); its log: $state/manager.log"
        sleep 0.1
    done
    echo "user=$user"
    echo "uid=$uid"
    echo "gid=$gid"
    echo "home=$home"
    echo "runtime_dir=$runtime"
    echo "pid=$pid"
}

stop() {
    local state=$1
    [ -f "$state/user" ] || return 0
    read -r user uid gid home <"$state/user"
    runtime="/run/user/$uid"
    local pid i
    pid=$(cat "$state/pid" 2>/dev/null || true)
    if is_manager "$pid"; then
        # As at logout: the manager stops its units (runspool gets SIGTERM) and exits.
        as_user timeout 30 systemctl --user exit >/dev/null 2>&1 || true
        for i in $(seq 1 300); do
            is_manager "$pid" || break
            sleep 0.1
        done
        if is_manager "$pid"; then
            echo "systemd-user-manager.sh: the manager (pid $pid) ignored 'exit'; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    # As user@.service's KillMode=mixed does next: SIGKILL what is left.
    local cgs=() kind what
    while read -r kind what; do
        [ "$kind" = cgroup ] && cgs+=("$what")
    done <"$state/created"
    for i in $(seq 1 50); do
        local pids
        pids=$(cgroup_pids "${cgs[@]}")
        [ -n "$pids" ] || break
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
    done
    local rc=0
    for cg in "${cgs[@]}"; do
        remove_cgroup "$cg" || rc=1
    done
    # Then what this script created, newest first.
    while read -r kind what; do
        case "$kind" in
        runtime)
            case "$what" in
            /run/user/[1-9]*) rm -rf --one-file-system "$what" ;;
            esac
            ;;
        dir) rmdir "$what" 2>/dev/null || echo "systemd-user-manager.sh: left $what (not empty)" >&2 ;;
        esac
    done < <(tac "$state/created")
    rm -f "$state/created" "$state/user" "$state/pid"
    return $rc
}

case "${1:-}" in
start)
    [ $# -eq 3 ] || die "usage: $0 start STATE_DIR HOME_DIR"
    start "$2" "$3"
    ;;
stop)
    [ $# -eq 2 ] || die "usage: $0 stop STATE_DIR"
    stop "$2"
    ;;
*) die "usage: $0 start STATE_DIR HOME_DIR | stop STATE_DIR" ;;
esac
