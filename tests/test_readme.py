"""The README's code runs as written: its Python blocks, the tour's commands that need nothing but the shipped model,
and the serving examples (the openai client and curl) against a real `printpress serve`.

Commands that need something else are left out, by the words they start with: another model (`--model`), training,
evaluation and benchmarks (minutes to hours), and `printpress serve` itself, which the serving test starts. Blocks
without a language (the GPU section) are not run. The serving examples talk to port 8000 with the key "secret": the
test starts the server with that key on a free port and changes only the port.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import free_port

pytestmark = pytest.mark.slow  # runs the README's commands and a server: minutes, not seconds

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
BIN = Path(sys.executable).parent  # the virtualenv's bin/, where the `printpress` script is
ENV = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
NOT_OFFLINE = ("--model", "printpress train", "printpress bench", "printpress eval", "printpress serve",
               "python -m printpress.eval")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def block(language: str, holding: str) -> str:
    """The one block of `language` that holds `holding`."""
    found = [b for b in blocks(language) if holding in b]
    assert len(found) == 1, f"expected one {language} block with {holding!r}, found {len(found)}"
    return found[0]


def tour() -> list[str]:
    return [c for c in commands(block("bash", "printpress generate $'ROMEO")) if not c.startswith(NOT_OFFLINE)
            and "--model" not in c]


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def run(command: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(blocks("python")) == 2 and len(tour()) >= 12
    assert all(c.startswith(("printpress ", "printf ")) for c in tour())


def test_the_python_tour_runs_as_written():
    done = subprocess.run([sys.executable, "-c", block("python", "printpress.load()")], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "ROMEO.\nBut soft, what " in done.stdout


def test_the_command_tour_runs_as_written():
    """Each command succeeds and prints something, or says on stderr that this sample is empty: the tour's commands
    take a fresh seed each run, and now and then the shipped model ends its text at once."""
    failed = []
    for command in tour():
        done = run(command)
        if done.returncode != 0 or not (done.stdout.strip() or "the model wrote nothing this time" in done.stderr):
            failed.append((command, done.returncode, done.stderr[-500:]))
    assert failed == []


def test_the_serving_examples_run_against_printpress_serve(tmp_path):
    serve = commands(block("bash", "PRINTPRESS_API_KEY=secret printpress serve"))
    client_code, curls = block("python", "from openai import OpenAI"), commands(block("bash", "curl "))
    assert serve[1].startswith("PRINTPRESS_API_KEY=secret printpress serve --port 8000")
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(shlex.split(serve[1].replace("PRINTPRESS_API_KEY=secret ", "").split("#")[0])
                              + ["--port", str(port)], cwd=REPO, env=dict(ENV, PRINTPRESS_API_KEY="secret"),
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _ready(port):
            assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        here = f"127.0.0.1:{port}"
        done = subprocess.run([sys.executable, "-c", client_code.replace("127.0.0.1:8000", here)], cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        assert len(curls) == 2
        for command in curls:
            done = run(command.replace("127.0.0.1:8000", here))
            assert done.returncode == 0 and done.stdout and '"error"' not in done.stdout, (command, done.stdout)
        rewritten = done.stdout  # the edit: "light through yonder window" rewritten, the rest kept
        assert '"text":"ROMEO.\\nBut soft, what ' in rewritten and ' breaks?\\n"' in rewritten
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("command", ["printpress --help", "printpress generate --help", "printpress chat --help"])
def test_help_is_a_quick_answer(command):
    done = run(command, timeout=60)
    assert done.returncode == 0 and "usage: printpress" in done.stdout
