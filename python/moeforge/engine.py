"""The engine from Python: `moeforge finetune`'s job, step by step (the C++ trainer the CLI runs,
through the C API), with metrics as Python objects and zero-copy views of the parameters."""

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from . import _native


def _yaml_scalar(value: Any) -> str:
    """A recipe value as the YAML the recipe parser reads: JSON scalars and arrays are valid flow YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str, list, tuple)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, os.PathLike):
        return json.dumps(os.fspath(value))
    raise TypeError(f"recipe value {value!r}: expected a bool, number, string or list")


def _override(key: str, value: Any) -> str:
    """key=value as `moeforge finetune` takes it; a Python keyword spells the dots as '__'
    (train__steps=4 is train.steps=4)."""
    return f"{key.replace('__', '.')}={_yaml_scalar(value)}"


class Recipe:
    """A training recipe: a YAML file, YAML text or a dict (nested as the file is), plus key=value
    overrides applied in order, exactly as `moeforge finetune RECIPE key=value ...` applies them.
    Relative paths of a file resolve from its directory; those of text or a dict from base_dir
    (default: the current directory)."""

    def __init__(self, source: Union[str, os.PathLike], *, is_text: bool = False, base_dir: Optional[str] = None,
                 overrides: Sequence[str] = ()):
        self.source = os.fspath(source)
        self.is_text = is_text
        self.base_dir = os.fspath(base_dir) if base_dir is not None else (os.getcwd() if is_text else "")
        self.overrides = list(overrides)

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], **overrides: Any) -> "Recipe":
        return cls(path).with_overrides(**overrides)

    @classmethod
    def from_text(cls, text: str, base_dir: Optional[str] = None, **overrides: Any) -> "Recipe":
        return cls(text, is_text=True, base_dir=base_dir).with_overrides(**overrides)

    @classmethod
    def from_dict(cls, recipe: Mapping[str, Any], base_dir: Optional[str] = None, **overrides: Any) -> "Recipe":
        def lines(d: Mapping[str, Any], indent: str) -> List[str]:
            out = []
            for key, value in d.items():
                if isinstance(value, Mapping):
                    out.append(f"{indent}{key}:")
                    out.extend(lines(value, indent + "  "))
                else:
                    out.append(f"{indent}{key}: {_yaml_scalar(value)}")
            return out

        return cls.from_text("\n".join(lines(recipe, "")) + "\n", base_dir=base_dir, **overrides)

    def with_overrides(self, overrides: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> "Recipe":
        """A copy with more overrides: a mapping {"train.steps": 4} and/or keywords train__steps=4."""
        extra = [_override(k, v) for k, v in (overrides or {}).items()] + [_override(k, v) for k, v in kwargs.items()]
        return Recipe(self.source, is_text=self.is_text, base_dir=self.base_dir or None,
                      overrides=self.overrides + extra)

    def __repr__(self) -> str:
        what = "text" if self.is_text else repr(self.source)
        return f"Recipe({what}, overrides={self.overrides!r})"


def _as_recipe(recipe: Union["Recipe", str, os.PathLike, Mapping[str, Any]]) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Mapping):
        return Recipe.from_dict(recipe)
    return Recipe(recipe)


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, as the CLI logs it (and writes to OUT/metrics.jsonl)."""

    step: int
    loss: float
    ce_loss: float
    aux_loss: float
    grad_norm: float
    lr: float
    tokens: int
    tokens_per_s: float
    peak_mem_gib: float
    step_seconds: float
    skipped: bool
    val_loss: Optional[float]


class Engine:
    """`moeforge finetune` from Python, step by step: opening one sets the run up as the CLI does
    (OUT checked and locked, model and data loaded; resume="auto" or a checkpoint directory
    continues a run), step() runs one optimizer step and records it as the CLI does (metrics.jsonl,
    log line, evaluation, checkpoints when due), export() writes the HF directory. The GIL is
    released while a step runs. Under a multi-process launch every rank opens its own engine.
    Closing it (or leaving a `with` block) releases OUT."""

    def __init__(self, recipe: Union[Recipe, str, os.PathLike, Mapping[str, Any]], *, resume: Optional[str] = None,
                 force_resume: bool = False, **overrides: Any):
        r = _as_recipe(recipe).with_overrides(**overrides)
        self.recipe = r
        self._engine = _native.Engine(r.source, r.is_text, r.base_dir, r.overrides, resume or "", force_resume)

    # --- progress
    @property
    def steps_done(self) -> int:
        return self._native().progress()[0]

    @property
    def total_steps(self) -> int:
        return self._native().progress()[1]

    @property
    def interrupted_by(self) -> int:
        """The signal that stopped the run (SIGINT/SIGTERM handled by the engine), else 0."""
        return self._native().progress()[2]

    @property
    def finished(self) -> bool:
        done, total, interrupted = self._native().progress()
        return done >= total or interrupted != 0

    # --- the job
    def step(self) -> StepMetrics:
        return StepMetrics(**self._native().step())

    def run(self, on_step: Optional[Callable[[StepMetrics], None]] = None) -> List[StepMetrics]:
        """Steps to train.steps. A KeyboardInterrupt between steps saves a checkpoint first (as the
        CLI does on SIGINT), then propagates: Engine(..., resume="auto") continues the run."""
        metrics = []
        try:
            while not self.finished:
                m = self.step()
                metrics.append(m)
                if on_step is not None:
                    on_step(m)
        except KeyboardInterrupt:
            self.save_checkpoint()
            raise
        return metrics

    def save_checkpoint(self) -> None:
        self._native().save_checkpoint()

    def export(self) -> str:
        """Writes the HF model directory into OUT; returns OUT."""
        return self._native().export()

    def recipe_json(self) -> Dict[str, Any]:
        """The recipe as resolved (every key, defaults filled in), as OUT/recipe.json holds it."""
        return json.loads(self._native().recipe_json())

    # --- parameters
    def parameter_names(self) -> List[str]:
        return self._native().param_names()

    def parameter(self, name: str, gradient: bool = False):
        """A zero-copy view of the live parameter or gradient `name` (HF names; stacked experts as
        the engine holds them): DLPack (numpy.from_dlpack gives a read-only array, torch.from_dlpack
        a tensor) and, on the CPU, the buffer protocol (numpy.asarray: writable). The engine's memory
        lives while any view or array of it does. Gradients are zeroed after each optimizer step."""
        return self._native().param(name, gradient)

    def parameters(self, gradient: bool = False) -> Dict[str, Any]:
        """{HF name: writable numpy array} sharing the engine's memory (CPU runs; numpy needed)."""
        import numpy as np

        return {name: np.asarray(self.parameter(name, gradient)) for name in self.parameter_names()}

    # --- lifetime
    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _native(self):
        if self._engine is None:
            raise ValueError("the engine is closed")
        return self._engine


@dataclasses.dataclass(frozen=True)
class FinetuneResult:
    out_dir: str  # the HF model directory ("" when the run was interrupted before the export)
    metrics: List[StepMetrics]
    interrupted_by: int = 0


def finetune(recipe: Union[Recipe, str, os.PathLike, Mapping[str, Any]], *, resume: Optional[str] = None,
             force_resume: bool = False, on_step: Optional[Callable[[StepMetrics], None]] = None,
             **overrides: Any) -> FinetuneResult:
    """`moeforge finetune RECIPE key=value ...` in this process: the run to its last step, then the
    export. Overrides as keywords, dots spelled '__' (train__steps=10), or via Recipe.with_overrides."""
    with Engine(recipe, resume=resume, force_resume=force_resume, **overrides) as engine:
        metrics = engine.run(on_step)
        if engine.interrupted_by != 0:
            return FinetuneResult("", metrics, engine.interrupted_by)
        return FinetuneResult(engine.export(), metrics)
