"""GPU ops from Python (the GPU machine: torch tensors through DLPack, on torch's current stream)
against the same ops on the CPU, fed the same bf16-rounded inputs. Each skips, saying why, where
there is no CUDA device (or no CUDA build) or no torch."""

import numpy as np
import pytest

import moeforge
from moeforge import ops

pytestmark = pytest.mark.skipif(not ops.has_cuda(), reason="no CUDA device (or moeforge built without CUDA)")


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the GPU tests allocate device memory with torch")


def context(torch):
    return moeforge.Context(device=torch.cuda.current_device(), stream=torch.cuda.current_stream().cuda_stream)


def to_gpu_bf16(torch, a):
    """a on the GPU in bf16, and its bf16-rounded values back in fp32 on the host."""
    t = torch.from_numpy(np.ascontiguousarray(a, np.float32)).to("cuda", torch.bfloat16)
    return t, t.float().cpu().numpy()


def test_clamped_swiglu_on_the_gpu_matches_the_cpu(torch):
    rng = np.random.default_rng(0)
    h_gpu, h = to_gpu_bf16(torch, rng.standard_normal((33, 2 * 40)) * 8)
    out_gpu = torch.empty((33, 40), device="cuda", dtype=torch.bfloat16)
    dy_gpu, dy = to_gpu_bf16(torch, rng.standard_normal((33, 40)))
    dh_gpu = torch.empty_like(h_gpu)
    ctx = context(torch)
    ops.clamped_swiglu_forward(out_gpu, h_gpu, ctx=ctx)
    ops.clamped_swiglu_backward(dh_gpu, dy_gpu, h_gpu, ctx=ctx)
    torch.cuda.synchronize()
    ref, dref = np.zeros((33, 40), np.float32), np.zeros((33, 80), np.float32)
    ops.clamped_swiglu_forward(ref, h)
    ops.clamped_swiglu_backward(dref, dy, h)
    np.testing.assert_allclose(out_gpu.float().cpu().numpy(), ref, rtol=1e-2, atol=1e-2)  # one bf16 rounding
    np.testing.assert_allclose(dh_gpu.float().cpu().numpy(), dref, rtol=1e-2, atol=1e-2)


def test_permute_with_ep_sentinels_is_the_cpus_bit_for_bit(torch):
    rng = np.random.default_rng(1)
    N, K, E = 37, 4, 8
    topk = rng.integers(0, E + 3, (N, K)).astype(np.int32)  # experts >= E: another rank's
    outs_cpu = [np.zeros(E + 1, np.int32), np.zeros(N * K, np.int32), np.zeros(N * K, np.int32)]
    ops.moe_permute_indices(*outs_cpu, topk, E)
    outs_gpu = [torch.zeros(a.shape, dtype=torch.int32, device="cuda") for a in outs_cpu]
    ops.moe_permute_indices(*outs_gpu, torch.from_numpy(topk).cuda(), E, ctx=context(torch))
    torch.cuda.synchronize()
    for cpu, gpu in zip(outs_cpu, outs_gpu):
        np.testing.assert_array_equal(gpu.cpu().numpy(), cpu)


def test_grouped_gemm_on_the_gpu_matches_the_cpu(torch):
    rng = np.random.default_rng(2)
    E, M, C, OC = 4, 50, 64, 32
    offsets = np.array([0, 20, 20, 41, 50], np.int32)  # an empty expert, ragged groups
    x_gpu, x = to_gpu_bf16(torch, rng.standard_normal((M, C)))
    w_gpu, w = to_gpu_bf16(torch, rng.standard_normal((E, OC, C)) * 0.1)
    out_gpu = torch.empty((M, OC), device="cuda", dtype=torch.bfloat16)
    ops.grouped_gemm_forward(out_gpu, x_gpu, w_gpu, torch.from_numpy(offsets).cuda(), ctx=context(torch))
    torch.cuda.synchronize()
    ref = np.zeros((M, OC), np.float32)
    ops.grouped_gemm_forward(ref, x, w, offsets)
    np.testing.assert_allclose(out_gpu.float().cpu().numpy(), ref, rtol=2e-2, atol=2e-2)  # bf16 output rounding


def test_engine_on_the_gpu_shares_its_parameters_with_torch_and_resumes(torch, tmp_path):
    """The engine on CUDA from Python: a parameter is a CUDA tensor in torch through DLPack (the same
    memory: a write through torch is what the engine trains on, and the view follows its update); a
    checkpoint resumes; a finished run refuses one more step with the engine's message."""
    import subprocess

    from conftest import REPO

    base = str(tmp_path / "base")
    subprocess.run([moeforge.binary(), "init", "--arch", "qwen3_moe", "--preset", "tiny", "--seed", "7", "--out",
                    base], check=True, capture_output=True)
    recipe = moeforge.Recipe.from_file(f"{REPO}/demo/tiny_tokens.yaml", model=base,
                                       data__train=f"{REPO}/demo/data/tokens.jsonl", out=str(tmp_path / "o"),
                                       train__steps=4, train__seq_len=32, train__micro_batch=2,
                                       optim__warmup_steps=0, device="cuda")
    with moeforge.Engine(recipe) as engine:
        p = torch.from_dlpack(engine.parameter("model.embed_tokens.weight"))
        assert p.is_cuda and p.dtype == torch.bfloat16
        p[1, 2] = 12.5
        assert torch.from_dlpack(engine.parameter("model.embed_tokens.weight"))[1, 2].item() == 12.5
        before = p.clone()
        engine.step()
        assert not torch.equal(p, before), "the view follows the engine's update"
        engine.step()
        engine.save_checkpoint()
    del p, before  # (a live view keeps the engine, and OUT's lock, alive)
    with moeforge.Engine(recipe, resume="auto") as engine:
        assert engine.steps_done == 2
        assert [m.step for m in engine.run()] == [3, 4]
        with pytest.raises(moeforge.InvalidArgumentError, match="no step is left"):
            engine.step()
