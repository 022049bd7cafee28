/* Crash-point shim for tests/it/crash_points.rs (docs/crash-points.md).
 *
 * Loaded with LD_PRELOAD into the daemon (and so into every process it
 * starts), it wraps glibc's entry points for the calls that change the
 * filesystem: creating opens, writes to regular files, rename, link,
 * unlink, mkdir, rmdir, fsync, flock, truncate and chmod. In the one process
 * whose role (`RUNSPOOL_CRASH_ROLE`: `daemon` or `runner`, told from its
 * command line) matches, it numbers those calls from 1 across all threads;
 * with `RUNSPOOL_CRASH_AT=N` it SIGKILLs its own process on entry to call N,
 * before the call has any effect. `RUNSPOOL_CRASH_TRACE=FILE` receives one
 * line per counted call (`count` lines when N is 0) or the one line of the
 * kill, so a violation can be pinned to the call that preceded it.
 * `RUNSPOOL_CRASH_MATCH=<call>:<text>` counts only the calls of that name
 * (any name when empty) whose path contains <text>: a targeted crash point
 * for a regression test.
 *
 * Every process of another role, and a forked child before its exec,
 * passes straight through, except the runners that a fork server forks:
 * each is armed at its fork and counts on its own.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static pid_t armed_pid;          /* 0: not armed in this process */
static unsigned long crash_at;   /* 0: count only */
static unsigned long counter;
static const char *trace_path;
static char match_call[32];      /* RUNSPOOL_CRASH_MATCH=<call>:<text>: count only */
static const char *match_text;   /* the calls of that name whose path holds text */

static void trace(const char *what, unsigned long n, const char *call, const char *arg) {
    if (!trace_path) return;
    char line[1024];
    int len = snprintf(line, sizeof line, "%s %d %lu %s %s\n", what, (int)armed_pid, n, call, arg ? arg : "-");
    if (len > (int)sizeof line - 1) {
        len = sizeof line - 1;
        line[len - 1] = '\n';
    }
    /* Opened for each line: the daemon closes every inherited descriptor
     * at start-up (platform::close_inherited_fds). */
    int fd = (int)syscall(SYS_openat, AT_FDCWD, trace_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    syscall(SYS_write, fd, line, (size_t)len);
    syscall(SYS_close, fd);
}

static void fd_path(int fd, char *buf, size_t size) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    long n = syscall(SYS_readlinkat, AT_FDCWD, link, buf, size - 1);
    if (n < 0) n = 0;
    buf[n] = 0;
    snprintf(buf + n, size - n, " (fd %d)", fd);
}

/* One counted call: trace it and, at N, die before it happens. */
static void point(const char *call, const char *path, int fd) {
    if (!armed_pid || syscall(SYS_getpid) != armed_pid) return;
    char buf[512];
    if (match_text) {
        if (!path && fd >= 0) {
            fd_path(fd, buf, sizeof buf);
            path = buf;
        }
        if ((match_call[0] && strcmp(call, match_call) != 0) || !path || !strstr(path, match_text)) return;
    }
    /* /dev/null opened for a child's stdio changes nothing on disk. */
    if (path && (strncmp(path, "/dev/", 5) == 0 || strncmp(path, "/proc/", 6) == 0)) return;
    unsigned long n = __atomic_add_fetch(&counter, 1, __ATOMIC_SEQ_CST);
    if (crash_at && n != crash_at) return;
    if (!path && fd >= 0) {
        fd_path(fd, buf, sizeof buf);
        path = buf;
    }
    trace(crash_at ? "kill" : "count", n, call, path);
    if (crash_at) syscall(SYS_kill, armed_pid, SIGKILL);
}

/* Copy at most size-1 bytes of src, NUL-terminated (a longer name just cannot match). */
static void copy_bounded(char *dst, const char *src, size_t size) {
    size_t l = strnlen(src, size - 1);
    memcpy(dst, src, l);
    dst[l] = 0;
}

/* This process's command line as it was exec'd: argv[0]'s base name and
 * argv[1] ("" when absent), copied into the buffers; 0 when unreadable. */
static int command_line(char *base, char *argv1, size_t size) {
    char cmd[4096];
    int fd = (int)syscall(SYS_openat, AT_FDCWD, "/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    long n = syscall(SYS_read, fd, cmd, sizeof cmd - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return 0;
    cmd[n] = 0;
    const char *a1 = cmd + strlen(cmd) + 1;
    if (a1 >= cmd + n) a1 = "";
    const char *b = strrchr(cmd, '/');
    copy_bounded(base, b ? b + 1 : cmd, size);
    copy_bounded(argv1, a1, size);
    return 1;
}

static int role_matches(const char *role, const char *base, const char *argv1) {
    if (strcmp(role, "daemon") == 0) return strcmp(base, "runspool") == 0 && strcmp(argv1, "daemon") == 0;
    if (strcmp(role, "runner") == 0)
        return strcmp(base, "runspool-runner") == 0 || (strcmp(base, "runspool") == 0 && strcmp(argv1, "runner") == 0);
    return 0;
}

/* A runner forked by the fork server (`runspool-runner --fork-server`,
 * src/platform/forkserver.rs): armed in the child, counting from 1 as an
 * exec'd runner would. */
static void arm_forked_runner(void) {
    if (armed_pid) return; /* a runner's own fork: the child passes through until its exec */
    counter = 0;
    armed_pid = (pid_t)syscall(SYS_getpid);
}

__attribute__((constructor)) static void init(void) {
    const char *role = getenv("RUNSPOOL_CRASH_ROLE");
    char base[256], argv1[256];
    if (!role || !command_line(base, argv1, sizeof base) || !role_matches(role, base, argv1)) return;
    const char *at = getenv("RUNSPOOL_CRASH_AT");
    crash_at = at ? strtoul(at, NULL, 10) : 0;
    const char *tr = getenv("RUNSPOOL_CRASH_TRACE");
    trace_path = tr ? strdup(tr) : NULL;
    const char *m = getenv("RUNSPOOL_CRASH_MATCH");
    const char *colon = m ? strchr(m, ':') : NULL;
    if (colon && (size_t)(colon - m) < sizeof match_call) {
        memcpy(match_call, m, (size_t)(colon - m));
        match_text = strdup(colon + 1);
    }
    if (strcmp(role, "runner") == 0 && strcmp(argv1, "--fork-server") == 0)
        pthread_atfork(NULL, NULL, arm_forked_runner); /* not armed itself: its children are */
    else
        armed_pid = (pid_t)syscall(SYS_getpid);
}

#define REAL(name) static __typeof__(name) *real; if (!real) real = (__typeof__(name) *)dlsym(RTLD_NEXT, #name)

static int mutating_open(int flags) {
    return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND)) != 0;
}

static int regular_fd(int fd) {
    struct stat st;
    if (fd <= 2) return 0; /* stdio: logs, not state */
    if (syscall(SYS_fstat, fd, &st) != 0) return 0;
    return S_ISREG(st.st_mode);
}

#define OPEN_MODE(flags) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }

int open(const char *p, int flags, ...) { OPEN_MODE(flags); REAL(open); if (mutating_open(flags)) point("open", p, -1); return real(p, flags, mode); }
int open64(const char *p, int flags, ...) { OPEN_MODE(flags); REAL(open64); if (mutating_open(flags)) point("open", p, -1); return real(p, flags, mode); }
int openat(int d, const char *p, int flags, ...) { OPEN_MODE(flags); REAL(openat); if (mutating_open(flags)) point("openat", p, -1); return real(d, p, flags, mode); }
int openat64(int d, const char *p, int flags, ...) { OPEN_MODE(flags); REAL(openat64); if (mutating_open(flags)) point("openat", p, -1); return real(d, p, flags, mode); }
int creat(const char *p, mode_t m) { REAL(creat); point("creat", p, -1); return real(p, m); }
int creat64(const char *p, mode_t m) { REAL(creat64); point("creat", p, -1); return real(p, m); }

ssize_t write(int fd, const void *b, size_t n) { REAL(write); if (armed_pid && regular_fd(fd)) point("write", NULL, fd); return real(fd, b, n); }
ssize_t writev(int fd, const struct iovec *v, int c) { REAL(writev); if (armed_pid && regular_fd(fd)) point("writev", NULL, fd); return real(fd, v, c); }
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) { REAL(pwrite); if (armed_pid && regular_fd(fd)) point("pwrite", NULL, fd); return real(fd, b, n, o); }
ssize_t pwrite64(int fd, const void *b, size_t n, off64_t o) { REAL(pwrite64); if (armed_pid && regular_fd(fd)) point("pwrite", NULL, fd); return real(fd, b, n, o); }

int rename(const char *a, const char *b) { REAL(rename); point("rename", a, -1); return real(a, b); }
int renameat(int da, const char *a, int db, const char *b) { REAL(renameat); point("renameat", a, -1); return real(da, a, db, b); }
int renameat2(int da, const char *a, int db, const char *b, unsigned f) { REAL(renameat2); point("renameat2", a, -1); return real(da, a, db, b, f); }
int link(const char *a, const char *b) { REAL(link); point("link", b, -1); return real(a, b); }
int linkat(int da, const char *a, int db, const char *b, int f) { REAL(linkat); point("linkat", b, -1); return real(da, a, db, b, f); }
int symlink(const char *a, const char *b) { REAL(symlink); point("symlink", b, -1); return real(a, b); }
int symlinkat(const char *a, int d, const char *b) { REAL(symlinkat); point("symlinkat", b, -1); return real(a, d, b); }
int unlink(const char *p) { REAL(unlink); point("unlink", p, -1); return real(p); }
int unlinkat(int d, const char *p, int f) { REAL(unlinkat); point("unlinkat", p, -1); return real(d, p, f); }
int mkdir(const char *p, mode_t m) { REAL(mkdir); point("mkdir", p, -1); return real(p, m); }
int mkdirat(int d, const char *p, mode_t m) { REAL(mkdirat); point("mkdirat", p, -1); return real(d, p, m); }
int rmdir(const char *p) { REAL(rmdir); point("rmdir", p, -1); return real(p); }
int fsync(int fd) { REAL(fsync); point("fsync", NULL, fd); return real(fd); }
int fdatasync(int fd) { REAL(fdatasync); point("fdatasync", NULL, fd); return real(fd); }
int flock(int fd, int op) { REAL(flock); point("flock", NULL, fd); return real(fd, op); }
int ftruncate(int fd, off_t l) { REAL(ftruncate); point("ftruncate", NULL, fd); return real(fd, l); }
int ftruncate64(int fd, off64_t l) { REAL(ftruncate64); point("ftruncate", NULL, fd); return real(fd, l); }
int truncate(const char *p, off_t l) { REAL(truncate); point("truncate", p, -1); return real(p, l); }
int chmod(const char *p, mode_t m) { REAL(chmod); point("chmod", p, -1); return real(p, m); }
int fchmod(int fd, mode_t m) { REAL(fchmod); point("fchmod", NULL, fd); return real(fd, m); }
int fchmodat(int d, const char *p, mode_t m, int f) { REAL(fchmodat); point("fchmodat", p, -1); return real(d, p, m, f); }
