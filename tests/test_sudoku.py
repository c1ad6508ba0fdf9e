"""Sudoku task: unique seeded puzzles, the one-token-per-cell layout, scoring, and the recipes end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from printpress.corpora import sudoku_documents
from printpress.errors import PrintpressError
from printpress.tasks import fixed_tokenizer
from printpress.tasks import sudoku as s

# A well-known puzzle (Wikipedia's Sudoku article) and its solution, worked out by hand long ago.
KNOWN = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
KNOWN_SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def test_solver_finds_the_known_solution_and_only_it():
    assert s.solve(s.parse(KNOWN)) == [s.parse(KNOWN_SOLUTION)]
    assert s.count_solutions(s.parse(KNOWN.replace("5", ".", 1))) == 1  # "." reads as empty


def test_solver_counts_several_solutions_and_none():
    assert s.count_solutions([0] * 81, limit=2) == 2
    clash = s.parse(KNOWN)
    clash[2] = 5  # a second 5 in the first row
    assert s.solve(clash) == []


def test_generated_puzzles_have_the_asked_givens_and_a_unique_solution():
    for index, givens in enumerate((28, 35, 40)):
        ex = s.example("unit", index, (givens, givens))
        assert ex.givens == givens
        assert s.solve(ex.puzzle, limit=2) == [ex.solution]
        assert s.is_valid_solution(ex.solution)
        assert s.keeps_givens(ex.puzzle, ex.solution)


def test_generation_is_seeded_and_each_puzzle_depends_only_on_seed_and_index():
    a = s.generate(3, "unit", (30, 36))
    assert a == s.generate(3, "unit", (30, 36))
    assert a[2] == s.example("unit", 2, (30, 36))  # regenerated alone
    assert a[0] != s.example("other", 0, (30, 36))
    assert all(30 <= ex.givens <= 36 for ex in a)


def test_bad_generator_settings_and_grids_are_named():
    with pytest.raises(s.SudokuError, match="givens must be between 17 and 81"):
        s.example("unit", 0, (10, 10))
    with pytest.raises(s.SudokuError, match="range"):
        s.example("unit", 0, (35, 30))
    with pytest.raises(s.SudokuError, match="81 characters"):
        s.parse("123")
    with pytest.raises(s.SudokuError, match="cell 3 is 12"):
        s.cells_to_ids([1, 2, 3, 12] + [0] * 77)
    assert issubclass(s.SudokuError, PrintpressError)


def test_layout_is_two_canvases_puzzle_then_solution():
    ex = s.Example(s.parse(KNOWN), s.parse(KNOWN_SOLUTION))
    ids = s.sequence_ids(ex)
    assert len(ids) == s.SEQ_LEN == 2 * s.CANVAS_LENGTH == 164
    assert ids[: s.CANVAS_LENGTH] == s.prompt_ids(ex.puzzle)
    assert ids[0] == s.BOS_ID and ids[-1] == s.EOS_ID
    assert s.ids_to_cells(ids[1:82]) == ex.puzzle and s.ids_to_cells(ids[82:163]) == ex.solution
    assert s.ids_to_cells([s.EOS_ID, s.PAD_ID, s.DIGIT_BASE + 7]) == [-1, -1, 7]


def test_fixed_tokenizer_round_trips_and_matches_the_layout():
    tok = fixed_tokenizer("sudoku")
    assert tok.get_vocab_size() == s.VOCAB_SIZE == 13
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "0", "9")] == [0, 1, 2, 3, 12]
    ex = s.Example(s.parse(KNOWN), s.parse(KNOWN_SOLUTION))
    text = s.document_text(ex)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == s.sequence_ids(ex)[1:-1]  # the data pipeline adds <bos> and <eos> around the text
    assert tok.decode(ids) == text
    with pytest.raises(PrintpressError, match="unknown fixed tokenizer 'nope'"):
        fixed_tokenizer("nope")


def test_scoring_of_right_and_wrong_grids():
    puzzle, solution = s.parse(KNOWN), s.parse(KNOWN_SOLUTION)
    right = s.score(puzzle, solution, solution)
    assert right == s.Score(solved=True, valid=True, cells_right=81, blanks_right=51, blanks=51)
    swapped = solution.copy()
    swapped[2], swapped[3] = swapped[3], swapped[2]  # two blanks of row 1 swapped: the columns break
    wrong = s.score(puzzle, solution, swapped)
    assert (wrong.solved, wrong.valid, wrong.cells_right, wrong.blanks_right) == (False, False, 79, 49)
    short = s.score(puzzle, solution, [-1] + solution[1:40])  # a non-digit and a grid cut short
    assert (short.solved, short.valid, short.cells_right) == (False, False, 39)
    # A valid grid that changes a given is not a solution of this puzzle.
    relabelled = [{5: 3, 3: 5}.get(v, v) for v in solution]
    assert s.is_valid_solution(relabelled) and not s.keeps_givens(puzzle, relabelled)
    assert not s.score(puzzle, solution, relabelled).valid


def test_the_corpus_is_generated_once_then_read_from_the_cache(tmp_path):
    docs = sudoku_documents(tmp_path, size=3)
    assert [d.name for d in docs] == ["sudoku/000000", "sudoku/000001", "sudoku/000002"]
    assert docs[2].text == s.document_text(s.example(s.CORPUS_SEED, 2, s.CORPUS_GIVENS))
    (cached,) = (tmp_path / "sudoku").glob("*.jsonl")
    cached.write_text(json.dumps({"text": "x" * 162}) + "\n")  # proves the second call reads the file
    assert [d.text for d in sudoku_documents(tmp_path, size=3)] == ["x" * 162]


def test_aligned_batches_start_at_whole_examples():
    from printpress.train.data import BatchSampler

    tokens = np.arange(164 * 10)
    sampler = BatchSampler(tokens, seq_len=164, batch_size=8, seed=3, aligned=True)
    for step in range(5):
        starts = sampler.global_starts(step)
        assert (starts % 164 == 0).all() and (starts <= 164 * 9).all()
        assert (sampler.batch(step)[:, 0].numpy() % 164 == 0).all()


@pytest.mark.parametrize("name", ["sudoku-diffusion", "sudoku-ar"])
def test_recipes_are_twins_with_the_sudoku_layout(name):
    from printpress.train.command import read_run_config

    run, twin = read_run_config(name, None, []), read_run_config("sudoku-ar", None, [])
    assert run.model == twin.model and run.data == twin.data
    assert {k: v for k, v in vars(run.train).items() if k != "objective"} == \
        {k: v for k, v in vars(twin.train).items() if k != "objective"}
    assert run.model["canvas_length"] == s.CANVAS_LENGTH and run.train.seq_len == s.SEQ_LEN
    assert run.data["tokenizer"] == "sudoku" and run.data["aligned_windows"] is True
    assert run.model["sliding_window"] >= s.SEQ_LEN  # sliding layers see the whole example
    run.train.validate(run.model["canvas_length"])


TINY = ["model.hidden_size=32", "model.intermediate_size=32", "model.moe_intermediate_size=16",
        "model.num_hidden_layers=2", 'model.layer_types=["sliding_attention","full_attention"]',
        "train.batch_size=4", "train.steps=2", "train.eval_every=2", "train.eval_batches=1", "train.save_every=2",
        "train.warmup=1"]


@pytest.mark.slow  # trains, then evaluates
@pytest.mark.parametrize("objective", ["diffusion", "ar"])
def test_a_tiny_recipe_trains_and_evaluates_end_to_end(objective, tmp_path):
    from printpress.engine import Pipeline
    from printpress.eval.sudoku import evaluate, noise_probe
    from printpress.train.command import read_run_config
    from printpress.train.loop import Trainer

    corpus = tmp_path / "sudoku.jsonl"
    examples = [s.example("smoke", i, (40, 40)) for i in range(24)]
    corpus.write_text("".join(json.dumps({"text": s.document_text(ex)}) + "\n" for ex in examples))
    sets = TINY + [f'data.sources=["{corpus}"]', "data.val_fraction=0.2"]
    run = read_run_config(f"sudoku-{objective}", None, sets)
    trainer = Trainer(run, tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "data" / "train.json").read_text())
    assert {count for _, _, count in meta["documents"]} == {s.SEQ_LEN}  # whole examples, so windows align
    final = trainer.fit(progress=False)

    pipe = Pipeline.from_pretrained(final)
    assert pipe.config.text.vocab_size == s.VOCAB_SIZE and pipe.canvas_length == s.CANVAS_LENGTH
    settings = {"mode": "ar"} if objective == "ar" else {"max_denoising_steps": 2}
    result = evaluate(pipe, limit=1, settings=settings, progress=False)
    metrics = result["metrics"]
    assert metrics["n"] == 3 and set(metrics["by_level"]) == {"28", "34", "40"}
    assert 0.0 <= metrics["exact_solve_accuracy"] <= metrics["cell_accuracy"] <= 1.0
    if objective == "ar":
        assert metrics["tokens_per_forward"] == 1.0 and metrics["forwards_per_puzzle"] <= s.CANVAS_LENGTH
    else:
        assert metrics["forwards_per_puzzle"] <= 2  # one canvas, at most two denoising steps
        assert metrics["tokens_per_forward"] >= 1.0
        probe = noise_probe(pipe, n=2, levels=(0.0, 1.0))
        assert set(probe) == {"0.0", "1.0"}
        assert all(0.0 <= v["given_accuracy"] <= 1.0 and v["blank_nll"] > 0 for v in probe.values())
    assert len(result["samples"]) == 3 and len(result["samples"][0]["predicted"]) == 81
    json.dumps(result)  # JSON-serialisable for the report card


def test_evaluation_refuses_a_model_without_the_sudoku_vocabulary():
    import torch

    from printpress.config import GenerationConfig, ModelConfig, TextConfig
    from printpress.engine import Pipeline
    from printpress.eval.sudoku import evaluate
    from printpress.model import DiffusionGemma

    text = TextConfig(vocab_size=40, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                      num_global_key_value_heads=1, layer_types=["full_attention"], num_experts=2, top_k_experts=1,
                      moe_intermediate_size=8, max_position_embeddings=256)
    torch.manual_seed(0)
    pipe = Pipeline(DiffusionGemma(text), ModelConfig(text, canvas_length=s.CANVAS_LENGTH),
                    GenerationConfig.from_dict({}, text))
    with pytest.raises(PrintpressError, match="vocabulary has 40 tokens, not the Sudoku vocabulary's 13"):
        evaluate(pipe, limit=1, progress=False)
    pipe.config = ModelConfig(text, canvas_length=32)
    with pytest.raises(PrintpressError, match="canvas is 32 tokens; Sudoku diffusion needs 82"):
        evaluate(pipe, limit=1, progress=False)
