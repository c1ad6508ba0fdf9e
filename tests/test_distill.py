"""Distillation levers: teacher rows, the mixed batch, the AR loss kept on real rows, certainty forcing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from printpress.train.data import MixedBatchSampler, open_token_file
from printpress.train.distill import DistillError, DistillSettings, distill
from printpress.train.loop import RunConfig, Trainer, TrainingError
from printpress.train.objectives import certainty_loss, next_token_loss

from helpers import free_port

TINY_MODEL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1,
                  sliding_window=16, layer_types=["sliding_attention", "full_attention"], num_experts=2,
                  top_k_experts=1, moe_intermediate_size=16, max_position_embeddings=256, canvas_length=8)

TEXT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 6


def test_certainty_loss_is_the_tempered_entropy_of_right_noised_positions_only():
    clean = torch.tensor([[0, 1, 2, 0]])
    noisy = torch.tensor([[3, 1, 0, 1]])  # position 1 is clean (not noised): excluded
    logits = torch.full((1, 4, 4), 0.0)
    logits[0, 0] = torch.tensor([2.0, 0.0, 0.0, 0.0])  # noised, argmax right: counted
    logits[0, 1] = torch.tensor([0.0, 5.0, 0.0, 0.0])  # right but not noised
    logits[0, 2] = torch.tensor([3.0, 0.0, 0.0, 0.0])  # noised, argmax wrong (0 != 2): excluded
    logits[0, 3] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # noised, argmax right: counted
    temperature = 0.5

    def entropy(row: list[float]) -> float:
        z = [math.exp(v / temperature) for v in row]
        p = [v / sum(z) for v in z]
        return -sum(q * math.log(q) for q in p)

    expected = (entropy([2.0, 0, 0, 0]) + entropy([1.0, 0, 0, 0])) / 2
    assert float(certainty_loss(logits, clean, noisy, temperature)) == pytest.approx(expected, rel=1e-6)


def test_certainty_loss_is_zero_when_nothing_noised_is_right():
    clean = torch.tensor([[0, 1]])
    logits = torch.zeros(1, 2, 3)
    logits[..., 2] = 1.0
    assert float(certainty_loss(logits, clean, torch.tensor([[2, 2]]), 0.5)) == 0.0


def test_next_token_loss_on_some_rows_equals_the_loss_of_those_rows_alone():
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (3, 6))
    logits = torch.randn(3, 6, 11)
    rows = torch.tensor([True, False, True])
    kept = next_token_loss(logits, tokens, None, rows)
    alone = next_token_loss(logits[rows], tokens[rows], None)
    assert float(kept) == pytest.approx(float(alone), rel=1e-6)
    assert float(kept) != pytest.approx(float(next_token_loss(logits, tokens, None)), rel=1e-3)


def test_mixed_batches_put_teacher_rows_last_and_shard_like_one_process():
    real = np.arange(1000, dtype=np.uint16)
    extra = np.arange(5000, 5000 + 10 * 8, dtype=np.uint16)  # 10 rows of 8
    one = MixedBatchSampler(real, extra, seq_len=8, batch_size=4, extra_rows=1, seed=3)
    batch = one.batch(5)
    assert [one.is_real(r) for r in range(4)] == [True, True, True, False]
    for row in batch[:3]:  # real windows: consecutive tokens from the real stream
        assert row[0] < 1000 and torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 8))
    teacher = batch[3]
    assert int(teacher[0]) >= 5000 and (int(teacher[0]) - 5000) % 8 == 0  # a whole, aligned teacher row
    assert torch.equal(batch, one.batch(5)) and not torch.equal(batch, one.batch(6))
    halves = [MixedBatchSampler(real, extra, 8, 4, 1, seed=3, rank=r, world_size=2).batch(5) for r in range(2)]
    assert torch.equal(torch.cat(halves), batch)


def test_mixed_batches_refuse_files_of_partial_rows():
    with pytest.raises(Exception, match="not whole rows of seq_len 8"):
        MixedBatchSampler(np.arange(100), np.arange(12), seq_len=8, batch_size=4, extra_rows=1)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny joint model trained a few steps on a small corpus (the corpus folder, the model folder)."""
    root = tmp_path_factory.mktemp("distill")
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(10):
        (corpus / f"doc{index}.txt").write_text(TEXT)
    run = RunConfig.from_dict({
        "model": dict(TINY_MODEL), "data": {"sources": [str(corpus)], "vocab_size": 300, "val_fraction": 0.2},
        "train": dict(objective="joint", steps=4, batch_size=4, seq_len=32, lr=3e-3, warmup=1, eval_every=4,
                      eval_batches=1, save_every=4, seed=1)})
    return corpus, Trainer(run, root / "run").fit(progress=False)


def test_distill_writes_training_prefixes_followed_by_teacher_continuations(teacher, tmp_path):
    corpus, model = teacher
    settings = DistillSettings(rows=6, prefix_tokens=16, new_tokens=16, temperature=0.8, top_k=20, seed=2, batch_size=4)
    out = distill(str(model), [str(corpus)], tmp_path / "teacher.bin", settings, val_fraction=0.2)
    import printpress

    tokenizer = printpress.load(model).tokenizer
    rows = open_token_file(out, tokenizer=tokenizer)
    assert len(rows.tokens) == 6 * 32 and all(count == 32 for _, _, count in rows.meta.documents)
    train = np.asarray(open_token_file(tmp_path / "teacher-data" / "train.bin").tokens)
    text = train.tobytes()
    for row in np.asarray(rows.tokens).reshape(6, 32):
        assert row[:16].astype(train.dtype).tobytes() in text  # the prefix is real training text
    again = distill(str(model), [str(corpus)], tmp_path / "again.bin", settings, val_fraction=0.2)
    assert np.array_equal(np.asarray(open_token_file(again).tokens), np.asarray(rows.tokens))  # seeded


def _greedy_rows_and_limit(teacher, tmp_path):
    """Eight greedy rows of the tiny teacher and a repeat limit that some of them exceed."""
    from printpress.eval.diversity import repeated_share

    corpus, model = teacher
    greedy = DistillSettings(rows=8, prefix_tokens=16, new_tokens=16, temperature=0.0, top_k=None, seed=2,
                             batch_size=4)
    plain = np.asarray(open_token_file(distill(str(model), [str(corpus)], tmp_path / "all.bin", greedy,
                                               val_fraction=0.2)).tokens).reshape(8, 32)
    shares = [repeated_share(row[16:].tolist()) for row in plain]
    limit = sorted(shares)[len(shares) // 2]
    assert any(share > limit for share in shares)  # so some rows must be replaced
    return greedy, plain, shares, limit


def test_max_repeat_keeps_only_continuations_that_repeat_no_more_than_it(teacher, tmp_path):
    """A greedy teacher loops; `max_repeat` drops those rows and continues more prefixes in their place, and every
    kept row's prefix is still real training text."""
    from printpress.eval.diversity import repeated_share

    corpus, model = teacher
    greedy, plain, shares, limit = _greedy_rows_and_limit(teacher, tmp_path)
    counts: dict = {}
    kept_file = open_token_file(distill(str(model), [str(corpus)], tmp_path / "kept.bin",
                                        replace(greedy, max_repeat=limit), val_fraction=0.2, counts=counts))
    kept = np.asarray(kept_file.tokens).reshape(8, 32)
    dropped = sum(share > limit for share in shares)
    # the first draw's 8 prefixes, then further ones in batches of 4 until 8 rows pass; the file says how many
    assert counts["continued"] >= 8 + dropped and counts["continued"] % 4 == 0
    assert json.loads(kept_file.meta.corpus.removeprefix("distill "))["continued"] == counts["continued"]
    assert all(repeated_share(row[16:].tolist()) <= limit for row in kept)
    passing = [tuple(row) for row, share in zip(plain, shares) if share <= limit]
    assert [tuple(row) for row in kept[: len(passing)]] == passing  # the first draw's rows come first, in order
    text = np.asarray(open_token_file(tmp_path / "kept-data" / "train.bin").tokens)
    assert all(row[:16].astype(text.dtype).tobytes() in text.tobytes() for row in kept)


def test_the_distill_command_says_how_many_continuations_max_repeat_dropped(teacher, tmp_path, capsys):
    from printpress.cli import main

    corpus, model = teacher
    _, _, _, limit = _greedy_rows_and_limit(teacher, tmp_path)
    counts: dict = {}
    distill(str(model), [str(corpus)], tmp_path / "api.bin", DistillSettings(
        rows=8, prefix_tokens=16, new_tokens=16, temperature=0.0, top_k=None, seed=2, batch_size=4, max_repeat=limit),
        val_fraction=0.2, counts=counts)
    capsys.readouterr()
    assert main(["distill", "--teacher", str(model), "--data", str(corpus), "--val-fraction", "0.2", "--out",
                 str(tmp_path / "cli.bin"), "--rows", "8", "--prefix-tokens", "16", "--new-tokens", "16",
                 "--temperature", "0", "--seed", "2", "--batch-size", "4", "--max-repeat", repr(limit),
                 "--no-progress"]) == 0
    continued = counts["continued"]
    assert capsys.readouterr().out.strip().endswith(
        f"({continued - 8} of {continued} continuations dropped for --max-repeat {limit:g})")


def test_max_repeat_that_too_few_rows_pass_is_refused_with_the_counts(teacher, tmp_path, monkeypatch):
    import printpress.train.distill as distill_module

    corpus, model = teacher
    greedy, _, shares, limit = _greedy_rows_and_limit(teacher, tmp_path)
    monkeypatch.setattr(distill_module, "MAX_CANDIDATES_PER_ROW", 1)  # no second draw of prefixes
    passing = sum(share <= limit for share in shares)
    with pytest.raises(DistillError, match=rf"only {passing} of 8 continuations repeat at most {limit:g} of their "
                                           r"4-grams, fewer than the 8 rows asked for"):
        distill(str(model), [str(corpus)], tmp_path / "few.bin", replace(greedy, max_repeat=limit), val_fraction=0.2)
    assert not (tmp_path / "few.bin").exists()
    with pytest.raises(DistillError, match=r"max-repeat must be in \[0, 1\)"):
        distill(str(model), [str(corpus)], tmp_path / "bad.bin", DistillSettings(max_repeat=1.0))


def test_distill_refuses_a_bad_output_name_and_bad_settings(teacher, tmp_path):
    corpus, model = teacher
    with pytest.raises(DistillError, match=r"must name a \.bin"):
        distill(str(model), [str(corpus)], tmp_path / "teacher.txt", DistillSettings(rows=2))
    with pytest.raises(DistillError, match="new-tokens must be positive"):
        distill(str(model), [str(corpus)], tmp_path / "t.bin", DistillSettings(new_tokens=0))


def test_a_fine_tune_mixes_teacher_rows_and_logs_certainty(teacher, tmp_path):
    corpus, model = teacher
    settings = DistillSettings(rows=8, prefix_tokens=16, new_tokens=16, seed=0)
    rows = distill(str(model), [str(corpus)], tmp_path / "teacher.bin", settings, val_fraction=0.2)
    data = {"sources": [str(corpus)], "val_fraction": 0.2, "distill": str(rows), "distill_fraction": 0.5}
    train = dict(objective="joint", steps=2, batch_size=4, seq_len=32, lr=1e-3, warmup=1, eval_every=2,
                 eval_batches=1, save_every=2, certainty_weight=1.0)
    run = RunConfig.from_dict({"init_from": str(model), "data": data, "train": train})
    trainer = Trainer(run, tmp_path / "fine")
    assert isinstance(trainer.sampler, MixedBatchSampler) and trainer.sampler.extra_rows == 2
    trainer.fit(progress=False)
    records = [json.loads(line) for line in (tmp_path / "fine" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["certainty"] >= 0 for r in records)
    assert records[0]["loss"] == pytest.approx(records[0]["diffusion"] + records[0]["certainty"] + records[0]["ar"],
                                               rel=1e-5)

    wrong = RunConfig.from_dict({"init_from": str(model), "data": data, "train": {**train, "seq_len": 16}})
    with pytest.raises(TrainingError, match="rows of \\[32\\] tokens; train.seq_len is 16"):
        Trainer(wrong, tmp_path / "wrong")


def test_a_draft_file_adds_its_rows_last_and_leaves_the_other_rows_as_they_were():
    real = np.arange(1000, dtype=np.uint16)
    extra = np.arange(5000, 5000 + 10 * 8, dtype=np.uint16)
    draft = np.arange(7000, 7000 + 6 * 8, dtype=np.uint16)
    three = MixedBatchSampler(real, extra, seq_len=8, batch_size=5, extra_rows=1, seed=3, draft=draft, draft_rows=2)
    batch = three.batch(4)
    assert [three.is_real(r) for r in range(5)] == [True, True, False, False, False]
    assert [three.is_draft(r) for r in range(5)] == [False, False, False, True, True]
    assert all(7000 <= int(row[0]) and (int(row[0]) - 7000) % 8 == 0 for row in batch[3:])  # whole draft rows
    two = MixedBatchSampler(real, extra, seq_len=8, batch_size=3, extra_rows=1, seed=3)
    assert torch.equal(batch[:3], two.batch(4))  # the real and teacher rows do not move
    whole = MixedBatchSampler(real, extra, 8, 6, 1, seed=3, draft=draft, draft_rows=2)
    halves = [MixedBatchSampler(real, extra, 8, 6, 1, seed=3, rank=r, world_size=2, draft=draft, draft_rows=2).batch(4)
              for r in range(2)]
    assert torch.equal(torch.cat(halves), whole.batch(4))
    with pytest.raises(Exception, match="draft_rows 2 != none"):
        two.load_state_dict(three.state_dict())
    with pytest.raises(Exception, match="draft_tokens None != 48"):
        three.load_state_dict(two.state_dict())
    with pytest.raises(Exception, match="not whole rows of seq_len 8"):
        MixedBatchSampler(real, extra, 8, 5, 1, draft=np.arange(12), draft_rows=1)
    with pytest.raises(Exception, match="at least one real row"):
        MixedBatchSampler(real, extra, 8, 4, 2, draft=draft, draft_rows=2)


def test_a_fine_tune_trains_the_draft_file_rows_as_drafts_and_only_those(teacher, tmp_path, monkeypatch):
    corpus, model = teacher
    settings = DistillSettings(rows=8, prefix_tokens=16, new_tokens=16, seed=0)
    rows = distill(str(model), [str(corpus)], tmp_path / "teacher.bin", settings, val_fraction=0.2)
    data = {"sources": [str(corpus)], "val_fraction": 0.2, "distill": str(rows), "distill_fraction": 0.25,
            "distill_draft": str(rows), "distill_draft_fraction": 0.25}
    train = dict(objective="joint", steps=1, batch_size=4, seq_len=32, lr=1e-3, warmup=1, eval_every=1,
                 eval_batches=1, save_every=1)
    import printpress.train.loop as loop

    seen, real_row_noise = [], loop.row_noise
    monkeypatch.setattr(loop, "row_noise", lambda *a, **k: seen.append(k["draft_rows"]) or real_row_noise(*a, **k))
    trainer = Trainer(RunConfig.from_dict({"init_from": str(model), "data": data, "train": train}), tmp_path / "fine")
    assert (trainer.sampler.real_rows, trainer.sampler.extra_rows, trainer.sampler.draft_rows) == (2, 1, 1)
    trainer.fit(progress=False)
    assert seen and seen[0].tolist() == [False, False, False, True]

    for change, message in [
        ({"distill": None}, "data.distill_draft needs data.distill"),
        ({"distill_fraction": 0.5, "distill_draft_fraction": 0.5}, "leave no real row in a batch of 4"),
        ({"distill_draft_fraction": 0.0}, r"data.distill_draft_fraction 0.0 gives 0 of 4 rows"),
    ]:
        bad = {k: v for k, v in {**data, **change}.items() if v is not None}
        with pytest.raises(TrainingError, match=message):
            Trainer(RunConfig.from_dict({"init_from": str(model), "data": bad, "train": train}), tmp_path / "bad")
    both = RunConfig.from_dict({"init_from": str(model), "data": data, "train": {**train, "draft_teacher_rows": True}})
    with pytest.raises(TrainingError, match="leave train.draft_teacher_rows off"):
        Trainer(both, tmp_path / "both")


@pytest.mark.slow  # two torchrun processes
def test_two_processes_match_one_when_the_real_rows_all_sit_on_one_rank(teacher, tmp_path):
    """With half of a batch of 4 from the teacher file, rank 0 holds both real rows and rank 1 none: the AR loss
    and the certainty term must still be the means over the whole batch (each rank scales by the global count),
    not the average of the ranks' means, which would halve the AR term's weight."""
    corpus, model = teacher
    rows = distill(str(model), [str(corpus)], tmp_path / "teacher.bin",
                   DistillSettings(rows=8, prefix_tokens=16, new_tokens=16, seed=0), val_fraction=0.2)
    config = tmp_path / "fine.toml"
    config.write_text(f'init_from = "{model}"\n[data]\nsources = ["{corpus}"]\nval_fraction = 0.2\n'
                      f'distill = "{rows}"\ndistill_fraction = 0.5\n[train]\nobjective = "joint"\nsteps = 3\n'
                      'batch_size = 4\nseq_len = 32\nlr = 1e-3\nwarmup = 1\neval_every = 3\neval_batches = 1\n'
                      'save_every = 3\ncertainty_weight = 1.0\n')
    command = ["-m", "printpress.train.command", "--config", str(config), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *command, "--out", str(tmp_path / "one")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), *command, "--out", str(tmp_path / "two")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    records = [[json.loads(line) for line in (tmp_path / side / "metrics.jsonl").read_text().splitlines()]
               for side in ("one", "two")]
    for a, b in zip(*records, strict=True):
        for key in ("ar", "certainty", "diffusion", "loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)


def test_draft_table_holds_the_models_greedy_rows_and_travels_with_the_folder(teacher, tmp_path):
    """`printpress draft-table`: the model's greedy continuations (distill's rows at temperature 0) with the last
    `longest` prefix tokens as context, written beside the weights; `load` attaches it, `save_pretrained` keeps it,
    and speculative decoding from it gives AR's tokens."""
    import shutil

    import printpress
    from printpress.cli import main
    from printpress.draft_table import FILE, DraftTable

    corpus, model = teacher
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    assert printpress.load(folder).model.draft_table is None
    assert main(["draft-table", str(folder), "--data", str(corpus), "--val-fraction", "0.2", "--rows", "6",
                 "--sampled-rows", "5", "--temperature", "0.9", "--top-k", "20", "--new-tokens", "16", "--longest",
                 "3", "--seed", "2", "--batch-size", "4", "--no-progress"]) == 0
    pipe = printpress.load(folder)
    table = pipe.model.draft_table
    settings = DistillSettings(rows=6, prefix_tokens=64, new_tokens=16, temperature=0, top_k=None, seed=2,
                               batch_size=4)
    rows = distill(str(model), [str(corpus)], tmp_path / "greedy.bin", settings, val_fraction=0.2)
    expected = np.asarray(open_token_file(rows).tokens).reshape(6, 80)[:, 61:]
    hot = DistillSettings(rows=5, prefix_tokens=64, new_tokens=16, temperature=0.9, top_k=20, seed=3, batch_size=4)
    sampled = distill(str(model), [str(corpus)], tmp_path / "sampled.bin", hot, val_fraction=0.2)
    sampled = np.asarray(open_token_file(sampled).tokens).reshape(5, 80)[:, 61:]
    remade = DraftTable.from_rows(expected, first=3, longest=3, sampled_rows=sampled)
    assert table.maps == remade.maps and table.longest == 3 and table.counts
    assert [{k: (t.tolist(), c.tolist()) for k, (t, c) in level.items()} for level in table.counts] == [
        {k: (t.tolist(), c.tolist()) for k, (t, c) in level.items()} for level in remade.counts]
    assert table.made_by["model"] == str(folder) and table.made_by["rows"] == 6
    prompt = "the quick"
    ar = pipe.generate(prompt, mode="ar", temperature=0, max_new_tokens=20)
    spec = pipe.generate(prompt, mode="speculative", draft_source="table", temperature=0, max_new_tokens=20)
    assert spec.token_ids == ar.token_ids and spec.stats.denoising_steps == 0
    pipe.save_pretrained(tmp_path / "copy")
    assert printpress.load(tmp_path / "copy").model.draft_table.maps == table.maps
    (folder / FILE).write_bytes(b"broken")
    with pytest.raises(printpress.errors.CheckpointError, match=f"{FILE}: unreadable draft table"):
        printpress.load(folder)


def test_draft_table_refuses_what_it_cannot_make(teacher, tmp_path, capsys):
    from printpress.cli import main
    from printpress.train.distill import make_draft_table

    corpus, model = teacher
    common = ["--data", str(corpus), "--rows", "2", "--no-progress"]
    assert main(["draft-table", str(model), "--longest", "0", *common]) == 2
    assert capsys.readouterr().err == "printpress: error: --longest must be in 1..64 (the prefix tokens), got 0\n"
    assert main(["draft-table", str(model), "--out", str(tmp_path / "table.bin"), *common]) == 2
    assert "--out must name a .safetensors file in an existing folder" in capsys.readouterr().err
    with pytest.raises(DistillError, match="owner/model is not a local folder; give --out for its draft table"):
        make_draft_table("owner/model", [str(corpus)], DistillSettings(rows=2, temperature=0), 5, None)
    with pytest.raises(DistillError, match="temperature must be 0, got 0.7"):
        make_draft_table(str(model), [str(corpus)], DistillSettings(rows=2), 5, None)
    with pytest.raises(DistillError, match="the sampled rows need a temperature above 0 \\(got 0"):
        make_draft_table(str(model), [str(corpus)], DistillSettings(rows=2, temperature=0), 5, None,
                         sampled=DistillSettings(rows=2, temperature=0))
    assert main(["draft-table", str(model), "--sampled-rows", "-1", *common]) == 2
    assert "--sampled-rows must be 0 (none) or positive, got -1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()) and not (model / "draft_table.safetensors").exists()
