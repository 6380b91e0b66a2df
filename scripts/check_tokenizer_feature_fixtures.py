#!/usr/bin/env python3
"""Cross-checks tests/fixtures/tokenizer_features/ (made with the Node binding of HF `tokenizers`,
scripts/make_tokenizer_feature_fixtures.mjs) against the Python package and, when installed,
transformers' fast tokenizer wrapper: every recorded encoding and decoding must come out the same.
Both bindings run the same Rust library, so a mismatch means a version difference or a wrapper
that changes results (transformers' decode options, e.g. clean_up_tokenization_spaces).

Usage (tokenizers 0.23; transformers optional):
  python3 scripts/check_tokenizer_feature_fixtures.py [tests/fixtures/tokenizer_features]
Prints one line a fixture and the totals; exits 1 on any mismatch.
"""
import glob
import json
import os
import sys

from tokenizers import Tokenizer

SKIP = {"sp_base.json", "refusals.json", "fixture_info.json", "unicode_classes.json"}


def load_fixture_tokenizer(directory, fixture):
    with open(os.path.join(directory, fixture["base"]), encoding="utf-8") as f:
        root = json.load(f)
    for key, value in fixture["set"].items():
        if "." in key:
            outer, inner = key.split(".", 1)
            root[outer][inner] = value
        else:
            root[key] = value
    return json.dumps(root, ensure_ascii=False)


def fast_wrapper(tok):
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tokenizer_features"
    total = mismatches = 0
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        if os.path.basename(path) in SKIP:
            continue
        with open(path, encoding="utf-8") as f:
            fixture = json.load(f)
        tok = Tokenizer.from_str(load_fixture_tokenizer(directory, fixture))
        wrapper = fast_wrapper(tok)
        bad = 0
        for case in fixture["cases"]:
            got = {
                "ids": tok.encode(case["text"], add_special_tokens=False).ids,
                "ids_special": tok.encode(case["text"], add_special_tokens=True).ids,
                "decoded": tok.decode(case["ids"], skip_special_tokens=False),
                "decoded_skip_special": tok.decode(case["ids_special"], skip_special_tokens=True),
            }
            if wrapper is not None:
                got["ids (transformers)"] = wrapper(case["text"], add_special_tokens=False)["input_ids"]
            for key, value in got.items():
                total += 1
                if value != case[key.split(" ")[0]]:
                    bad += 1
                    if bad <= 5:
                        print(f"  {fixture['name']}: {key} of {case['text']!r}: {value!r}, fixture {case[key.split(' ')[0]]!r}")
        for case in fixture["decode_cases"]:
            for key, skip in (("decoded", False), ("decoded_skip_special", True)):
                total += 1
                if tok.decode(case["ids"], skip_special_tokens=skip) != case[key]:
                    bad += 1
        mismatches += bad
        print(f"{fixture['name']}: {bad} mismatches")
    import tokenizers
    print(f"tokenizers {tokenizers.__version__}: {total} checks, {mismatches} mismatches")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
