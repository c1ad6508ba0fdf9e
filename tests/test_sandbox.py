"""The sandbox that runs model-written code: each harmful program fails alone, and the harness is unharmed."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from printpress.eval.sandbox import Limits, isolation, network_isolation, run_program, run_programs

FAST = Limits(timeout_s=1.5, memory_mb=256)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_program_that_runs_to_its_end_passes_and_its_output_is_kept():
    result = run_program("print('hello from the sandbox')\nassert sum([1, 2]) == 3\n", FAST)
    assert result.status == "passed" and result.passed
    assert result.returncode == 0
    assert result.stdout == "hello from the sandbox\n"
    assert result.detail == ""


def test_a_failing_assertion_is_a_failure_with_its_error():
    result = run_program("assert 1 + 1 == 3, 'arithmetic'\n", FAST)
    assert result.status == "failed"
    assert result.detail == "AssertionError: arithmetic"
    assert "program.py" in result.stderr


@pytest.mark.parametrize("body", ["while True:\n    pass\n", "import time\ntime.sleep(600)\n"],
                         ids=["busy-loop", "sleep"])
def test_a_hanging_program_is_killed_at_the_deadline_with_its_process_group(body):
    started = time.monotonic()
    result = run_program("import os\nprint(os.getpid(), flush=True)\n" + body, FAST)
    elapsed = time.monotonic() - started
    assert result.status == "timeout"
    assert 1.5 <= elapsed < 5
    assert _group_gone(int(result.stdout.split()[0]))


@pytest.mark.parametrize("body, detail", [
    ("import faulthandler\nfaulthandler._sigsegv()\n", "killed by signal SIGSEGV"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGABRT)\n", "killed by signal SIGABRT"),
], ids=["segfault", "abort"])
def test_a_crashing_program_is_a_crash(body, detail):
    result = run_program(body, FAST)
    assert (result.status, result.detail) == ("crashed", detail)


@pytest.mark.parametrize("body", [
    "import sys\nsys.exit(0)\nassert False\n",
    "import os\nos._exit(0)\nassert False\n",
    "raise SystemExit\n",
], ids=["sys.exit", "os._exit", "SystemExit"])
def test_leaving_early_with_status_zero_is_not_a_pass(body):
    result = run_program(body, FAST)
    assert result.returncode == 0
    assert (result.status, result.detail) == ("failed", "exited before the end of the program")


def test_ctypes_is_refused_so_it_cannot_reach_around_the_guards():
    result = run_program("import ctypes\nctypes.string_at(0)\n", FAST)
    assert result.status == "failed"
    assert result.detail == "PermissionError: sandbox: ctypes.dlopen is not allowed"


@pytest.mark.parametrize("body", [
    "x = bytearray(8 * 1024 ** 3)\n",
    "chunks = []\nwhile True:\n    chunks.append(b' ' * 10 ** 7)\n",
], ids=["one-big-allocation", "growing"])
def test_a_memory_hungry_program_fails_and_the_harness_keeps_its_memory(body):
    before = _rss_mb()
    result = run_program(body, Limits(timeout_s=10, memory_mb=128))
    assert (result.status, result.detail) == ("failed", "MemoryError")
    assert _rss_mb() - before < 50


def test_a_flood_of_output_is_cut_by_the_file_size_limit():
    result = run_program("while True:\n    print('x' * 1000)\n", Limits(timeout_s=5, file_size_mb=1))
    assert result.status == "failed"
    assert result.detail == "OSError: [Errno 27] File too large"
    assert len(result.stdout) <= 2000


def test_writing_outside_the_working_directory_is_refused_inside_is_allowed(tmp_path):
    target = tmp_path / "escaped.txt"
    outside = run_program(f"open({str(target)!r}, 'w').write('x')\n", FAST)
    assert outside.status == "failed"
    assert "outside the working directory is not allowed" in outside.detail
    assert not target.exists()
    removed = tmp_path / "keep.txt"
    removed.write_text("keep")
    assert run_program(f"import os\nos.remove({str(removed)!r})\n", FAST).status == "failed"
    assert removed.read_text() == "keep"
    inside = run_program("import tempfile\nopen('scratch.txt', 'w').write('x')\ntempfile.mkstemp()\n", FAST)
    assert inside.status == "passed"


def test_starting_processes_is_refused(tmp_path):
    target = tmp_path / "touched"
    for body in (f"import subprocess\nsubprocess.run(['touch', {str(target)!r}])\n",
                 f"import os\nos.system('touch {target}')\n",
                 "import os\nos.fork()\n"):
        result = run_program(body, FAST)
        assert result.status == "failed"
        assert result.detail.startswith("PermissionError: sandbox: ")
    assert not target.exists()


def _listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    return server


def _connects(server) -> bool:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def test_the_network_is_out_of_reach(tmp_path):
    server = _listener()
    port = server.getsockname()[1]
    body = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
    result = run_program(body, FAST)
    assert result.status == "failed"
    assert result.detail.startswith("PermissionError: sandbox: socket.")
    assert not _connects(server)
    server.close()


@pytest.mark.skipif(not isolation(), reason="no network namespace can be made on this machine")
def test_without_the_audit_hook_the_network_namespace_still_keeps_the_network_away():
    assert network_isolation() == "namespace"
    server = _listener()
    port = server.getsockname()[1]
    body = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
    result = run_program(body, Limits(timeout_s=3, audit_hook=False))
    assert result.status == "failed"
    assert result.detail.startswith(("OSError", "ConnectionRefusedError", "TimeoutError"))
    assert not _connects(server)
    server.close()


def test_programs_run_in_parallel_keep_their_order_and_the_harness_still_works_after():
    bodies = ["assert True\n", "while True: pass\n", "import faulthandler; faulthandler._sigsegv()\n",
              "assert False\n", "print('last')\n"]
    started = time.monotonic()
    results = run_programs(bodies, Limits(timeout_s=1.5), workers=2)
    assert [r.status for r in results] == ["passed", "timeout", "crashed", "failed", "passed"]
    assert time.monotonic() - started < 1.5 + 3  # the hang did not hold up the other worker's programs
    assert run_program("print(6 * 7)\n", FAST).stdout == "42\n"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_processes_left_behind_by_a_program_are_killed_with_its_group():
    # Without the audit hook fork is allowed: the group kill alone must take the orphan down.
    body = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(600)\n    os._exit(0)\n"
            "print(pid, flush=True)\n")
    result = run_program(body, Limits(timeout_s=5, audit_hook=False))
    assert result.status == "passed"
    orphan = int(result.stdout)
    deadline = time.monotonic() + 3
    while _alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(orphan)


def test_the_working_directory_is_temporary_and_removed():
    result = run_program("import os\nprint(os.getcwd())\nopen('left-behind', 'w').write('x')\n", FAST)
    assert result.passed
    workdir = Path(result.stdout.strip())
    assert workdir.name.startswith("printpress-sandbox-")
    assert not workdir.exists()
