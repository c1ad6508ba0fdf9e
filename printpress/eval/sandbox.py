"""Run untrusted Python (model-written code) where the kernel, not Python, keeps it away from everything else.

Threat model: the program is hostile. It may be pure Python or reach native code (ctypes, `_posixsubprocess`,
`os.*` with `dir_fd=`, sqlite3, ...); it may start processes, detach them (`setsid`), signal or `prlimit`
anything it can name, read any file or `/proc` entry it can open, and inspect its own interpreter (frames,
gc, /proc/self/mem). Nothing a Python audit hook refuses counts as a guarantee, since native code steps around
it. The guarantees below hold because the kernel enforces them.

How one run goes (each program gets a fresh sandbox; `python -I -S -B` starts once per run, the rest are forks):

1. The harness starts a *launcher* (`python -I -S -B`, its code compiled once by the harness and marshalled
   with the run's configuration on stdin, never in argv) in a new session with a minimal environment (PATH,
   LANG) and nothing else of its own: no secret of the harness's environment is ever in it.
2. The launcher calls unshare(2) for new mount, PID, network, IPC, UTS and cgroup namespaces (and a user
   namespace when not run as root, mapping only the invoking user) and forks: the child is PID 1, "init", of
   a PID namespace the harness is not in.
3. Init (still privileged) builds a new root on a tmpfs and pivots into it (pivot_root, old root detached):
   read-only, nosuid, nodev bind mounts of /usr, /bin, /sbin, /lib*, /etc (and /nix) and of the interpreter's
   own prefix and library folders, wherever they are; a fresh /proc of the new PID namespace (hidepid=2,
   read-only); a /dev with only null, zero, full, random, urandom; and a private writable tmpfs at /tmp, owned
   by the program's user, capped at `disk_mb` (and an inode count): the working directory and the only
   writable place. Home folders, the repository, /run, /var, /sys and the harness's /tmp are simply absent.
4. Init forks the program's process. It drops every capability (bounding set included), sets no_new_privs,
   and switches to an unprivileged uid/gid with no supplementary groups (as root: a random uid from a high,
   unassigned range, so concurrent runs do not share RLIMIT_NPROC; in a user namespace: capabilities dropped,
   uid unchanged). It sets RLIMIT_AS, CPU, FSIZE, NOFILE, NPROC and CORE on itself, clears os.environ, closes
   every descriptor except stdin (/dev/null), stdout/stderr (files of the harness, capped by RLIMIT_FSIZE) and
   its own channels, installs the audit hook (a tripwire), and only then compiles and runs the program.
5. Init reaps. When the process that decides the verdict exits, init writes a report on a pipe to the harness
   and exits; the kernel then SIGKILLs every other process of the namespace, `setsid` daemons included. At the
   wall-clock deadline the harness SIGKILLs the launcher's process group (launcher and init), with the same
   effect.

What this gives, and why (each is a test in tests/test_sandbox.py):
- Writes outside /tmp fail with EROFS (or ENOENT: most of the machine is not there) whatever the path,
  `dir_fd=`, sqlite3, mkfifo, fchmod or rename used: there is no writable mount but /tmp. The disk cap is the
  tmpfs size (ENOSPC), per file RLIMIT_FSIZE.
- Processes: `fork`/`exec` (even `_posixsubprocess.fork_exec`) may run, but as the same unprivileged user,
  under RLIMIT_NPROC, inside the namespaces, and they all die when the run ends.
- The harness is out of reach: its PID is not in the namespace (kill, pidfd_open, prlimit, ptrace and
  /proc/<pid> all see ESRCH/ENOENT). The parent the program sees is init: as root, init is another uid,
  invisible under hidepid, that the program cannot signal, prlimit or ptrace. In a user namespace init has
  the program's kernel uid but capabilities it lacks (no ptrace) and, as PID 1, ignores signals; should the
  program still bring init down (prlimit), the run is that program's crash, never a pass nor a harness error.
- No network: a new network namespace with only a loopback device that is down. Pathname Unix sockets of the
  host (/run, /tmp, /var) are not in the new root.
- Nothing of the harness's environment: the launcher never had it, /proc shows only the namespace.
- `detail` is one line of at most DETAIL_LIMIT printable characters, and any value of the harness's own
  environment found in detail, stdout or stderr is replaced with "[redacted]" (defence in depth: the
  sandbox cannot read them in the first place).

The verdict. A program that runs in one process with its tests can always forge a pass from inside: whatever
the trusted code at the end would do (write a nonce, exit 0, print a marker) the program can do first, and
any secret it would use is in the same address space (frames, gc, /proc/self/mem) or arrives on a channel
the program can also read. It can also defeat the tests without leaving the process at all (a result whose
`__eq__` always says True, a trace function that jumps over asserts). So a trustworthy verdict needs the
tests in another process. `run_check(Check(...))` does that: the program (untrusted) and the tests (trusted:
HumanEval's prompt, test and `check` call) run in two processes of the same sandbox, under two different
unprivileged uids (or, in a user namespace, with the test process non-dumpable), so the program cannot
signal, ptrace or read the test process. The tests call the program's function through a proxy: arguments
go over a pipe, the function runs in the program's process, and only plain data comes back (None, bool, int,
float, complex, str, bytes, and lists, tuples, sets, frozensets and dicts of them), decoded by a strict
parser in the test process (JSON with one-key tags, read by the C scanner of the json package); an
exception comes back as its builtin type and message. The program's objects never reach the tests, so a
custom `__eq__`, a patched builtin or a trace function in the program changes nothing there. Pass means:
the test process ran the tests to their end and exited 0, as init saw it (init is the only holder of the
report pipe, which the program never has). A program that exits, crashes or stops answering makes the
tests fail.

`run_program(source)` runs one untrusted program with no trusted part: it passes when it runs to its end
without error and exits 0 (`sys.exit(0)` in the middle is a failure; an end marker is written after the
program returns). Nothing there can be forged because nothing there is trusted: a program that wants to
pass can simply not fail. Use `run_check` whenever the tests are trusted and the code is not.

When the machine cannot make the namespaces (no root and no unprivileged user namespaces, or a seccomp
policy that forbids them), `run_program`/`run_check` refuse with SandboxUnavailable, unless the caller opts
out explicitly (`unsafe_no_isolation=True`, or PRINTPRESS_UNSAFE_NO_ISOLATION=1 in the environment). Then
only the old guards remain: the audit hook (a tripwire: native code steps around it), the rlimits, a
temporary working directory, the process group killed at the end, and the program runs as the invoking user.

Not enforced: memory is limited per process (RLIMIT_AS), not per sandbox (no cgroup), so a program may use
about `processes` x `memory_mb` if it forks, plus `disk_mb` of tmpfs; CPU time is per process as well; the
program may read the world-readable files of /usr, /etc and the interpreter's prefix.
"""

from __future__ import annotations

import functools
import marshal
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from printpress.errors import PrintpressError

OUTPUT_TAIL = 2000  # characters of stdout/stderr kept in a result
DETAIL_LIMIT = 240  # characters of `detail`
UNSAFE_ENV = "PRINTPRESS_UNSAFE_NO_ISOLATION"  # set to 1 to run without kernel isolation (not recommended)
# Programs run as uids drawn at random from this range when the harness is root (see `_draw_uids`): above
# every range systemd assigns to users, containers (0x00080000-0x6FFFFFFF) and foreign images (0x7FFE0000..).
SANDBOX_UIDS = range(0x7F000000, 0x7F200000)


class SandboxUnavailable(PrintpressError):
    """The machine cannot give untrusted code kernel isolation, and the caller did not opt out."""


class SandboxError(PrintpressError):
    """The sandbox itself failed (not the program): a run could not be set up."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    timeout_s: float = 10.0  # wall clock; the whole sandbox is killed after it
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS)
    file_size_mb: int = 16  # largest file a process may write, stdout and stderr included (RLIMIT_FSIZE)
    disk_mb: int = 64  # everything written under the working directory together (size of its tmpfs)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # processes and threads of the program's user (RLIMIT_NPROC)
    audit_hook: bool = True  # the Python-level tripwire (turned off only to test the kernel-level guards)


@dataclass(frozen=True)
class Check:
    """Untrusted code and the trusted tests of one of its functions, run in separate processes.

    `program` (untrusted) is run, then its function `entry_point` serves calls. `prelude` and then `tests`
    (trusted) run in another process, where `entry_point` names a proxy of that function (HumanEval: prelude
    = the prompt, for its helpers; tests = the test code and `check(entry_point)`).
    """

    program: str
    entry_point: str
    tests: str
    prelude: str = ""


@dataclass(frozen=True)
class SandboxResult:
    status: str  # "passed", "failed" (error or early exit), "timeout" or "crashed" (killed by a signal)
    returncode: int | None  # the program's exit status (negative: signal); for a Check, the tests' process's
    duration_s: float
    stdout: str  # tails of the program's output
    stderr: str
    detail: str  # one line: why it did not pass ("" when it passed); bounded and scrubbed
    test_output: str = ""  # for a Check: the tail of the tests' process's stderr

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# ---------------------------------------------------------------------------------------------------------------
# The launcher: compiled once by the harness, run as `python -I -S -B -c _BOOT` with its code object and the
# run's configuration marshalled on stdin; it reports (marshalled) on stdout. Self-contained (standard library
# only, and only cheap modules: `signal` would pull in enum): it runs before and outside anything of printpress.
_BOOT = ("import marshal, sys\ncode, config = marshal.loads(sys.stdin.buffer.read())\n"
         "exec(marshal.loads(code), {'__name__': '__launcher__', 'CONFIG': config})\n")
_LAUNCHER = r'''
import _signal, ctypes, errno, marshal, os, resource, sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, AT_RECURSIVE, SYS_MOUNT_SETATTR = 1, 2, 4, 0x8000, 442
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "loongarch64": 41, "ppc64le": 203,
                  "ppc64": 203, "s390x": 217, "i386": 217, "i686": 217, "armv7l": 218}
ALLOWED_TOP = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "nix")
DEVICES = ("null", "zero", "full", "random", "urandom")
NEW_ROOT = "/tmp"  # where init builds the new root (any existing directory; hidden by the mount)
GONE = 3  # exit status of the tests' process when the program stopped answering
STARTED = []  # set once the program's process exists: a failure of init after that may be the program's doing
SIGINT, SIGKILL = _signal.SIGINT, _signal.SIGKILL
MAX_MESSAGE = 16 << 20

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
libc.syscall.restype = ctypes.c_long


def _ok(ret, what):
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _b(s):
    return None if s is None else os.fsencode(s)


def mount(source, target, fstype, flags, data=None):
    _ok(libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def prctl(option, arg=0):
    return _ok(libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def make_read_only(path):
    """Read-only, nosuid, nodev: `path` and every mount below it."""
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    if libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(-100), ctypes.c_char_p(_b(path)),
                    ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:  # kernels before 5.12 have no mount_setattr: remount one by one
        _ok(-1, f"mount_setattr {path}")
    keep = {"noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            if point == path or point.startswith(path.rstrip("/") + "/"):
                flags = sum(keep.get(o, 0) for o in fields[5].split(","))
                mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | flags)


def kept_paths():
    """Folders the interpreter needs (its prefixes, the folders of the libraries it has mapped) outside ALLOWED_TOP."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            name = parts[5].strip() if len(parts) == 6 else ""
            if name.startswith("/") and not name.endswith("(deleted)"):
                paths.add(os.path.dirname(os.path.realpath(name)))
    covered = {os.path.realpath("/" + top) for top in ALLOWED_TOP}
    out = []
    for p in sorted(paths):
        if p == "/" or any(p == c or p.startswith(c + "/") for c in covered | set(out)):
            continue
        out.append(p)
    return out


def enter_namespaces(userns):
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    uid, gid = os.geteuid(), os.getegid()
    _ok(libc.unshare(flags | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:  # only the invoking user exists inside, as uid 0 of the namespace
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def build_root(config, keep):
    """Init's work: the new root (see the module docstring of printpress/eval/sandbox.py), then pivot into it."""
    R = NEW_ROOT
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount may propagate back to the host
    mount("printpress-root", R, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for top in ALLOWED_TOP:
        src = "/" + top
        if os.path.islink(src):
            os.symlink(os.readlink(src), R + src)
        elif os.path.isdir(src):
            os.mkdir(R + src)
            mount(src, R + src, None, MS_BIND | MS_REC)
    for path in keep:
        os.makedirs(R + path, mode=0o755)
        mount(path, R + path, None, MS_BIND | MS_REC)
    for d in ("tmp", "proc", "dev"):
        os.mkdir(R + "/" + d)
    make_read_only(R)
    try:
        mount("proc", R + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "hidepid=2")
    except OSError:
        if not config["userns"]:
            raise  # a user namespace may be refused proc where the host's is partly hidden: go without
    uid = config["uids"][0]
    mount("printpress-work", R + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={config['disk_kb']}k,nr_inodes={config['inodes']},mode=0700,uid={uid},gid={uid}")
    mount("printpress-dev", R + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in DEVICES:
        os.close(os.open(R + "/dev/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
        mount("/dev/" + name, R + "/dev/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, R + "/dev/" + name)
    mount(None, R + "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.chdir(R)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and libc.syscall(ctypes.c_long(number), b".", b".") == 0:
        _ok(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH: the old root is gone from this namespace
    else:  # rootfs (initramfs) or an unknown architecture: move the new root over / and chroot into it
        mount(R, "/", None, MS_MOVE)
        _ok(libc.chroot(b"."), "chroot")
    os.chdir("/")
    libc.sethostname(b"sandbox", 7)


def drop_privileges(uid, userns, dumpable):
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if userns:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        _ok(libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    else:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    prctl(PR_SET_DUMPABLE, 1 if dumpable else 0)
    with open("/proc/self/status") as f:  # verify, never assume: no capability may be left
        caps = dict(line.split(":", 1) for line in f if line.startswith("Cap"))
    if any(int(caps[k], 16) for k in ("CapEff", "CapPrm", "CapAmb", "CapInh")):
        raise OSError(errno.EPERM, f"capabilities remain after dropping them: {caps}")


def setup_child(config, fds, uid, dumpable, workdir):
    """In a fresh fork of init: descriptors, privileges, limits, environment. `fds` land on 0, 1, 2, 3, ..."""
    import fcntl
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in fds]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(len(fds), 1 << 20)
    if config["isolate"]:
        drop_privileges(uid, config["userns"], dumpable)
    lim = config["limits"]
    for kind, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, lim["fsize"]),
                        (resource.RLIMIT_NOFILE, lim["nofile"]), (resource.RLIMIT_CPU, lim["cpu"]),
                        (resource.RLIMIT_AS, lim["memory"])):
        resource.setrlimit(kind, (value, value))
    if config["isolate"]:
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    _signal.signal(SIGINT, _signal.default_int_handler)  # init ignores it; the program gets Python's usual
    os.umask(0o077)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                       "LANG": "C.UTF-8"})
    sys.argv[:] = ["program.py"]


def guard(workdir):
    """The audit hook: a tripwire with clear messages, not a boundary (the kernel is the boundary)."""
    import os.path as _path
    allowed = (workdir, "/dev/null")
    writes = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    denied = ("socket.", "ctypes.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
              "subprocess.Popen", "pty.spawn", "os.killpg", "signal.pthread_kill", "sys.addaudithook")
    paths_changed = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2,
                     "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1, "shutil.rmtree": 1,
                     "shutil.copyfile": 2, "shutil.copymode": 2, "shutil.copystat": 2, "os.chflags": 1,
                     "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1}
    busy = []

    def inside(path):
        if isinstance(path, int):
            return True
        try:
            real = _path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return any(real == a or real.startswith(a + "/") for a in allowed)

    def hook(event, args):
        if busy:
            return
        busy.append(1)
        try:
            if event.startswith(denied):
                raise PermissionError(f"sandbox: {event} is not allowed")
            if event == "os.kill" and args[0] not in (0, os.getpid()):
                raise PermissionError("sandbox: signalling other processes is not allowed")
            if event == "open" and args[2] & writes and not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
            n = paths_changed.get(event)
            if n and not all(inside(p) for p in args[:n]):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
        finally:
            busy.pop()

    sys.addaudithook(hook)


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def print_exception():
    """The traceback of the exception being handled, as the interpreter prints it (its C printer: no imports),
    without the launcher's frames."""
    kind, exc, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_code.co_filename == "<launcher>":
        tb = tb.tb_next
    try:
        sys.__excepthook__(kind, exc.with_traceback(tb), tb)
    except BaseException:
        print(kind.__name__, file=sys.stderr)


def exit_status(exc):
    """What the interpreter would exit with for this SystemExit."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# --- the channel between the tests' process and the program's: length-prefixed JSON of plain data ---

def make_codec():
    """(dumps, loads) for JSON through the C accelerator alone: the json package would import re and enum
    (about 15 ms a run). Falls back to the json package if the accelerator's interface differs."""
    try:
        import _json
        ctx = type("Context", (), {})()
        ctx.strict, ctx.object_hook, ctx.object_pairs_hook = True, None, None
        ctx.parse_float, ctx.parse_int = float, int
        ctx.parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__
        scan = _json.make_scanner(ctx)

        def refuse(obj):
            raise TypeError(f"{type(obj).__name__} is not JSON")

        chunks = _json.make_encoder(None, refuse, _json.encode_basestring_ascii, None, ":", ",", False, False, True)

        def dumps(obj):
            return "".join(chunks(obj, 0))

        def loads(text):
            try:
                obj, end = scan(text, 0)
            except StopIteration:
                raise ValueError("not JSON") from None
            if end != len(text):
                raise ValueError("not JSON: trailing data")
            return obj

        sample = [1, -2.5, float("inf"), None, True, "\u00e9\"", {"d": [[{"t": []}, 10 ** 30]]}]
        if dumps(sample) != '[1,-2.5,Infinity,null,true,"\\u00e9\\"",{"d":[[{"t":[]},' + str(10 ** 30) + ']]}]' \
                or loads(dumps(sample)) != sample:
            raise ValueError("unexpected accelerator")
        return dumps, loads
    except Exception:
        import json
        return (lambda obj: json.dumps(obj, separators=(",", ":"))), json.loads


CODEC = []  # (dumps, loads), made on first use (in init, before the forks, for a Check)


def codec():
    if not CODEC:
        CODEC.extend(make_codec())
    return CODEC


def write_message(fd, obj):
    data = codec()[0](obj).encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(fd):
    header = read_exact(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes is over the limit")
    data = read_exact(fd, size)
    if data is None:
        return None
    return codec()[1](data.decode("utf-8"))


def encode(value, depth=0):
    """Plain data as JSON: native for None, bool, int, float, str; tagged one-key objects for the rest."""
    if depth > 100:
        raise ValueError("the value is nested too deeply")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return {"l": [encode(v, depth + 1) for v in value]}
    if isinstance(value, tuple):
        return {"t": [encode(v, depth + 1) for v in value]}
    if isinstance(value, frozenset):
        return {"f": [encode(v, depth + 1) for v in value]}
    if isinstance(value, set):
        return {"s": [encode(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"a value of type {type(value).__name__} cannot be passed between the program and its tests")


def decode(value, depth=0):
    """The strict inverse of encode: builds only plain data, refuses anything else."""
    if depth > 100:
        raise ValueError("the value is nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is dict and len(value) == 1:
        (tag, x), = value.items()
        if tag == "c" and type(x) is list and len(x) == 2 and all(type(v) in (int, float) for v in x):
            return complex(x[0], x[1])
        if tag == "b" and type(x) is str:
            return bytes.fromhex(x)
        if type(x) is list:
            if tag == "l":
                return [decode(v, depth + 1) for v in x]
            if tag == "t":
                return tuple(decode(v, depth + 1) for v in x)
            if tag == "s":
                return {decode(v, depth + 1) for v in x}
            if tag == "f":
                return frozenset(decode(v, depth + 1) for v in x)
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in x):
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in x}
    raise ValueError("the program sent a malformed value")


class ProgramGone(BaseException):
    """The program's process stopped answering (exited, crashed or closed its channel). Not an Exception, so
    tests that catch Exception cannot swallow it."""


def serve(entry_point, namespace, requests, replies):
    """The program's side of a Check: answer calls of its function until the tests close the channel."""
    fn = namespace.get(entry_point)
    if not callable(fn):
        print(f"NameError: the program does not define a function {entry_point!r}", file=sys.stderr)
        flush()
        os._exit(1)
    while True:
        message = read_message(requests)
        if message is None:
            flush()
            os._exit(0)
        try:
            args, kwargs = decode(message[0]), decode(message[1])
            result = fn(*args, **kwargs)
            reply = ["return", encode(result)]
        except BaseException as exc:
            try:
                text = str(exc)[:500]
            except BaseException:
                text = ""
            reply = ["raise", type(exc).__name__, text]
        flush()
        try:
            write_message(replies, reply)
        except (TypeError, ValueError, RecursionError) as exc:
            write_message(replies, ["raise", "TypeError", str(exc)[:500]])


def proxy(requests, replies):
    """The tests' side: a function that forwards its call and returns (or raises) plain data only."""
    import builtins

    def candidate(*args, **kwargs):
        try:
            write_message(requests, [encode(list(args)), encode(kwargs)])
            message = read_message(replies)
        except (BrokenPipeError, ConnectionResetError):
            raise ProgramGone("the program stopped answering") from None
        if message is None:
            raise ProgramGone("the program stopped answering")
        if type(message) is list and len(message) == 2 and message[0] == "return":
            return decode(message[1])
        if (type(message) is list and len(message) == 3 and message[0] == "raise" and type(message[1]) is str
                and type(message[2]) is str):
            name, text = message[1][:100], message[2][:500]
            kind = getattr(builtins, name, None) if name.isidentifier() else None
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    error = kind(text)
                except Exception:
                    error = RuntimeError(f"{name}: {text}")
            else:
                error = RuntimeError(f"{name}: {text}")
            raise error
        raise ValueError("the program sent a malformed reply")

    return candidate


def run_tests(config, requests, replies):
    namespace = {"__name__": "__main__"}
    fn = proxy(requests, replies)
    try:
        exec(compile(config["prelude"], "prompt.py", "exec"), namespace)
        namespace[config["entry_point"]] = fn
        exec(compile(config["tests"], "tests.py", "exec"), namespace)
    except ProgramGone as exc:
        print(f"ProgramGone: {exc}", file=sys.stderr)
        flush()
        os._exit(GONE)
    except BaseException:
        print_exception()
        flush()
        os._exit(1)
    flush()
    os._exit(0)


def run_untrusted(config, entry_point, channels):
    """The untrusted side: run the program; then either mark its end, or serve calls for the tests."""
    source = config["program"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        with open("program.py", "w", encoding="utf-8") as f:  # for the source lines of tracebacks
            f.write(source)
    except OSError:
        pass
    try:
        code = compile(source, "program.py", "exec")
    except BaseException:
        print_exception()
        flush()
        os._exit(1)
    write = os.write
    if config["hook"]:
        guard(os.getcwd())
    try:
        exec(code, namespace)
    except SystemExit as exc:
        status = exit_status(exc)
        flush()
        os._exit(status)
    except BaseException:
        print_exception()
        flush()
        os._exit(1)
    if entry_point is None:
        flush()
        write(channels[0], b"1")  # the end marker (nothing here is trusted: see the module docstring)
        os._exit(0)
    serve(entry_point, namespace, *channels)


def status_of(wait_status):
    return os.waitstatus_to_exitcode(wait_status)


def init(config, report):
    """PID 1 of the sandbox (or, without isolation, a plain parent): set up, fork the processes, reap, report."""
    os.umask(0o022)
    # PID 1 ignores every signal it has no handler for; Python's only one is SIGINT's. (In a user namespace the
    # program has init's kernel uid, so it may signal it: none must reach it.)
    _signal.signal(SIGINT, _signal.SIG_IGN)
    if config["isolate"]:
        prctl(PR_SET_PDEATHSIG, SIGKILL)
        build_root(config, config["keep"])
        workdir = "/tmp"
    else:
        workdir = config["workdir"]
    null = os.open("/dev/null", os.O_RDWR)
    out, err, test_err = config["fds"]
    check = config["mode"] == "check"
    if check:  # once, before the two forks that both use them: the codec, the modules the (trusted) prelude imports
        codec()
        for line in config["prelude"].splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from"):
                try:
                    __import__(words[1].split(".")[0].rstrip(","))
                except Exception:
                    pass
    uid_program, uid_tests = config["uids"]
    pids = {}
    if check:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                setup_child(config, [null, out, err, req_r, rep_w], uid_program, True, workdir)
                run_untrusted(config, config["entry_point"], (3, 4))
            finally:
                os._exit(70)
        pids[pid] = "program"
        STARTED.append(True)
        pid = os.fork()
        if pid == 0:
            try:
                setup_child(config, [null, test_err, test_err, req_w, rep_r], uid_tests, False, "/")
                run_tests(config, 3, 4)
            finally:
                os._exit(70)
        pids[pid] = "tests"
        for fd in (req_r, req_w, rep_r, rep_w):
            os.close(fd)
        target = "tests"
    else:
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                setup_child(config, [null, out, err, done_w], uid_program, True, workdir)
                run_untrusted(config, None, (3,))
            finally:
                os._exit(70)
        pids[pid] = "program"
        STARTED.append(True)
        os.close(done_w)
        target = "program"
    statuses = {}
    while target not in statuses:
        pid, status = os.wait()
        if pid in pids:
            statuses[pids[pid]] = status_of(status)
    if check and statuses["tests"] == GONE and "program" not in statuses:
        import time
        deadline = time.monotonic() + 1.0  # it is exiting: its channel closed; collect how it ended
        program_pid = next(p for p, n in pids.items() if n == "program")
        while time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == program_pid:
                statuses["program"] = status_of(status)
                break
            if pid == 0:
                time.sleep(0.002)
    result = {"ok": True, "program": statuses.get("program"), "tests": statuses.get("tests")}
    if not check:
        os.set_blocking(done_r, False)
        try:
            result["finished"] = os.read(done_r, 1) == b"1"
        except BlockingIOError:
            result["finished"] = False
    os.write(report, marshal.dumps(result))
    if not config["isolate"]:
        try:
            os.killpg(0, SIGKILL)  # the program's leftovers (no namespace to end them)
        except OSError:
            pass
    os._exit(0)


def main(config):
    report = 1
    if config["isolate"]:
        prctl(PR_SET_PDEATHSIG, SIGKILL)
        try:
            config["keep"] = kept_paths()
            enter_namespaces(config["userns"])
        except OSError as exc:
            os.write(report, marshal.dumps({"error": f"cannot create namespaces: {exc}"}))
            os._exit(0)
    pid = os.fork()
    if pid == 0:
        try:
            init(config, report)
        except BaseException as exc:
            try:
                error = f"{type(exc).__name__}: {exc}"[:500]
                os.write(report, marshal.dumps({"error": error, "started": bool(STARTED)}))
            except BaseException:
                pass
        os._exit(0)
    os.waitpid(pid, 0)
    os._exit(0)


main(CONFIG)
'''


@functools.cache
def _launcher_code() -> bytes:
    return marshal.dumps(compile(_LAUNCHER, "<launcher>", "exec"))

# ---------------------------------------------------------------------------------------------------------------
# The harness side.

_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _draw_uids() -> tuple[int, int]:
    """Two fresh uids (program, tests) for one run, distinct from every run this process has in flight."""
    with _uid_lock:
        while True:
            first = SANDBOX_UIDS.start + 2 * secrets.randbelow(len(SANDBOX_UIDS) // 2)
            if first not in _uids_in_use:
                _uids_in_use.add(first)
                return first, first + 1


def _release_uids(uids: tuple[int, int]) -> None:
    with _uid_lock:
        _uids_in_use.discard(uids[0])


def unsafe_requested(unsafe_no_isolation: bool = False) -> bool:
    """Whether the caller opted out of kernel isolation (argument or PRINTPRESS_UNSAFE_NO_ISOLATION=1)."""
    return unsafe_no_isolation or os.environ.get(UNSAFE_ENV, "").strip().lower() in ("1", "true", "yes")


@functools.cache
def _probe() -> tuple[str, str]:
    """(description, problem): what isolation this machine gives, or why it gives none. Tried once per process."""
    userns = os.geteuid() != 0
    body = "import os, json, hashlib, sqlite3, decimal\nassert os.getppid() == 1, os.getppid()\n"
    try:
        result = _execute({"mode": "program", "program": body}, Limits(timeout_s=20), isolate=True)
    except SandboxError as exc:
        return "", str(exc)
    if not result.passed:
        return "", f"a trial program failed in the sandbox: {result.detail or result.status}"
    if userns:
        return "kernel: user, PID, mount, network, IPC and UTS namespaces; capabilities dropped", ""
    return "kernel: PID, mount, network, IPC and UTS namespaces; an unprivileged uid", ""


def isolation() -> str:
    """How untrusted code is isolated on this machine ("" when the kernel isolation cannot be had)."""
    return _probe()[0]


def network_isolation() -> str:
    """How the network is kept away: "namespace" (kernel) or "audit hook" (Python-level only, unsafe mode)."""
    return "namespace" if isolation() else "audit hook"


def require_isolation(unsafe_no_isolation: bool = False) -> bool:
    """True when runs will be isolated; False when the caller opted out; SandboxUnavailable otherwise."""
    description, problem = _probe()
    if description:
        return True
    if unsafe_requested(unsafe_no_isolation):
        return False
    raise SandboxUnavailable(
        f"refusing to run untrusted code: this machine cannot isolate it ({problem}). Run as root, or enable "
        f"unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also "
        f"kernel.apparmor_restrict_unprivileged_userns=0); or, to run it with only the weak guards, opt out "
        f"explicitly: printpress eval --unsafe-no-isolation, {UNSAFE_ENV}=1, or unsafe_no_isolation=True from Python")


def run_program(source: str, limits: Limits | None = None, *, unsafe_no_isolation: bool = False) -> SandboxResult:
    """Run `source` (untrusted, with no trusted part) and say whether it ran to its end without error."""
    isolate = require_isolation(unsafe_no_isolation)
    return _execute({"mode": "program", "program": source}, limits or Limits(), isolate)


def run_check(check: Check, limits: Limits | None = None, *, unsafe_no_isolation: bool = False) -> SandboxResult:
    """Run `check.program` (untrusted) and `check.tests` (trusted) in separate processes; see the docstring."""
    isolate = require_isolation(unsafe_no_isolation)
    job = {"mode": "check", "program": check.program, "entry_point": check.entry_point, "tests": check.tests,
           "prelude": check.prelude}
    return _execute(job, limits or Limits(), isolate)


def run_programs(
    jobs: Sequence[str | Check],
    limits: Limits | None = None,
    workers: int = 2,
    on_done: Callable[[SandboxResult], None] | None = None,
    *,
    unsafe_no_isolation: bool = False,
) -> list[SandboxResult]:
    """Run several programs or checks, `workers` at a time (each in its own sandbox); results in input order."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    require_isolation(unsafe_no_isolation)

    def one(job: str | Check) -> SandboxResult:
        if isinstance(job, Check):
            return run_check(job, limits, unsafe_no_isolation=unsafe_no_isolation)
        return run_program(job, limits, unsafe_no_isolation=unsafe_no_isolation)

    results: list[SandboxResult] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for result in pool.map(one, jobs):
            if on_done is not None:
                on_done(result)
            results.append(result)
    return results


def _execute(job: dict, limits: Limits, isolate: bool) -> SandboxResult:
    userns = os.geteuid() != 0
    uids = _draw_uids() if isolate and not userns else (0, 0)
    files = [tempfile.TemporaryFile() for _ in range(4)]  # program stdout, stderr; tests' stderr; launcher
    workdir = None if isolate else tempfile.mkdtemp(prefix="printpress-sandbox-")
    try:
        config = {
            **job,
            "isolate": isolate,
            "userns": userns,
            "uids": list(uids),
            "workdir": workdir,
            "hook": limits.audit_hook,
            "fds": [f.fileno() for f in files[:3]],
            "disk_kb": max(1, limits.disk_mb) * 1024,
            "inodes": 4096,
            "limits": {"memory": limits.memory_mb * 2**20, "cpu": int(limits.timeout_s) + 1,
                       "fsize": limits.file_size_mb * 2**20, "nofile": limits.open_files,
                       "nproc": limits.processes},
        }
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _BOOT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=files[3], env=_BASE_ENV, start_new_session=True,
                                close_fds=True, pass_fds=config["fds"])
        timed_out = False
        try:
            raw, _ = proc.communicate(marshal.dumps((_launcher_code(), config)), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            raw, _ = proc.communicate()
        _kill_group(proc.pid)
        duration = time.monotonic() - started
        out, err, test_err, launcher_err = (_tail(f) for f in files)
    finally:
        for f in files:
            f.close()
        if workdir is not None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        if uids != (0, 0):
            _release_uids(uids)
    try:
        report = marshal.loads(raw) if raw else {}  # written by init only: the program never holds that pipe
    except (EOFError, ValueError, TypeError):
        report = {}
    if "error" in report and not report.get("started"):
        raise SandboxError(f"the sandbox could not be set up: {report['error']}")
    if "error" in report or (not report and not timed_out):
        # Init failed or died after the program started: only the program (or the OOM killer) can do that,
        # and only where it shares init's kernel uid (a user namespace). Its result, not the harness's error.
        why = report.get("error") or _last_line(launcher_err) or "no report"
        return SandboxResult("crashed", None, duration, _scrub(out), _scrub(err),
                             _scrub(f"the sandbox's init failed while the program ran: {why}", DETAIL_LIMIT),
                             _scrub(test_err))
    status, returncode, detail = _classify(job["mode"], report, timed_out, err, test_err, limits)
    return SandboxResult(status, returncode, duration, _scrub(out), _scrub(err), _scrub(detail, DETAIL_LIMIT),
                         _scrub(test_err))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(f) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - 4 * OUTPUT_TAIL))
    return f.read().decode("utf-8", errors="replace")[-OUTPUT_TAIL:]


def _last_line(text: str) -> str:
    return next((line for line in reversed(text.strip().splitlines()) if line.strip()), "")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return str(-returncode)


def _classify(mode: str, report: dict, timed_out: bool, err: str, test_err: str,
              limits: Limits) -> tuple[str, int | None, str]:
    program, tests = report.get("program"), report.get("tests")
    timeout = f"killed after the {limits.timeout_s:g} s limit"
    if timed_out or -signal.SIGXCPU in (program, tests):
        return "timeout", program if mode == "program" else tests, timeout
    if mode == "program":
        if program < 0:
            return "crashed", program, f"killed by signal {_signal_name(program)}"
        if program == 0 and report.get("finished"):
            return "passed", 0, ""
        if program == 0:
            return "failed", 0, "exited before the end of the program"
        return "failed", program, _last_line(err) or f"exit status {program}"
    if tests == 0:
        return "passed", 0, ""
    if program is not None and program != 0 and (tests == 3 or program < 0):
        if program < 0:
            return "crashed", tests, f"killed by signal {_signal_name(program)}"
        return "failed", tests, _last_line(err) or f"exit status {program}"
    if tests == 3:
        if program == 0:
            return "failed", tests, "exited before the end of the program"
        return "failed", tests, "the program stopped answering"
    if tests is not None and tests < 0:
        return "crashed", tests, f"the tests were killed by signal {_signal_name(tests)}"
    return "failed", tests, _last_line(test_err) or f"exit status {tests}"


_UNPRINTABLE = re.compile(r"[^\t\n\x20-\x7e\u00a0-\ud7ff\ue000-\ufffd]")


def _secrets() -> list[str]:
    """Values of the harness's environment worth hiding (long enough to be a secret, and not a path)."""
    values = {v for v in os.environ.values() if len(v) >= 12 and not v.startswith("/")}
    return sorted(values, key=len, reverse=True)


def _scrub(text: str, limit: int | None = None) -> str:
    """Printable only, no value of the harness's environment, and at most `limit` characters (one line)."""
    for value in _secrets():
        if value in text:
            text = text.replace(value, "[redacted]")
    text = _UNPRINTABLE.sub("?", text)
    if limit is not None:
        text = " ".join(text.split())
        if len(text) > limit:
            text = text[: limit - 1] + "…"
    return text
