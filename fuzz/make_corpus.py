#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer targets into fuzz/corpus/<target>/ (committed).

Each target gets a few small valid inputs and a few invalid ones, laid out as its fuzz_<target>.cpp
expects (mode bytes, NUL-separated overrides, ...). Seeds stay small (a few KiB) so libFuzzer's
default max_len applies and the mutations stay fast. Re-run after changing a target's layout:
    python3 fuzz/make_corpus.py
"""
import json
import os
import shutil
import struct

ROOT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(ROOT)


def write(target, name, data):
    d = os.path.join(ROOT, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def st(header, data=b""):
    h = json.dumps(header, separators=(",", ":")).encode() if not isinstance(header, (bytes, str)) else header
    h = h.encode() if isinstance(h, str) else h
    return struct.pack("<Q", len(h)) + h + data


def json_corpus():
    t = "json"
    write(t, "empty_object", "{}")
    write(t, "nested", '{"a": [1, 2.5, -3e-7, true, false, null], "b": {"c": "d\\n\\u00e9\\ud83d\\ude00"}}')
    write(t, "numbers", "[0, -0, 1e308, -1.5E+3, 123456789012345678, 0.1, 4.9e-324]")
    write(t, "string_escapes", '"\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000"')
    write(t, "utf8", '{"名前": "値", "emoji": "😀"}')
    write(t, "deep", "[" * 40 + "]" * 40)
    with open(os.path.join(REPO, "tests/fixtures/hf/norm_topk/model/config.json"), "rb") as f:
        write(t, "hf_config", f.read())
    write(t, "bad_trailing_comma", '{"a": 1,}')
    write(t, "bad_duplicate_key", '{"a": 1, "a": 2}')
    write(t, "bad_lone_surrogate", '"\\ud800"')
    write(t, "bad_leading_zero", "[01]")
    write(t, "bad_unterminated", '{"a": "b')


def config_corpus():
    t = "config"
    for name in ("norm_topk", "no_norm_topk"):
        with open(os.path.join(REPO, "tests/fixtures/hf", name, "model/config.json"), "rb") as f:
            write(t, name, f.read())
    small = {
        "model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 8, "intermediate_size": 12,
        "moe_intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [0], "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 128, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    write(t, "small_v4", json.dumps(small))
    v5 = dict(small)
    del v5["rope_theta"], v5["num_experts"], v5["torch_dtype"]
    v5.update({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "num_local_experts": 4,
               "dtype": "float32", "tie_word_embeddings": True})
    write(t, "small_v5", json.dumps(v5))
    write(t, "bad_model_type", json.dumps(dict(small, model_type="llama")))
    write(t, "bad_rope_scaling", json.dumps(dict(small, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    write(t, "bad_heads", json.dumps(dict(small, num_attention_heads=3)))
    write(t, "not_object", "[1, 2]")


def recipe_corpus():
    t = "recipe"
    with open(os.path.join(REPO, "demo/tiny_tokens.yaml"), "rb") as f:
        write(t, "demo", f.read())
    minimal = "model: m\ndata: {train: d.jsonl}\ntrain: {steps: 3}\nout: o\n"
    write(t, "minimal", minimal)
    write(t, "with_overrides", minimal + "\0train.steps=7\noptim.betas=[0.8, 0.9]\noptim.no_decay=[*norm*,*bias]")
    write(t, "lists_and_quotes",
          "---\nmodel: 'm'\ndata:\n  train: \"d\\u00e9.jsonl\"  # comment\n  on_error: skip\ntrain:\n  steps: 1e3\n"
          "  seq_len: 0x40\noptim:\n  no_decay:\n    - \"*norm*\"\n    - '*bias'\n  schedule: linear\n"
          "  warmup_steps: 10\n  min_lr_ratio: .5\nout: o\n")
    write(t, "bad_unknown_key", minimal + "optim:\n  lrr: 1\n")
    write(t, "bad_tab_indent", "model: m\ndata:\n\ttrain: d\n")
    write(t, "bad_alias", minimal + "seed: *x\n")
    write(t, "bad_override", minimal + "\0train.stepz=3")


def token_jsonl_corpus():
    t = "token_jsonl"
    vocab_255 = bytes([63])  # vocab_size = 1 + 63 * 4 = 253
    stop, skip = b"\x00", b"\x01"
    write(t, "ids_only", vocab_255 + stop + b'{"input_ids": [1, 2, 3]}\n{"input_ids": [252]}\n')
    write(t, "with_labels", vocab_255 + stop + b'{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}\r\n\n  \n'
          b'{"labels": null, "input_ids": [0]}')
    write(t, "skip_bad", vocab_255 + skip + b'{"input_ids": [1]}\n{"input_ids": [999]}\nnot json\n{"input_ids": []}\n')
    write(t, "bad_label_length", vocab_255 + stop + b'{"input_ids": [1, 2], "labels": [1]}\n')
    write(t, "bad_unknown_field", vocab_255 + stop + b'{"input_ids": [1], "attention_mask": [1]}\n')
    write(t, "bad_float_id", vocab_255 + stop + b'{"input_ids": [1.5]}\n')


def safetensors_corpus():
    t = "safetensors"
    single, index = b"\x00", b"\x01"
    f32 = struct.pack("<2f", 1.0, -2.0)
    write(t, "one_f32", single + st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, f32))
    write(t, "mixed", single + st({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "BF16", "shape": [1, 2], "data_offsets": [0, 4]},
        "b": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]},
        "c": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]},
        "d": {"dtype": "F64", "shape": [], "data_offsets": [16, 24]},
        "e": {"dtype": "BOOL", "shape": [0, 3], "data_offsets": [24, 24]},
    }, bytes(range(24))))
    write(t, "padded_header", single + st(b'{"w":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}   ', b"xyz"))
    write(t, "empty", single + st(b"{}"))
    write(t, "bad_overlap", single + st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32))
    write(t, "bad_header_len", single + struct.pack("<Q", 1 << 40) + b"{}")
    write(t, "index_two_shards",
          index + json.dumps({"metadata": {"total_size": 20},
                              "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}).encode())
    write(t, "index_escape_dotdot", index + b'{"weight_map": {"a": "../model/s1.safetensors"}}')
    write(t, "index_symlink_out", index + b'{"weight_map": {"e": "link.safetensors"}}')
    write(t, "index_subdir", index + b'{"weight_map": {"d": "sub/s3.safetensors"}}')
    write(t, "index_not_safetensors", index + b'{"weight_map": {"a": "notes.txt"}}')


def tokenizer_corpus():
    t = "tokenizer"
    # GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 and up.
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    vocab = {c: i for i, c in enumerate(chars)}
    merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["i", "n"], ["Ġ", "a"]]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    base = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": len(vocab), "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    text = "\0Hello the world, in a test! 123 <|endoftext|> é😀\n"
    write(t, "gpt2", json.dumps(base, ensure_ascii=False) + text)
    qwen = json.loads(json.dumps(base))
    qwen["normalizer"] = {"type": "NFC"}
    qwen["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                                               "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        dict(byte_level, use_regex=False)]}
    qwen["model"]["merges"] = [" ".join(m) for m in merges]  # the older "a b" spelling
    write(t, "qwen2", json.dumps(qwen, ensure_ascii=False) + text)
    bad = json.loads(json.dumps(base))
    bad["model"]["type"] = "WordPiece"
    write(t, "bad_model_type", json.dumps(bad))
    bad = json.loads(json.dumps(base))
    bad["model"]["merges"].append(["q", "zz"])
    write(t, "bad_merge", json.dumps(bad))
    write(t, "bad_not_object", "[]")
    # SentencePiece-style BPE (Mistral): byte_fallback, Prepend/Replace normalizers, its decoders.
    sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        sp_vocab[f"<0x{b:02X}>"] = 3 + b
    for piece in ["\u2581", "h", "e", "l", "o", "\u2581h", "ll", "\u2581he", "\u2581hell", "\u2581hello"]:
        sp_vocab[piece] = len(sp_vocab)
    sp = json.loads(json.dumps(base))
    sp["added_tokens"] = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True} for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    sp["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    sp["pre_tokenizer"] = None
    sp["post_processor"] = None
    sp["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    sp["model"] = dict(base["model"], unk_token="<unk>", byte_fallback=True, fuse_unk=True, vocab=sp_vocab,
                       merges=[["\u2581", "h"], ["l", "l"], ["\u2581h", "e"], ["\u2581he", "ll"], ["\u2581hell", "o"]])
    write(t, "sentencepiece", json.dumps(sp, ensure_ascii=False) + "\0hello world <s> ñ 😀\n")
    meta = json.loads(json.dumps(sp))
    meta["normalizer"] = None
    meta["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}
    meta["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    write(t, "metaspace", json.dumps(meta, ensure_ascii=False) + "\0<s>hello  hello 1234, 中文\n")
    # A tiktoken.model (see fuzz_tokenizer.cpp): the 256 bytes, a few merges, then the text.
    import base64
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" world"]
    lines = "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(ranks))
    write(t, "tiktoken", "tiktoken\n" + lines + "\0hello world [BOS]中文Hello\n")


def jinja_corpus():
    t = "jinja"
    fam = os.path.join(ROOT, "..", "tests", "fixtures", "chat", "families")
    for name in sorted(os.listdir(fam)):
        if name.endswith(".jinja"):
            with open(os.path.join(fam, name), encoding="utf-8") as f:
                write(t, name[:-len(".jinja")], f.read())
    write(t, "loops_and_filters", "{% for m in messages if m.role != 'tool' %}{{ loop.index }}:{{ m.role|upper }}"
          "{% if not loop.last %}, {% endif %}{% else %}none{% endfor %}|{{ tools|map(attribute='type')|join }}")
    write(t, "macro_recursion", "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(5) }}")
    write(t, "namespace", "{%- set ns = namespace(x=0) -%}{%- for i in range(5) -%}{%- set ns.x = ns.x + i -%}"
          "{%- endfor -%}{{ ns.x }}")
    write(t, "with_context", "{{ a.b[0] ~ c|tojson(indent=2) }}\0" + '{"a": {"b": ["x"]}, "c": {"d": [1, 2.5]}}')
    write(t, "bad_unclosed", "{% if x %}")
    write(t, "bad_filter", "{{ x|nosuch }}")


def main():
    shutil.rmtree(os.path.join(ROOT, "corpus"), ignore_errors=True)
    jinja_corpus()
    json_corpus()
    config_corpus()
    recipe_corpus()
    token_jsonl_corpus()
    safetensors_corpus()
    tokenizer_corpus()


if __name__ == "__main__":
    main()
