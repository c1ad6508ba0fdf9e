"""Infilling quality on held-out Shakespeare or Python: diffusion infill against two AR baselines, same weights.

    OMP_NUM_THREADS=1 python bench/infill.py --spans 100 --out docs/results/infill.json
    OMP_NUM_THREADS=1 python bench/infill.py --data stdlib --joint models/stdlib-code --ar runs/code-ar/model \
        --spans 100 --out docs/results/code/infill.json

Code (`--data stdlib`): every span is one simple statement of a held-out module (an assignment, call, return,
raise, ...: one line, 12-70 characters, inside a function or class body), cut as the BPE reads code: the middle
starts at the newline before the statement and holds its indentation, so the prefix ends at the end of the line
before. Beside the figures below, `file_parses`: whether the whole module, with the generated middle in place of
the true one, still parses (`ast.parse`).

Spans are cut from the validation works of the shipped models (the 5% of works held out by
`split_documents(load_corpus("shakespeare"), 0.05)`, as in their training recipe): half are whole
lines of dialogue (the middle is the line, the newlines stay in the prefix and suffix), half are 2-3
consecutive words inside such a line (the middle starts with its space, as the BPE attaches it).
Each span gets the 400 characters before it as the prefix and the 200 after it as the suffix.

Methods (the joint model's weights for all, except the judge):
- diffusion infill at the true span's token count (oracle length), the suffix clamped in the canvas;
- the same with a length search (editing.default_lengths, chosen by the model's own causal head);
- the same at the oracle length with no suffix visible (suffix_window 0): what the suffix contributes;
- the same at the oracle length with a longer canvas at inference (32 suffix tokens visible);
- AR, prefix only, greedy, oracle length in tokens;
- AR given "suffix + blank line + prefix" as its prompt, greedy, oracle length.

`--variant sampler` runs the oracle-length diffusion infill at other temperatures and step counts;
`--variant feedback` compares the self-conditioning signal at the clamped positions;
`--variant core --joint FOLDER` runs the suffix ablation and the AR baseline for another checkpoint.

Figures per method and span kind: exact match (stripped text), token accuracy (position-wise over the
true span's tokens, the generated middle re-tokenised), judged NLL per character of the middle after
the prefix, and judged NLL per character of the next 100 suffix characters after prefix + middle (how
well the middle joins the right side), under the AR twin (models/shakespeare-ar). The true middle is
scored too, as the floor. Diffusion uses the checkpoint's sampler defaults, seed = span index.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import time
from pathlib import Path

import torch

import printpress
from printpress import editing
from printpress.corpora import load_corpus, split_documents
from printpress.eval.judge import nll_per_char

ROOT = Path(__file__).resolve().parents[1]
PREFIX_CHARS, SUFFIX_CHARS, JOIN_CHARS = 400, 200, 100
BASELINE = "AR greedy, prefix only"


def dialogue_lines(text: str) -> list[tuple[int, int]]:
    """(start, end) of lines that are verse or prose: 20-70 characters, 4+ words, not a speaker or stage line."""
    out, pos = [], 0
    for line in text.split("\n"):
        start, pos = pos, pos + len(line) + 1
        stripped = line.strip()
        if not 20 <= len(stripped) <= 70 or len(stripped.split()) < 4 or line != stripped:
            continue
        if stripped.isupper() or stripped.startswith("[") or stripped.endswith("]"):
            continue
        if start < PREFIX_CHARS:
            continue
        out.append((start, start + len(line)))
    return out


def statement_lines(text: str) -> list[tuple[int, int]]:
    """(start, end) of the one-line simple statements inside a block (indented) of a module, 12-70 characters, each
    from the newline before it (so the middle holds the indentation) to its end; [] if the module does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    offsets = [0, *(i + 1 for i, ch in enumerate(text) if ch == "\n")]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or hasattr(node, "body") or node.lineno != node.end_lineno:
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
            continue
        line_start = offsets[node.lineno - 1]
        line = text[line_start:text.find("\n", line_start)]
        if node.col_offset == 0 or not 12 <= len(line.strip()) <= 70 or line.strip() != ast.get_source_segment(text, node):
            continue  # top level, too short or long, or sharing its line with another statement or a comment
        if line_start - 1 >= PREFIX_CHARS:
            out.append((line_start - 1, line_start + len(line)))
    return sorted(out)


def heldout_documents(data: str) -> list:
    """The held-out documents of `data`, split as the training recipes split it."""
    return split_documents(load_corpus(data), val_fraction=0.05)[1]


def make_spans(count: int, validation: list, seed: int = 0, code: bool = False) -> list[dict]:
    rng = random.Random(seed)
    spans = []
    if code:
        statements = {doc.name: statement_lines(doc.text) for doc in validation}
        validation = [doc for doc in validation if statements[doc.name]]
        for _ in range(count):
            doc = rng.choice(validation)
            start, end = rng.choice(statements[doc.name])
            spans.append({"doc": doc.name, "kind": "statement", "start": start, "end": end,
                          "prefix": doc.text[start - PREFIX_CHARS:start], "middle": doc.text[start:end],
                          "suffix": doc.text[end:end + SUFFIX_CHARS]})
        return spans
    for i in range(count):
        doc = rng.choice(validation)
        start, end = rng.choice(dialogue_lines(doc.text))
        kind = "line" if i % 2 == 0 else "words"
        if kind == "words":
            line = doc.text[start:end]
            starts = [j for j, ch in enumerate(line) if ch == " "]  # a word starts after each space
            n = rng.choice((2, 3))
            first = rng.randrange(0, max(1, len(starts) - n + 1))
            cut = starts[first:first + n + 1]
            stop = cut[n] if len(cut) > n else len(line)
            start, end = start + cut[0], start + stop
        spans.append({"doc": doc.name, "kind": kind, "start": start, "end": end,
                      "prefix": doc.text[start - PREFIX_CHARS:start], "middle": doc.text[start:end],
                      "suffix": doc.text[end:end + SUFFIX_CHARS]})
    return spans


def ar_middle(pipe, prompt: str, tokens: int) -> str:
    result = pipe.generate(prompt, mode="ar", temperature=0.0, max_new_tokens=tokens, seed=0)
    return result.text


def token_accuracy(pipe, generated: str, true: str) -> float:
    tok = pipe.tokenizer
    want = tok.encode(true, add_special_tokens=False).ids
    got = tok.encode(generated, add_special_tokens=False).ids
    return sum(1 for a, b in zip(want, got) if a == b) / len(want)


def score(pipe, judge, span: dict, middle: str, document: str | None = None) -> dict:
    """The figures of one generated middle; with the span's whole `document` (code), also whether it parses."""
    prefix, suffix = span["prefix"], span["suffix"]
    parses = {}
    if document is not None:
        try:
            ast.parse(document[:span["start"]] + middle + document[span["end"]:])
            parses["file_parses"] = True
        except (SyntaxError, ValueError):
            parses["file_parses"] = False
    return {**parses,
        "middle": middle,
        "exact": middle.strip() == span["middle"].strip(),
        "token_accuracy": token_accuracy(pipe, middle, span["middle"]),
        "middle_nll": nll_per_char(judge, prefix, middle) if middle else None,
        "join_nll": nll_per_char(judge, prefix + middle, suffix[:JOIN_CHARS]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--joint", default=str(ROOT / "models" / "shakespeare-joint"))
    parser.add_argument("--ar", default=str(ROOT / "models" / "shakespeare-ar"))
    parser.add_argument("--spans", type=int, default=100)
    parser.add_argument("--data", choices=("shakespeare", "stdlib"), default="shakespeare",
                        help="the held-out corpus the spans are cut from (stdlib: Python statements)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "infill.json"))
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--variant", choices=("main", "sampler", "core", "feedback"), default="main",
                        help="main: the methods above; sampler: diffusion infill at other temperatures/steps; "
                             "core: original, diffusion with and without the suffix, AR prefix-only; "
                             "feedback: one-hot self-conditioning at the clamped positions")
    parser.add_argument("--summarize", default=None, help="only recompute the summary of a saved result file")
    parser.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                        help="paired join NLL differences (B - A) of the methods both result files ran")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.summarize:
        path = Path(args.summarize)
        data = json.loads(path.read_text())
        data.update(summarize(data))
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        return
    torch.set_num_threads(1)
    pipe, judge = printpress.load(args.joint), printpress.load(args.ar)
    validation = heldout_documents(args.data)
    spans = make_spans(args.spans, validation, code=args.data == "stdlib")
    documents = {d.name: d.text for d in validation} if args.data == "stdlib" else {}
    methods = {
        "original (the true middle)": lambda s, i, n: s["middle"],
        "diffusion infill, oracle length": lambda s, i, n: editing.infill(
            pipe, s["prefix"], s["suffix"], length=n, seed=i),
        "diffusion infill, length search": lambda s, i, n: editing.infill(
            pipe, s["prefix"], s["suffix"], seed=i),
        "diffusion, oracle length, no suffix seen": lambda s, i, n: editing.infill(
            pipe, s["prefix"], s["suffix"], length=n, seed=i, suffix_window=0),
        "diffusion infill, oracle length, canvas + 32 suffix tokens": lambda s, i, n: editing.infill(
            pipe, s["prefix"], s["suffix"], length=n, seed=i, suffix_window=32),
        "AR greedy, prefix only": lambda s, i, n: ar_middle(pipe, s["prefix"], n),
        "AR greedy, suffix + blank line + prefix": lambda s, i, n: ar_middle(pipe, s["suffix"] + "\n\n" + s["prefix"], n),
    }
    if args.variant == "core":  # for another checkpoint (--joint): the suffix's effect and the AR baseline
        keep = ("original (the true middle)", "diffusion infill, oracle length", "diffusion, oracle length, no suffix seen",
                BASELINE)
        methods = {name: methods[name] for name in keep}
    if args.variant == "feedback":  # self-conditioning at clamped positions: the model's own vs one-hot
        keep = ("original (the true middle)", "diffusion infill, oracle length", BASELINE)
        methods = {name: methods[name] for name in keep}
        methods["diffusion infill, oracle length, exact suffix feedback"] = lambda s, i, n: editing.infill(
            pipe, s["prefix"], s["suffix"], length=n, seed=i, suffix_feedback="exact")
    if args.variant == "sampler":  # the sampler's temperature and step budget, at the oracle length
        keep = ("original (the true middle)", "diffusion infill, oracle length", BASELINE)
        methods = {name: methods[name] for name in keep}
        for t_max, t_min, steps in ((0.4, 0.1, 32), (0.2, 0.05, 32), (0.8, 0.4, 64)):
            methods[f"diffusion infill, oracle length, t {t_max}->{t_min}, {steps} steps"] = (
                lambda s, i, n, a=t_max, b=t_min, c=steps: editing.infill(
                    pipe, s["prefix"], s["suffix"], length=n, seed=i, t_max=a, t_min=b, max_denoising_steps=c))
    records = {name: [] for name in methods}
    seconds = {name: 0.0 for name in methods}
    for i, span in enumerate(spans):
        n = len(pipe.tokenizer.encode(span["middle"], add_special_tokens=False).ids)
        for name, method in methods.items():
            started = time.perf_counter()
            out = method(span, i, n)
            seconds[name] += time.perf_counter() - started
            extra = {"true_tokens": n}
            if isinstance(out, editing.EditResult):
                extra["length"] = out.stats.length
                extra["candidates"] = [[c.length, c.join_nll, c.join_chars, c.middle] for c in out.candidates]
                out = out.middle
            records[name].append({"span": i, **score(pipe, judge, span, out, documents.get(span["doc"])), **extra})
        if (i + 1) % 10 == 0:
            print(f"{i + 1}/{len(spans)} spans", flush=True)
    command = (f"OMP_NUM_THREADS=1 python bench/infill.py --spans {args.spans} --variant {args.variant} "
               f"--data {args.data} --joint {args.joint} --ar {args.ar} --out {args.out}")
    meta = {"command": command, "threads": 1, "data": args.data,
            "model": Path(args.joint).name, "judge": Path(args.ar).name, "spans": len(spans),
            "prefix_chars": PREFIX_CHARS, "suffix_chars": SUFFIX_CHARS, "join_chars": JOIN_CHARS,
            "sampler": "checkpoint defaults (32 steps, entropy bound 0.1, t 0.8->0.4), seed = span index",
            "seconds_per_span": {name: seconds[name] / len(spans) for name in methods}, "note": args.note}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "spans": spans, "records": records}
    data.update(summarize(data))
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def compare(path_a: str, path_b: str) -> None:
    """Per method run by both files (same spans and seeds): mean join and middle NLL of B minus A, ± stderr."""
    a, b = json.loads(Path(path_a).read_text()), json.loads(Path(path_b).read_text())
    for name in a["records"]:
        if name not in b["records"]:
            continue
        for key in ("join_nll", "middle_nll"):
            diffs = [y[key] - x[key] for x, y in zip(a["records"][name], b["records"][name])
                     if x[key] is not None and y[key] is not None]
            err = statistics.stdev(diffs) / len(diffs) ** 0.5
            print(f"{name:58s} {key:10s} B - A = {statistics.mean(diffs):+.3f} ± {err:.3f} ({len(diffs)} spans)")


def summarize(data: dict) -> dict:
    """Per method and span kind means, and how the length search chose (from the records alone)."""
    spans, records = data["spans"], data["records"]
    seconds = data["meta"].get("seconds_per_span") or {r["method"]: r["seconds_per_span"] for r in data["rows"]}
    rows = []
    for name, recs_all in records.items():
        for kind in [*sorted({s["kind"] for s in spans}), "all"]:
            recs = [r for r in recs_all if kind == "all" or spans[r["span"]]["kind"] == kind]
            middles = [r["middle_nll"] for r in recs if r["middle_nll"] is not None]
            row = {"method": name, "kind": kind, "spans": len(recs),
                   "exact_match": statistics.mean(r["exact"] for r in recs),
                   "token_accuracy": statistics.mean(r["token_accuracy"] for r in recs),
                   "middle_nll_per_char": statistics.mean(middles) if middles else None,
                   "join_nll_per_char": statistics.mean(r["join_nll"] for r in recs),
                   "file_parses": (statistics.mean(r["file_parses"] for r in recs) if "file_parses" in recs[0]
                                   else None),
                   "seconds_per_span": seconds[name]}
            # Paired against AR-prefix-only on the same spans: mean difference of the join NLL and its standard error.
            base = {r["span"]: r["join_nll"] for r in records[BASELINE]}
            diffs = [r["join_nll"] - base[r["span"]] for r in recs]
            row["join_minus_ar_prefix_only"] = statistics.mean(diffs)
            row["join_minus_ar_prefix_only_stderr"] = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
            rows.append(row)
            print(f"{name:58s} {kind:5s} exact {row['exact_match']:.2f} tok-acc {row['token_accuracy']:.3f} "
                  f"middle {row['middle_nll_per_char'] or float('nan'):.3f} join {row['join_nll_per_char']:.3f}"
                  f" ({row['join_minus_ar_prefix_only']:+.3f} vs AR) {row['seconds_per_span']:.2f} s/span"
                  + ("" if row["file_parses"] is None else f" file parses {row['file_parses']:.2f}"), flush=True)
    search = {}
    for name, recs in records.items():
        if not any(r.get("candidates") for r in recs):
            continue
        per_char = [r["length"] for r in recs]
        total = [min(r["candidates"], key=lambda c: c[1])[0] for r in recs]
        truth = [r["true_tokens"] for r in recs]
        nearest = [min((c[0] for c in r["candidates"]), key=lambda n, t=r["true_tokens"]: abs(n - t)) for r in recs]
        search[name] = {
            "mean_true_tokens": statistics.mean(truth),
            "mean_chosen_length_per_char_rule": statistics.mean(per_char),
            "mean_chosen_length_total_nll_rule": statistics.mean(total),
            "chose_the_candidate_nearest_the_truth": statistics.mean(a == b for a, b in zip(per_char, nearest)),
            "mean_abs_error_tokens": statistics.mean(abs(a - b) for a, b in zip(per_char, truth)),
            "chosen_lengths": {str(n): per_char.count(n) for n in sorted(set(per_char))},
        }
        print(name, search[name])
    return {"rows": rows, "length_search": search}


if __name__ == "__main__":
    main()
