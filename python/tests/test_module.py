"""The module builds and imports without torch, and bad arguments raise Python exceptions carrying
the C++ message."""

import os
import subprocess
import sys

import numpy as np
import pytest

import moeforge
from moeforge import ops


def test_imports_without_torch():
    # torch made unimportable: `import moeforge` must not need it, nor load it.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import moeforge, moeforge.ops\n"
            "assert sys.modules['torch'] is None\n"
            "print(moeforge.API_VERSION)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == moeforge._native.api_version() >= 1


def test_bad_arguments_raise_with_the_engine_message():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(moeforge.InvalidArgumentError, match=r"mf_rmsnorm_forward: out is \[4, 3\], expected \[3, 4\]"):
        ops.rmsnorm_forward(np.empty((4, 3), np.float32), np.empty(3, np.float32), x, np.ones(4, np.float32), 1e-6)
    with pytest.raises(moeforge.InvalidArgumentError, match="inp .* is not contiguous"):
        ops.rmsnorm_forward(np.empty((4, 3), np.float32), np.empty(4, np.float32), x.T, np.ones(3, np.float32), 1e-6)
    with pytest.raises(moeforge.InvalidArgumentError, match="out is float64|out is f64"):
        ops.swiglu_forward(np.empty((2, 2)), np.ones((2, 4), np.float32))
    # A message from the ops layer itself, through the same path.
    with pytest.raises(ValueError, match=r"clamped_swiglu_forward: inp \[1, 6\] must be \[N, 2I\]"):
        ops.clamped_swiglu_forward(np.empty((1, 4), np.float32), np.ones((1, 6), np.float32))
    with pytest.raises(moeforge.InvalidArgumentError, match="required"):
        ops.swiglu_forward(None, x)
    with pytest.raises(moeforge.InvalidArgumentError, match="neither a DLPack array"):
        ops.swiglu_forward([1.0, 2.0], x)


def test_recipe_and_file_errors_are_typed():
    with pytest.raises(moeforge.IoError, match="/nonexistent/recipe.yaml"):
        moeforge.Engine("/nonexistent/recipe.yaml")
    with pytest.raises(moeforge.InvalidArgumentError, match="bogus"):
        moeforge.Engine(moeforge.Recipe.from_dict({"model": "m", "data": {"train": "d"}, "train": {"steps": 1},
                                                   "out": "o", "bogus": 1}))
    with pytest.raises(moeforge.InvalidArgumentError, match="train.steps"):
        moeforge.Engine(moeforge.Recipe.from_dict({"model": "m", "data": {"train": "d"}, "train": {"steps": 1},
                                                   "out": "o"}), train__steps=-3)


@pytest.mark.skipif(moeforge.ops.has_cuda(), reason="a CUDA device is present: these made-up pointers would be used")
def test_cuda_tensors_without_a_gpu_are_refused_by_kind():
    t = moeforge.RawTensor(0x1000, "bfloat16", [2, 4], "cuda")
    out = moeforge.RawTensor(0x2000, "bfloat16", [2, 2], "cuda")
    if moeforge.ops.built_with_cuda():
        with pytest.raises(moeforge.CudaError, match="CUDA error"):  # a CUDA build on a machine without a GPU
            ops.swiglu_forward(out, t)
    else:
        with pytest.raises(moeforge.UnsupportedError, match="without CUDA"):
            ops.swiglu_forward(out, t)
