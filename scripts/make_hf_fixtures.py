#!/usr/bin/env python3
"""Builds the HF parity fixtures with `transformers` itself (run where it is installed).

For each case it writes tests/fixtures/hf/<case>/:
  model/            a tiny random Qwen3-MoE saved by save_pretrained (float32)
  batch.json        {"input_ids": [[...]], "labels": [[...]]}  (labels with -100 holes)
  expected.json     loss, ce_loss, aux_loss, grad_norm, the losses of 5 AdamW steps, the optimizer
                    settings used, and the transformers/torch versions
  expected.safetensors  logits [B, T, V] and every parameter gradient (float32, HF names)
The reference runs in float64 on the CPU, so the fixture is exact to ~1e-12 and our fp32 engine
is judged against the true values, not against another fp32 rounding.
"""
import argparse
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

CASES = {
    # norm_topk_prob on, one dense layer via mlp_only_layers, untied embeddings
    "norm_topk": dict(norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False),
    # norm_topk_prob off, every other layer dense via decoder_sparse_step, tied embeddings
    "no_norm_topk": dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2, tie_word_embeddings=True),
}

OPTIM = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GRAD_CLIP = 1.0
NUM_STEPS = 5


def make_case(name, overrides, out_dir):
    torch.manual_seed(1234)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, router_aux_loss_coef=0.02, output_router_logits=True,
        initializer_range=0.1, **overrides)
    # float64 reference: grouped_mm and sdpa kernels take no doubles, so use the eager paths.
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():  # norms away from 1 so their gradients matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(os.path.join(out_dir, "model"))

    B, T = 2, 24
    g = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    labels = input_ids.clone()
    labels[0, :5] = -100
    labels[1, 10:14] = -100
    labels[1, -1] = -100
    with open(os.path.join(out_dir, "batch.json"), "w") as f:
        json.dump({"input_ids": input_ids.tolist(), "labels": labels.tolist()}, f)

    model = model.double()
    model.train()
    out = model(input_ids=input_ids, labels=labels)
    loss = out.loss
    aux = out.aux_loss
    ce = loss - config.router_aux_loss_coef * aux
    loss.backward()
    grads = {n: p.grad.detach().float().contiguous() for n, p in model.named_parameters() if p.grad is not None}
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    tensors = {"logits": out.logits.detach().float().contiguous()}
    tensors.update({"grad." + n: t for n, t in grads.items()})
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))

    # 5 AdamW steps on the same batch, clipping by the global norm, from the same start.
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses, norms = [], []
    for _ in range(NUM_STEPS):
        opt.zero_grad(set_to_none=True)
        o = model(input_ids=input_ids, labels=labels)
        o.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        losses.append(float(o.loss))
        opt.step()

    expected = {
        "case": name, "loss": float(loss), "ce_loss": float(ce), "aux_loss": float(aux),
        "grad_norm": float(grad_norm), "tokens": int((labels[:, 1:] != -100).sum()),
        "adamw": {"lr": OPTIM["lr"], "betas": list(OPTIM["betas"]), "eps": OPTIM["eps"],
                  "weight_decay": OPTIM["weight_decay"], "grad_clip": GRAD_CLIP, "schedule": "constant"},
        "step_losses": losses, "step_grad_norms": norms,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "param_names": [n for n, _ in model.named_parameters()],
    }
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(name, json.dumps({k: expected[k] for k in ("loss", "ce_loss", "aux_loss", "grad_norm", "step_losses")}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/hf")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for name, overrides in CASES.items():
        make_case(name, overrides, os.path.join(args.out, name))


if __name__ == "__main__":
    main()
