"""Self-speculative decoding against AR decoding on the same weights: speed, acceptance, exactness.

For each setting (draft steps x draft length, canvas 32 unless said), every prompt is decoded greedily by
`mode="ar"` and by `printpress.speculative.speculative` back to back, so both sides share the machine's load
at that moment; the tokens must be identical (the script stops otherwise). Reported per setting: tokens/s
of each side summed over the prompts and their ratio, mean tokens committed per verification (accepted
drafts + the AR token), accepted drafts per verification, tokens per forward.

Fused settings (`fused_draft`: one pass per round verifies the drafts and drafts the next round, each outcome on
a canvas of `fused canvas` positions) run with `--fused`, beside the best unfused settings of the first sweep.

    python bench/speculative.py [--model models/shakespeare-joint] [--tokens 128] [--threads 1] \
        [--out docs/results/speculative.json] [--fused]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import printpress
from printpress.engine import DoneEvent, Request, run
from printpress.eval.bench import heldout_prompts
from printpress.speculative import speculative

PROMPTS = ["ROMEO:\n", "To be, or not to be", "First Citizen:\nBefore we proceed"]
# (draft steps, draft length, decoder canvas, fused canvas or None): the sweep the doc reports.
SETTINGS = [(steps, drafts, 32, None) for steps in (1, 2, 4) for drafts in (31, 7, 3)]
SETTINGS += [(8, 31, 32, None), (8, 3, 32, None), (1, 7, 8, None), (1, 3, 4, None), (2, 3, 4, None)]
# A fifth element, when present, is the draft source (`draft_source`; diffusion when absent): `--only` gives it.
# --fused: fused rounds (one draft step; drafts at most fused canvas - 1), and the best unfused settings beside them.
FUSED_SETTINGS = [(1, drafts, 32, fused) for fused in (4, 8, 32) for drafts in (1, 2, 3, 7) if drafts < fused]
FUSED_SETTINGS += [(1, 7, 32, None), (1, 3, 32, None), (1, 1, 32, None)]


def run_ar(pipe, prompt: list[int], tokens: int, temperature: float = 0.0, seed: int = 0) -> tuple[list[int], float]:
    """AR through the engine with no text decoding, as the speculative side runs (decoding text costs time)."""
    settings = pipe.settings(mode="ar", max_new_tokens=tokens, temperature=temperature)
    start = time.perf_counter()
    events = run(pipe.model, pipe.canvas_length, [Request(prompt, settings, seed)], None, step_events=False)
    result = next(e.result for e in events if isinstance(e, DoneEvent))
    return result.token_ids, time.perf_counter() - start


def run_speculative(pipe, prompt: list[int], tokens: int, steps: int, drafts: int, canvas: int,
                    fused: int | None = None, source: str = "diffusion", temperature: float = 0.0, seed: int = 0):
    settings = pipe.settings(mode="speculative", max_new_tokens=tokens, draft_steps=steps, temperature=temperature,
                             fused_draft=fused is not None, draft_source=source)
    start = time.perf_counter()
    events = speculative(pipe.model, [Request(prompt, settings, seed)], None, canvas_length=canvas,
                         draft_length=drafts, step_events=False, fused_canvas=fused)
    result = next(e.result for e in events if isinstance(e, DoneEvent))
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shakespeare-joint")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="docs/results/speculative.json")
    parser.add_argument("--margins", default=None, help="instead of the sweep, measure how far greedy verification is "
                        "from an argmax tie and write it here")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON at --out")
    parser.add_argument("--costs", default=None, help="instead of the sweep, time single passes and write them here")
    parser.add_argument("--fused", action="store_true", help="run the fused draft+verify settings and the best "
                        "unfused ones (about 10 minutes on a loaded 2-core machine) instead of the first sweep")
    parser.add_argument("--only", default=None, help="only these settings, 'drafts:fused canvas' pairs ('-' for "
                        "unfused), e.g. '1:4,2:8,7:-' (1 draft step, decoder canvas 32), each with an optional "
                        "':draft source' (lookup, both; diffusion when absent), e.g. '7:-:lookup'")
    parser.add_argument("--repeat", type=int, default=1, help="decode each prompt this many times per setting "
                        "(the settings taking turns), summing the times")
    parser.add_argument("--heldout", type=int, default=None, metavar="N",
                        help="instead of the three prompts, N held-out prompts of --heldout-data, as `printpress bench "
                             "--heldout-prompts N` draws them (never seen by training or a distillation teacher)")
    parser.add_argument("--heldout-data", default="shakespeare", help="corpus of --heldout (shakespeare, stdlib)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample both sides at this temperature (the "
                        "checkpoint's top_k), each prompt with its own seed; the outputs then differ (speculative "
                        "sampling keeps AR's distribution, not its random stream) and are not compared")
    parser.add_argument("--compile", default=None, help="load with printpress.load(compile=...) (ar, decoder, all): "
                        "both sides run compiled passes; the first calls compile (a minute or two)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = printpress.load(args.model, compile=args.compile)
    if args.costs:
        return pass_costs(pipe, args)
    if args.margins:
        return tie_margins(pipe, args)
    if args.plot_only:
        return plot(json.loads(Path(args.out).read_text())["rows"], Path(args.out).with_suffix(".png"))
    texts = PROMPTS if args.heldout is None else heldout_prompts(args.heldout, [args.heldout_data], 0.05)
    prompts = [pipe.encode_text(p) for p in texts]
    for prompt in prompts:  # warm-up: first calls pay one-off allocation costs
        run_ar(pipe, prompt, 8)
        run_speculative(pipe, prompt, 8, 1, 31, 32)
        if args.fused or args.only:
            run_speculative(pipe, prompt, 8, 1, 7, 32, 8)

    sweep = FUSED_SETTINGS if args.fused else SETTINGS
    if args.only:
        pairs = [item.split(":") for item in args.only.split(",")]
        sweep = [(1, int(drafts), 32, None if fused == "-" else int(fused), *source)
                 for drafts, fused, *source in pairs]
    totals = {setting: dict(ar_time=0.0, spec_time=0.0, tokens=0, ar_tokens=0, verifications=0, accepted=0, forwards=0,
                            decoder=0) for setting in sweep}
    if args.compile:  # every setting once, untimed: the graphs a setting meets compile here, not in its timing
        for setting in sweep:
            measure(pipe, prompts, args.tokens, setting, dict(totals[setting]), args.temperature)
    for _ in range(args.repeat):  # the settings take turns, so a change of the machine's load hits all alike
        for setting in sweep:
            measure(pipe, prompts, args.tokens, setting, totals[setting], args.temperature)
    rows = []
    for (steps, drafts, canvas, fused, *source), t in totals.items():
        tokens, verifications = t["tokens"], t["verifications"]
        row = {
            "draft_steps": steps, "draft_length": drafts, "canvas": canvas, "fused_canvas": fused,
            "draft_source": source[0] if source else "diffusion",
            "identical": True if args.temperature == 0 else None, "new_tokens": tokens,
            "ar_tokens_per_s": t["ar_tokens"] / t["ar_time"], "speculative_tokens_per_s": tokens / t["spec_time"],
            "ratio": (tokens / t["spec_time"]) / (t["ar_tokens"] / t["ar_time"]),  # sampled sides may stop apart
            "tokens_per_verification": (tokens - len(prompts) * args.repeat) / verifications,
            "accepted_drafts_per_verification": t["accepted"] / verifications,
            "tokens_per_forward": tokens / t["forwards"], "decoder_passes": t["decoder"],
            "verifications": verifications,
        }
        rows.append(row)
        print(f"steps {steps} drafts {drafts:2d} canvas {canvas:2d} fused {fused or '-':>2} {row['draft_source']}: "
              f"AR {row['ar_tokens_per_s']:6.1f} tok/s, "
              f"speculative {row['speculative_tokens_per_s']:6.1f} tok/s, ratio {row['ratio']:.2f}, "
              f"{row['tokens_per_verification']:.2f} tokens/verification, "
              f"{row['tokens_per_forward']:.2f} tokens/forward", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python bench/speculative.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "model": args.model, "prompts": texts, "max_new_tokens": args.tokens, "threads": args.threads,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
        "decoding": "greedy (temperature 0); every speculative output checked identical to mode='ar'"
                    if args.temperature == 0 else f"sampled at temperature {args.temperature:g} (outputs not compared)",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if args.fused or args.only:  # the plot draws the first sweep
        print(f"wrote {out}")
        return
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def measure(pipe, prompts: list[list[int]], tokens: int, setting: tuple, totals: dict,
            temperature: float = 0.0) -> None:
    """Decode every prompt with AR then with `setting`, back to back; add times and counts to `totals`."""
    steps, drafts, canvas, fused, *source = setting
    for seed, prompt in enumerate(prompts):
        ar_ids, seconds = run_ar(pipe, prompt, tokens, temperature, seed)
        totals["ar_time"] += seconds
        totals["ar_tokens"] += len(ar_ids)
        result, seconds = run_speculative(pipe, prompt, tokens, steps, drafts, canvas, fused, *source,
                                          temperature=temperature, seed=seed)
        totals["spec_time"] += seconds
        if temperature == 0 and result.token_ids != ar_ids:
            raise SystemExit(f"speculative output differs from AR for {pipe.decode(prompt)!r} at {setting}")
        s = result.stats
        totals["tokens"] += s.new_tokens
        totals["verifications"] += s.verifications
        totals["accepted"] += s.accepted_drafts
        totals["forwards"] += s.forward_passes
        totals["decoder"] += s.denoising_steps


def pass_costs(pipe, args) -> None:
    """Median time of one pass of each kind, measured round-robin so load hits all alike: an AR step (encode
    1 token), a verification (encode m + 1 tokens, logits for all, then roll back) and a draft step (denoise a
    canvas), after a 100-token context. With them, the ceiling of a setting is what perfect drafts would give:
    (m + 1) tokens per (draft steps x denoise + verify), against 1 token per AR step."""
    model = pipe.model
    cache = model.new_cache(1, 512)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.no_grad():
        model.encode(torch.randint(3, vocab, (1, 100), generator=g), cache, logits="none")

        def verify(block: int):
            def go():
                snapshot = cache.snapshot(block)
                model.encode(torch.randint(3, vocab, (1, block), generator=g), cache, logits="all")
                cache.truncate(100, snapshot)
            return go

        def ar_step():
            snapshot = cache.snapshot(1)
            model.encode(torch.randint(3, vocab, (1, 1), generator=g), cache, logits="last")
            cache.truncate(100, snapshot)

        def draft(canvas: int):
            ids = torch.randint(3, vocab, (1, canvas), generator=g)
            return lambda: model.denoise(ids, cache)

        def fused(block: int, canvas: int):
            """A fused round's pass: verify `block` tokens, draft a canvas per outcome, roll back, and the head
            over one canvas's drafts (what `speculative` computes of it)."""
            def go():
                snapshot = cache.snapshot(block)
                noise = torch.randint(0, vocab, (block, canvas), generator=g)
                _, hidden = model.verify_and_draft(torch.randint(3, vocab, (1, block), generator=g), noise, cache)
                model.logits(hidden[0, 1:block])
                cache.truncate(100, snapshot)
            return go

        kinds = {"ar_step": ar_step}
        kinds.update({f"verify_{m + 1}": verify(m + 1) for m in (3, 7, 15, 31)})
        kinds.update({f"denoise_{c}": draft(c) for c in (4, 8, 16, 32)})
        kinds.update({f"fused_{m + 1}x{c}": fused(m + 1, c) for m, c in ((1, 4), (2, 4), (3, 4), (1, 8), (2, 8),
                                                                         (3, 8), (7, 8), (3, 32), (7, 32))})
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(60):
            for name, fn in kinds.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    medians = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    for name, ms in medians.items():
        print(f"{name:12s} {ms:7.2f} ms  ({ms / medians['ar_step']:.2f} AR steps)")
    command = f"python bench/speculative.py --threads {args.threads} --costs {args.costs}"
    Path(args.costs).write_text(json.dumps({"command": command, "model": args.model, "threads": args.threads,
                                            "median_ms": medians}, indent=2) + "\n")


def tie_margins(pipe, args) -> None:
    """How safe is "verification gives AR's argmax"? For each prompt's AR greedy continuation, the logits of
    every position computed one token at a time (as AR does) and in one block of 32 (as a verification does):
    the largest difference between the two, against the smallest gap between the best and second-best logit.
    The argmax can only differ where the gap is below the difference."""
    model = pipe.model
    worst_diff, smallest_gap = 0.0, float("inf")
    positions = 0
    with torch.no_grad():
        for text in PROMPTS:
            prompt = pipe.encode_text(text)
            ar_ids, _ = run_ar(pipe, prompt, args.tokens)
            ids = prompt + ar_ids
            single = model.new_cache(1, len(ids))
            one_at_a_time = [model.encode(torch.tensor([prompt]), single, logits="last")[0, -1]]
            for token in ar_ids[:-1]:
                one_at_a_time.append(model.encode(torch.tensor([[token]]), single, logits="last")[0, -1])
            stepwise = torch.stack(one_at_a_time)  # logits predicting ar_ids[i]
            blocked = model.new_cache(1, len(ids))
            first = model.encode(torch.tensor([prompt]), blocked, logits="last")[0]
            rest = [model.encode(torch.tensor([ar_ids[i : i + 32]]), blocked)[0] for i in range(0, len(ar_ids) - 1, 32)]
            block = torch.cat([first, *rest])[: len(ar_ids)]
            worst_diff = max(worst_diff, float((block - stepwise).abs().max()))
            top2 = stepwise.topk(2, dim=-1).values
            smallest_gap = min(smallest_gap, float((top2[:, 0] - top2[:, 1]).min()))
            assert torch.equal(block.argmax(-1), stepwise.argmax(-1))
            positions += len(ar_ids)
    result = {"command": f"python bench/speculative.py --threads {args.threads} --tokens {args.tokens} --margins "
                         f"{args.margins}", "model": args.model, "positions": positions,
              "max_abs_logit_difference_block_vs_stepwise": worst_diff, "smallest_top2_logit_gap": smallest_gap}
    print(json.dumps(result, indent=2))
    Path(args.margins).write_text(json.dumps(result, indent=2) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for steps in sorted({r["draft_steps"] for r in rows}):
        mine = [r for r in rows if r["draft_steps"] == steps and r["canvas"] == 32]
        mine.sort(key=lambda r: r["draft_length"])
        lengths = [r["draft_length"] for r in mine]
        left.plot(lengths, [r["ratio"] for r in mine], marker="o", label=f"{steps} draft step(s)")
        right.plot(lengths, [r["tokens_per_verification"] for r in mine], marker="o", label=f"{steps} draft step(s)")
    left.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    left.set(xlabel="draft tokens verified per pass", ylabel="tokens/s, speculative / AR", xscale="log", title="speed",
             ylim=(0, 1.1))
    right.set(xlabel="draft tokens verified per pass", ylabel="tokens committed per verification", xscale="log",
              title="acceptance", ylim=(1, 2))
    for ax in (left, right):
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks([3, 7, 31], labels=["3", "7", "31"])
        ax.legend(fontsize="small")
    fig.suptitle("Self-speculative decoding, shakespeare-joint, greedy, canvas 32 (identical tokens to AR)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
