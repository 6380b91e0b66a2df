# The fused loss backward's scaling of (dh, dw) by dloss: the plain products against one
# torch._foreach_mul, bitwise and in time, at D1's shapes (P1: 8192 tokens, H 2048, V 151936).
# Usage (GPU machine, torch): python3 scale.py
import torch
torch.manual_seed(0)
dw = torch.randn(151936, 2048, device="cuda", dtype=torch.bfloat16)
dh = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
def old(dh, dw, dl):
    return dh * dl.to(dh.dtype), dw * dl.to(dw.dtype)
def new(dh, dw, dl):
    return tuple(torch._foreach_mul([dh, dw], dl.to(dw.dtype)))
cnew = torch.compile(new, fullgraph=True)
for v in (1.0, 0.25, 1 / 3, 0.0, 3.7):
    dl = torch.tensor(v, device="cuda")
    a, b, c = old(dh, dw, dl), new(dh, dw, dl), cnew(dh, dw, dl)
    print(f"dloss {v:.4f}: foreach == mul: {all(torch.equal(x, y) for x, y in zip(a, b))}, compiled == mul: {all(torch.equal(x, y) for x, y in zip(a, c))}", flush=True)
def t(fn, n=20):
    dl = torch.tensor(1.0, device="cuda")
    for _ in range(3): fn(dh, dw, dl)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn(dh, dw, dl)
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3
print(f"per call (dh [8192, 2048] and dw [151936, 2048] bf16): mul {t(old):.1f} us, _foreach_mul {t(new):.1f} us, compiled foreach {t(cnew):.1f} us", flush=True)
