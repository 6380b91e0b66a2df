"""Shared fixtures of the Python tests. ctest runs them (label cpu) with PYTHONPATH at the build's
assembled package and MOEFORGE_REPO at the source tree; run by hand:
    PYTHONPATH=build/python /usr/bin/python3 -m pytest python/tests"""

import os
import subprocess

import numpy as np
import pytest

import moeforge

REPO = os.environ.get("MOEFORGE_REPO") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def close_by_rule(got, ref64, naive32, floor=1e-6, what=""):
    """CONVENTIONS.md's rule for GEMMs, reductions and attention: the error against the fp64
    reference is at most twice that of the same computation done naively in fp32, plus a rounding
    floor scaled by the reference's magnitude."""
    got, ref64, naive32 = (np.asarray(a, dtype=np.float64) for a in (got, ref64, naive32))
    assert got.shape == ref64.shape, what
    scale = max(1.0, float(np.max(np.abs(ref64)))) if ref64.size else 1.0
    bound = 2 * np.abs(naive32 - ref64) + floor * scale
    worst = np.max(np.abs(got - ref64) - bound) if got.size else 0.0
    assert worst <= 0, f"{what}: error exceeds 2x the naive fp32 error + floor by {worst}"


def close_elementwise(got, ref64, rtol=2e-6, atol=1e-7, what=""):
    """Elementwise ops in fp32 (CONVENTIONS.md's per-dtype table: fp32 ~ a few ulp)."""
    np.testing.assert_allclose(np.asarray(got, np.float64), ref64, rtol=rtol, atol=atol, err_msg=what)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Qwen3-MoE of `moeforge init --preset tiny`, as the demo makes it."""
    out = tmp_path_factory.mktemp("tiny") / "base"
    subprocess.run([moeforge.binary(), "init", "--arch", "qwen3_moe", "--preset", "tiny", "--seed", "7", "--out",
                    str(out)], check=True, capture_output=True)
    return str(out)
