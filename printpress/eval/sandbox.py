"""Run untrusted Python (model-written code and its tests) in a guarded child process.

Code written by a model must never harm the process that evaluates it, nor the machine. Each program
runs in a fresh `python -I -B` child, in its own session (process group), in a temporary working
directory that is removed afterwards. What is enforced, and by whom:

Enforced by the kernel (the program cannot undo these from Python):
- wall-clock timeout: the whole process group is killed with SIGKILL when it runs out of time;
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS, so big allocations raise MemoryError), file size
  (RLIMIT_FSIZE; stdout and stderr go to files, so a print loop cannot fill our memory), open files
  (RLIMIT_NOFILE), no core dumps (RLIMIT_CORE). The child sets them on itself, soft and hard, before
  it reads the program (setting them in `preexec_fn` is unsafe with the thread pool that runs programs
  in parallel);
- no network, when the machine lets us create a network namespace (`unshare --net`, or with a user
  namespace when not root): the child sees only a loopback device that is down. `isolation()` says
  which applies.

Enforced by a Python audit hook (a tripwire against accidents, not a security boundary: it stops plain
Python calls, and native code could step around it, which is why ctypes is refused):
- sockets (creation, connect, bind, name lookups), even where no network namespace could be made;
- starting processes (fork, exec, spawn, subprocess, os.system) and signalling other processes;
- writing, creating, removing, renaming or changing files outside the working directory;
- ctypes (it could call into libc and undo the above).

Not enforced: reading files the invoking user may read; the child runs as the invoking user. A passed
program is one that ran to its end: the child writes a one-time nonce to a marker file after the
program returns, so `sys.exit(0)` or `os._exit(0)` in the middle of the tests counts as a failure.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

OUTPUT_TAIL = 2000  # characters of stdout/stderr kept in a result


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    timeout_s: float = 10.0  # wall clock, whole process group killed after it
    memory_mb: int = 1024  # address space of the child (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the child may write, stdout and stderr included
    open_files: int = 64
    audit_hook: bool = True  # the Python-level guards (turned off only to test the kernel-level ones)


@dataclass(frozen=True)
class SandboxResult:
    status: str  # "passed", "failed" (error or early exit), "timeout" or "crashed" (killed by a signal)
    returncode: int | None
    duration_s: float
    stdout: str
    stderr: str
    detail: str  # one line: why it did not pass ("" when it passed)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# The child's entry point, run with `python -I -B -c`. Arguments: memory bytes, CPU seconds, file size
# bytes, open files, audit hook flag. The nonce arrives on stdin so the program cannot read it from argv.
_CHILD = r'''
import os, resource, sys

def _limits(memory, cpu, fsize, nofile):
    for kind, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                        (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, (value, value))

def _guard(workdir):
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
            return True  # an already open descriptor
        try:
            real = _path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return any(real == a or real.startswith(a + "/") for a in allowed)

    def hook(event, args):
        if busy:
            return  # realpath's own calls
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

def _main():
    memory, cpu, fsize, nofile, hook = (int(a) for a in sys.argv[1:6])
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    _limits(memory, cpu, fsize, nofile)
    workdir = os.path.realpath(os.getcwd())
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "program.py", "exec")
    fd = os.open("passed", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # opened before the guards
    write = os.write
    if hook:
        _guard(workdir)
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    write(fd, nonce.encode())

_main()
'''


@functools.cache
def isolation() -> tuple[str, ...]:
    """The command prefix that gives the child its own, empty network namespace; () when none can be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net"), (unshare, "--user", "--map-root-user", "--net")):
        try:
            probe = subprocess.run([*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=10,
                                   check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


def network_isolation() -> str:
    """How the network is kept away: "namespace" (kernel) or "audit hook" (Python-level only)."""
    return "namespace" if isolation() else "audit hook"


def run_program(source: str, limits: Limits | None = None) -> SandboxResult:
    """Run `source` as a program in the sandbox and say whether it ran to its end without error."""
    limits = limits or Limits()
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="printpress-sandbox-") as workdir:
        work = Path(workdir)
        (work / "program.py").write_text(source, encoding="utf-8")
        command = [*isolation(), sys.executable, "-I", "-B", "-c", _CHILD,
                   str(limits.memory_mb * 2**20), str(int(limits.timeout_s) + 1),
                   str(limits.file_size_mb * 2**20), str(limits.open_files), str(int(limits.audit_hook))]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        started = time.monotonic()
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            timed_out = _wait(proc, nonce, limits.timeout_s)
        duration = time.monotonic() - started
        marker = work / "passed"
        finished = marker.exists() and marker.read_text() == nonce
        stdout, stderr = _tail(work / "stdout"), _tail(work / "stderr")
    status, detail = _classify(proc.returncode, timed_out, finished, stderr, limits)
    return SandboxResult(status, proc.returncode, duration, stdout, stderr, detail)


def _wait(proc: subprocess.Popen, nonce: str, timeout_s: float) -> bool:
    """Hand over the nonce and wait; kill the whole process group at the deadline or when the leader exits."""
    timed_out = False
    try:
        proc.stdin.write(nonce.encode() + b"\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the child died before reading it
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(proc.pid)  # stragglers too, if anything got past the guards and forked
    proc.wait()
    return timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path) -> str:
    data = path.read_bytes()
    return data[-OUTPUT_TAIL:].decode("utf-8", errors="replace")


def _classify(returncode: int, timed_out: bool, finished: bool, stderr: str, limits: Limits) -> tuple[str, str]:
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout", f"killed after the {limits.timeout_s:g} s limit"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return "crashed", f"killed by signal {name}"
    if returncode == 0 and finished:
        return "passed", ""
    if returncode == 0:
        return "failed", "exited before the end of the program"
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return "failed", last or f"exit status {returncode}"


def run_programs(
    sources: Sequence[str],
    limits: Limits | None = None,
    workers: int = 2,
    on_done: Callable[[SandboxResult], None] | None = None,
) -> list[SandboxResult]:
    """Run several programs, `workers` at a time (each in its own sandbox); results in input order."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    results: list[SandboxResult] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for result in pool.map(functools.partial(run_program, limits=limits), sources):
            if on_done is not None:
                on_done(result)
            results.append(result)
    return results
