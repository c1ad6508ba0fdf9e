"""Two checkouts of printpress, interleaved: the exact AR step and decoder passes of one model, each checkout in its
own long-lived process, in alternating rounds of a few calls.

A change to the C++ layers cannot be timed against its old version in one process (both register the same
operators), and two runs of a bench a minute apart on a shared machine can differ by more than most changes do (the
AMD EPYC of session 35: the same code's AR step 2.2-3.7 ms from one run to the next). Here both sides wait loaded and
warmed up, and each round runs one side's calls and then the other's (the order alternating), so a spell of load
hits both; the report gives each side's median and best, and the median of the per-round ratios, which is the figure
to quote; and the same median of the ratios of each round's quietest calls (each side's least time a call in the
round), steadier where a neighbour's bursts lengthen some calls of most rounds (a change of a few percent). Each
worker also reports a digest of its logits (an AR step and a decoder pass on fixed inputs), so the report says
whether the two checkouts compute the same bits.

A round: `--steps` consecutive AR steps (`model.encode` of 1 token, `logits="last"`) after a 64-token prefix, then
decoder passes (`model.denoise`, self-conditioned) over each `--canvases` length after the same prefix, then (with
`--verify N`) `--passes` consecutive verifications of speculative decoding, each a block of N tokens (the last
committed one and N - 1 drafts) through `model.encode_tentatively`, of which the first N // 2 are kept (about what
the shipped model's table drafts get accepted). The workers use only `printpress.load`, `new_cache`, `encode`,
`encode_tentatively` and `denoise`, so any checkout of the last months runs.

    git worktree add /tmp/before <commit>
    OMP_NUM_THREADS=1 .venv/bin/python bench/checkouts_ab.py --before /tmp/before --after . --rounds 40 \\
        --out docs/results/checkouts_ab.json

Each side runs in its checkout's folder with that checkout first on PYTHONPATH and this script's Python.

With `--switch NAME` instead of `--before`, both sides are one process of this checkout, alternating one of the C++
layers' runtime switches (`torch.ops.printpress_layers.set_NAME`): "before" with it off, "after" with it on. One
process takes the machine's differences between processes out of the ratio (on the AMD EPYC of sessions 44-48 the same
code ran up to 1.7x apart in two processes), so a change of a few percent that has a switch is best measured so:

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkouts_ab.py --switch experts_in_buffers --rounds 30 --steps 16 \
        --canvases 8 --passes 4 --verify 8 --out docs/results/experts_in_buffers_ab_session48.json
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 64
SWITCHES = ("layers_in_buffers", "experts_in_buffers", "attention_in_loops", "rows_kernel", "half_width")  # set_NAME(bool)


def worker(model_path: str, steps: int, canvases: list[int], passes: int, verify: int = 0,
           switch: str | None = None) -> None:
    """Loads the model from this process's checkout, prints a ready line with the logits' digest, then times one round
    per line read from stdin and prints, per work, its mean and least milliseconds a call as JSON. With `switch`, the
    ready line has the digest with it off and on, and a line "off" or "on" sets it for its round."""
    import torch

    import printpress

    torch.set_grad_enabled(False)
    model = printpress.load(model_path).model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    kept = verify // 2
    prefix = model.new_cache(1, CONTEXT + max(steps, max(canvases), passes * kept + verify))
    model.encode(torch.randint(3, vocab, (1, CONTEXT), generator=gen), prefix, logits="none")
    token = torch.randint(3, vocab, (1, 1), generator=gen)
    decoder = {}
    for c in canvases:
        ids = torch.randint(3, vocab, (1, c), generator=gen)
        probs = torch.softmax(model.denoise(ids, prefix) / 0.8, dim=-1, dtype=torch.float32)
        decoder[c] = (ids, probs)

    def timed(call, times: int) -> tuple[list[float], torch.Tensor]:
        """`call()` `times` times in a row: the mean and the least milliseconds a call, and the last call's logits."""
        took = []
        for _ in range(times):
            start = time.perf_counter()
            logits = call()
            took.append(time.perf_counter() - start)
        return [sum(took) / times * 1e3, min(took) * 1e3], logits

    def ar_steps() -> tuple[list[float], torch.Tensor]:
        cache = copy.deepcopy(prefix)
        return timed(lambda: model.encode(token, cache, logits="last"), steps)

    def decoder_passes(c: int) -> tuple[list[float], torch.Tensor]:
        ids, probs = decoder[c]
        return timed(lambda: model.denoise(ids, prefix, self_conditioning_probs=probs), passes)

    block = torch.randint(3, vocab, (1, verify), generator=gen)

    def verifications() -> tuple[list[float], torch.Tensor]:
        cache = copy.deepcopy(prefix)

        def verification() -> torch.Tensor:
            logits, keep = model.encode_tentatively(block, cache)
            keep(kept)
            return logits

        return timed(verification, passes)

    def digest() -> str:
        hashed = hashlib.sha256()
        runs = [ar_steps()] + [decoder_passes(c) for c in canvases] + ([verifications()] if verify else [])
        for _, logits in runs:  # also the warm-up
            hashed.update(logits.contiguous().numpy().tobytes())
        return hashed.hexdigest()[:16]

    ready = {"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__}
    set_switch = getattr(torch.ops.printpress_layers, f"set_{switch}") if switch else None
    if set_switch is not None:
        set_switch(False)
        ready["digest_off"] = digest()
        set_switch(True)
    ready["digest"] = digest()
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if set_switch is not None:
            set_switch(line.strip() == "on")
        times = {"AR step": ar_steps()[0]}
        times.update({f"decoder pass, canvas {c}": decoder_passes(c)[0] for c in canvases})
        if verify:
            times[f"verification of {verify} tokens ({kept} kept)"] = verifications()[0]
        print(json.dumps(times), flush=True)


def start_worker(checkout: Path, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(Path(args.model).resolve()),
               "--steps", str(args.steps), "--passes", str(args.passes), "--canvases", *map(str, args.canvases),
               "--verify", str(args.verify)] + (["--switch", args.switch] if args.switch else [])
    return subprocess.Popen(command, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read_line(name: str, process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"checkouts_ab: the {name} side's worker stopped (its error is above)")
    return json.loads(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout of printpress (e.g. a `git worktree`)")
    parser.add_argument("--after", type=Path, default=ROOT, help="another checkout (default: this one)")
    parser.add_argument("--model", default=str(ROOT / "models" / "shakespeare-joint"),
                        help="a model folder, or a benchmark size of bench/engine_speed.py (e.g. `large`, the 99.7M "
                             "config): its random weights (seed 0) written once to a temporary folder both sides load")
    parser.add_argument("--stored-as", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="the dtype a benchmark size's random checkpoint is written in (both sides load it in "
                             "float32: float16 or bfloat16 gives weights whose values fit half width, as the shipped "
                             "model's and released checkpoints' do)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=32, help="AR steps per round")
    parser.add_argument("--canvases", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--passes", type=int, default=3, help="decoder passes per canvas (and verifications) per round")
    parser.add_argument("--verify", type=int, default=0, metavar="N",
                        help="also time verifications of N-token blocks (speculative decoding's pass; 0: none)")
    parser.add_argument("--switch", choices=SWITCHES,
                        help="instead of two checkouts, one process of --after with this switch of the C++ layers off "
                             "(before) and on (after)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model, args.steps, args.canvases, args.passes, args.verify, args.switch)
        return
    if (args.before is None) == (args.switch is None):
        parser.error("give --before (the checkout to compare against) or --switch (one of the layers' switches), "
                     "not both")
    if args.verify < 0 or args.verify == 1:
        parser.error(f"--verify: a block of at least 2 tokens (the committed one and a draft), or 0; got {args.verify}")
    for checkout in filter(None, (args.before, args.after)):
        if not (checkout / "printpress" / "__init__.py").is_file():
            parser.error(f"{checkout} is not a printpress checkout (no printpress/__init__.py)")
    # Here, not at the top: the workers import their own checkout's printpress.
    from printpress.eval.report import cpu_name

    sides = {"before": (args.before or args.after).resolve(), "after": args.after.resolve()}
    model = args.model
    with tempfile.TemporaryDirectory(prefix="checkouts_ab_") as scratch:
        if not Path(args.model).exists():
            args.model = str(size_checkpoint(args.model, Path(scratch), args.stored_as))
        report = compare(args, sides)
    report["model"] = model
    if not Path(model).exists():
        report["stored_as"] = args.stored_as
    report["machine"] = {"cpu": cpu_name(), "load_average": os.getloadavg()}
    between = f"with {args.switch} off and on" if args.switch else "between the checkouts"
    print(f"{args.rounds} alternating rounds; logits {'identical' if report['same_bits'] else 'DIFFERENT'} {between}")
    print("| work | before, median / best (ms) | after, median / best (ms) | before / after, median of the rounds | "
          "the same of each round's quietest calls |")
    print("|---|---|---|---|---|")
    for work, figures in report["work"].items():
        before, after = figures["before_ms"], figures["after_ms"]
        print(f"| {work} | {statistics.median(before):.2f} / {min(before):.2f} | "
              f"{statistics.median(after):.2f} / {min(after):.2f} | **{figures['ratio_median']:.2f}x** | "
              f"{figures['quietest_ratio_median']:.2f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


def size_checkpoint(size: str, folder: Path, stored_as: str = "float32") -> Path:
    """A checkpoint of bench/engine_speed.py's benchmark size `size` with random weights (seed 0), in `folder`, its
    weights written in the dtype named `stored_as`."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from engine_speed import SIZES

    from printpress.checkpoint import save_model
    from printpress.config import ModelConfig, TextConfig
    from printpress.model import DiffusionGemma

    if size not in SIZES:
        raise SystemExit(f"checkouts_ab: --model {size!r} is neither a model folder nor a benchmark size "
                         f"({', '.join(SIZES)})")
    torch.manual_seed(0)
    model = DiffusionGemma(TextConfig(**SIZES[size].text)).eval()
    return save_model(model, ModelConfig(model.config, canvas_length=32), folder / size,
                      dtype=getattr(torch, stored_as))


def compare(args: argparse.Namespace, sides: dict[str, Path]) -> dict:
    """Both sides' workers on `args.model` (with `args.switch`, one worker for both), timed in alternating rounds: the
    report without the machine."""
    if args.switch:
        process = start_worker(sides["after"], args)
        workers, lines = {"before": process, "after": process}, {"before": "off\n", "after": "on\n"}
    else:
        workers = {name: start_worker(path, args) for name, path in sides.items()}
        lines = {"before": "go\n", "after": "go\n"}
    try:
        if args.switch:
            both = read_line("switch", workers["after"])
            ready = {"before": {**both, "digest": both["digest_off"]}, "after": both}
        else:
            ready = {name: read_line(name, process) for name, process in workers.items()}
        seconds: dict[str, list[dict]] = {name: [] for name in workers}
        for index in range(args.rounds):
            for name in (list(workers) if index % 2 == 0 else list(workers)[::-1]):
                workers[name].stdin.write(lines[name])
                workers[name].stdin.flush()
                seconds[name].append(read_line(name, workers[name]))
    finally:
        for process in set(workers.values()):
            process.stdin.close()
            process.wait()
    report = {"checkouts": {name: str(path) for name, path in sides.items()}, "model": args.model,
              "rounds": args.rounds, "steps": args.steps, "passes": args.passes, "ready": ready,
              "same_bits": ready["before"]["digest"] == ready["after"]["digest"], "work": {}}
    if args.switch:
        report["switch"] = args.switch
    for work in seconds["before"][0]:
        (before, before_least), (after, after_least) = (
            zip(*(r[work] for r in seconds[side])) for side in ("before", "after"))
        report["work"][work] = {
            "before_ms": list(before), "after_ms": list(after),
            "ratio_median": statistics.median(b / a for b, a in zip(before, after)),
            # each side's least time a call in the round: on a shared machine a neighbour's burst lengthens some
            # calls of a round, and the quietest call of each is the steadier figure (for a change of a few percent)
            "before_quietest_ms": list(before_least), "after_quietest_ms": list(after_least),
            "quietest_ratio_median": statistics.median(b / a for b, a in zip(before_least, after_least))}
    return report


if __name__ == "__main__":
    main()
