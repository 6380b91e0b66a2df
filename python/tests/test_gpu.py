"""GPU ops from Python (the GPU machine: torch tensors through DLPack on the current stream): each
skips, saying why, where there is no CUDA device, no CUDA build or no torch."""

import numpy as np
import pytest

import moeforge
from moeforge import ops

pytestmark = pytest.mark.skipif(not ops.has_cuda(), reason="no CUDA device (or moeforge built without CUDA)")


def test_clamped_swiglu_on_the_gpu_matches_the_cpu():
    torch = pytest.importorskip("torch", reason="the GPU tests allocate device memory with torch")
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((33, 2 * 40)) * 8).astype(np.float32)
    h_gpu = torch.from_numpy(h).to("cuda", torch.bfloat16)
    h_rounded = h_gpu.float().cpu().numpy()
    out_gpu = torch.empty((33, 40), device="cuda", dtype=torch.bfloat16)
    ctx = moeforge.Context(device=torch.cuda.current_device(), stream=torch.cuda.current_stream().cuda_stream)
    ops.clamped_swiglu_forward(out_gpu, h_gpu, ctx=ctx)
    torch.cuda.synchronize()
    ref = np.zeros((33, 40), np.float32)
    ops.clamped_swiglu_forward(ref, h_rounded)
    np.testing.assert_allclose(out_gpu.float().cpu().numpy(), ref, rtol=1e-2, atol=1e-2)  # one bf16 rounding
