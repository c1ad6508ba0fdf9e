"""`printpress distill`: sequence-level distillation data from an autoregressive teacher.

The teacher (any checkpoint that decodes autoregressively: an AR twin, or a joint model's own encoder)
continues random prefixes of the *training* split; each ``[prefix | continuation]`` row, exactly
``prefix_tokens + new_tokens`` long, is written to a token file that a fine-tune mixes into its batches
(`data.distill`, `data.distill_fraction`; see docs/training.md, "Distillation").

Why: a parallel decoder samples every canvas position independently from its marginal, so multimodal targets
("thou art" / "you are") get mixed. A teacher's continuations at a moderate temperature are a lower-entropy
target than human text (sequence-level KD, Kim & Rush 2016; Zhou et al. 2020), so the denoiser can be sure of
more positions at once. The held-out prompts of `printpress bench --yardstick` come from the validation split,
which the teacher never sees.

The teacher continues through end-of-text (it writes the next document's start, as training windows do), so
every row has the same length and no padding.

`printpress draft-table` makes greedy rows the same way, with the model as its own teacher, and keeps them as the
model's draft table (printpress/draft_table.py) for `mode="speculative"`'s `draft_source="table"`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from printpress.data import prepare_data

from printpress.draft_table import DEFAULT_LONGEST
from printpress.errors import PrintpressError

logger = logging.getLogger(__name__)


class DistillError(PrintpressError):
    """Distillation data that cannot be made as asked."""


@dataclass(frozen=True)
class DistillSettings:
    rows: int = 4800
    prefix_tokens: int = 64
    new_tokens: int = 64
    temperature: float = 0.7
    top_k: int | None = 50
    seed: int = 0
    batch_size: int = 256
    # Drop a continuation whose share of repeated token 4-grams is above this (None: keep every row), and continue
    # more prefixes in its place. A greedy teacher loops (`self.x = 0` four times, a run of bare `#` lines), and a
    # loop trained as a canvas target teaches the denoiser its filler.
    max_repeat: float | None = None

    def validate(self) -> None:
        for name in ("rows", "prefix_tokens", "new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise DistillError(f"{name.replace('_', '-')} must be positive (got {getattr(self, name)})")
        if self.max_repeat is not None and not 0 <= self.max_repeat < 1:
            raise DistillError(f"max-repeat must be in [0, 1): the share of a row's repeated 4-grams above which "
                               f"it is dropped (got {self.max_repeat})")
        if self.temperature < 0:
            raise DistillError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k is not None and self.top_k < 1:
            raise DistillError(f"top-k must be positive (got {self.top_k})")


# With `max_repeat`, how many prefixes per row asked for may be continued before giving up.
MAX_CANDIDATES_PER_ROW = 8
REPEAT_NGRAM = 4


def prefix_starts(num_tokens: int, settings: DistillSettings, draw: int = 0) -> np.ndarray:
    """`settings.rows` random prefix offsets into the training tokens, a function of the seed and `draw` only
    (draw 0 is what every distillation without `max_repeat` continues; later draws replace dropped rows)."""
    high = num_tokens - settings.prefix_tokens + 1
    if high < 1:
        raise DistillError(f"the training split holds {num_tokens} tokens, fewer than one prefix of {settings.prefix_tokens}")
    seed = settings.seed if draw == 0 else settings.seed * 1_000_003 + 7919 * draw
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (settings.rows,), generator=gen).numpy()


def teacher_rows(pipe, train_tokens: np.ndarray, settings: DistillSettings,
                 progress: bool = False) -> tuple[np.ndarray, int]:
    """(rows, prefix_tokens + new_tokens) int64: each prefix followed by the teacher's continuation; with
    `settings.max_repeat`, only continuations that repeat no more than that, from as many prefixes as it takes.
    Returns the rows and how many prefixes the teacher continued."""
    from tqdm import tqdm

    from printpress.eval.diversity import repeated_share

    width = settings.prefix_tokens + settings.new_tokens
    out = np.empty((settings.rows, width), dtype=np.int64)
    kept = tried = 0
    with tqdm(total=settings.rows, disable=not progress, desc="teacher", unit="row") as bar:
        for draw in range(MAX_CANDIDATES_PER_ROW if settings.max_repeat is not None else 1):
            starts = prefix_starts(len(train_tokens), settings, draw)
            for lo in range(0, settings.rows, settings.batch_size):
                chunk = [np.asarray(train_tokens[s : s + settings.prefix_tokens], dtype=np.int64)
                         for s in starts[lo : lo + settings.batch_size]]
                results = pipe.generate([row.tolist() for row in chunk], mode="ar", max_new_tokens=settings.new_tokens,
                                        temperature=settings.temperature, top_k=settings.top_k, eos_token_ids=(),
                                        seed=[settings.seed * 1_000_003 + tried + i for i in range(len(chunk))])
                tried += len(chunk)
                for prefix, result in zip(chunk, results):
                    if len(result.token_ids) != settings.new_tokens:  # the engine stops only at the budget
                        raise DistillError(f"the teacher wrote {len(result.token_ids)} tokens for a row, "
                                           f"not {settings.new_tokens}")
                    if settings.max_repeat is not None and \
                            (repeated_share(result.token_ids, REPEAT_NGRAM) or 0.0) > settings.max_repeat:
                        continue
                    out[kept] = np.concatenate([prefix, np.asarray(result.token_ids, dtype=np.int64)])
                    kept += 1
                    bar.update()
                    if kept == settings.rows:
                        return out, tried
    raise DistillError(f"only {kept} of {tried} continuations repeat at most {settings.max_repeat:g} of their "
                       f"{REPEAT_NGRAM}-grams, fewer than the {settings.rows} rows asked for: raise --max-repeat or "
                       "ask for fewer --rows")


def write_rows(rows: np.ndarray, path: Path, tokenizer, teacher: str, settings: DistillSettings,
               continued: int | None = None):
    """Write the rows as a printpress token file, one "document" per row (so the trainer can check lengths), with
    the teacher and its settings recorded as the corpus (and with `max_repeat`, how many prefixes it continued)."""
    from printpress.data import write_token_documents

    made = {"teacher": teacher, **asdict(settings)}
    if settings.max_repeat is not None:
        made["continued"] = continued
    described = json.dumps(made, sort_keys=True)
    return write_token_documents(((f"row {i}", row) for i, row in enumerate(rows)), tokenizer, path,
                                 corpus=f"distill {described}",
                                 corpus_digest=hashlib.sha256(described.encode()).hexdigest(),
                                 layout="prefix continuation")


def distill(teacher: str, sources: list[str], out: Path, settings: DistillSettings, val_fraction: float = 0.05,
            progress: bool = False, counts: dict | None = None) -> Path:
    """Make the token file `out` from `teacher`'s continuations of the training split of `sources` (with a dict
    `counts`, how many prefixes the teacher continued goes in `counts["continued"]`: more than the rows with
    `max_repeat`)."""
    import printpress

    settings.validate()
    if out.suffix != ".bin":
        raise DistillError(f"--out must name a .bin token file (its .json metadata goes beside it), got {out}")
    pipe = printpress.load(teacher)
    splits = prepare_data(sources, pipe.tokenizer, out.parent / (out.stem + "-data"), val_fraction=val_fraction)
    started = time.perf_counter()
    rows, continued = teacher_rows(pipe, splits.train.tokens, settings, progress)
    seconds = time.perf_counter() - started
    write_rows(rows, out, pipe.tokenizer, teacher, settings, continued)
    if counts is not None:
        counts["continued"] = continued
    logger.info("wrote %s: %d rows in %.0f s (%.0f teacher tokens/s)", out, len(rows), seconds,
                continued * settings.new_tokens / seconds)
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = DistillSettings()
    p = subparsers.add_parser("distill", help="make distillation data: a teacher continues training prefixes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=None, help="the AR teacher, a folder or hub id (default: the shipped model)")
    p.add_argument("--data", nargs="+", default=["shakespeare"], help="corpus whose training split gives the prefixes")
    p.add_argument("--val-fraction", type=float, default=0.05, help="the held-out share, as in the recipes (0.05)")
    p.add_argument("--out", required=True, help="the token file to write (.bin; metadata beside it)")
    p.add_argument("--rows", type=int, default=defaults.rows, help=f"rows to make ({defaults.rows})")
    p.add_argument("--prefix-tokens", type=int, default=defaults.prefix_tokens, help="real tokens per row")
    p.add_argument("--new-tokens", type=int, default=defaults.new_tokens, help="teacher tokens per row")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="teacher temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="teacher top-k")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="rows the teacher continues at once")
    p.add_argument("--max-repeat", type=float, default=None,
                   help="drop continuations with more than this share of repeated token 4-grams (a greedy teacher's "
                        "loops), continuing more prefixes in their place (default: keep every row)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = DistillSettings(rows=args.rows, prefix_tokens=args.prefix_tokens, new_tokens=args.new_tokens,
                               temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                               batch_size=args.batch_size, max_repeat=args.max_repeat)
    teacher = args.teacher
    if teacher is None:
        from printpress.engine import default_model_path

        teacher = str(default_model_path())
    counts: dict = {}
    out = distill(teacher, args.data, Path(args.out), settings, args.val_fraction, progress=not args.no_progress,
                  counts=counts)
    continued = counts["continued"]
    dropped = "" if settings.max_repeat is None else \
        f" ({continued - settings.rows} of {continued} continuations dropped for --max-repeat {settings.max_repeat:g})"
    print(f"wrote {settings.rows} rows of {settings.prefix_tokens}+{settings.new_tokens} tokens to {out}{dropped}")
    return 0


# A draft table's rows: greedy for the greedy chain, sampled as AR sampling samples (0.8, top-k 50) for the counts,
# from other prefixes (seed + 1). `printpress draft-table` and scripts/ship_model.py start from these.
TABLE_GREEDY = DistillSettings(temperature=0.0, top_k=None, seed=3)
TABLE_SAMPLED = DistillSettings(temperature=0.8, top_k=50, seed=TABLE_GREEDY.seed + 1)


def make_draft_table(model: str, sources: list[str], settings: DistillSettings, longest: int, out: Path | None,
                     val_fraction: float = 0.05, progress: bool = False,
                     sampled: DistillSettings | None = None) -> Path:
    """Write `model`'s draft table: its greedy continuations of `settings.rows` training prefixes, each kept with
    the `longest` prefix tokens before it as context, and with `sampled` (rows at a temperature above 0) the
    next-token counts of its sampled continuations too. `out` None: `draft_table.safetensors` in the model's
    folder."""
    import printpress
    from printpress.draft_table import FILE, DraftTable
    from printpress.pipeline import model_folder

    settings.validate()
    if settings.temperature != 0:
        raise DistillError(f"a draft table holds the model's greedy continuations; temperature must be 0, "
                           f"got {settings.temperature}")
    if sampled is not None:
        sampled.validate()
        if sampled.temperature <= 0 or sampled.prefix_tokens != settings.prefix_tokens:
            raise DistillError(f"the sampled rows need a temperature above 0 (got {sampled.temperature}) and the "
                               f"greedy rows' prefix length ({settings.prefix_tokens}, got {sampled.prefix_tokens})")
    if not 1 <= longest <= settings.prefix_tokens:
        raise DistillError(f"--longest must be in 1..{settings.prefix_tokens} (the prefix tokens), got {longest}")
    if out is None:
        folder = model_folder(model)
        if folder is None:
            raise DistillError(f"{model} is not a local folder; give --out for its draft table")
        out = folder / FILE
    if out.suffix != ".safetensors" or not out.parent.is_dir():
        raise DistillError(f"--out must name a .safetensors file in an existing folder, got {out}")
    pipe = printpress.load(model)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="draft-table-") as scratch:
        train = prepare_data(sources, pipe.tokenizer, Path(scratch), val_fraction=val_fraction).train.tokens
        rows, _ = teacher_rows(pipe, train, settings, progress)
        sampled_rows = None if sampled is None else teacher_rows(pipe, train, sampled, progress)[0]
    seconds = time.perf_counter() - started
    made_by = {"model": str(model), "data": sources, "val_fraction": val_fraction, **asdict(settings),
               "sampled": None if sampled is None else asdict(sampled)}
    context = slice(settings.prefix_tokens - longest, None)  # the model's writing, after `longest` prefix tokens
    table = DraftTable.from_rows(rows[:, context], first=longest, longest=longest, made_by=made_by,
                                 sampled_rows=None if sampled_rows is None else sampled_rows[:, context])
    table.save(out)
    logger.info("wrote %s: %d greedy and %d sampled rows in %.0f s", out, settings.rows,
                0 if sampled is None else sampled.rows, seconds)
    return out


def register_draft_table(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("draft-table", help="write a model's draft table for speculative decoding",
                              description=make_draft_table.__doc__)
    p.add_argument("model", nargs="?", default=None, help="a model folder or hub id (default: the shipped model)")
    p.add_argument("--out", default=None,
                   help="the file to write (default: draft_table.safetensors in the model's folder)")
    p.add_argument("--data", nargs="+", default=["shakespeare"], help="corpus whose training split gives the prefixes")
    p.add_argument("--val-fraction", type=float, default=0.05, help="the held-out share, as in the recipes (0.05)")
    p.add_argument("--rows", type=int, default=DistillSettings.rows, help=f"greedy rows ({DistillSettings.rows})")
    p.add_argument("--new-tokens", type=int, default=DistillSettings.new_tokens, help="tokens the model writes per row")
    p.add_argument("--longest", type=int, default=DEFAULT_LONGEST,
                   help=f"longest context looked up ({DEFAULT_LONGEST})")
    p.add_argument("--sampled-rows", type=int, default=DistillSettings.rows,
                   help=f"rows sampled for the draft distributions of sampling requests ({DistillSettings.rows}; 0: "
                        "none, greedy drafts only)")
    p.add_argument("--temperature", type=float, default=TABLE_SAMPLED.temperature,
                   help=f"of the sampled rows ({TABLE_SAMPLED.temperature:g}, as AR sampling)")
    p.add_argument("--top-k", type=int, default=TABLE_SAMPLED.top_k,
                   help=f"of the sampled rows ({TABLE_SAMPLED.top_k}, as AR sampling)")
    p.add_argument("--seed", type=int, default=TABLE_GREEDY.seed,
                   help=f"which training prefixes ({TABLE_GREEDY.seed}; the sampled rows: seed + 1)")
    p.add_argument("--batch-size", type=int, default=DistillSettings.batch_size, help="rows continued at once")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_draft_table)


def run_draft_table(args: argparse.Namespace) -> int:
    shared = dict(new_tokens=args.new_tokens, batch_size=args.batch_size)
    settings = replace(TABLE_GREEDY, rows=args.rows, seed=args.seed, **shared)
    if args.sampled_rows < 0:
        raise DistillError(f"--sampled-rows must be 0 (none) or positive, got {args.sampled_rows}")
    sampled = None if args.sampled_rows == 0 else replace(
        TABLE_SAMPLED, rows=args.sampled_rows, temperature=args.temperature, top_k=args.top_k, seed=args.seed + 1,
        **shared)
    model = args.model
    if model is None:
        from printpress.engine import default_model_path

        model = str(default_model_path())
    out = make_draft_table(model, args.data, settings, args.longest, None if args.out is None else Path(args.out),
                           args.val_fraction, progress=not args.no_progress, sampled=sampled)
    also = "" if sampled is None else f" and {sampled.rows} sampled at temperature {sampled.temperature:g}"
    print(f"wrote the draft table of {model} ({settings.rows} greedy rows of {settings.new_tokens} tokens{also}) "
          f"to {out}")
    return 0
