"""moeforge from Python: the fine-tuning engine (Engine, Recipe, finetune, launch, SFTTrainer), a
model directory's weights (Weights) and its ops (moeforge.ops), over moeforge's C API. No framework
is needed: arrays are passed as DLPack objects (numpy arrays, torch tensors), capsules or RawTensor
pointers; `import moeforge` works without torch."""

from . import _native
from .errors import CudaError, Error, InternalError, InvalidArgumentError, IoError, UnsupportedError

_native.set_error_classes(InvalidArgumentError, UnsupportedError, CudaError, IoError, InternalError)

from . import ops  # noqa: E402  (after the error classes are known to the extension)
from .engine import Engine, FinetuneResult, Recipe, StepMetrics, finetune  # noqa: E402
from .launcher import binary, launch  # noqa: E402
from .sft import SFTTrainer, recipe_overrides_from_training_args  # noqa: E402
from .weights import Weights  # noqa: E402

API_VERSION = _native.API_VERSION
RawTensor = _native.RawTensor
Context = _native.Context

__all__ = [
    "API_VERSION", "Context", "CudaError", "Engine", "Error", "FinetuneResult", "InternalError",
    "InvalidArgumentError", "IoError", "RawTensor", "Recipe", "SFTTrainer", "StepMetrics", "UnsupportedError",
    "Weights", "binary", "finetune", "launch", "ops", "recipe_overrides_from_training_args",
]
