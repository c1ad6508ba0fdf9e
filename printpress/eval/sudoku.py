"""Sudoku evaluation: solve held-out puzzles with a model through the engine and score every grid.

The held-out set is generated, not stored: puzzles of the seed ``"test"`` (training uses ``"train"``, so
the sets share no generator stream), at a few difficulty levels given by the number of givens. Each
prompt is ``<bos>`` + the puzzle (one canvas of 82 tokens, see `printpress.tasks.sudoku`); the model
writes one canvas (diffusion) or 82 tokens greedily (``mode="ar"``), and the first 81 generated tokens
are read as the grid.

Metrics: exact-solve accuracy (all 81 cells equal the unique solution, which for a unique puzzle is the
same as a valid grid that keeps the givens; both are reported), cell accuracy over all cells and over
the blank cells only (givens can simply be copied, so the blank-cell figure is the one that measures
solving; the given-cell figure says whether the model copies the puzzle), tokens per forward (generated
tokens / decoder or encoder passes; 1 for AR) and wall time.

    python -m printpress.eval.sudoku --model /work/runs/sudoku-diffusion/model --limit 50
    python -m printpress.eval.sudoku --model /work/runs/sudoku-ar/model --mode ar
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from printpress.errors import PrintpressError
from printpress.tasks import sudoku

TEST_SEED = "test"
LEVELS = (40, 34, 28)  # givens per held-out level: top, middle and bottom of the training range (28..40)
DEFAULT_LIMIT = 100  # puzzles per level
BATCH = 50  # puzzles generated at once
N_SAMPLES = 3  # example grids kept in the result


def held_out(limit: int | None = None, levels: tuple[int, ...] = LEVELS) -> list[tuple[int, sudoku.Example]]:
    """(level, example) pairs of the held-out set: the first `limit` puzzles of each level."""
    n = DEFAULT_LIMIT if limit is None else limit
    if n < 1:
        raise PrintpressError(f"limit must be at least 1 puzzle per level, got {n}")
    return [(g, sudoku.example(f"{TEST_SEED}-g{g}", i, (g, g))) for g in levels for i in range(n)]


def _generation_settings(pipe, settings: dict) -> dict:
    """Sampler overrides for every request: exactly one canvas of new tokens, greedy AR unless told."""
    overrides = dict(settings)
    overrides.setdefault("max_new_tokens", sudoku.CANVAS_LENGTH)
    if overrides.get("mode") == "ar":
        overrides.setdefault("temperature", 0.0)
    if pipe.canvas_length != sudoku.CANVAS_LENGTH and overrides.get("mode") != "ar":
        raise PrintpressError(
            f"the model's canvas is {pipe.canvas_length} tokens; Sudoku diffusion needs {sudoku.CANVAS_LENGTH} "
            "(puzzle canvas, then solution canvas)"
        )
    if pipe.config.text.vocab_size != sudoku.VOCAB_SIZE:
        raise PrintpressError(
            f"the model's vocabulary has {pipe.config.text.vocab_size} tokens, not the Sudoku vocabulary's "
            f"{sudoku.VOCAB_SIZE}: train it with a sudoku recipe"
        )
    pipe.settings(**overrides)  # a bad setting fails here, before any work
    return overrides


def evaluate(pipe, *, limit: int | None = None, seed: int = 0, settings: dict | None = None,
             progress: bool = True) -> dict:
    """Solve the held-out puzzles with `pipe` and score them.

    `limit`: puzzles per difficulty level (default 100, levels `LEVELS`). `settings`: sampler overrides for
    Pipeline.generate (mode, max_denoising_steps, entropy_bound, ...); puzzle j is generated with seed
    `seed + j`.
    """
    from tqdm.auto import tqdm

    overrides = _generation_settings(pipe, settings or {})
    items = held_out(limit)
    rows: list[dict] = []
    samples: list[dict] = []
    tokens = forwards = 0
    started = time.perf_counter()
    bar = tqdm(total=len(items), desc="sudoku", unit="puzzle", disable=not progress)
    for start in range(0, len(items), BATCH):
        chunk = items[start : start + BATCH]
        prompts = [sudoku.prompt_ids(ex.puzzle) for _, ex in chunk]
        seeds = [seed + start + j for j in range(len(chunk))]
        results = pipe.generate(prompts, seed=seeds, **overrides)
        for (level, ex), result in zip(chunk, results):
            predicted = sudoku.ids_to_cells(result.token_ids[: sudoku.CELLS])
            s = sudoku.score(ex.puzzle, ex.solution, predicted)
            rows.append({"level": level, **asdict(s)})
            tokens += result.stats.new_tokens
            forwards += result.stats.forward_passes
            if len(samples) < N_SAMPLES:
                samples.append({"level": level, "puzzle": sudoku.to_string(ex.puzzle),
                                "solution": sudoku.to_string(ex.solution),
                                "predicted": "".join("?" if v < 0 else str(v) for v in predicted),
                                **asdict(s)})
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - started
    metrics = summarise(rows)
    metrics.update(
        tokens_per_forward=tokens / max(forwards, 1),
        forwards_per_puzzle=forwards / len(rows),
        wall_time_s=seconds,
        puzzles_per_s=len(rows) / seconds,
        mode=overrides.get("mode", "diffusion"),
        by_level={str(g): summarise([r for r in rows if r["level"] == g]) for g in sorted({r["level"] for r in rows})},
    )
    info = {"test_seed": TEST_SEED, "levels": list(LEVELS), "per_level": len(rows) // len(LEVELS), "seed": seed,
            "settings": {k: v for k, v in overrides.items()}}
    return {"metrics": metrics, "samples": samples, "info": info}


def summarise(rows: list[dict]) -> dict:
    """Accuracies over scored rows (see `printpress.tasks.sudoku.Score`)."""
    n = len(rows)
    blanks = sum(r["blanks"] for r in rows)
    return {
        "n": n,
        "exact_solve_accuracy": sum(r["solved"] for r in rows) / n,
        "valid_accuracy": sum(r["valid"] for r in rows) / n,
        "cell_accuracy": sum(r["cells_right"] for r in rows) / (n * sudoku.CELLS),
        "blank_cell_accuracy": sum(r["blanks_right"] for r in rows) / max(blanks, 1),
        "given_cell_accuracy": sum(r["cells_right"] - r["blanks_right"] for r in rows) / max(n * sudoku.CELLS - blanks, 1),
        # Copying the givens and leaving the rest wrong scores this cell accuracy: the floor to beat.
        "copy_givens_cell_accuracy": 1 - blanks / (n * sudoku.CELLS),
    }


def noise_probe(pipe, *, n: int = 32, givens: int = 34, levels=(0.0, 0.25, 0.5, 0.75, 1.0), seed: int = 0) -> dict:
    """Where a diffusion model's skill stops: the training forward on held-out examples with the solution
    canvas noised at fixed levels t, reporting argmax accuracy and cross-entropy separately on the cells
    that are givens (copyable from the puzzle in the cache) and the blank ones (to be solved). At t = 1 the
    canvas holds no information, so givens are right only if the decoder reads the puzzle."""
    import torch
    import torch.nn.functional as F

    from printpress.objectives import add_uniform_noise, forward_block_diffusion

    examples = [sudoku.example(f"{TEST_SEED}-g{givens}", i, (givens, givens)) for i in range(n)]
    clean = torch.tensor([sudoku.sequence_ids(ex) for ex in examples])
    given = torch.tensor([[v != 0 for v in ex.puzzle] for ex in examples])
    canvas = slice(sudoku.CANVAS_LENGTH, sudoku.CANVAS_LENGTH + sudoku.CELLS)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for t in levels:
        noisy, _ = add_uniform_noise(clean, sudoku.CANVAS_LENGTH, sudoku.VOCAB_SIZE, generator,
                                     t=torch.full((n, 2), float(t)))
        with torch.no_grad():
            _, logits = forward_block_diffusion(pipe.model, clean, noisy, sudoku.CANVAS_LENGTH)
        logits, target = logits[:, canvas], clean[:, canvas]
        loss = F.cross_entropy(logits.reshape(-1, sudoku.VOCAB_SIZE), target.reshape(-1), reduction="none").view(n, -1)
        right = (logits.argmax(-1) == target).float()
        out[str(t)] = {"given_accuracy": float(right[given].mean()), "blank_accuracy": float(right[~given].mean()),
                       "given_nll": float(loss[given].mean()), "blank_nll": float(loss[~given].mean())}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m printpress.eval.sudoku", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder trained with a sudoku recipe")
    parser.add_argument("--limit", type=int, default=None, help=f"puzzles per level (default {DEFAULT_LIMIT})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("diffusion", "ar"), default=None, help="default: diffusion")
    parser.add_argument("--steps", type=int, default=None, help="maximum denoising steps per canvas")
    parser.add_argument("--entropy-bound", type=float, default=None)
    parser.add_argument("--t-min", type=float, default=None)
    parser.add_argument("--t-max", type=float, default=None)
    parser.add_argument("--out", default=None, help="also write the full result JSON here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--probe", action="store_true",
                        help="diffusion models: also report denoising accuracy on givens/blanks per noise level")
    args = parser.parse_args(argv)
    settings = {"mode": args.mode, "max_denoising_steps": args.steps, "entropy_bound": args.entropy_bound,
                "t_min": args.t_min, "t_max": args.t_max}
    settings = {k: v for k, v in settings.items() if v is not None}
    try:
        from printpress.pipeline import Pipeline

        pipe = Pipeline.from_pretrained(args.model)
        result = evaluate(pipe, limit=args.limit, seed=args.seed, settings=settings, progress=not args.no_progress)
    except PrintpressError as exc:
        print(f"printpress.eval.sudoku: error: {exc}", file=sys.stderr)
        return 2
    if args.probe:
        result["metrics"]["noise_probe"] = noise_probe(pipe)
    result["info"]["model"] = args.model
    result["info"]["command"] = "python -m printpress.eval.sudoku " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
    print(json.dumps(result["metrics"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
