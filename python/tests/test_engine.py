"""The engine from Python: a tiny fine-tune through moeforge.finetune equals `moeforge finetune` of
the same recipe bit for bit (the exported model.safetensors bytes and the logged losses), metrics
come back as Python objects, a run resumes, launch runs the CLI's launcher, and the SFTTrainer
facade maps TrainingArguments names onto recipe keys and refuses the others by name."""

import dataclasses
import json
import os
import subprocess

import pytest
from conftest import REPO

import moeforge

RECIPE = os.path.join(REPO, "demo", "tiny_tokens.yaml")
DATA = os.path.join(REPO, "demo", "data", "tokens.jsonl")


def overrides(model, out):
    return {"model": model, "data.train": DATA, "out": out, "train.steps": 5, "train.seq_len": 64,
            "train.micro_batch": 2, "train.log_every": 1, "optim.warmup_steps": 1}


def metrics_lines(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_finetune_from_python_equals_the_cli_bitwise(tiny_model, tmp_path):
    py_out, cli_out = str(tmp_path / "py"), str(tmp_path / "cli")
    seen = []
    result = moeforge.finetune(moeforge.Recipe.from_file(RECIPE).with_overrides(overrides(tiny_model, py_out)),
                               on_step=seen.append)
    assert result.out_dir == py_out and result.interrupted_by == 0
    assert [m.step for m in result.metrics] == [1, 2, 3, 4, 5] and seen == result.metrics
    assert all(isinstance(m, moeforge.StepMetrics) and m.loss > 0 and m.tokens > 0 for m in result.metrics)

    cli = [moeforge.binary(), "finetune", RECIPE] + [f"{k}={v}" for k, v in overrides(tiny_model, cli_out).items()]
    proc = subprocess.run(cli, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    with open(os.path.join(py_out, "model.safetensors"), "rb") as a, open(os.path.join(cli_out, "model.safetensors"),
                                                                          "rb") as b:
        assert a.read() == b.read(), "the exported weights differ"
    py_lines, cli_lines = metrics_lines(py_out), metrics_lines(cli_out)
    assert len(py_lines) == len(cli_lines) == 5
    for p, c, m in zip(py_lines, cli_lines, result.metrics):
        for key in ("step", "loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens"):
            assert p[key] == c[key], key
        assert m.loss == p["loss"] and m.grad_norm == p["grad_norm"], "the returned metrics are the logged ones"


def test_engine_steps_checkpoints_and_resumes(tiny_model, tmp_path):
    out = str(tmp_path / "run")
    recipe = moeforge.Recipe.from_file(RECIPE).with_overrides(overrides(tiny_model, out))
    with moeforge.Engine(recipe) as engine:
        assert (engine.steps_done, engine.total_steps) == (0, 5)
        assert engine.recipe_json()["train"]["steps"] == 5
        first = engine.step()
        engine.step()
        engine.save_checkpoint()
    with moeforge.Engine(recipe, resume="auto") as engine:
        assert engine.steps_done == 2
        rest = engine.run()
        assert [m.step for m in rest] == [3, 4, 5]
        with pytest.raises(moeforge.InvalidArgumentError, match="no step is left"):
            engine.step()
        assert engine.export() == out
    assert metrics_lines(out)[0]["loss"] == first.loss
    # A closed engine refuses calls.
    with pytest.raises(ValueError, match="closed"):
        engine.step()


def test_text_and_dict_recipes(tiny_model, tmp_path):
    text = f"model: {tiny_model}\ndata:\n  train: {DATA}\n  format: tokens\ntrain:\n  steps: 1\n  seq_len: 32\n" \
           f"out: {tmp_path / 'text'}\n"
    assert moeforge.finetune(moeforge.Recipe.from_text(text)).out_dir == str(tmp_path / "text")
    d = {"model": tiny_model, "data": {"train": DATA, "format": "tokens"}, "train": {"steps": 1, "seq_len": 32},
         "optim": {"betas": [0.9, 0.95]}, "out": str(tmp_path / "dict")}
    assert moeforge.finetune(d, train__micro_batch=2).out_dir == str(tmp_path / "dict")


def test_launch_runs_the_cli_launcher(tiny_model, tmp_path):
    out = str(tmp_path / "dp2")
    o = overrides(tiny_model, out)
    o["train.steps"] = 2
    o["device"] = "cpu"  # two ranks on any machine (a CUDA one may have a single GPU)
    assert moeforge.launch(moeforge.Recipe.from_file(RECIPE).with_overrides(o), nproc_per_node=2) == 0
    assert len(metrics_lines(out)) == 2 and os.path.exists(os.path.join(out, "model.safetensors"))
    with pytest.raises(moeforge.InvalidArgumentError, match="from a file"):
        moeforge.launch({"model": "m"}, nproc_per_node=2)


# --- SFTTrainer ------------------------------------------------------------------------------------------

def test_training_arguments_map_onto_recipe_keys():
    got = moeforge.recipe_overrides_from_training_args(dict(
        learning_rate=2e-5, max_steps=40, num_train_epochs=3, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, warmup_ratio=0.1, weight_decay=0.0, adam_beta1=0.8, adam_beta2=0.95,
        adam_epsilon=1e-6, max_grad_norm=0.5, lr_scheduler_type="cosine", seed=3, output_dir="o", save_steps=10,
        logging_steps=5, bf16=True, report_to="none"))
    assert got == {"optim.lr": 2e-5, "train.steps": 40, "train.micro_batch": 4, "train.grad_accum": 2,
                   "optim.warmup_steps": 4, "optim.weight_decay": 0.0, "optim.betas": [0.8, 0.95], "optim.eps": 1e-6,
                   "train.grad_clip": 0.5, "optim.schedule": "cosine", "seed": 3, "out": "o", "checkpoint.every": 10,
                   "train.log_every": 5, "precision": "mixed"}


def test_training_arguments_without_a_recipe_key_are_refused_by_name():
    with pytest.raises(moeforge.InvalidArgumentError, match="deepspeed, label_smoothing_factor have no moeforge"):
        moeforge.recipe_overrides_from_training_args(dict(max_steps=1, deepspeed="ds.json",
                                                          label_smoothing_factor=0.1))
    with pytest.raises(moeforge.InvalidArgumentError, match="num_train_epochs"):
        moeforge.recipe_overrides_from_training_args(dict(num_train_epochs=2))
    with pytest.raises(moeforge.InvalidArgumentError, match="lr_scheduler_type 'polynomial'"):
        moeforge.recipe_overrides_from_training_args(dict(max_steps=1, lr_scheduler_type="polynomial"))
    with pytest.raises(moeforge.InvalidArgumentError, match="fp16"):
        moeforge.recipe_overrides_from_training_args(dict(max_steps=1, fp16=True))


def test_a_training_arguments_dataclass_counts_only_what_differs_from_its_defaults():
    @dataclasses.dataclass
    class Args:  # the shape of transformers.TrainingArguments
        output_dir: str = "trainer_output"
        learning_rate: float = 5e-5
        max_steps: int = -1
        deepspeed: str = None
        push_to_hub: bool = False

    assert moeforge.recipe_overrides_from_training_args(Args(max_steps=3)) == {"train.steps": 3}
    with pytest.raises(moeforge.InvalidArgumentError, match="push_to_hub"):
        moeforge.recipe_overrides_from_training_args(Args(max_steps=3, push_to_hub=True))


def test_sft_trainer_trains_the_tiny_model(tiny_model, tmp_path):
    trainer = moeforge.SFTTrainer(model=tiny_model, train_dataset=DATA,
                                  args=dict(output_dir=str(tmp_path / "sft"), max_steps=3, learning_rate=1e-3,
                                            per_device_train_batch_size=2, max_length=32, logging_steps=1),
                                  recipe=moeforge.Recipe.from_dict({"model": tiny_model, "data": {
                                      "train": DATA, "format": "tokens"}, "train": {"steps": 1},
                                      "out": str(tmp_path / "sft")}))
    result = trainer.train()
    assert [m.step for m in result.metrics] == [1, 2, 3]
    assert result.metrics[0].lr == pytest.approx(1e-3)
    assert os.path.exists(os.path.join(result.out_dir, "model.safetensors"))
