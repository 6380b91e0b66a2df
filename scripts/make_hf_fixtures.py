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

Families (model_type): qwen3_moe, mixtral, olmoe, qwen2_moe, nemotron_h; the cases below pick one each.
nemotron_h (hybrid Mamba-2 / MoE / attention / dense MLP, no aux loss: aux_loss is written as 0) is
built by make_nemotron_h_case: HF's Mamba-2 torch fallback (mamba2_chunk_scan's torch body) is the path that
runs (asserted, recorded in expected.json under "nemotron_h"), a float32 run on the GPU (when there is one)
is recorded beside the float64 reference, and model_hub/ holds the same weights in the Hub's layout
(backbone. prefix, hybrid_override_pattern, bare Infinity) which HF is checked to load to the same loss
(its model.safetensors is a symlink to model/'s when save_pretrained wrote the same bytes, as 5.17 does).
Usage: python3 scripts/make_hf_fixtures.py [--out tests/fixtures/hf] [--cases norm_topk,mixtral,...]
It prints, per case, the tensors save_pretrained wrote (v5 writes the checkpoint layout: per-expert
matrices, and for Mixtral block_sparse_moe.* / w1 w2 w3, not the fused in-memory tensors).
"""
import argparse
import filecmp
import glob
import json
import os
import shutil
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


# --- nemotron_h --------------------------------------------------------------------------------------
# Every layer kind (M Mamba-2, * attention, E MoE, - dense MLP); 4 Mamba heads of 16 with 2 B/C groups
# and state 16; a chunk (8) smaller than the sequence (28 = three full chunks and a partial one);
# grouped routing (2 groups of 4 experts, 1 group kept, top-2), a shared expert, routed scaling 2.5,
# renormalised top-k, a random non-zero e_score_correction_bias; GQA attention without positions.
# expand stays 2 as in the real configs: HF sizes the Mamba mixer by mamba_num_heads * mamba_head_dim
# (64 here), never by expand * hidden_size (128), and the fixture keeps the two apart on purpose.
# transformers 5.17 no longer reads use_mamba_kernels: its Mamba functions are decorated with
# use_kernel_func_from_hub_with_fallback, which takes mamba_ssm / causal_conv1d when they import (absent
# on the GPU machine: checked and recorded) and otherwise the torch body written in modeling_nemotron_h.
NEMOTRON_H = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256, initializer_range=0.1, layer_norm_epsilon=1e-5,
    mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
    expand=2, use_conv_bias=True, mamba_hidden_act="silu", mamba_proj_bias=False, use_bias=False,
    time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, time_step_limit=(0.0, float("inf")),
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_shared_experts=1, intermediate_size=96, mlp_hidden_act="relu2", mlp_bias=False, attention_bias=False,
    n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, residual_in_fp32=False,
    rescale_prenorm_residual=True, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
NEMOTRON_CASES = {
    "nemotron_h": dict(hybrid_override_pattern="M*EM-E"),
    # LatentMoE (Nemotron 3 Super/Ultra): experts work in a 32-wide latent between fc1/fc2_latent_proj
    "nemotron_h_latent": dict(hybrid_override_pattern="ME*E", moe_latent_size=32),
}
NEMOTRON_T = 28
PATTERN_CHAR = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                "moe": "E", "mlp": "-"}


def nemotron_base(model):
    return getattr(model, model.base_model_prefix)


def undo_float_objects(v):
    """Python value of a config read from JSON, with {"__float__": "Infinity"}-style objects resolved."""
    if isinstance(v, dict):
        if set(v) == {"__float__"}:
            return float(v["__float__"])
        return {k: undo_float_objects(x) for k, x in v.items()}
    if isinstance(v, list):
        return [undo_float_objects(x) for x in v]
    return v


def write_hub_layout(model_dir, hub_dir):
    """The same weights as the Hub's nemotron_h checkpoints hold them: backbone. prefix, per-expert
    experts.N.{up,down}_proj.weight, hybrid_override_pattern, bare Infinity in time_step_limit."""
    from safetensors.torch import load_file
    sd = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        sd.update(load_file(path))
    out = {}
    for k, t in sd.items():
        k2 = "backbone." + k[len("model."):] if k.startswith("model.") else k
        head, _, leaf = k2.rpartition(".")
        if head.endswith(".experts") and leaf in ("up_proj", "down_proj") and t.dim() == 3:
            for e in range(t.shape[0]):
                out[f"{head}.{e}.{leaf}.weight"] = t[e].contiguous()
        else:
            out[k2] = t
    os.makedirs(hub_dir, exist_ok=True)
    hub_weights = os.path.join(hub_dir, "model.safetensors")
    save_file(out, hub_weights, metadata={"format": "pt"})
    saved = glob.glob(os.path.join(model_dir, "*.safetensors"))
    if len(saved) == 1 and filecmp.cmp(saved[0], hub_weights, shallow=False):
        # transformers 5.x already writes the Hub's tensor names: share the bytes rather than copy them.
        os.remove(hub_weights)
        os.symlink(os.path.join("..", os.path.basename(model_dir), os.path.basename(saved[0])), hub_weights)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = undo_float_objects(json.loads(f.read()))
    types = cfg.pop("layers_block_type", None) or cfg.pop("layer_types", None)
    if types is not None:
        cfg["hybrid_override_pattern"] = "".join(PATTERN_CHAR[t] for t in types)
        cfg["num_hidden_layers"] = len(types)
    for key in ("mtp_layers_block_type", "mtp_hybrid_override_pattern"):
        cfg.pop(key, None)
    with open(os.path.join(hub_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)  # Python's json writes Infinity bare, as the Hub's files have it
    return sorted(out)


class record_errors:
    """Context manager: an exception inside is appended to stats["problems"] instead of propagating."""

    def __init__(self, stats, what):
        self.stats, self.what = stats, what

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is not None:
            self.stats["problems"].append(f"{self.what}: {value!r}")
        return True


def nemotron_stats_hooks(model, config, stats):
    """Forward hooks recording, for the reference forward only, how often the torch fallback's dt clamp
    (at time_step_min) bites and how often e_score_correction_bias changes the chosen experts."""
    hooks = []
    base = nemotron_base(model)
    for i, layer in enumerate(base.layers):
        mixer = layer.mixer
        kind = layer.block_type
        if PATTERN_CHAR[kind] == "M":
            def hook(mod, args, out, i=i):
                if not stats["on"]:
                    return
                with torch.no_grad(), record_errors(stats, f"dt hook {i}"):
                    proj = mod.in_proj(args[0])
                    dt = proj[..., -mod.num_heads:]
                    sp = torch.nn.functional.softplus(dt + mod.dt_bias)
                    stats["dt_clamped"][str(i)] = [float((sp < mod.time_step_limit[0]).double().mean()),
                                                   float(sp.min()), float(sp.max())]
            hooks.append(mixer.register_forward_hook(hook))
        elif PATTERN_CHAR[kind] == "E":
            def hook(mod, args, out, i=i):
                if not stats["on"]:
                    return
                with torch.no_grad(), record_errors(stats, f"router hook {i}"):
                    idx_b = mod.gate(args[0])[2]
                    saved = mod.gate.e_score_correction_bias.clone()
                    mod.gate.e_score_correction_bias.zero_()
                    idx_0 = mod.gate(args[0])[2]
                    mod.gate.e_score_correction_bias.copy_(saved)
                    a = idx_b.sort(dim=-1).values
                    b = idx_0.sort(dim=-1).values
                    stats["bias_changed_routing"][str(i)] = [int((a != b).any(-1).sum()), int(a.shape[0])]
            hooks.append(mixer.register_forward_hook(hook))
    return hooks


def make_nemotron_h_case(name, overrides, out_dir):
    import importlib.util
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.models.nemotron_h import modeling_nemotron_h as mod_nh

    stats = {"on": False, "dt_clamped": {}, "bias_changed_routing": {}, "problems": []}
    torch.manual_seed(1234)
    kwargs = dict(NEMOTRON_H)
    kwargs.update(overrides)
    config = NemotronHConfig(**kwargs)
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    assert config.model_type == "nemotron_h"
    model = NemotronHForCausalLM(config).float()
    base = nemotron_base(model)
    kinds = "".join(PATTERN_CHAR[layer.block_type] for layer in base.layers)
    assert kinds == overrides["hybrid_override_pattern"], (kinds, overrides)
    print(f"{name}: base_model_prefix {model.base_model_prefix!r}, layers {kinds}, "
          f"block types {[layer.block_type for layer in base.layers]}")
    found = {m: importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d", "kernels")}
    print(f"{name}: modules found: {found}; mixer time_step_limit "
          f"{[layer.mixer.time_step_limit for layer in base.layers if PATTERN_CHAR[layer.block_type] == 'M']}")
    ties = None
    if name == "nemotron_h":  # does tie_word_embeddings tie anything? (_tied_weights_keys is {} in 5.17)
        with record_errors(stats, "tie probe"):
            tm = NemotronHForCausalLM(NemotronHConfig(**dict(kwargs, tie_word_embeddings=True)))
            ties = tm.lm_head.weight is nemotron_base(tm).embeddings.weight
            print(f"{name}: tie_word_embeddings=True ties lm_head to the embeddings: {ties}")
            del tm
    torch.manual_seed(1234)  # the tie probe drew numbers; the fixture's weights come from a fresh seed
    model = NemotronHForCausalLM(config).float()
    base = nemotron_base(model)

    # What a fresh model holds (HF's _init_weights), before the perturbation below.
    fresh = {}
    for n, p in list(model.named_parameters()) + list(model.named_buffers()):
        if any(s in n for s in ("norm", "A_log", ".D", "dt_bias", "e_score", "conv1d.bias")):
            fresh[n] = [round(float(p.min()), 6), round(float(p.max()), 6)]
    print(f"{name}: fresh [min, max]: {json.dumps(fresh)}")

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # norms (incl. the Mamba gated norm) away from 1 so their gradients matter
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif n.endswith(".A_log"):
                p.add_(0.2 * torch.randn_like(p))
            elif n.endswith(".D"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    buffers = {n: [str(b.dtype), list(b.shape)] for n, b in model.named_buffers()}
    print(f"{name}: buffers {json.dumps(buffers)}")

    os.makedirs(out_dir, exist_ok=True)
    model_dir = os.path.join(out_dir, "model")
    model.save_pretrained(model_dir)
    print_disk_layout(name, model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        written_config = f.read()
    print(f"{name}: config.json as written:\n{written_config}")
    disk_names = sorted(read_safetensors_header(glob.glob(os.path.join(model_dir, "*.safetensors"))[0]))

    # The saved directory loads back to the same tensors.
    back = NemotronHForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_sd = model.state_dict()
    rt = max(float((back.state_dict()[k].float() - v.float()).abs().max()) for k, v in ref_sd.items())
    if rt != 0.0:
        stats["problems"].append(f"save/load round trip differs by {rt}")
    del back

    B, T = 2, NEMOTRON_T
    g = torch.Generator().manual_seed(99)
    input_ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    pad = config.pad_token_id
    if pad is not None:
        input_ids[:, 0][input_ids[:, 0] == pad] = (pad + 1) % config.vocab_size
    labels = input_ids.clone()
    labels[0, :5] = -100
    labels[1, 10:14] = -100
    labels[1, -1] = -100
    with open(os.path.join(out_dir, "batch.json"), "w") as f:
        json.dump({"input_ids": input_ids.tolist(), "labels": labels.tolist()}, f)

    # Which Mamba path runs: count the calls of the module's scan functions (the mixer looks them up as
    # module globals at call time) and whether the fused training entry returned None (its torch
    # fallback does: only a kernel returns a tensor there).
    calls = {"mamba2_split_conv1d_scan_combined": 0, "fused_returned_tensor": 0, "mamba2_chunk_scan": 0,
             "causal_conv1d_fn": 0}
    originals = {}
    for fn in ("mamba2_split_conv1d_scan_combined", "mamba2_chunk_scan", "causal_conv1d_fn"):
        orig = originals[fn] = getattr(mod_nh, fn)

        def counted(*a, _orig=orig, _fn=fn, **k):
            calls[_fn] += 1
            r = _orig(*a, **k)
            if _fn == "mamba2_split_conv1d_scan_combined" and r is not None:
                calls["fused_returned_tensor"] += 1
            return r
        setattr(mod_nh, fn, counted)

    # The Hub layout: HF must load it to the same weights and loss (float32, CPU).
    hub = {}
    hub_dir = os.path.join(out_dir, "model_hub")
    hub_names = write_hub_layout(model_dir, hub_dir)
    try:
        hub_model, info = NemotronHForCausalLM.from_pretrained(hub_dir, dtype=torch.float32,
                                                               output_loading_info=True)
        hub_model.config._experts_implementation = "eager"
        hub_model.config._attn_implementation = "eager"
        hsd = hub_model.state_dict()
        diff = max(float((hsd[k].float() - v.float()).abs().max()) for k, v in ref_sd.items())
        with torch.no_grad():
            l_hub = float(hub_model(input_ids=input_ids, labels=labels, use_cache=False).loss)
            l_ref = float(model(input_ids=input_ids, labels=labels, use_cache=False).loss)
        hub = {"max_param_diff": diff, "loss_hub": l_hub, "loss_saved": l_ref,
               "info": {k: sorted(map(str, v)) for k, v in info.items()}}
        hub["ok"] = diff == 0.0 and abs(l_hub - l_ref) <= 1e-6 * abs(l_ref) and not info.get(
            "missing_keys") and not info.get(
            "unexpected_keys") and not info.get("mismatched_keys")
        del hub_model
    except Exception as e:  # recorded, not fatal: the notes say what HF does with the Hub layout
        hub = {"ok": False, "error": repr(e)}
    print(f"{name}: hub layout: {json.dumps(hub)}")
    if not hub["ok"] or name != "nemotron_h":  # one Hub-layout copy is enough (the main case's)
        shutil.rmtree(hub_dir)

    # float32 on the GPU (HF's torch fallback there too), against the float64 reference below.
    cuda = None
    if torch.cuda.is_available():
        with record_errors(stats, "cuda float32 run"):
            import copy
            m32 = copy.deepcopy(model).cuda()
            m32.train()
            torch.use_deterministic_algorithms(False)
            before = dict(calls)
            o32 = m32(input_ids=input_ids.cuda(), labels=labels.cuda(), use_cache=False)
            o32.loss.backward()
            torch.use_deterministic_algorithms(True)
            cuda = {"device": torch.cuda.get_device_name(), "loss": float(o32.loss),
                    "logits": o32.logits.detach().double().cpu(),
                    "grad_norm": float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m32.parameters()
                                                      if p.grad is not None))),
                    "calls": {k: calls[k] - before[k] for k in calls}}
            del m32
        torch.use_deterministic_algorithms(True)

    model = model.double()
    model.train()
    stats["on"] = True
    hooks = nemotron_stats_hooks(model, config, stats)
    before = dict(calls)
    out = model(input_ids=input_ids, labels=labels, use_cache=False)
    ref_calls = {k: calls[k] - before[k] for k in calls}
    stats["on"] = False
    for h in hooks:
        h.remove()
    for fn, orig in originals.items():
        setattr(mod_nh, fn, orig)
    n_m = kinds.count("M")
    if not (ref_calls["fused_returned_tensor"] == 0 and ref_calls["mamba2_chunk_scan"] == n_m and
            ref_calls["causal_conv1d_fn"] == n_m):
        stats["problems"].append(f"not the torch fallback, or not once per Mamba layer: {ref_calls}")
    if not any(v[0] > 0 for v in stats["bias_changed_routing"].values()):
        stats["problems"].append(f"e_score_correction_bias changes no routing decision: {stats}")
    loss = out.loss
    loss.backward()
    grads = {n: p.grad.detach().float().contiguous() for n, p in model.named_parameters() if p.grad is not None}
    # A parameter no token reaches (an expert nobody chose) has no .grad in torch: its gradient is zero.
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    grads.update({n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters() if p.grad is None})
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    tensors = {"logits": out.logits.detach().float().contiguous()}
    tensors.update({"grad." + n: t for n, t in grads.items()})
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    if cuda is not None and "logits" in cuda:
        cuda["max_logit_diff"] = float((cuda.pop("logits") - out.logits.detach().double()).abs().max())
        cuda["loss_rel_diff"] = abs(cuda["loss"] - float(loss)) / abs(float(loss))

    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses, norms = [], []
    for _ in range(NUM_STEPS):
        opt.zero_grad(set_to_none=True)
        o = model(input_ids=input_ids, labels=labels, use_cache=False)
        o.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        losses.append(float(o.loss))
        opt.step()

    expected = {
        "case": name, "model_type": config.model_type,
        "loss": float(loss), "ce_loss": float(loss), "aux_loss": 0.0,
        "grad_norm": float(grad_norm), "tokens": int((labels[:, 1:] != -100).sum()),
        "adamw": {"lr": OPTIM["lr"], "betas": list(OPTIM["betas"]), "eps": OPTIM["eps"],
                  "weight_decay": OPTIM["weight_decay"], "grad_clip": GRAD_CLIP, "schedule": "constant"},
        "step_losses": losses, "step_grad_norms": norms,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "param_names": [n for n, _ in model.named_parameters()],
        "nemotron_h": {
            "pattern": kinds,
            "mamba_path": {"reference_cpu_float64": ref_calls, "modules_found": found},
            "dt_clamp": "the mixer's time_step_limit is (time_step_min, inf) whatever config.time_step_limit says",
            "tie_word_embeddings_ties": ties,
            "dt_below_time_step_min": stats["dt_clamped"],
            "bias_changed_routing": stats["bias_changed_routing"],
            "cuda_float32": cuda,
            "hub_layout": hub,
            "disk_names": disk_names,
            "hub_disk_names": hub_names if hub.get("ok") else None,
            "no_aux_loss": True,
            "params_without_grad": no_grad,
            "problems": stats["problems"],
        },
    }
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(name, json.dumps({k: expected[k] for k in ("model_type", "loss", "grad_norm", "step_losses")}))
    print(name, json.dumps({k: v for k, v in expected["nemotron_h"].items() if "names" not in k}))
    assert not stats["problems"], f"{name}: {stats['problems']}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/hf")
    all_cases = list(CASES) + list(NEMOTRON_CASES)
    ap.add_argument("--cases", default=",".join(all_cases),
                    help="comma-separated subset of: " + ", ".join(all_cases) + " (default: all)")
    args = ap.parse_args()
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in all_cases]
    if unknown or not names:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(all_cases)}")
    torch.use_deterministic_algorithms(True)
    for name in names:
        if name in NEMOTRON_CASES:
            make_nemotron_h_case(name, NEMOTRON_CASES[name], os.path.join(args.out, name))
            continue
        family, overrides = CASES[name]
        make_case(name, family, overrides, os.path.join(args.out, name))


if __name__ == "__main__":
    main()
