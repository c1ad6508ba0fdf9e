"""bench/yardstick_table.py: two yardstick reports as one Markdown table."""

from __future__ import annotations

import json

import pytest

from helpers import bench_module

yardstick_table = bench_module("yardstick_table")


def row(label, kind, model, settings, speed, twin, smol, entropy, repeats=0.0, matched=None, tpf=4.0, stops=0):
    return {"label": label, "kind": kind, "model": model, "settings": settings, "tokens_per_s": speed,
            "tokens_per_forward": tpf, "adaptive_stops": stops, "judge_ar_twin_nll_per_char": twin,
            "judge_gguf_nll_per_char": smol, "unigram_entropy_nats": entropy, "repeated_4gram_share": repeats,
            "matched_diversity": matched}


def report(fast_entropy: float, heldout: bool = True) -> dict:
    return {
        "diversity_reference": {"unigram_entropy_nats": 5.4, "entropy_tolerance": 0.05, "repeated_4gram_share": 0.0,
                                "repeat_slack": 0.05},
        "heldout": {"diffusion": {"val_ar": 4.2, "val_diffusion": 3.1456}} if heldout else None,
        "rows": [
            row("AR twin", "ar", "ar", {"mode": "ar", "temperature": 0.8}, 100.0, 0.9951, 1.5472, 5.35),
            row("diffusion model, AR decoding", "ar", "diffusion", {"mode": "ar"}, 98.0, 1.035, 1.379, 5.4),
            row("diffusion, 8 steps, bound 4", "diffusion", "diffusion", {"max_denoising_steps": 8}, 157.0, 1.533,
                1.845, fast_entropy, matched=fast_entropy >= 5.13),
            row("diffusion, 24 steps, stop", "diffusion", "diffusion", {"max_denoising_steps": 24}, 105.0, 1.464,
                None, 5.53, matched=True, tpf=2.594, stops=40),
            row("speculative, temperature 0", "speculative", "diffusion", {"temperature": 0.0}, 59.0, 0.749, 0.918,
                3.93, repeats=0.176, tpf=1.04),
        ],
    }


def test_the_cells_read_as_the_docs_tables_do():
    lines = yardstick_table.table([report(5.15), report(5.12, heldout=False)], ["before", "after"]).splitlines()
    assert lines[0] == "| setting | before | after |"
    assert lines[2] == "| AR twin | 0.995 / 1.547, 5.35 | 0.995 / 1.547, 5.35 |"
    assert lines[4] == ("| diffusion, 8 steps, bound 4 | 1.57×, 1.533 / 1.845, 5.15, yes "
                        "| 1.57×, 1.533 / 1.845, 5.12, no (0.2% short) |")
    assert lines[5].startswith("| diffusion, 24 steps, stop | 1.05× (2.59), 1.464 / -, 5.53, yes |")
    assert lines[6].startswith("| speculative, temperature 0 | 0.59× (1.04), 0.749 / 0.918, 0.176 |")
    assert lines[7] == "| held-out AR / diffusion loss | 4.200 / 3.146 | — |"
    assert lines[-1].endswith("The diversity line: before 5.13, after 5.13.)")


def test_a_setting_one_run_lacks_gets_a_dash():
    other = report(5.15)
    other["rows"] = other["rows"][:3]
    lines = yardstick_table.table([report(5.15), other], ["a", "b"]).splitlines()
    assert lines[5].endswith("| — |")


def test_a_file_that_is_not_a_report_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SystemExit) as exit_info:
        yardstick_table.main([str(path)])
    assert exit_info.value.code == 2
    assert f"{path} is not a printpress bench report" in capsys.readouterr().err
