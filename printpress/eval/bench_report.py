"""What `printpress bench` shows: the table on the terminal with its legend and the headline, the report card's
page, and the frontier plot. It reads the rows and headlines of `printpress.eval.frontier` and changes none.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from printpress.eval.bench_sides import OWN_AR
from printpress.eval.frontier import CPU, GGUF_KEY, JUDGE_KEY, WALL

# The per-side columns, in order: the terminal table's header and number format, the report card's header, the
# row's key, and what the column means (the terminal's legend).
COLUMNS = [
    ("nll/char", "8.3f", "judged NLL/char, AR twin", JUDGE_KEY, "judged NLL per character, AR twin (lower is better)"),
    ("smollm", "6.3f", "judged NLL/char, SmolLM2", GGUF_KEY, "the same, SmolLM2-135M"),
    ("tok/s", "7.1f", "tokens/s", WALL, "new tokens per second, wall clock"),
    ("xAR", "5.2f", "x AR twin", "speed_ratio_vs_ar_twin", "x the AR twin's speed"),
    ("xAR cpu", "7.2f", "x AR twin (CPU time)", "cpu_speed_ratio_vs_ar_twin", "the same in CPU time"),
    ("tok/fwd", "7.2f", "tokens/forward (engine)", "tokens_per_forward", "tokens per pass as the engine counts them"),
    ("fwd all", "7.2f", "tokens/forward (all passes)", "tokens_per_forward_all_passes", "per pass of any kind"),
    ("H word", "6.3f", "unigram entropy (nats)", "unigram_entropy_nats", "word unigram entropy (nats)"),
    ("dist2", "5.3f", "distinct-2", "distinct_2", "share of distinct word bigrams"),
    ("rep4", "5.3f", "repeated 4-grams", "repeated_4gram_share", "share of repeated word 4-grams"),
    ("gap", "6.1%", "SmolLM2 gap to AR sampling", "judge_gguf_gap",
     f"SmolLM2's NLL/char over '{OWN_AR}''s, minus 1 (90% interval in the JSON)"),
    ("div=", "4.1f", "matched diversity", "matched_diversity", f"diversity matched to '{OWN_AR}'"),
    ("py", "5.2f", "valid Python (so far)", "python_prefix_share", "share of samples that are Python or its start"),
    ("parse", "5.2f", "parses as Python", "python_parses_share", "share of samples that parse as a whole module"),
    ("code", "5.2f", "valid Python with code", "python_code_share",
     "share of samples valid so far with >= 2 lines of code (not only comments)"),
    ("TTFC s", "7.3f", "first commit s", "time_to_first_commit_s", "seconds to the first commit"),
    ("st/can", "6.1f", "steps/canvas", "steps_per_canvas", "denoising steps per canvas"),
    ("H acc", "6.3f", "accepted entropy", "accepted_entropy_mean", "entropy of the accepted tokens"),
    ("acc/st", "6.2f", "accepted/step", "accepted_per_step", "tokens accepted per step"),
    ("stops", "5.2f", "adaptive stops", "adaptive_stop_rate", "share of canvases stopped early"),
]

# Shown only when some side has them (`printpress bench --python`; the SmolLM2 judge).
OPTIONAL_KEYS = {"python_prefix_share", "python_parses_share", "python_code_share", "judge_gguf_gap"}


def columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, str, str]]:
    """`COLUMNS`, less the optional ones no side has."""
    return [c for c in COLUMNS if c[3] not in OPTIONAL_KEYS or any(c[3] in r for r in rows)]


# The one headline printed: AR twin judge, wall clock, every diffusion side. The JSON's `headline` holds each
# judge by wall clock and by CPU time, and over the sides of matched diversity only.
HEADLINE = "ar_twin/wall"


# --------------------------------------------------------------------------------------------
# The terminal
# --------------------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]], heads: dict[str, dict[str, Any]], cost: dict[str, Any],
                heldout: dict) -> None:
    """The sides' figures, the legend of the columns, the per-forward cost, the held-out losses, and the headline."""

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        value = r.get(key)
        if isinstance(value, bool):
            text = "yes" if value else "no"
        else:
            text = format(value, fmt) if isinstance(value, (int, float)) else "-"
        return text.rjust(len(format(0.0, fmt)))

    shown = columns(rows)
    print(f"{'side':44s} " + " ".join(name.rjust(len(format(0.0, fmt))) for name, fmt, *_ in shown))
    for r in rows:
        print(f"{r['label'][:44]:44s} " + " ".join(cell(r, key, fmt) for _, fmt, _, key, _ in shown))
    legend = "; ".join(f"{name}: {meaning}" for name, _, _, _, meaning in shown)
    print("\n".join(textwrap.wrap(legend, 118, initial_indent="legend: ", subsequent_indent="  ")))
    print(f"decoder forward (canvas {cost['canvas_length']}) {cost['decoder_forward_ms']:.2f} ms = "
          f"{cost['decoder_over_ar_step']:.2f} AR steps ({cost['ar_step_ms']:.2f} ms)")
    for name, h in heldout.items():
        print(f"held-out {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in h.items() if k.startswith("val_")))
    print(headline_line(heads[HEADLINE]))


def headline_line(head: dict[str, Any]) -> str:
    """The headline in one line (`HEADLINE`; the others are in the JSON and on the report card)."""
    prefix = "headline (AR twin judge, wall clock; the others on the report card):"
    if "best_diffusion" not in head:
        return f"{prefix} no diffusion side to compare"
    b = head["best_diffusion"]
    if head["matched_quality_reached"]:
        return f"{prefix} ratio at matched quality: {head['ratio_at_matched_quality']:.2f}x the AR twin"
    return (f"{prefix} no diffusion setting reaches the AR twin's quality ({head['ar_twin_nll_per_char']:.3f}); "
            f"best: {b['label']} {b['nll_per_char']:.3f} (gap {head['quality_gap_nats_per_char']:.3f}) at "
            f"{b['ratio_vs_ar_twin']:.2f}x the AR twin")


# --------------------------------------------------------------------------------------------
# The report card and the plot
# --------------------------------------------------------------------------------------------


def write_outputs(args: argparse.Namespace, payload: dict[str, Any], title: str) -> tuple[Path, Path]:
    """The report card (JSON, page, plot) under --results, and a copy of the JSON and plot at --out."""
    from printpress.eval.report import command_line, write_report

    rows, heads = payload["rows"], payload["headline"]
    json_path, md_path = write_report(args.results, "bench", {"command": command_line(), **payload})
    md_path.write_text(card_markdown(json_path), encoding="utf-8")
    plot(rows, heads, json_path.with_suffix(".png"), title)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json_path.read_text(encoding="utf-8"), encoding="utf-8")
        plot(rows, heads, out.with_suffix(".png"), title)
    return json_path, md_path


def headline_metrics(heads: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The few numbers the report card's table shows."""
    matched = [r["label"] for r in rows if r.get("matched_diversity")]
    out: dict[str, Any] = {f"sides of matched diversity (vs {OWN_AR})": ", ".join(matched) or "none"}
    for r in rows:
        if "same_text_as_ar_greedy" in r:
            out[f"{r['label']}: x AR greedy, same text"] = (f"{r['speed_ratio_vs_ar_greedy']:.2f}x, "
                                                            f"{r['same_text_as_ar_greedy']:.0%} of samples")
    for name, head in heads.items():
        out[f"{name}: AR twin NLL/char"] = head["ar_twin_nll_per_char"]
        if "best_diffusion" not in head:
            continue
        b = head["best_diffusion"]
        out[f"{name}: matched quality reached"] = head["matched_quality_reached"]
        out[f"{name}: ratio at matched quality"] = head["ratio_at_matched_quality"]
        out[f"{name}: best diffusion"] = f"{b['label']}: NLL/char {b['nll_per_char']:.3f}, {b['ratio_vs_ar_twin']:.2f}x"
        out[f"{name}: quality gap (nats/char)"] = head["quality_gap_nats_per_char"]
    return out


def card_markdown(json_path: Path) -> str:
    """The report card's page, with the per-side figures as one table instead of JSON cells."""
    import json

    from printpress.eval.report import markdown

    card = json.loads(json_path.read_text(encoding="utf-8"))
    rows = card.pop("rows")
    card.pop("samples")
    card.pop("headline")  # its figures are in `metrics`; the full ladders stay in the JSON
    shown = columns(rows)
    lines = ["## Sides", "", "| side | " + " | ".join(c[2] for c in shown) + " |",
             "|---|" + "---|" * len(shown)]
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(_card_cell(r.get(c[3])) for c in shown) + " |")
    return markdown(card, json_path.name) + "\n" + "\n".join(lines) + "\n"


def _card_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.3g}"


STYLES = {"ar": ("s", "tab:red"), "diffusion": ("o", "tab:blue"), "speculative": ("D", "tab:green")}


def _panel(ax, rows: list[dict[str, Any]], head: dict[str, Any], x_of, xlabel: str, title: str) -> None:
    key = head["judge"]
    for row in rows:
        if row.get(key) is None or row["kind"] == "chain":  # the table's chain is a control, not a way to decode
            continue
        marker, color = STYLES[row["kind"]]
        x = x_of(row)
        ax.scatter(x, row[key], marker=marker, color=color, s=30, zorder=3)
        ax.annotate(row["label"].replace("diffusion, ", "").replace("speculative, ", "spec, "), (x, row[key]),
                    fontsize=5.5, xytext=(3, 2), textcoords="offset points")
    ax.axhline(head["ar_twin_nll_per_char"], color="tab:red", ls=":", alpha=0.7,
               label=f"AR twin quality ({head['ar_twin_nll_per_char']:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    judge = "SmolLM2-135M" if "gguf" in key else "AR twin"
    ax.set_ylabel(f"judged NLL per character ({judge}; lower is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")


def _frontier_panel(ax, rows: list[dict[str, Any]], head: dict[str, Any], title: str) -> None:
    speed = head["speed"]
    ar = head["ar_twin_speed"]
    kind = "tokens per CPU-second" if speed == CPU else "tokens/s (wall clock)"
    _panel(ax, rows, head, lambda r: r[speed] / ar, f"{kind} relative to the AR twin (same run; log2)", title)
    front = sorted((r for r in rows if r["label"] in head.get("frontier", [])), key=lambda r: r[speed])
    if front:
        ax.plot([r[speed] / ar for r in front], [r[head["judge"]] for r in front], "-", color="tab:blue", alpha=0.5,
                label="diffusion frontier")
    ax.axvline(1.0, color="gray", alpha=0.5)
    for kind_name, (marker, color) in STYLES.items():
        if any(r["kind"] == kind_name for r in rows):
            ax.scatter([], [], marker=marker, color=color, label=f"{kind_name} decoding")
    ax.legend(fontsize=7, loc="upper left")


def plot(rows: list[dict[str, Any]], heads: dict[str, dict[str, Any]], png: Path, title: str) -> None:
    """Frontiers (wall clock, CPU time; a second judge when there is one) and quality against tokens/forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 10.5))
    _frontier_panel(axes[0, 0], rows, heads["ar_twin/wall"], "speed-quality frontier, wall clock")
    _frontier_panel(axes[0, 1], rows, heads["ar_twin/cpu"], "speed-quality frontier, CPU time (load-independent)")
    _panel(axes[1, 0], rows, heads["ar_twin/wall"], lambda r: r["tokens_per_forward_all_passes"],
           "tokens per forward, every encoder and decoder pass counted (log2)",
           "quality against tokens per forward")
    if "gguf/cpu" in heads:
        _frontier_panel(axes[1, 1], rows, heads["gguf/cpu"], "frontier under the independent judge, CPU time")
    else:
        axes[1, 1].axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
