"""The training loop: it learns, it resumes exactly, 2 ranks equal 1, and its checkpoints load everywhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from printpress.checkpoint import load_model
from printpress.train.command import main as train_main
from printpress.train.command import read_run_config
from printpress.train.loop import RunConfig, Trainer, TrainingError

from helpers import free_port, killed_and_resumed, losses, run_config


@pytest.mark.slow  # trains 80 steps
def test_a_tiny_model_overfits_a_small_text(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, steps=80, lr=1e-2, eval_every=40, save_every=80, batch_size=8), tmp_path)
    trainer.fit(progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    # Starting near ln(300) = 5.7 nats per token for both terms; the repeated verses become predictable.
    assert first["ar"] > 5.0 and first["diffusion"] > 5.0
    assert last["ar"] < 2.5, last
    assert last["diffusion"] < 4.0, last
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert "val_ar" in last and "val_diffusion" in last


def test_killed_and_resumed_run_reproduces_the_uninterrupted_losses(corpus, tmp_path):
    whole = tmp_path / "whole"
    Trainer(run_config(corpus), whole).fit(progress=False)

    broken = tmp_path / "broken"
    killed_and_resumed(run_config(corpus), broken)  # one step past the checkpoint at step 3, then "killed"

    assert losses(broken) == losses(whole)  # exact, including the re-run of step 4
    a, _, _, _ = load_model(whole / "model")
    b, _, _, _ = load_model(broken / "model")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_trained_checkpoint_loads_in_transformers_with_the_same_logits(corpus, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    Trainer(run_config(corpus, steps=2, save_every=2, eval_every=2), tmp_path).fit(progress=False)
    ours, config, _, tokenizer = load_model(tmp_path / "model")
    assert tokenizer is not None and tokenizer.token_to_id("<eos>") == 1
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "model").eval()
    ids = torch.tensor([tokenizer.encode("Shall I compare thee").ids])
    canvas = torch.randint(0, config.text.vocab_size, (1, config.canvas_length))
    with torch.no_grad():
        out = ref(input_ids=ids, decoder_input_ids=canvas)
        cache = ours.new_cache(1, 64)
        ours.encode(ids, cache, logits="none")
        assert (ours.denoise(canvas, cache) - out.logits).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_process_torchrun_matches_one_process(corpus, tmp_path, fsdp):
    config = tmp_path / "run.toml"
    config.write_text(toml_of(run_config(corpus, steps=3, eval_every=3, save_every=3, fsdp=fsdp)))
    single = tmp_path / "single"
    assert train_main(["--config", str(config), "--out", str(single), "--no-progress"]) == 0
    double = tmp_path / "double"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "printpress.train.command", "--config", str(config),
                           "--out", str(double), "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for (step_a, a), (step_b, b) in zip(losses(single), losses(double), strict=True):
        assert step_a == step_b and a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # The held-out figures too: both world sizes evaluate the same windows with the same noise.
    held_out = [held_out_figures(run) for run in (single, double)]
    assert held_out[0] and held_out[0].keys() == held_out[1].keys()
    for key, value in held_out[0].items():
        assert held_out[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    one, _, _, _ = load_model(single / "model")
    two, _, _, _ = load_model(double / "model")
    for (name, x), y in zip(one.state_dict().items(), two.state_dict().values()):
        assert (x - y).abs().max() < 1e-5, name


def held_out_figures(out: Path) -> dict[tuple[int, str], float]:
    """{(step, val_ar | val_diffusion): value} of a run's metrics.jsonl."""
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {(r["step"], k): v for r in records for k, v in r.items() if k.startswith("val_")}


def toml_of(run: RunConfig) -> str:
    def value(v):
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    data = run.to_dict()
    lines = []
    for section in ("model", "data", "train"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in data[section].items() if v is not None]
    return "\n".join(lines) + "\n"


def test_the_objective_settings_default_as_the_training_settings_do():
    from printpress.objectives import DiffusionSettings
    from printpress.train.loop import TrainSettings, objective_settings

    shared = objective_settings(TrainSettings())  # an objective setting missing from TrainSettings raises here
    assert shared and "block" not in shared
    assert DiffusionSettings(block=32, **shared) == DiffusionSettings(block=32)  # one default, written twice


# -- bad input -------------------------------------------------------------------------------------------


def test_missing_corpus_is_one_clear_error(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[data]\nsources = ["/nonexistent/corpus"]\n[train]\nsteps = 1\n')
    assert train_main(["--config", str(config), "--out", str(tmp_path / "o")]) == 2
    *stages, error = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("printpress train: error:") and "/nonexistent/corpus" in error
    assert stages == ["printpress train: training a tokenizer on the corpus"]  # progress before it, no traceback


def test_a_run_that_cannot_fit_in_memory_is_refused_before_starting(corpus, tmp_path):
    run = run_config(corpus)
    run.model.update(hidden_size=8192, intermediate_size=32768, num_hidden_layers=48, num_experts=64,
                     moe_intermediate_size=8192, head_dim=128, global_head_dim=128, num_attention_heads=64,
                     num_key_value_heads=8, num_global_key_value_heads=8, layer_types=None)
    with pytest.raises(TrainingError, match=r"needs about .* GiB but the machine has"):
        Trainer(run, tmp_path)


def test_nan_loss_stops_with_a_message_and_keeps_the_last_checkpoint(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, lr=1e-3), tmp_path)
    trainer.train_step()
    trainer.save_checkpoint()
    with torch.no_grad():
        trainer.model.layers[0].mlp.up_proj.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match=r"loss became nan at step 1; stopped; the last good checkpoint \(step 1\)"):
        trainer.train_step()
    model, _, _, _ = load_model(tmp_path / "checkpoint")
    assert torch.isfinite(model.layers[0].mlp.up_proj.weight).all()


def test_bad_settings_and_unknown_recipe_are_named(corpus, tmp_path):
    with pytest.raises(TrainingError, match="seq_len \\(30\\) must be a multiple of the canvas length \\(8\\)"):
        Trainer(run_config(corpus, seq_len=30), tmp_path)
    with pytest.raises(TrainingError, match="unknown recipe 'nope'"):
        read_run_config("nope", None, [])
    with pytest.raises(TrainingError, match="unknown training setting\\(s\\): \\['stepz'\\]"):
        RunConfig.from_dict({"train": {"stepz": 3}})
    with pytest.raises(TrainingError, match="no checkpoint to resume"):
        Trainer(RunConfig(), tmp_path / "empty", resume=True)


@pytest.mark.parametrize("device, message", [
    ("tpu", "device 'tpu' is not cpu or cuda"),
    ("cuda:x", "train.device 'cuda:x' is not a device name"),
    pytest.param("cuda", "train.device cuda: this torch .* sees no CUDA device; train on cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_a_device_it_cannot_train_on_is_refused_before_starting(corpus, tmp_path, device, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(run_config(corpus, device=device), tmp_path)
    assert not (tmp_path / "checkpoint").exists()


def test_bfloat16_precision_autocasts_the_step_and_keeps_float32_weights(corpus, tmp_path):
    """Autocast changes the matmuls' precision, not what is trained or saved: the losses stay near float32's,
    though not equal to them, and the checkpoint is float32."""
    runs = {}
    for precision in ("float32", "bfloat16"):
        out = tmp_path / precision
        Trainer(run_config(corpus, steps=3, eval_every=3, save_every=3, precision=precision), out).fit(progress=False)
        runs[precision] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for full, half in zip(runs["float32"], runs["bfloat16"]):
        assert half["loss"] != full["loss"]
        assert half["loss"] == pytest.approx(full["loss"], rel=0.02)
    assert runs["bfloat16"][-1]["val_ar"] == pytest.approx(runs["float32"][-1]["val_ar"], rel=0.02)
    model, _, _, _ = load_model(tmp_path / "bfloat16" / "model")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(TrainingError, match="precision 'float16' is not float32 or bfloat16"):
        Trainer(run_config(corpus, precision="float16"), tmp_path / "fp16")


def test_resume_can_shorten_a_run_with_set(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, steps=10), tmp_path)
    for _ in range(3):
        trainer.train_step()
    trainer.save_checkpoint()
    args = ["--out", str(tmp_path), "--resume", "--set", "train.steps=5", "--no-progress"]
    assert train_main(args) == 0
    assert json.loads((tmp_path / "run.json").read_text())["train"]["steps"] == 5
    assert losses(tmp_path)[-1][0] == 5


@pytest.mark.parametrize("name", ["shakespeare-joint", "shakespeare-ar", "shakespeare-diffusion", "stdlib-code-diffusion"])
def test_every_shipped_recipe_parses_and_validates(name):
    from printpress.config import TextConfig
    from printpress.train.command import recipe_names
    from printpress.train.loop import check_memory

    assert name in recipe_names()
    run = read_run_config(name, None, [])
    model = dict(run.model)
    canvas = model.pop("canvas_length")
    run.train.validate(canvas)
    check_memory(TextConfig(vocab_size=run.data["vocab_size"], **model), run.train, 1)


@pytest.mark.parametrize("name", ["shakespeare-joint-distill", "shakespeare-joint-fewstep", "shakespeare-joint-draft",
                                  "shakespeare-joint-continue", "shakespeare-joint-long", "shakespeare-joint-long-t09",
                                  "shakespeare-joint-long-states", "stdlib-code-joint-draft", "stdlib-code-long-states",
                                  "stdlib-code-continue", "stdlib-code-round2"])
def test_the_fine_tune_recipes_parse_and_validate_against_the_shipped_canvas(name):
    run = read_run_config(name, None, [])
    assert run.init_from.startswith("runs/") and not run.model  # a fine-tune: the model comes from init_from
    run.train.validate(32)
    teachers = [run.data[key] for key in ("distill", "distill_draft") if key in run.data]
    assert all(path.startswith("runs/distill/") for path in teachers)
    continuation = name in ("shakespeare-joint-continue", "stdlib-code-continue")
    assert bool(teachers) != continuation  # a continuation trains on real text only


# -- a run that survives kills and refuses to clobber ----------------------------------------------------


def checkpointed_run(corpus: Path, out: Path, steps: int = 3) -> None:
    """A run killed right after its checkpoint at `steps` (metrics written up to there)."""
    trainer = Trainer(run_config(corpus, steps=6), out)
    for _ in range(steps):
        trainer.log({"step": trainer.step + 1, **trainer.train_step()})
    trainer.save_checkpoint()


def test_a_save_killed_between_its_two_renames_still_resumes(corpus, tmp_path):
    whole = tmp_path / "whole"
    Trainer(run_config(corpus), whole).fit(progress=False)
    broken = tmp_path / "broken"
    checkpointed_run(corpus, broken)
    # What a kill between the renames leaves: the previous checkpoint moved aside, the new one not yet in place.
    (broken / "checkpoint").rename(broken / ".checkpoint.old")
    (broken / ".checkpoint.x1y2z3").mkdir()  # and the abandoned temporary copy of the save in progress
    assert train_main(["--out", str(broken), "--resume", "--no-progress"]) == 0
    assert losses(broken) == losses(whole)
    assert sorted(p.name for p in broken.iterdir() if p.name.startswith(".")) == []


def test_resume_survives_a_metrics_line_cut_short(corpus, tmp_path):
    checkpointed_run(corpus, tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "loss": 5.1')  # killed mid-write
    assert train_main(["--out", str(tmp_path), "--resume", "--no-progress"]) == 0
    assert [step for step, _ in losses(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(corpus, tmp_path, capsys):
    checkpointed_run(corpus, tmp_path)
    config = tmp_path.parent / f"{tmp_path.name}.toml"
    config.write_text(toml_of(run_config(corpus, steps=2, save_every=2, eval_every=2)))
    assert train_main(["--config", str(config), "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a run (metrics.jsonl, checkpoint)" in err and "--resume" in err and "\n" not in err
    assert train_main(["--config", str(config), "--out", str(tmp_path), "--overwrite", "--no-progress"]) == 0
    assert [step for step, _ in losses(tmp_path)] == [1, 2]  # the old records are gone, not appended to
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and state["run"]["train"]["steps"] == 2


def test_resume_refuses_to_change_the_model_shape(corpus, tmp_path, capsys):
    checkpointed_run(corpus, tmp_path)
    args = ["--out", str(tmp_path), "--resume", "--set", "model.hidden_size=64", "--no-progress"]
    assert train_main(args) == 2
    assert "--resume cannot change the model (model.hidden_size=64)" in capsys.readouterr().err


@pytest.mark.parametrize("setting, message", [
    ("train.steps=abc", "training setting steps must be an integer, got 'abc'"),
    ("train.lr=true", "training setting lr must be a finite number, got True"),
    ("train.fsdp=1", "training setting fsdp must be true or false, got 1"),
])
def test_mistyped_settings_are_one_line_errors(corpus, tmp_path, capsys, setting, message):
    config = tmp_path / "run.toml"
    config.write_text(toml_of(run_config(corpus)))
    assert train_main(["--config", str(config), "--out", str(tmp_path / "o"), "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_set_init_from_fine_tunes_a_from_scratch_config_and_refuses_another_architecture(corpus, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(toml_of(run_config(corpus, steps=2, eval_every=2, save_every=2)))
    base = tmp_path / "base"
    assert train_main(["--config", str(config), "--out", str(base), "--no-progress"]) == 0
    # The config's [model] is the base's architecture: --set init_from makes the same config a fine-tune of it.
    fine = tmp_path / "fine"
    args = ["--config", str(config), "--out", str(fine), "--set", f"init_from={base / 'model'}",
            "--set", "train.lr=1e-9", "--set", "train.min_lr=1e-10", "--no-progress"]
    assert train_main(args) == 0
    assert f"printpress train: loading {base / 'model'} (init_from)" in capsys.readouterr().err
    assert json.loads((fine / "run.json").read_text())["init_from"] == str(base / "model")
    # It started from the base's weights (at lr 1e-9 two steps move no weight by more than ~1e-8).
    before, _, _, _ = load_model(base / "model")
    after, _, _, _ = load_model(fine / "model")
    for (name, x), (_, y) in zip(before.state_dict().items(), after.state_dict().items(), strict=True):
        assert (x - y).abs().max() < 1e-6, name
    # A [model] that is not the checkpoint's is refused by name, before any training.
    wider = tmp_path / "wider.toml"
    wider.write_text(re.sub(r"^hidden_size = (\d+)", lambda m: f"hidden_size = {2 * int(m[1])}", config.read_text(),
                            count=1, flags=re.M))
    assert train_main(["--config", str(wider), "--out", str(tmp_path / "w"), "--set",
                       f"init_from={base / 'model'}", "--no-progress"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the "loading ..." stage line
    assert last.startswith(f"printpress train: error: init_from {base / 'model'} is not the [model] of the run config: "
                           "hidden_size=")
    assert train_main(["--config", str(config), "--out", str(tmp_path / "x"), "--set", "steps=3"]) == 2
    assert "--set 'steps=3': expected section.key=value, e.g. train.steps=200, or init_from=PATH" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_one_line_error(corpus, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(toml_of(run_config(corpus)))
    assert train_main(["--config", str(config), "--out", str(config)]) == 2
    assert f"--out {config} is a file, not a run folder" in capsys.readouterr().err


def test_the_command_says_what_it_prepares_and_ends_with_the_losses(corpus, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(toml_of(run_config(corpus, steps=3, eval_every=3, save_every=3)))
    assert train_main(["--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    stages = [line for line in captured.err.splitlines() if line.startswith("printpress train: ")]
    assert stages[0] == "printpress train: training a tokenizer on the corpus"
    assert stages[1].startswith(f"printpress train: preparing the data ({corpus}) in ")
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    line = captured.out.strip()
    assert line.startswith("trained 3 steps (") and line.endswith(f"model saved to {tmp_path / 'run' / 'model'}")
    assert f"last step loss {last['loss']:.3f}, ar {last['ar']:.3f}, diffusion {last['diffusion']:.3f}" in line
    assert f"held-out at step 3 val_ar {last['val_ar']:.3f}, val_diffusion {last['val_diffusion']:.3f}" in line
