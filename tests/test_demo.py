"""`make demo` (printpress.demo): every decoding of the shipped model, and speculative decoding's text is AR's."""

from __future__ import annotations

import re

from printpress import demo


def test_the_demo_shows_each_decoding_and_speculative_text_is_greedy_ars(capsys):
    assert demo.main() == 0
    captured = capsys.readouterr()
    sections = captured.out.split("\n== ")[1:]
    assert [s.split(" ==\n")[0] for s in sections] == [
        "diffusion: 32-token canvases denoised in parallel (the printing press)",
        *(header for header, _ in demo.DECODINGS)]
    greedy, speculative, lookup, table = (s.split(" ==\n", 1)[1] for s in sections[2:])
    assert greedy.strip() and greedy == speculative == lookup == table
    stats = [line for line in captured.err.splitlines() if "tokens per forward" in line]
    assert len(stats) == 6  # one statistics line per decoding (stderr)
    assert "1.00 tokens per forward" in stats[2] and "1.00 tokens per forward" not in stats[3]
    for line in stats[3:]:
        assert " verifications of " in line and "canvases" not in line  # its rounds, not canvases
    kept = [re.search(r"\((\d+) of (\d+) (\w+) drafts kept\)", line) for line in stats[3:]]
    assert [k[3] for k in kept] == ["diffusion", "lookup", "table"]  # the default source is the table
    assert 0 < int(kept[1][1]) < int(kept[2][1])  # lookup drafts were kept, the table's more often
