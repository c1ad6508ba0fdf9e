"""Would a learned acceptance filter (lever L6 of the research note, after Learn2PD) know more than the entropy bound?
(docs/benchmarks.md §7, "L6").

    OMP_NUM_THREADS=1 python bench/acceptance_filter.py --steps 8 --entropy-bound 4 \
        --out docs/results/levers/acceptance-filter-8steps.json

The sampler is run on held-out prompts (`printpress bench`'s, so no teacher saw them) and every step's per-position
evidence is logged from the engine's own step events: the entropy the bound compared, whether the argmax equals the
previous step's, whether the position was accepted, the step's and the position's place in the canvas, the canvas's
mean entropy. The label is whether that step's argmax is the token the canvas commits. A logistic regression on
those features is fitted on the first half of the seeds' canvases and scored on the rest, against the entropy alone
(the rule the bound applies: lower entropy first) and argmax stability alone (what the adaptive stop reads). The
figure of merit is the area under the ROC curve: if the learned score does not beat the entropy's, a filter trained
on these features cannot accept more right tokens per step than the bound does. Also per step: the share of
positions already final, stable, and final among the stable.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import printpress
from printpress.engine import StepEvent
from printpress.eval.bench import heldout_prompts

FEATURES = ("entropy", "stable", "accepted", "step", "position", "canvas_mean_entropy", "log_entropy")


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve of `score` for the boolean `label`: the chance that a random positive scores above a
    random negative, ties counting half (Mann-Whitney, with average ranks)."""
    score = score.double()
    _, inverse, counts = torch.unique(score, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based average rank of each tie group
    positive = label.bool()
    n1, n0 = int(positive.sum()), int((~positive).sum())
    if not n1 or not n0:
        raise ValueError("the AUC needs both labels")
    return float((ranks[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def canvas_rows(step_events) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (S*C, len(FEATURES)) and labels (S*C,) of one canvas's step events, in step order."""
    final = torch.tensor(step_events[-1].argmax)
    features, labels, previous = [], [], None
    for event in step_events:
        argmax, entropy = torch.tensor(event.argmax), torch.tensor(event.entropy, dtype=torch.float64)
        length = len(argmax)
        stable = (argmax == previous) if previous is not None else torch.zeros(length, dtype=torch.bool)
        features.append(torch.stack([
            entropy, stable.double(), torch.tensor(event.accepted, dtype=torch.float64),
            torch.full((length,), event.step / event.max_steps, dtype=torch.float64),
            torch.arange(length, dtype=torch.float64) / length,
            torch.full((length,), float(entropy.mean()), dtype=torch.float64), torch.log(entropy + 1e-4)], 1))
        labels.append(argmax == final)
        previous = argmax
    return torch.cat(features), torch.cat(labels)


def collect(pipe, prompts: list[str], seeds: int, max_new_tokens: int, steps: int, bound: float) -> list:
    """Per canvas (prompt-major within each seed round, as `printpress bench` seeds them), its step events."""
    canvases = []
    for round_ in range(seeds):
        for i, prompt in enumerate(prompts):
            events = []
            pipe.generate(prompt, seed=round_ * len(prompts) + i, max_new_tokens=max_new_tokens,
                          max_denoising_steps=steps, entropy_bound=bound,
                          on_event=lambda e: events.append(e) if isinstance(e, StepEvent) else None)
            by_canvas: dict[int, list] = {}
            for event in events:
                by_canvas.setdefault(event.canvas, []).append(event)
            canvases.append(list(by_canvas.values()))
    return canvases


def fit_logistic(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised logistic regression by L-BFGS: (weights, mean, std)."""
    mean, std = x.mean(0), x.std(0) + 1e-9
    z = ((x - mean) / std).float()
    weights = torch.zeros(z.shape[1] + 1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights], max_iter=200)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ weights[:-1] + weights[-1], y.float())
        loss.backward()
        return loss

    optimizer.step(closure)
    return weights.detach(), mean, std


def analyse(canvases: list) -> dict:
    """The module docstring's figures; the first half of the samples' canvases train, the second half score."""
    half = len(canvases) // 2
    train = [canvas_rows(c) for sample in canvases[:half] for c in sample]
    test = [canvas_rows(c) for sample in canvases[half:] for c in sample]
    x_train, y_train = torch.cat([f for f, _ in train]), torch.cat([label for _, label in train])
    x_test, y_test = torch.cat([f for f, _ in test]), torch.cat([label for _, label in test])
    weights, mean, std = fit_logistic(x_train, y_train)
    learned = ((x_test - mean) / std).float() @ weights[:-1] + weights[-1]
    x_all, y_all = torch.cat([x_train, x_test]), torch.cat([y_train, y_test])
    per_step = []
    for value in sorted(set(x_all[:, 3].tolist())):
        at = x_all[:, 3] == value
        stable = at & (x_all[:, 1] == 1)
        per_step.append({"step_fraction": value, "final": float(y_all[at].float().mean()),
                         "stable": float(x_all[at, 1].mean()),
                         "final_if_stable": float(y_all[stable].float().mean()) if stable.any() else None})
    return {"positions": {"train": len(y_train), "test": len(y_test)}, "share_final": float(y_all.float().mean()),
            "auc": {"entropy": auc(-x_test[:, 0], y_test),
                    "stable_then_entropy": auc(x_test[:, 1] - 1e-3 * x_test[:, 0], y_test),
                    "learned": auc(learned, y_test)},
            "weights": dict(zip([*FEATURES, "bias"], weights.tolist(), strict=True)), "per_step": per_step}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the diffusion model (default: the shipped one)")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts (as the yardstick's)")
    p.add_argument("--seeds", type=int, default=2, help="samples per prompt; half of them fit, half score")
    p.add_argument("--data", nargs="+", default=["shakespeare"], help="the held-out prompts' sources")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--entropy-bound", type=float, default=4.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error("--seeds must be at least 2: half of the samples fit the filter, the other half score it")
    torch.manual_seed(0)
    pipe = printpress.load(args.model)
    canvases = collect(pipe, heldout_prompts(args.prompts, args.data, 0.05), args.seeds, args.max_new_tokens,
                       args.steps, args.entropy_bound)
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              **analyse(canvases)}
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
