#!/usr/bin/env python3
"""Builds the generation parity fixtures with `transformers` itself (run where it is installed).

For each case it writes <out>/<case>/:
  model/                a tiny random Qwen3-MoE saved by save_pretrained (float32), whose
                        generation_config.json names the EOS ids (see below)
  expected.json         prompt ids, HF's greedy output ids without and with EOS stopping, the
                        smallest top-1/top-2 logit gap and router top-k/top-(k+1) gap met (how far
                        from a tie every decision was), and the transformers/torch versions
  expected.safetensors  step_logits [new, V]: the logits `generate(output_logits=True)` returned at
                        every step; full_logits [prompt + new, V] ("ids" case only): one forward over
                        the whole generated sequence
Cases:
  ids   random prompt ids; norm_topk_prob on, a dense layer (mlp_only_layers), untied embeddings
  chat  the tokenizer of tests/fixtures/tokenizer (its files are NOT copied into model/: the test
        assembles a model directory from both); the prompt text rendered by apply_chat_template as
        one user message with add_generation_prompt=True, and the same text as a plain prompt
        (tokenizer(text)); norm_topk_prob off, tied embeddings
The reference runs in float64 on the CPU (eager attention and experts, HF's DynamicCache KV cache),
so the fixture holds the true values of the float32 weights, not another fp32 rounding. A random
seed is taken only if every greedy choice and every router top-k choice is clear of a tie by a
margin fp32 rounding cannot cross, so the ids are the same in any correct fp32 implementation.
EOS: after a first run with no EOS, the EOS ids are set to [a token the run never produced, the
token it produced at step EOS_STEP (a first occurrence)], so the second run stops there (HF keeps
the EOS token in the output).

Usage: python3 scripts/make_generate_fixture.py --out tests/fixtures/generate
"""
import argparse
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "tests", "fixtures", "tokenizer")
CHAT_PROMPT = "Hello! What is a mixture of experts model?"
MAX_NEW = {"ids": 20, "chat": 16}
EOS_STEP = 6
MIN_LOGIT_GAP = 1e-3
MIN_ROUTER_GAP = 1e-4

CASES = {
    "ids": dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False,
                max_position_embeddings=64),
    "chat": dict(vocab_size=2048, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1, tie_word_embeddings=True,
                 max_position_embeddings=128),
}


def build_model(fields, seed):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.2, router_aux_loss_coef=0.01,
                            output_router_logits=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                            **fields)
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():  # norms away from 1 so that they matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
    model.eval()
    return model


def greedy(model, prompt, max_new, eos):
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=0,
                                               max_new_tokens=max_new)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             output_logits=True, return_dict_in_generate=True, use_cache=True)
    seq = out.sequences[0].tolist()
    logits = torch.cat([l.double() for l in out.logits], dim=0)  # [new, V]
    return seq[len(prompt):], logits


def router_gap(model, seq):
    """The smallest gap between the k-th and (k+1)-th router probability over all tokens and MoE layers."""
    K = model.config.num_experts_per_tok
    gaps = []
    hooks = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "weight"):
            continue

        def hook(_mod, _inp, out, gate=gate):
            h = out.reshape(-1, out.shape[-1]).double()
            p = torch.softmax(h @ gate.weight.double().t(), dim=-1)
            top = torch.sort(p, dim=-1, descending=True).values
            gaps.append(float((top[:, K - 1] - top[:, K]).min()))

        hooks.append(layer.post_attention_layernorm.register_forward_hook(hook))
    with torch.no_grad():
        full = model(torch.tensor([seq])).logits[0].double()
    for h in hooks:
        h.remove()
    return (min(gaps) if gaps else float("inf")), full


def logit_gap(logits):
    top = torch.sort(logits, dim=-1, descending=True).values
    return float((top[:, 0] - top[:, 1]).min())


def prompts_for(name, tok):
    if name == "ids":
        g = torch.Generator().manual_seed(7)
        return {"prompt_ids": torch.randint(0, CASES["ids"]["vocab_size"], (10,), generator=g).tolist()}
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    plain = tok(CHAT_PROMPT)["input_ids"]
    return {"prompt_ids": list(chat), "plain_prompt_ids": list(plain)}


def make_case(name, out_dir, tok):
    fields = CASES[name]
    max_new = MAX_NEW[name]
    prompts = prompts_for(name, tok)
    prompt = prompts["prompt_ids"]
    for seed in range(100):
        model = build_model(fields, seed).double()
        new, step_logits = greedy(model, prompt, max_new, None)
        gap = logit_gap(step_logits)
        rgap, full = router_gap(model, prompt + new)
        extra = {}
        if "plain_prompt_ids" in prompts:
            plain_new, plain_logits = greedy(model, prompts["plain_prompt_ids"], max_new, None)
            prgap, _ = router_gap(model, prompts["plain_prompt_ids"] + plain_new)
            gap = min(gap, logit_gap(plain_logits))
            rgap = min(rgap, prgap)
            extra = {"plain_output_ids": plain_new}
        eos_tok = new[EOS_STEP]
        if gap < MIN_LOGIT_GAP or rgap < MIN_ROUTER_GAP or eos_tok in new[:EOS_STEP] or len(set(new)) < 4:
            print(f"{name}: seed {seed} rejected (logit gap {gap:.3g}, router gap {rgap:.3g}, tokens {new})")
            continue
        break
    else:
        raise SystemExit(f"{name}: no seed gave clear decisions")
    unused = next(t for t in range(fields["vocab_size"] - 1, -1, -1) if t not in new and t not in prompt)
    eos = [unused, eos_tok]
    with_eos, _ = greedy(model, prompt, max_new, eos)
    assert with_eos == new[:EOS_STEP + 1], (with_eos, new)

    # Save the float32 weights (exactly the values the float64 run used) and EOS ids.
    model = model.float()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=0)
    if name == "chat":
        model.config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(os.path.join(out_dir, "model"))
    tensors = {"step_logits": step_logits.float().contiguous()}
    if name == "ids":
        tensors["full_logits"] = full.float().contiguous()
    save_file(tensors, os.path.join(out_dir, "expected.safetensors"))
    expected = {"case": name, "seed": seed, "max_new_tokens": max_new, **prompts, "output_ids": new,
                "eos_token_id": eos, "output_ids_with_eos": with_eos, "min_logit_gap": gap,
                "min_router_gap": rgap, "transformers": transformers.__version__, "torch": torch.__version__}
    expected.update(extra)
    if name == "chat":
        expected["prompt_text"] = CHAT_PROMPT
        expected["output_text_with_eos"] = tok.decode(with_eos, skip_special_tokens=True)
        expected["chat_text"] = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}],
                                                        add_generation_prompt=True, tokenize=False)
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(name, json.dumps({k: expected[k] for k in ("seed", "prompt_ids", "output_ids", "eos_token_id",
                                                      "output_ids_with_eos", "min_logit_gap", "min_router_gap")}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/generate")
    ap.add_argument("--tokenizer", default=TOKENIZER_DIR)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    for name in CASES:
        make_case(name, os.path.join(args.out, name), tok)


if __name__ == "__main__":
    main()
