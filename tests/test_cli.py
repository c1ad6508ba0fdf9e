"""`printpress generate` prints what the Python API returns, and bad input ends in one line and exit 2."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import printpress
from printpress.cli import build_parser, main
from printpress.engine import CommitEvent, StepEvent
from printpress.live_view import LiveView, _fit

from helpers import make_reference, save_checkpoint, word_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    with_tokenizer = save_checkpoint(make_reference("gqa"), root / "text", word_tokenizer(128))
    ids_only = save_checkpoint(make_reference("gqa"), root / "ids")
    return {"text": str(with_tokenizer), "ids": str(ids_only)}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_the_text(folders, capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", folders["text"], "--seed", "3", "--max-new-tokens", "8",
                           "w7 w9 w11")
    expected = printpress.load(folders["text"]).generate("w7 w9 w11", seed=3, max_new_tokens=8)
    assert code == 0
    assert out == expected.text + "\n"


def test_json_has_ids_text_and_stats(folders, capsys):
    code, out, _ = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "3", "--max-new-tokens", "16",
                           "--steps", "2", "--entropy-bound", "0.5", "--t-min", "0.3", "--t-max", "0.9", "--json",
                           "w7 w9 w11")
    data = json.loads(out)
    expected = printpress.load(folders["text"]).generate(
        "w7 w9 w11", seed=3, max_new_tokens=16, max_denoising_steps=2, entropy_bound=0.5, t_min=0.3, t_max=0.9
    )
    assert code == 0
    assert data["token_ids"] == expected.token_ids and data["text"] == expected.text
    assert data["prompt_ids"] == [2, 7, 9, 11]
    assert data["stats"]["forward_passes"] == 4  # two canvases of two steps: --steps reached the sampler
    assert set(data["stats"]) >= {"tokens_per_forward", "denoising_steps", "wall_time_s", "time_to_first_commit_s"}


def test_several_prompts_and_token_ids(folders, capsys):
    code, out, _ = run_cli(capsys, "generate", "-m", folders["ids"], "--ids", "--seed", "1", "--max-new-tokens", "8",
                           "--json", "2,7,9", "2 40")
    data = json.loads(out)
    pipe = printpress.load(folders["ids"])
    assert code == 0
    assert [d["token_ids"] for d in data] == [r.token_ids for r in pipe.generate([[2, 7, 9], [2, 40]], seed=1,
                                                                                  max_new_tokens=8)]
    code, out, _ = run_cli(capsys, "generate", "-m", folders["ids"], "--ids", "--seed", "1", "--max-new-tokens", "8",
                           "2,7,9")
    assert out.split() == [str(t) for t in data[0]["completion_ids"]]


def test_ar_mode_and_its_flags(folders, capsys):
    code, out, _ = run_cli(capsys, "generate", "-m", folders["ids"], "--ids", "--mode", "ar", "--temperature", "0",
                           "--max-new-tokens", "5", "--eos", "", "--json", "2,7,9")
    data = json.loads(out)
    assert code == 0 and data["mode"] == "ar" and len(data["token_ids"]) == 5
    assert data["token_ids"] == printpress.load(folders["ids"]).generate(
        [2, 7, 9], mode="ar", max_new_tokens=5, eos_token_ids=[], temperature=0).token_ids


def test_show_steps_writes_one_line_per_step_when_not_a_terminal(folders, capsys):
    code, out, err = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "2", "--max-new-tokens", "16",
                             "--steps", "3", "--show-steps", "--json", "w7 w9")
    data = json.loads(out)  # stdout stays clean JSON
    step_lines = [line for line in err.splitlines() if line.startswith("[0] canvas")]
    assert code == 0
    assert len(step_lines) == data["stats"]["forward_passes"] == 6
    assert step_lines[0].startswith("[0] canvas 0 step 1/3 accepted ")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_view_redraws_in_place_on_a_terminal(folders, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    pipe = printpress.load(folders["text"])
    screen = FakeTerminal()
    view = LiveView(pipe, screen, requests=1, min_interval_s=0.0)
    step = StepEvent(0, 0, 1, 3, tokens=[7, 8], argmax=[7, 8], accepted=[True, False], stopped=False)
    view.update(step)
    view.update(CommitEvent(0, 0, [7, 8], "w7 w8", finished=False))
    view.update(StepEvent(0, 1, 1, 3, tokens=[9, 10], argmax=[9, 10], accepted=[False, True], stopped=True))
    view.close()
    drawn = screen.getvalue()
    assert "\x1b[1m\x1b[32mw7" in drawn and "\x1b[2mw8" in drawn  # accepted bright, re-noised dim
    assert "\x1b[1F" in drawn  # later frames move back up over the previous one
    assert "w7 w8" in drawn and drawn.endswith("\x1b[1F\x1b[J")  # the committed text, then cleared


def test_fit_keeps_the_tail_and_counts_only_visible_characters():
    line = "abc" + "\x1b[1m" + "defgh" + "\x1b[0m"
    fitted = _fit(line, 4)
    assert fitted.replace("\x1b[1m", "").replace("\x1b[0m", "") == "efgh"
    assert _fit("xy", 10).startswith("xy")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ids", "--mode", "beam", "2,3"], "unknown mode 'beam'"),
        (["--ids", ""], "the prompt is empty"),
        (["--ids", "2,x"], "token ids must be integers"),
        (["--ids", "--max-new-tokens", "0", "2,3"], "max_new_tokens must be a positive integer"),
        (["--ids", "--steps", "0", "2,3"], "steps (max_denoising_steps) must be a positive integer"),
        (["--ids", "--entropy-bound", "-1", "2,3"], "entropy_bound must be > 0"),
        (["--ids", "--t-min", "0.9", "--t-max", "0.1", "2,3"], "t_min (0.9) must not exceed t_max (0.1)"),
        (["--ids", "--max-new-tokens", "600", "2,3"], "a prompt of 2 tokens plus 600 new tokens exceeds"),
        (["hello"], "this model has no tokenizer"),
    ],
)
def test_bad_input_exits_2_with_one_line(folders, capsys, argv, message):
    code, out, err = run_cli(capsys, "generate", "-m", folders["ids"], *argv)
    lines = [line for line in err.splitlines() if not line.startswith("WARNING")]
    assert code == 2 and out == ""
    assert lines == [lines[0]] and lines[0].startswith(f"printpress: error: {message}")


CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
MPS = pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")


@pytest.mark.parametrize(
    "argv,message",
    [
        # Temperatures whose arithmetic is not finite: NaN tracebacks, or silently empty output (t_max = inf).
        (["--t-max", "nan"], "t_max must be > 0 and finite: between 0.0001 and 10000, got nan"),
        (["--t-max", "inf"], "t_max must be > 0 and finite: between 0.0001 and 10000, got inf"),
        (["--t-min", "0", "--t-max", "1e-38"], "t_max must be > 0 and finite: between 0.0001 and 10000, got 1e-38"),
        (["--t-min=-inf"], "t_min must be >= 0 and finite"),
        (["--mode", "ar", "--temperature", "1e-38"], "temperature must be >= 0 and finite: 0 (greedy) or between"),
        (["--mode", "speculative", "--temperature", "nan"], "temperature must be >= 0 and finite"),
        (["--confidence-threshold", "nan"], "confidence_threshold must be > 0 and finite, got nan"),
        (["--window-lead", "-1"], "window_lead must be >= 0 and finite, got -1.0"),
        # An int32 overflow traceback, and a 25 GB allocation for the stability history.
        (["--steps", "100000000000"], "steps (max_denoising_steps) must be a positive integer no larger than 4096"),
        (["--stability-threshold", "100000000"], "stability_threshold must be an integer >= 0 no larger than 4096"),
        # torch's tracebacks ("Torch not compiled with CUDA enabled").
        pytest.param(["--device", "cuda"], "device 'cuda' is not available: this torch", marks=CUDA),
        pytest.param(["--device", "cuda:1"], "device 'cuda:1' is not available", marks=CUDA),
        pytest.param(["--device", "mps"], "device 'mps' is not available: this torch", marks=MPS),
        (["--device", "gpu"], "unknown device 'gpu'"),
        # Issue 14: a mode in the wrong case, zero steps, and speculative drafts asked for with a canvas's steps.
        (["--mode", "AR"], "unknown mode 'AR'; expected one of diffusion, ar, speculative"),
        (["--steps", "0"], "steps (max_denoising_steps) must be a positive integer"),
        (["--mode", "speculative", "--steps", "16"], "steps=16 does not apply to mode='speculative' (it sets the "
                                                     "denoising steps of a diffusion canvas); the speculative drafts "
                                                     "run draft_steps steps"),
        (["--draft-steps", "0"], "draft_steps must be a positive integer"),
    ],
)
def test_settings_and_devices_are_refused_before_the_model_loads(capsys, tmp_path, argv, message):
    """The model folder does not exist: the error is about the flag, so it was checked first."""
    code, out, err = run_cli(capsys, "generate", "-m", str(tmp_path / "not-loaded"), *argv, "ROMEO:")
    assert code == 2 and out == ""
    assert err.splitlines() == [err.splitlines()[0]] and err.startswith(f"printpress: error: {message}")


@pytest.mark.parametrize("command", [["generate"], ["edit", "--prefix"]])
@pytest.mark.parametrize("text", ["caf\udce9", "lone \ud800 surrogate"])
def test_arguments_that_are_not_utf8_exit_2(capsys, tmp_path, command, text):
    code, out, err = run_cli(capsys, *command, text, "-m", str(tmp_path / "not-loaded"))
    assert code == 2 and out == ""
    assert err.startswith(f"printpress: error: argument {len(command) + 1} is not valid UTF-8 text (at character ")
    assert len(err.splitlines()) == 1


def test_invalid_utf8_bytes_from_the_shell_exit_2(folders):
    """Real bytes in argv (Python hands them on as lone surrogates): one line, no traceback."""
    done = subprocess.run([sys.executable, "-m", "printpress", "generate", "-m", folders["text"], b"w7 \xff\xfe"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("printpress: error: argument 4 is not valid UTF-8 text (at character 3: ")
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_serve_refuses_an_unavailable_device(capsys):
    code, _, err = run_cli(capsys, "serve", "--device", "cuda", "--port", "0")
    assert code == 2 and err.startswith("printpress: error: device 'cuda' is not available")


@pytest.mark.parametrize("flags, message", [
    (["--quantize", "int4"], "printpress: error: quantize 'int4' is not supported"),
    (["--compile", "yes"], "printpress: error: compile 'yes' is not supported; use ar, decoder, all"),
    (["--compile-weights", "bfloat16"], "printpress: error: compile_weights bfloat16 applies to compiled passes"),
    (["--compile", "ar", "--compile-weights", "int8"], "printpress: error: compile_weights 'int8' is not supported"),
    (["--canvas-length", "0"], "printpress: error: canvas_length 0 is not supported; give a positive number"),
    (["--dtype", "float8"], "printpress: error: "),
])
def test_serve_refuses_bad_runtime_flags_before_binding_or_loading(capsys, flags, message):
    code, _, err = run_cli(capsys, "serve", *flags, "--port", "0")
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1


def test_missing_model_exits_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "-m", str(tmp_path / "nope"), "hello")
    assert code == 2 and err.startswith("printpress: error: ") and "Traceback" not in err


def test_subcommands_are_pluggable():
    parser = build_parser()
    args = parser.parse_args(["generate", "-m", "x", "hi"])
    assert args.command == "generate" and callable(args.func)
    args = parser.parse_args(["train", "--recipe", "r", "--out", "o"])
    assert args.command == "train" and callable(args.func)


@pytest.mark.slow  # a `python -m printpress` subprocess
def test_python_dash_m_runs_the_cli(folders):
    done = subprocess.run(
        [sys.executable, "-m", "printpress", "generate", "-m", folders["ids"], "--ids", "--seed", "0",
         "--max-new-tokens", "4", "--steps", "1", "2,7"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 4  # the ids of --max-new-tokens, out of one whole canvas of 8
    bad = subprocess.run([sys.executable, "-m", "printpress", "generate", "-m", folders["ids"], "--ids", ""],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.mark.slow  # a `printpress` subprocess
def test_show_steps_redraws_in_a_real_pseudo_terminal(folders):
    import pty

    controller, terminal = pty.openpty()
    done = subprocess.run(
        [sys.executable, "-m", "printpress", "generate", "-m", folders["text"], "--seed", "1", "--max-new-tokens", "16",
         "--steps", "4", "--show-steps", "w7 w9"],
        stdout=subprocess.PIPE, stderr=terminal, text=True, cwd=REPO, timeout=300, env=dict(os.environ, TERM="xterm"),
    )
    os.close(terminal)
    drawn = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal side is closed: everything has been read
            break
        if not chunk:
            break
        drawn += chunk
    os.close(controller)
    assert done.returncode == 0 and done.stdout.strip()
    text = drawn.decode()
    assert "\x1b[1F" in text  # frames redraw in place over the previous one
    assert "\x1b[2m" in text and "\x1b[1m" in text  # re-noised positions dim, accepted bright


# ------------------------------------------------------------------------------------------------
# Issue 14: the habits of llama.cpp / Ollama users
# ------------------------------------------------------------------------------------------------


def test_edit_span_is_checked_before_the_model_loads(capsys, tmp_path):
    code, out, err = run_cli(capsys, "edit", "-m", str(tmp_path / "not-loaded"), "--text", "abc", "--span", "3:99")
    assert code == 2 and out == ""
    assert err == "printpress: error: the span end 99 is beyond the text's 3 characters\n"


def test_max_new_tokens_prints_that_many_tokens_in_diffusion_mode(folders, capsys):
    """The engine computes a whole canvas (8 here); the text holds --max-new-tokens tokens, as the server's
    max_tokens does."""
    code, out, _ = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "3", "--max-new-tokens", "5",
                           "--eos", "", "w7 w9")
    result = printpress.load(folders["text"]).generate("w7 w9", seed=3, max_new_tokens=5, eos_token_ids=[])
    assert len(result.token_ids) == 8 and len(result.completion_ids) == 5
    assert code == 0 and out == result.text + "\n" and len(out.split()) == 5


class Recorder(io.StringIO):
    """stdout that remembers each write and each flush, to see text arrive while generation goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)

    def flush(self) -> None:
        self.flushes += 1


def test_text_streams_to_stdout_as_it_is_committed(folders, monkeypatch):
    pipe = printpress.load(folders["text"])
    for mode, commits in (("diffusion", 3), ("ar", 20)):
        out = Recorder()
        monkeypatch.setattr(sys, "stdout", out)
        assert main(["generate", "-m", folders["text"], "--mode", mode, "--seed", "4", "--max-new-tokens", "20",
                     "--eos", "", "w7 w9"]) == 0
        expected = pipe.generate("w7 w9", mode=mode, seed=4, max_new_tokens=20, eos_token_ids=[]).text
        assert out.getvalue() == expected + "\n"
        # canvas by canvas (8 tokens; the last one cut at 20) or token by token, each flushed at once
        pieces = [w for w in out.writes if w.strip()]
        assert len(pieces) == commits and out.flushes >= commits


def test_several_prompts_are_printed_in_order_under_headers(folders, capsys):
    code, out, _ = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "1", "--max-new-tokens", "6",
                           "--eos", "", "w7 w9", "w11", "w12 w13 w14")
    texts = [r.text for r in printpress.load(folders["text"]).generate(["w7 w9", "w11", "w12 w13 w14"], seed=1,
                                                                        max_new_tokens=6, eos_token_ids=[])]
    assert code == 0
    assert out == (f"==> prompt 1 <==\n{texts[0]}\n\n==> prompt 2 <==\n{texts[1]}\n"
                   f"\n==> prompt 3 <==\n{texts[2]}\n")


def test_text_printer_holds_later_prompts_until_the_earlier_ones_finish():
    from printpress.cli import TextPrinter
    from printpress.events import DoneEvent

    out = io.StringIO()
    printer = TextPrinter(out, 2)
    printer.update(CommitEvent(1, 0, [5], "second ", False))
    assert out.getvalue() == "==> prompt 1 <==\n"  # prompt 2's text waits for prompt 1
    printer.update(CommitEvent(0, 0, [5], "first", True))
    assert out.getvalue() == "==> prompt 1 <==\nfirst"
    printer.update(DoneEvent(0, None))  # prompt 2 goes live: what it held, then what comes
    printer.update(CommitEvent(1, 1, [6], "more", True))
    printer.update(DoneEvent(1, None))
    assert out.getvalue() == "==> prompt 1 <==\nfirst\n\n==> prompt 2 <==\nsecond more\n"


def test_a_dash_reads_the_prompt_from_stdin(folders, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("w7 w9 w11"))
    code, out, _ = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "3", "--max-new-tokens", "8", "-")
    expected = printpress.load(folders["text"]).generate("w7 w9 w11", seed=3, max_new_tokens=8).text
    assert code == 0 and out == expected + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("2 7 9"))
    code, out, _ = run_cli(capsys, "generate", "-m", folders["ids"], "--ids", "--seed", "3", "--max-new-tokens", "8",
                           "--json", "-")
    assert code == 0 and json.loads(out)["prompt_ids"] == [2, 7, 9]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = run_cli(capsys, "generate", "-m", folders["text"], "-")
    assert code == 2 and err == "printpress: error: '-' reads the prompt from stdin, and stdin was empty\n"


@pytest.mark.slow  # a `printpress` subprocess
def test_stats_go_to_stderr_on_their_own_line_after_the_text(folders):
    done = subprocess.run([sys.executable, "-m", "printpress", "generate", "-m", folders["text"], "--seed", "2",
                           "--max-new-tokens", "5", "--eos", "", "--stats", "w7"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, timeout=300)
    lines = [line for line in done.stdout.splitlines() if not line.startswith("WARNING")]  # the tiny test model's
    assert done.returncode == 0 and len(lines) == 2, done.stdout
    assert len(lines[0].split()) == 5  # the text, then (flushed first) the statistics
    assert lines[1].startswith("[5 tokens of 8 generated in ") and lines[1].endswith(" canvases]")


def test_stats_say_when_the_time_includes_compiling(folders):
    """With --compile a one-shot `generate` spends most of its time compiling; its statistics say so, not only a
    rate that looks like the compiled passes' speed."""
    from printpress.cli import _stats_line

    result = printpress.load(folders["text"]).generate("w7", seed=2, max_new_tokens=5, eos_token_ids=[])
    plain, compiled = _stats_line(result), _stats_line(result, compiled=True)
    assert plain.startswith("[5 tokens of 8 generated in ") and plain.endswith(" canvases]")
    assert compiled == plain[:-1] + "; the time includes compiling the passes (--compile), once per process]"


def test_compiled_commands_warm_up_first_and_say_so(folders, capsys, monkeypatch):
    """`chat` and `serve` with --compile compile before the first request (`Pipeline.warm_up`, tested in
    tests/test_fast.py), with a line on stderr before and after; without --compile they say nothing. Either way,
    on a CPU, the exact kernels (draws, softmax and entropy, layers) are loaded first (built on a machine's first
    use), not in the first request, and the layers' choice of reading weights ahead is made."""
    import argparse

    from printpress import model, sampling
    from printpress.cli_flags import warm_up

    pipe = printpress.load(folders["text"])
    loads = []
    monkeypatch.setattr(sampling, "draw_kernels", lambda: loads.append("draw") or True)
    monkeypatch.setattr(sampling, "softmax_kernels", lambda: loads.append("softmax") or True)
    native_layers = model.native_layers
    monkeypatch.setattr(model, "native_layers", lambda: loads.append("layers") or native_layers())
    monkeypatch.setattr(model, "_warm_chosen", False)
    monkeypatch.setattr(model, "warm_measurement", None)
    warm_up(pipe, argparse.Namespace(compile=None))
    assert capsys.readouterr().err == "" and loads[:3] == ["draw", "softmax", "layers"]
    assert model._warm_chosen == native_layers()
    warm_up(pipe, argparse.Namespace(compile="ar"))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("printpress: compiling the passes (--compile ar) before the first request")
    assert re.fullmatch(r"printpress: compiled in \d+ s", lines[1]) and len(lines) == 2


def test_help_does_not_import_torch():
    """`printpress --help` and `printpress generate --help` answer without importing torch (2.4 s on a busy
    machine before; the lazily registered train and distill commands import it only when they run)."""
    code = ("import sys\nfrom printpress.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['chat', '--help'], ['serve', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nprint('no torch')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.endswith("no torch\n"), done.stderr
    assert "train" in done.stdout and "distill" in done.stdout and "chat" in done.stdout  # listed all the same


@pytest.mark.slow  # a `printpress chat` subprocess
def test_chat_answers_each_line_of_stdin_over_the_plain_template():
    """`printpress chat` from a pipe: one answer per line, each the engine's continuation of the conversation in the
    server's plain template, cut where the next USER turn would start; turn i uses seed + i."""
    from printpress.serve.chat import PLAIN_STOP

    done = subprocess.run([sys.executable, "-m", "printpress", "chat", "--mode", "ar", "--seed", "5",
                           "--max-new-tokens", "24", "--system", "A street in Verona."],
                          input="Who is there?\n\nWhat news?\n/bye\nnever read\n", capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    pipe = printpress.load()
    history, printed = "A street in Verona.\n\n", []
    for turn, line in enumerate(["Who is there?", "What news?"]):
        history += f"USER: {line}\n\nASSISTANT:"
        answer = pipe.generate(history, mode="ar", seed=5 + turn, max_new_tokens=24).text.split(PLAIN_STOP)[0]
        printed.append(answer.lstrip() + "\n")
        history += f" {answer.strip()}\n\n"
    assert done.stdout == "".join(printed)


def test_the_runtime_flags_given_are_spelled_back_for_a_reproducing_command():
    import argparse

    from printpress.cli_flags import add_sampler_arguments, load_options, sampler_flags_given

    parser = argparse.ArgumentParser()
    add_sampler_arguments(parser)
    args = parser.parse_args(["--steps", "8", "--compile", "ar", "--canvas-length", "16"])
    assert sampler_flags_given(args) == ["--steps", "8", "--compile", "ar", "--canvas-length", "16"]
    assert load_options(args)["canvas_length"] == 16
    weights = parser.parse_args(["--compile", "ar", "--compile-weights", "bfloat16"])
    assert sampler_flags_given(weights) == ["--compile-weights", "bfloat16", "--compile", "ar"]
    assert load_options(weights)["compile_weights"] == "bfloat16"
    none = parser.parse_args([])
    assert sampler_flags_given(none) == [] and load_options(none)["canvas_length"] is None
    flags = parser.parse_args(["--no-sliding", "--sample-accepted-only"])  # a flag a checkpoint may default to on
    assert (flags.sliding, flags.sample_accepted_only) == (False, True)
    assert sampler_flags_given(flags) == ["--no-sliding", "--sample-accepted-only"]


@pytest.mark.slow  # a `printpress` subprocess
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_a_reader_that_has_gone_ends_the_command_quietly_with_status_141(folders, extra):
    """`printpress generate ... | head -1` whose reader has already gone: no traceback, SIGPIPE's status. The read end
    is closed before the command starts, so its first write fails, whenever that comes."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "printpress", "generate", "-m", folders["text"], "--seed", "2",
                               "--max-new-tokens", "5", "--eos", "", *extra, "w7"],
                              stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300)
    finally:
        os.close(write)
    errors = [line for line in done.stderr.splitlines() if not line.startswith("WARNING")]  # the tiny model's
    assert done.returncode == 141 and errors == [], done.stderr


def test_a_text_that_ends_at_once_is_named_on_stderr_with_its_seed(folders, capsys):
    """Every id an end of text: the completion is empty, and stderr says so with the seed (stdout stays the text)."""
    every_id = ",".join(map(str, range(128)))
    code, out, err = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "5", "--eos", every_id, "w7")
    assert code == 0 and out == "\n"
    assert err.endswith("printpress: the model wrote nothing this time (--seed 5 does it again)\n")
    code, out, err = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "5", "--eos", every_id, "w7", "w9")
    assert code == 0 and "printpress: prompt 2: the model wrote nothing this time (--seed 5 does it again)\n" in err
    code, out, err = run_cli(capsys, "generate", "-m", folders["text"], "--seed", "5", "--eos", "", "w7")
    assert code == 0 and out.strip() and "wrote nothing" not in err


def test_an_empty_chat_answer_is_named_on_stderr(folders, capsys, monkeypatch, tmp_path):
    """A checkpoint whose every id ends the text answers nothing: stderr says so (chat takes the model's end ids)."""
    import shutil

    ends_at_once = shutil.copytree(folders["text"], tmp_path / "ends")
    generation = json.loads((ends_at_once / "generation_config.json").read_text())
    (ends_at_once / "generation_config.json").write_text(json.dumps(dict(generation, eos_token_id=list(range(128)))))
    for folder, nothing in ((ends_at_once, True), (folders["text"], False)):
        monkeypatch.setattr(sys, "stdin", io.StringIO("w7\n"))
        code, out, err = run_cli(capsys, "chat", "-m", str(folder), "--mode", "ar", "--seed", "5")
        assert code == 0 and (out == "\n") == nothing
        assert err.endswith("printpress: the model wrote nothing this time\n") == nothing
