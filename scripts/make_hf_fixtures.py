#!/usr/bin/env python3
"""Builds the HF parity fixtures with `transformers` itself (run where it is installed).

For each case it writes tests/fixtures/hf/<case>/:
  model/            a tiny random model of the case's family saved by save_pretrained (float32)
  batch.json        {"input_ids": [[...]], "labels": [[...]]}  (labels with -100 holes)
  expected.json     model_type, loss, ce_loss, aux_loss, grad_norm, the losses of 5 AdamW steps, the
                    optimizer settings used, and the transformers/torch versions
  expected.safetensors  logits [B, T, V] and every parameter gradient (float32, HF in-memory names,
                    e.g. "grad.model.layers.0.mlp.experts.gate_up_proj" [E, 2I, H])
The reference runs on the CPU with the model in float64, eager attention and eager experts. It is not
float64 throughout: HF itself computes the RMSNorms, the attention softmax, RoPE's cos/sin, the router
softmax (and so the routing weights), the aux-loss statistics and the cross-entropy (logits.float()) in
float32, so the expected values carry float32 rounding at those points (~1e-7 relative).

Families (model_type): qwen3_moe, mixtral, olmoe, qwen2_moe; the cases below pick one each.
Usage: python3 scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--cases norm_topk,mixtral,...]
It prints, per case, the tensors save_pretrained wrote (v5 writes the checkpoint layout: per-expert
matrices, and for Mixtral block_sparse_moe.* / w1 w2 w3, not the fused in-memory tensors).
"""
import argparse
import glob
import json
import os
import struct

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Settings every case shares: 3 layers, 4 heads of 16 (hidden 64), 2 KV heads, 8 experts, top-2.
COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    num_experts_per_tok=2, max_position_embeddings=256, router_aux_loss_coef=0.02, output_router_logits=True,
    initializer_range=0.1,
)
HEAD_DIM = 16

# Per family: config class, model class, and its own settings. A field not named keeps the family's
# default (rms_norm_eps, rope theta, head_dim where the family's config has none, ...), as a real
# checkpoint's config.json of that family would have it.
FAMILIES = {
    "qwen3_moe": dict(
        config=Qwen3MoeConfig, model=Qwen3MoeForCausalLM,
        settings=dict(intermediate_size=96, moe_intermediate_size=32, head_dim=HEAD_DIM, num_experts=8,
                      rms_norm_eps=1e-6, rope_theta=10000.0)),
    # Every layer sparse (Mixtral has no dense layer); intermediate_size is the per-expert width.
    # num_local_experts is the field (num_experts is an alias); head_dim stays None (-> hidden / heads).
    "mixtral": dict(
        config=MixtralConfig, model=MixtralForCausalLM,
        settings=dict(intermediate_size=32, num_local_experts=8, sliding_window=None, router_jitter_noise=0.0)),
    # Every layer sparse; intermediate_size is the per-expert width; QK-norm over the whole projection.
    # pad_token_id keeps OLMoE's default 1 (embedding row 1 starts at zero and gets no gradient in HF);
    # eos_token_id's default 50279 lies outside the tiny vocabulary, so it is dropped.
    "olmoe": dict(
        config=OlmoeConfig, model=OlmoeForCausalLM,
        settings=dict(intermediate_size=32, num_experts=8, norm_topk_prob=False, clip_qkv=None, eos_token_id=None)),
    # Shared expert (sigmoid-gated) in every sparse layer; q/k/v biases (qkv_bias defaults to True).
    "qwen2_moe": dict(
        config=Qwen2MoeConfig, model=Qwen2MoeForCausalLM,
        settings=dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, use_sliding_window=False)),
}

# case -> (family, overrides)
CASES = {
    # norm_topk_prob on, one dense layer via mlp_only_layers, untied embeddings
    "norm_topk": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                                    tie_word_embeddings=False)),
    # norm_topk_prob off, every other layer dense via decoder_sparse_step, tied embeddings
    "no_norm_topk": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2,
                                       tie_word_embeddings=True)),
    # Mixtral always renormalises its top-k weights (no norm_topk_prob switch)
    "mixtral": ("mixtral", dict(tie_word_embeddings=False)),
    "olmoe": ("olmoe", dict(tie_word_embeddings=False)),
    # one dense layer (intermediate_size 96) via mlp_only_layers, untied, no top-k renormalisation
    "qwen2_moe": ("qwen2_moe", dict(norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
                                    tie_word_embeddings=False)),
    # layer 1 the only sparse one (decoder_sparse_step 2), renormalised top-k, tied embeddings
    "qwen2_moe_tied": ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=2,
                                         tie_word_embeddings=True)),
}

OPTIM = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GRAD_CLIP = 1.0
NUM_STEPS = 5


def build_config(family, overrides):
    fam = FAMILIES[family]
    kwargs = dict(COMMON)
    for part in (fam["settings"], overrides):
        clash = set(kwargs) & set(part)
        assert not clash, f"{family}: settings given twice: {sorted(clash)}"
        kwargs.update(part)
    config = fam["config"](**kwargs)
    assert config.model_type == family, (config.model_type, family)
    # float64 reference: grouped_mm and sdpa kernels take no doubles, so use the eager paths. All four
    # families' experts classes carry @use_experts_implementation in v5, and "eager" selects their
    # own per-expert loop; "eager" attention is eager_attention_forward.
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    return config


def check_model(name, model):
    cfg = model.config
    assert cfg._attn_implementation == "eager", cfg._attn_implementation
    assert cfg._experts_implementation == "eager", cfg._experts_implementation
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if callable(can_set) and not can_set():
        # No switch in this family's modeling file: its experts always run their own forward.
        print(f"{name}: note: {type(model).__name__} has no experts-implementation switch")
    layers = model.model.layers
    head_dims = {layer.self_attn.head_dim for layer in layers}
    assert head_dims == {HEAD_DIM}, head_dims
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    assert sparse, "no sparse layer"
    return sparse


def read_safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def print_disk_layout(name, model_dir):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    assert files, f"no safetensors under {model_dir}"
    for path in files:
        header = read_safetensors_header(path)
        print(f"{name}: {os.path.relpath(path, os.path.dirname(model_dir))}: {len(header)} tensors")
        for key in sorted(header):
            print(f"  {key} {header[key]['shape']} {header[key]['dtype']}")


def make_case(name, family, overrides, out_dir):
    torch.manual_seed(1234)
    config = build_config(family, overrides)
    model = FAMILIES[family]["model"](config).float()
    sparse = check_model(name, model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # norms away from 1 so their gradients matter
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith(".bias"):  # biases start at zero; make them matter too
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(out_dir, exist_ok=True)
    model_dir = os.path.join(out_dir, "model")
    model.save_pretrained(model_dir)
    print(f"{name}: model_type {config.model_type}, sparse layers {sparse}, "
          f"tied {bool(config.tie_word_embeddings)}")
    print_disk_layout(name, model_dir)

    B, T = 2, 24
    g = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    # A row that starts with the padding token (nn.Embedding(padding_idx) keeps its row at zero) has an
    # all-zero hidden state in every layer, so its router probabilities tie exactly (1/E each) and the
    # experts it is counted for in the aux loss are whatever torch.topk's implementation returns for ties
    # (in the float64 aux, not necessarily those of the float32 forward). Such a row cannot occur in real
    # data; the padding token stays elsewhere in the batch, where its gradient rule is still exercised.
    pad = getattr(config, "pad_token_id", None)
    if pad is not None:
        input_ids[:, 0][input_ids[:, 0] == pad] = (pad + 1) % config.vocab_size
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
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"{name}: parameters without a gradient: {missing}"
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
        "case": name, "model_type": config.model_type,
        "loss": float(loss), "ce_loss": float(ce), "aux_loss": float(aux),
        "grad_norm": float(grad_norm), "tokens": int((labels[:, 1:] != -100).sum()),
        "adamw": {"lr": OPTIM["lr"], "betas": list(OPTIM["betas"]), "eps": OPTIM["eps"],
                  "weight_decay": OPTIM["weight_decay"], "grad_clip": GRAD_CLIP, "schedule": "constant"},
        "step_losses": losses, "step_grad_norms": norms,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "param_names": [n for n, _ in model.named_parameters()],
    }
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(name, json.dumps({k: expected[k] for k in ("model_type", "loss", "ce_loss", "aux_loss", "grad_norm",
                                                     "step_losses")}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/hf")
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated subset of: " + ", ".join(CASES) + " (default: all)")
    args = ap.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    torch.use_deterministic_algorithms(True)
    for name in names:
        family, overrides = CASES[name]
        make_case(name, family, overrides, os.path.join(args.out, name))


if __name__ == "__main__":
    main()
