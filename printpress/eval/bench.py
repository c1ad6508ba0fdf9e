"""`printpress bench`: a diffusion model against its AR twin — speed, quality and diversity, same prompts, one run.

    printpress bench                                   # the shipped pair, the default sweep (~10 min, 1 thread)
    printpress bench --steps 32 8 --entropy-bounds 0.1 4 --limit 2 --no-heldout     # a quick look
    printpress bench --out docs/results/pair.json      # also a stable copy of the JSON and the frontier PNG
    printpress bench --yardstick --out docs/results/yardstick.json                  # the fixed yardstick (issue 11)

Prompts: eight Shakespeare openings by default, one per line of `--prompts-file`, or `--heldout-prompts N`:
N windows of whole lines (at most 160 characters, starting at a line start) drawn with a fixed seed from the
held-out documents of `--heldout-data` (split as the training recipes split it, `--heldout-val-fraction`),
and never found verbatim in a training document, so no prompt was seen by training or by a distillation
teacher (teachers only read training-split prefixes).

Every side decodes the same prompts with the same seeds: with `--seeds K`, prompt i of P is decoded K times,
with seeds SEED + i, SEED + P + i, ..., SEED + (K-1)P + i (round r is what `--seed SEED + rP` alone would
decode). The sides are interleaved sample by sample (every side on one prompt and seed, then the next), so a
change in machine load hits every side alike, and speed is reported as ratios to the AR twin measured in the
same run. Sides:

- the AR twin (`--ar`, AR decoding) — the reference for speed, and a judge;
- the diffusion model (`--diffusion`) decoded autoregressively (a joint model is also a causal LM);
- the diffusion model decoded by diffusion over a grid of denoising steps x entropy bounds, plus any
  `--setting` points (temperature schedule, `sample_accepted_only`, speculative mode, greedy AR, ...).

Per side, pooled over every prompt x seed sample: tokens/s (generated tokens over the wall time of
`generate`, prefill included); tokens per forward two ways — `tokens_per_forward` as the engine and the
reference count it (diffusion: decoder passes; AR: token-producing encoder passes; speculative: prompt pass
+ decoder passes + verifications) and `tokens_per_forward_all_passes`, over every network pass counted at the
model (prefill, the encoder pass that writes each committed canvas to the cache, decoder passes,
verifications); time to the first committed canvas (diffusion) or token (AR); the likelihood of the samples
under the judges (NLL per character; lower is better): the AR twin, and SmolLM2-135M from GGUF when
`printpress.eval.gguf_judge` is installed (the JSON's `judges` says which model and file judged), and per
judge how far each side is behind AR sampling on the same weights (the ratio of mean judgements minus 1, with a
90% interval from resampling the samples: issue 11's "within 10%" test; the terminal shows SmolLM2's); diversity
(`printpress.eval.diversity`: unigram entropy of words in nats, distinct-2, the share of repeated word
4-grams) and whether it is matched to AR sampling on the same weights (repeated 4-grams at most AR's + 0.05,
unigram entropy within 5% of AR's); for diffusion, how confident the sampler was (entropy of the accepted
tokens, tokens accepted per step, how often the adaptive stop fired); for speculative decoding at
temperature 0, its speed against greedy AR on the same weights and how many samples are identical to it.
A run with a `canvas_start=table` side also draws the draft table's chain alone for every prompt and seed (no
network pass): what the denoiser added is the difference from it.
Then the held-out losses of both models (the training loop's own validation: AR NLL per token and the
diffusion loss), the cost of one decoder forward against one AR step on this machine, and the headline: the
speed ratio at matched judged quality — over every diffusion side, and over the sides of matched diversity
only — or, where no diffusion setting reaches the AR twin's quality, the ratio at the best diffusion
quality, the gap, and the speed the diffusion frontier reaches at each quality level.

Both models decode in float32, the exact path, unless `--dtype` (bfloat16, float16, auto: the measured choice a
user on this machine would get) or `--compile` (with `--compile-weights`) says otherwise; the judges always score in
float32.

The yardstick (`--yardstick`, issue 11) is the fixed measurement every training lever is compared with:
24 held-out prompts x 3 seeds, 64 new tokens (two canvases of 32), steps 32, 16, 8 x entropy bounds 0.1, 1,
4, the AR twin and the diffusion model's own AR decoding at temperature 0.8 top-k 50, plus greedy AR and
speculative decoding (1 draft step) at temperature 0 on the diffusion model. Options given explicitly win
over the preset's (`--setting` adds sides to it; `--prompts-file` replaces the held-out prompts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from printpress.errors import CheckpointError
from printpress.eval.bench_report import headline_metrics, print_table, write_outputs
from printpress.eval.bench_sides import (
    AR_SAMPLING,
    SETTING_KEYS,
    BenchError,
    decode_all,
    default_sides,
    describe,
    parse_setting,
    seed_plan,
)
from printpress.eval.frontier import (
    GGUF_KEY,
    JUDGE_KEY,
    compare_with_ar,
    headlines,
    judge_samples,
    load_gguf_judge,
    summarize,
)
from printpress.runtime_options import (COMPILE, COMPILE_WEIGHTS, COMPILE_WEIGHTS_HELP, DTYPE_HELP, check_compile,
                                        check_compile_weights, check_dtype)

if TYPE_CHECKING:
    from printpress.corpora import Document

# Shakespeare-style openings (the same eight as bench/quality_sweep.py, so figures stay comparable).
PROMPTS = ("ROMEO:\n", "To be, or not to be", "KING HENRY:\nMy lords,", "Enter HAMLET and HORATIO.\n\nHAMLET:",
           "JULIET:\nO", "FIRST CITIZEN:\nWe are", "DUKE:\nWhat news", "Exeunt.\n\nSCENE II.")

# Held-out prompts: whole lines up to this many characters (~58 tokens of the shipped BPE, so a prompt and 64
# new tokens stay near the 128-token windows the models were trained on), drawn with this fixed seed so that
# the prompts never move with --seed.
HELDOUT_PROMPT_CHARS, HELDOUT_PROMPT_SEED = 160, 11

# Options the --yardstick preset sets (issue 11), and their values without it. The parser leaves them None,
# so that an option given explicitly wins over either.
PLAIN = {"heldout_prompts": None, "seeds": 1, "max_new_tokens": 96, "steps": [64, 32, 16, 8, 4],
         "entropy_bounds": [0.1, 1.0, 4.0]}
YARDSTICK = {"heldout_prompts": 24, "seeds": 3, "max_new_tokens": 64, "steps": [32, 16, 8],
             "entropy_bounds": [0.1, 1.0, 4.0]}
# Beside the grid: greedy AR, speculative decoding (diffusion drafts, drafts from the context, and from the model's
# draft table where it has one), and about 4 tokens per forward with the adaptive stop (a canvas ends once its argmax
# settles; docs/benchmarks.md §7, L7), the first setting to keep AR's diversity there.
TABLE_SETTING = "mode=speculative,draft_source=table,temperature=0"
YARDSTICK_SETTINGS = ["mode=ar,temperature=0", "mode=speculative,steps=1,draft_source=diffusion,temperature=0",
                      "mode=speculative,draft_source=lookup,temperature=0", TABLE_SETTING,
                      "steps=24,entropy_bound=12,confidence_threshold=2"]

# Fewer samples per side than this (prompts x seeds), and a difference between two sides is mostly the luck of
# the draw: `printpress bench` says so on stderr.
MIN_SAMPLES = 8


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    """Mount `printpress bench` on the CLI."""
    p = subparsers.add_parser("bench", help="diffusion model vs its AR twin: speed, quality, frontier plot",
                              description=(__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diffusion", default=None, help="the diffusion model (default: the shipped shakespeare-joint)")
    p.add_argument("--ar", default=None, help="its AR twin, also the judge (default: the shipped shakespeare-ar)")
    p.add_argument("--canvas-length", type=int, default=None, metavar="TOKENS",
                   help="decode the diffusion model with this canvas instead of its checkpoint's (exact, as the "
                        "reference with that canvas_length; the held-out losses keep the checkpoint's canvas)")
    p.add_argument("--compile", default=None, metavar="|".join(COMPILE),
                   help="decode both models with these passes compiled (printpress.fast; not exact): both sides near "
                        "the machine's limit. Two prompts per side are decoded at full length first, untimed (the "
                        "compiles); the judge stays exact")
    p.add_argument("--compile-weights", default="float32", metavar="|".join(COMPILE_WEIGHTS),
                   help="with --compile, for both models: " + COMPILE_WEIGHTS_HELP)
    p.add_argument("--dtype", default="float32",
                   help="load both models in this dtype for decoding (the judge stays float32, exact): " + DTYPE_HELP)
    p.add_argument("--yardstick", action="store_true",
                   help="issue 11's fixed yardstick: --heldout-prompts 24 --seeds 3 --max-new-tokens 64 --steps 32 16 8 "
                        "--entropy-bounds 0.1 1 4, plus --setting " + " --setting ".join(YARDSTICK_SETTINGS))
    p.add_argument("--prompts-file", default=None, help="one prompt per line (default: eight Shakespeare openings)")
    p.add_argument("--heldout-prompts", type=int, default=None, metavar="N",
                   help=f"N prompts drawn (fixed seed) from the held-out documents of --heldout-data: whole lines, "
                        f"at most {HELDOUT_PROMPT_CHARS} characters, none found in a training document")
    p.add_argument("--heldout-skip", type=int, default=0, metavar="K",
                   help="draw K + N held-out prompts and use the last N: a prompt set disjoint from the first K's "
                        "(the yardstick's are the first 24), to check a screen's result on other prompts")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--seed", type=int, default=0,
                   help="prompt i is decoded with seed SEED + i on every side (with --seeds, see there)")
    p.add_argument("--seeds", type=int, default=None, metavar="K",
                   help="decode each prompt K times, with seeds SEED + i, SEED + P + i, ... (P prompts; default 1)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt (default 96: 3 canvases of 32)")
    p.add_argument("--steps", type=int, nargs="+", default=None,
                   help="denoising steps of the grid (default: 64 32 16 8 4)")
    p.add_argument("--entropy-bounds", type=float, nargs="+", default=None,
                   help="entropy bounds of the grid (default: 0.1 1 4)")
    p.add_argument("--setting", action="append", default=[], metavar="K=V,...",
                   help="an extra side, e.g. 'steps=8,entropy_bound=4,t_max=0.4,t_min=0.1' or "
                        "'mode=speculative,steps=1' (repeatable; keys: " + ", ".join(SETTING_KEYS) + ")")
    p.add_argument("--gguf-judge", choices=("auto", "on", "off"), default="auto",
                   help="also judge with SmolLM2-135M from GGUF (auto: when printpress.eval.gguf_judge exists)")
    p.add_argument("--python", action="store_true",
                   help="code: also the share of samples that are Python, or the start of it, and that parse "
                        "(prompt + sample cut after its last newline; printpress.eval.python_syntax)")
    p.add_argument("--no-heldout", action="store_true", help="skip the held-out losses")
    p.add_argument("--heldout-data", nargs="+", default=["shakespeare"],
                   help="corpus for held-out losses and --heldout-prompts")
    p.add_argument("--heldout-val-fraction", type=float, default=0.05, help="as the training recipes (0.05)")
    p.add_argument("--heldout-seq-len", type=int, default=128, help="validation window length (as training: 128)")
    p.add_argument("--heldout-batch-size", type=int, default=16, help="windows per validation batch (16)")
    p.add_argument("--heldout-batches", type=int, default=8, help="validation batches (as training: 8)")
    p.add_argument("--forward-reps", type=int, default=15, help="repeats of the per-forward cost measurement")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared 2-core machine)")
    p.add_argument("--results", default="results", metavar="DIR", help="folder for the report card (default ./results)")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the result here, and the plot beside it")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset from the --yardstick preset, or from the plain defaults without it.
    Explicit options win; --setting adds sides to the preset's (one the preset already measures is taken once, so
    a script written before the preset grew still runs); --prompts-file replaces its held-out prompts."""
    preset = YARDSTICK if args.yardstick else PLAIN
    for key, value in preset.items():
        if getattr(args, key) is None and not (key == "heldout_prompts" and args.prompts_file is not None):
            setattr(args, key, list(value) if isinstance(value, list) else value)
    if args.yardstick:
        preset_labels = {describe(parse_setting(text)) for text in YARDSTICK_SETTINGS}
        args.setting = [*YARDSTICK_SETTINGS,
                        *(text for text in args.setting if describe(parse_setting(text)) not in preset_labels)]
    return args


def run(args: argparse.Namespace) -> int:
    import torch

    apply_preset(args)
    if args.max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if any(n < 1 for n in args.steps) or any(not b > 0 for b in args.entropy_bounds):
        raise BenchError("--steps must be positive integers and --entropy-bounds positive numbers")
    if args.threads < 1:
        raise BenchError(f"--threads must be positive, got {args.threads}")
    if args.canvas_length is not None and args.canvas_length < 1:
        raise BenchError(f"--canvas-length must be a positive number of tokens, got {args.canvas_length}")
    try:
        check_compile(args.compile)
        check_compile_weights(args.compile_weights, args.compile)
        check_dtype(args.dtype)
    except CheckpointError as error:
        raise BenchError("--" + str(error).replace("_", "-", 1)) from None  # the flag, as the command line spells it
    if args.prompts_file is not None and args.heldout_prompts is not None:
        raise BenchError("give --prompts-file or --heldout-prompts, not both")
    if args.heldout_skip < 0 or (args.heldout_skip and args.heldout_prompts is None):
        raise BenchError(f"--heldout-skip must be a number of held-out prompts >= 0, given with --heldout-prompts; "
                         f"got {args.heldout_skip}" + ("" if args.heldout_prompts else " without --heldout-prompts"))
    if not 0 <= args.seed < 2**62:
        raise BenchError(f"--seed must be an integer in [0, 2**62), got {args.seed}")
    if min(args.heldout_seq_len, args.heldout_batch_size, args.heldout_batches) < 1:
        raise BenchError("--heldout-seq-len, --heldout-batch-size and --heldout-batches must be positive")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    import torch

    from printpress.engine import Pipeline, default_model_path

    load_start = os.getloadavg()
    sides = default_sides(args.steps, args.entropy_bounds, [parse_setting(s) for s in args.setting])
    prompts, prompt_source = choose_prompts(args)
    plan = seed_plan(prompts, args.seeds, args.seed)
    warning = few_samples_warning(len(prompts), args.seeds, args)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    diffusion_path = args.diffusion or str(default_model_path())
    ar_path = args.ar or str(default_model_path().parent / "shakespeare-ar")
    compiled = {"compile": args.compile, "compile_weights": args.compile_weights, "dtype": args.dtype}
    pipes = {"diffusion": Pipeline.from_pretrained(diffusion_path, canvas_length=args.canvas_length, **compiled),
             "ar": Pipeline.from_pretrained(ar_path, **compiled)}
    exact = args.compile is None and pipes["ar"].model.dtype == torch.float32
    judge = pipes["ar"] if exact else Pipeline.from_pretrained(ar_path)  # the judge stays exact
    if args.yardstick and pipes["diffusion"].model.draft_table is None:
        table_side = describe(parse_setting(TABLE_SETTING))
        sides = [side for side in sides if side.label != table_side]
        print(f"{diffusion_path} has no draft table: the yardstick's '{table_side}' side is left out",
              file=sys.stderr, flush=True)
    for side in sides:  # every setting checked before any work
        pipes[side.model].settings(max_new_tokens=args.max_new_tokens, **side.overrides).validate()
    gguf, gguf_note = load_gguf_judge(args.gguf_judge)
    progress = not args.no_progress

    if args.compile is not None:  # the graphs compile here, untimed: every variant a full-length decode meets
        for side in sides:
            for prompt, seed in plan[:2]:
                pipes[side.model].generate(prompt, seed=seed, max_new_tokens=args.max_new_tokens, **side.overrides)
    samples = decode_all(pipes, sides, plan, args.max_new_tokens, progress)
    scores = judge_samples(samples, judge, gguf, progress)
    rows = [summarize(side, samples[side.label], scores[side.label]) for side in sides]
    if args.python:
        from printpress.eval.python_syntax import python_validity

        for row, side in zip(rows, sides, strict=True):
            items = samples[side.label]
            row.update(python_validity([s.prompt for s in items], [s.text for s in items]))
    diversity_reference = compare_with_ar(rows, samples)
    cost = forward_cost(pipes["diffusion"], reps=args.forward_reps)
    heldout = {} if args.no_heldout else heldout_figures(args, diffusion_path, ar_path, progress)
    heads = headlines(rows, ["ar_twin", "gguf"] if gguf is not None else ["ar_twin"])

    payload = {
        "metrics": headline_metrics(heads, rows),
        "settings": {"prompts": len(prompts), "prompt_source": prompt_source, "seeds_per_prompt": args.seeds,
                     "samples_per_side": len(plan), "max_new_tokens": args.max_new_tokens,
                     "seeds": f"{args.seed}..{args.seed + len(plan) - 1}", "yardstick": args.yardstick,
                     "steps": args.steps, "entropy_bounds": args.entropy_bounds, "extra": args.setting,
                     "threads": args.threads, "ar_sampling": AR_SAMPLING, "python_syntax": args.python,
                     "canvas_length": pipes["diffusion"].canvas_length, "compile": args.compile,
                     "compile_weights": args.compile_weights,
                     "dtype": {"asked": args.dtype, **{name: str(pipe.model.dtype).removeprefix("torch.")
                                                      for name, pipe in pipes.items()}},
                     "compiled_passes": {name: compiled_passes(pipe.model) for name, pipe in pipes.items()}},
        "model": {"diffusion": diffusion_path, "ar": ar_path,
                  "parameters": sum(p.numel() for p in pipes["diffusion"].model.parameters())},
        "judges": {"ar_twin": {"model": ar_path, "weights_sha256": _weights_digest(ar_path), "column": JUDGE_KEY},
                   "gguf": {"model": gguf_note, "column": GGUF_KEY if gguf is not None else None}},
        "info": {"load_average_start": [round(x, 2) for x in load_start],
                 "load_average_end": [round(x, 2) for x in os.getloadavg()],
                 "canvas_note": "canvas length is fixed by the checkpoint (trained at this length); not swept",
                 "speed_note": "tokens_per_s: wall clock; tokens_per_cpu_s: this process's CPU time (one thread), "
                               "which a shared machine's load hardly changes; ratios are against the AR twin",
                 "forward_note": "tokens_per_forward: as the engine counts passes (diffusion: decoder passes; AR: "
                                 "token-producing encoder passes; speculative: prompt pass + decoder passes + "
                                 "verifications); tokens_per_forward_all_passes: over every encoder and decoder "
                                 "pass (prefill and commit encodes included)",
                 "diversity_note": "words: lower-cased runs of letters/digits/apostrophes; unigram entropy in nats "
                                   "pooled over a side's samples; distinct-2 pooled; repeated 4-gram share within "
                                   "each sample, averaged"},
        "diversity_reference": diversity_reference,
        "headline": heads,
        "forward_cost": cost,
        "heldout": heldout,
        "rows": rows,
        "samples": [{"side": s.side, "prompt": s.prompt, "seed": s.seed, "text": s.text} for v in samples.values()
                    for s in v],
    }
    title = (f"{Path(diffusion_path).name} vs {Path(ar_path).name}: {len(prompts)} prompts x {args.seeds} seeds x "
             f"{args.max_new_tokens} tokens, {args.threads} thread(s), load average {load_start[0]:.1f} at start")
    json_path, md_path = write_outputs(args, payload, title)
    print_table(rows, heads, cost, heldout)
    print(f"report: {json_path} and {md_path}", file=sys.stderr)
    return 0


def few_samples_warning(prompts: int, seeds: int, args: argparse.Namespace) -> str | None:
    """One line for stderr when there are fewer than `MIN_SAMPLES` samples per side, saying what to pass instead."""
    samples = prompts * seeds
    if samples >= MIN_SAMPLES:
        return None
    fixes = [f"--seeds {math.ceil(MIN_SAMPLES / prompts)}",
             "a larger --limit" if args.limit is not None else "more prompts"]
    if not args.yardstick:
        fixes.append("--yardstick (24 held-out prompts x 3 seeds)")
    return (f"printpress bench: warning: only {samples} sample(s) per side ({prompts} prompt(s) x {seeds} seed(s)), "
            f"too few for a difference between sides to mean anything; use at least {MIN_SAMPLES}: pass "
            + ", ".join(fixes[:-1]) + f" or {fixes[-1]}")


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def choose_prompts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The prompts, and a line saying where they came from (for the JSON)."""
    if args.heldout_prompts is None:
        source = f"the file {args.prompts_file}" if args.prompts_file else "the eight built-in Shakespeare openings"
        return read_prompts(args.prompts_file, args.limit), source
    skip = args.heldout_skip
    prompts = heldout_prompts(skip + args.heldout_prompts, args.heldout_data, args.heldout_val_fraction)[skip:]
    if args.limit is not None:
        prompts = prompts[: args.limit]
    source = (f"{args.heldout_prompts} windows of whole lines (<= {HELDOUT_PROMPT_CHARS} characters, seed "
              f"{HELDOUT_PROMPT_SEED}{f', the {skip} drawn first skipped' if skip else ''}) from the held-out "
              f"documents of {' '.join(args.heldout_data)} (val_fraction {args.heldout_val_fraction}), none found in "
              "a training document")
    return prompts, source


def read_prompts(path: str | None, limit: int | None) -> list[str]:
    if path is None:
        prompts = list(PROMPTS)
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"cannot read the prompts file {path}: {exc.strerror}") from None
        prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
        if not prompts:
            raise BenchError(f"the prompts file {path} holds no prompt")
    if limit is not None:
        if limit < 1:
            raise BenchError(f"--limit must be a positive number of prompts, got {limit}")
        prompts = prompts[:limit]
    return prompts


def heldout_prompts(n: int, sources: list[str], val_fraction: float) -> list[str]:
    """`n` prompts from the held-out documents of `sources`, split as the training recipes split them
    (`split_documents`, as `Trainer._train_tokenizer` and `prepare_data` do), so no model trained by a recipe on
    these sources, nor any teacher reading its training prefixes, has seen them."""
    from printpress.corpora import load_corpus, split_documents

    train, val = split_documents(load_corpus(sources), val_fraction)
    return draw_prompts(val, n, train)


def draw_prompts(docs: Sequence[Document], n: int, exclude: Sequence[Document] = (), chars: int = HELDOUT_PROMPT_CHARS,
                 seed: int = HELDOUT_PROMPT_SEED) -> list[str]:
    """`n` distinct windows of whole lines from `docs` (each starts at a line start with text on it, ends with a
    newline, holds at most `chars` and at least `chars // 2` characters), drawn with `seed`; a window found
    verbatim in an `exclude` document (a repeated stage direction, say) is skipped."""
    if n < 1:
        raise BenchError(f"--heldout-prompts must be a positive number of prompts, got {n}")
    starts = [(doc.text, i) for doc in sorted(docs, key=lambda d: d.name) for i in _window_starts(doc)]
    random.Random(seed).shuffle(starts)
    prompts: list[str] = []
    for text, start in starts:
        window = _lines_window(text, start, chars)
        if (len(window) >= chars // 2 and window not in prompts
                and not any(window in doc.text for doc in exclude)):
            prompts.append(window)
            if len(prompts) == n:
                return prompts
    raise BenchError(f"the held-out documents hold only {len(prompts)} usable prompt windows, {n} asked for")


def _window_starts(doc: Document) -> list[int]:
    """Where a prompt window may start: at a top-level statement of a Python module (so that a sample's indentation
    is its own, and `--python` can parse it), at any line with text on it otherwise."""
    if doc.name.endswith(".py"):
        from printpress.eval.python_syntax import top_level_starts

        starts = top_level_starts(doc.text)
        if starts is not None:
            return starts
    return _line_starts(doc.text)


def _line_starts(text: str) -> list[int]:
    """Offsets of the lines of `text` (split at "\\n", as `_lines_window` reads them) that hold non-whitespace."""
    starts, offset = [], 0
    for line in text.split("\n"):
        if line.strip():
            starts.append(offset)
        offset += len(line) + 1
    return starts


def _lines_window(text: str, start: int, chars: int) -> str:
    """Whole lines of `text` from `start`, as many as fit in `chars` characters (each ending with a newline)."""
    end = start
    while True:
        newline = text.find("\n", end)
        if newline < 0 or newline + 1 - start > chars:
            return text[start:end]
        end = newline + 1


# --------------------------------------------------------------------------------------------
# Per-forward cost, held-out losses, the judge's weights
# --------------------------------------------------------------------------------------------


def compiled_passes(model) -> dict[str, str]:
    """The model's compiled passes (`--compile`) after the run: "ok", or why a pass fell back to the exact path."""
    graphs = {name: getattr(model, name) for name in ("compiled_ar_step", "compiled_encoder", "compiled_decoder")}
    return {name: graph.failure or "ok" for name, graph in graphs.items() if graph is not None}


def forward_cost(pipe, prompt_tokens: int = 64, reps: int = 15) -> dict[str, Any]:
    """One decoder forward over a canvas (self-conditioned, as every step after the first) against one AR
    step (encode one token), both after `prompt_tokens` of context, interleaved; medians in ms."""
    import torch

    model, canvas_length = pipe.model, pipe.canvas_length
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, prompt_tokens), generator=gen)
    canvas = torch.randint(0, vocab, (1, canvas_length), generator=gen)
    with torch.no_grad():
        cache = model.new_cache(1, prompt_tokens)
        model.encode(prompt, cache, logits="none")
        probs = torch.softmax(model.denoise(canvas, cache) / 0.8, dim=-1)
        ar_cache = model.new_cache(1, prompt_tokens + 2 * reps + 2)
        model.encode(prompt, ar_cache, logits="none")
        token = torch.tensor([[5]])
        decoder, ar = [], []
        for _ in range(reps + 1):
            start = time.perf_counter()
            model.denoise(canvas, cache, self_conditioning_probs=probs)
            decoder.append(time.perf_counter() - start)
            start = time.perf_counter()
            model.encode(token, ar_cache, logits="last")
            ar.append(time.perf_counter() - start)
    decoder_ms, ar_ms = 1e3 * statistics.median(decoder[1:]), 1e3 * statistics.median(ar[1:])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    l3 = _l3_bytes()
    return {
        "canvas_length": canvas_length,
        "context_tokens": prompt_tokens,
        "reps": reps,
        "decoder_forward_ms": decoder_ms,
        "ar_step_ms": ar_ms,
        "decoder_over_ar_step": decoder_ms / ar_ms,
        "parameter_bytes": params,
        "l3_bytes": l3,
        "cache_resident": None if l3 is None else params <= l3,
    }


def _l3_bytes() -> int | None:
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()
                return int(size[:-1]) * {"K": 2**10, "M": 2**20}.get(size[-1], 1)
        except (OSError, ValueError):
            continue
    return None


def heldout_figures(args: argparse.Namespace, diffusion_path: str, ar_path: str, progress: bool) -> dict[str, Any]:
    """`heldout_losses` of both models, the diffusion one under the joint objective."""
    from printpress.corpora import cache_dir

    folder = cache_dir() / "bench-heldout"
    out: dict[str, Any] = {}
    for name, path, objective in (("diffusion", diffusion_path, "joint"), ("ar", ar_path, "ar")):
        if progress:
            print(f"held-out losses: {name} ({path})", file=sys.stderr, flush=True)
        out[name] = heldout_losses(path, objective, args.heldout_data, args.heldout_seq_len, args.heldout_batch_size,
                                   args.heldout_batches, args.heldout_val_fraction, folder)
    return out


def heldout_cache(cache: Path, sources: Sequence[str], tokenizer) -> Path:
    """The folder under `cache` for the token files of `sources` cut with `tokenizer`: named by both (the tokenizer
    by its digest), so models that share a tokenizer share them, and two models' runs at once never write one file
    with different tokens."""
    from printpress.tokenizer import tokenizer_sha256

    label = "+".join(Path(str(source)).name for source in sources)  # a corpus may be a folder's path
    digest = hashlib.sha256(json.dumps([list(map(str, sources)), tokenizer_sha256(tokenizer)]).encode()).hexdigest()
    return cache / f"{label}-{digest[:16]}" / "data"


def heldout_losses(model_path: str, objective: str, sources: list[str], seq_len: int, batch_size: int,
                   batches: int, val_fraction: float, cache: Path, quantize: str | None = None) -> dict[str, Any]:
    """The training loop's own validation on a saved model: `printpress.objectives.evaluate_losses`, which
    `Trainer.evaluate` calls, on the validation windows a training run on `sources` evaluates (the first `batches`
    batches of `batch_size` windows of `seq_len` tokens of the held-out documents) with the same fixed noise
    (seed 0, the training defaults: t ~ U(0, 1), uniform weighting, half the rows self-conditioned).

    `objective` "joint" gives both the AR NLL (`val_ar`, nats/token) and the diffusion loss (`val_diffusion`:
    x0 cross-entropy over every canvas position, noise t ~ U(0, 1), uniform weighting — the training
    objective, not a tight likelihood bound); "ar" gives `val_ar` only. Also nats per character of the
    AR NLL, from the characters the validation windows decode to, to set beside the judge's figures.
    Token files are cached under `cache` (`heldout_cache`). `quantize` loads the model quantized (bench/quantize.py's
    quality cost).
    """
    from printpress.checkpoint import load_model
    from printpress.objectives import DiffusionSettings, TrainStep, evaluate_losses
    from printpress.data import eval_batches, prepare_data

    model, config, _, tokenizer = load_model(model_path, quantize=quantize)
    if tokenizer is None:
        raise BenchError(f"{model_path} has no tokenizer.json to cut the held-out windows with; pass --no-heldout")
    if seq_len % config.canvas_length:
        raise BenchError(f"--heldout-seq-len ({seq_len}) must be a multiple of the canvas length "
                         f"({config.canvas_length})")
    splits = prepare_data(list(sources), tokenizer, heldout_cache(cache, sources, tokenizer), val_fraction=val_fraction)
    windows = list(eval_batches(splits.val.tokens, seq_len, batch_size, max_batches=batches))
    settings = DiffusionSettings(block=config.canvas_length)
    step = TrainStep(model.eval(), objective, settings)
    losses = evaluate_losses(step, windows, objective, settings, config.text.vocab_size)
    tokens = sum(w.numel() for w in windows)
    chars = sum(len(tokenizer.decode(row.tolist())) for w in windows for row in w)
    out: dict[str, Any] = dict(losses)
    out.update(objective=objective, windows=sum(w.shape[0] for w in windows), seq_len=seq_len,
               tokens=tokens, chars_per_token=chars / tokens)
    if "val_ar" in losses:
        # Each window predicts seq_len - 1 tokens; the per-token mean carries over to characters by the ratio.
        out["val_ar_nats_per_char"] = losses["val_ar"] * tokens / chars
    return out


def _weights_digest(path: str) -> str | None:
    """sha256 of a local checkpoint's safetensors (first 16 hex digits), so the JSON pins which weights judged:
    the AR judge must never have been a teacher, and a path alone does not say that the file stayed the same."""
    import hashlib

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
