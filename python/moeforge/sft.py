"""An SFTTrainer-like facade: Hugging Face TrainingArguments / TRL SFTConfig names mapped onto
recipe keys, the rest refused by name, then the engine's fine-tune.

    trainer = moeforge.SFTTrainer(model="runs/base", train_dataset="chats.jsonl",
                                  args=dict(output_dir="runs/sft", max_steps=100, learning_rate=2e-5))
    result = trainer.train()

`args` is a mapping or a TrainingArguments-like object (a dataclass: only its fields that differ
from their defaults count, as HF leaves the rest alone); keywords add to it."""

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Union

from .engine import FinetuneResult, Recipe, finetune
from .errors import InvalidArgumentError

# Names whose value carries over one to one: HF name -> recipe key.
_DIRECT = {
    "learning_rate": "optim.lr",
    "per_device_train_batch_size": "train.micro_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "warmup_steps": "optim.warmup_steps",
    "weight_decay": "optim.weight_decay",
    "adam_epsilon": "optim.eps",
    "max_grad_norm": "train.grad_clip",
    "seed": "seed",
    "output_dir": "out",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "logging_steps": "train.log_every",
    "eval_steps": "eval.every",
    "per_device_eval_batch_size": "eval.micro_batch",
    "max_length": "train.seq_len",  # TRL SFTConfig
    "max_seq_length": "train.seq_len",  # TRL < 0.20
    "packing": "data.packing",  # TRL SFTConfig
}
# gradient_checkpointing=True: recompute each layer in the backward (train.recompute: full).
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
# Names mapped by the code below (a value to convert, or one that moeforge refuses with a reason).
_HANDLED = {"gradient_checkpointing", "max_steps", "num_train_epochs", "warmup_ratio", "adam_beta1", "adam_beta2", "lr_scheduler_type", "bf16",
            "fp16", "optim", "report_to", "save_strategy"}
# Names that change nothing in a moeforge run (bookkeeping of HF's Trainer); accepted and ignored.
_IGNORED = {"do_train", "overwrite_output_dir", "logging_dir", "run_name", "disable_tqdm", "remove_unused_columns",
            "dataloader_num_workers", "logging_strategy", "eval_strategy", "evaluation_strategy"}


def _given(args: Any) -> Dict[str, Any]:
    """The settings a caller gave: a mapping as is, a dataclass's fields that differ from their defaults."""
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return dict(args)
    if dataclasses.is_dataclass(args):
        out = {}
        for f in dataclasses.fields(args):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            value = getattr(args, f.name)
            if default is dataclasses.MISSING or value != default:
                out[f.name] = value
        return out
    raise InvalidArgumentError(f"args: a {type(args).__name__} is neither a mapping nor a TrainingArguments-like "
                               "dataclass")


def recipe_overrides_from_training_args(args: Any) -> Dict[str, Any]:
    """Recipe overrides {"optim.lr": 2e-5, ...} from TrainingArguments names; any name without a
    recipe key (or a value moeforge does not support) raises InvalidArgumentError naming it."""
    given = _given(args)
    out: Dict[str, Any] = {}
    known = set(_DIRECT) | _HANDLED | _IGNORED
    unknown = sorted(k for k in given if k not in known and given[k] not in (None, False))
    if unknown:
        raise InvalidArgumentError(
            "TrainingArguments " + ", ".join(unknown) + (" has" if len(unknown) == 1 else " have") +
            " no moeforge recipe key (supported: " + ", ".join(sorted(set(_DIRECT) | _HANDLED)) + ")")
    for name, key in _DIRECT.items():
        if given.get(name) is not None:
            out[key] = given[name]
    if "save_steps" in given and given.get("save_strategy", "steps") in ("no", "epoch"):
        out.pop("checkpoint.every")
    max_steps = given.get("max_steps", -1)
    if max_steps is not None and max_steps > 0:
        out["train.steps"] = int(max_steps)  # as in HF, max_steps wins over num_train_epochs
    elif "num_train_epochs" in given:
        raise InvalidArgumentError("TrainingArguments num_train_epochs: moeforge recipes count optimizer steps "
                                   "(train.steps); give max_steps instead")
    if "adam_beta1" in given or "adam_beta2" in given:
        out["optim.betas"] = [given.get("adam_beta1", 0.9), given.get("adam_beta2", 0.999)]
    if given.get("lr_scheduler_type") is not None:
        kind = str(getattr(given["lr_scheduler_type"], "value", given["lr_scheduler_type"]))
        if kind not in _SCHEDULES:
            raise InvalidArgumentError(f"TrainingArguments lr_scheduler_type {kind!r}: moeforge schedules are "
                                       + ", ".join(sorted(_SCHEDULES)))
        if kind == "constant" and given.get("warmup_steps", 0) or kind == "constant" and given.get("warmup_ratio", 0):
            raise InvalidArgumentError("TrainingArguments lr_scheduler_type 'constant' has no warmup in HF; use "
                                       "'constant_with_warmup' with warmup_steps or warmup_ratio")
        out["optim.schedule"] = _SCHEDULES[kind]
    if given.get("warmup_ratio"):
        if "train.steps" not in out:
            raise InvalidArgumentError("TrainingArguments warmup_ratio needs max_steps (the step count it is a ratio of)")
        out["optim.warmup_steps"] = math.ceil(out["train.steps"] * given["warmup_ratio"])  # HF's rounding
    if given.get("gradient_checkpointing"):
        out["train.recompute"] = "full"
    if given.get("fp16"):
        raise InvalidArgumentError("TrainingArguments fp16: moeforge computes in bf16 on GPUs (bf16=True)")
    if given.get("bf16"):
        out["precision"] = "mixed"  # HF's bf16 flag: bf16 compute over fp32 weights and optimizer state
    optim = given.get("optim")
    if optim is not None and str(getattr(optim, "value", optim)) not in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
        raise InvalidArgumentError(f"TrainingArguments optim {optim!r}: moeforge runs torch.optim.AdamW (adamw_torch)")
    report_to = given.get("report_to")
    reports = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for target in reports:
        if target == "tensorboard":
            out["log.tensorboard"] = True
        elif target not in ("none", "all"):
            raise InvalidArgumentError(f"TrainingArguments report_to {target!r}: moeforge writes metrics.jsonl and "
                                       "TensorBoard events (report_to='tensorboard')")
    return out


class SFTTrainer:
    """Supervised fine-tuning with TRL's SFTTrainer's names, run by moeforge's engine.

    model: an HF model directory; train_dataset / eval_dataset: JSONL files in a format the recipe
    reads (messages, prompt/completion, text, tokens); args: TrainingArguments names (mapping or
    dataclass); recipe: an optional base recipe (file, text, dict or Recipe) the rest overrides."""

    def __init__(self, model: str, train_dataset: str, args: Any = None, eval_dataset: Optional[str] = None,
                 recipe: Union[Recipe, str, Mapping[str, Any], None] = None, **training_args: Any):
        given = _given(args)
        given.update(training_args)
        self.overrides = recipe_overrides_from_training_args(given)
        self.overrides["model"] = model
        self.overrides["data.train"] = train_dataset
        if eval_dataset is not None:
            self.overrides["eval.data"] = eval_dataset
        if "out" not in self.overrides:
            raise InvalidArgumentError("SFTTrainer: output_dir is required (where the model is written)")
        if recipe is None:
            if "train.steps" not in self.overrides:
                raise InvalidArgumentError("SFTTrainer: max_steps is required (or a base recipe with train.steps)")
            recipe = Recipe.from_dict({"model": model, "data": {"train": train_dataset},
                                       "train": {"steps": self.overrides["train.steps"]},
                                       "out": self.overrides["out"]})
        self.recipe = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe) if isinstance(
            recipe, Mapping) else Recipe(recipe)

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None) -> FinetuneResult:
        """The fine-tune; resume_from_checkpoint=True continues from the newest checkpoint in output_dir."""
        resume = "auto" if resume_from_checkpoint is True else (resume_from_checkpoint or None)
        return finetune(self.recipe.with_overrides(self.overrides), resume=resume)
