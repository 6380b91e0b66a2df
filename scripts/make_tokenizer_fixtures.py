#!/usr/bin/env python3
"""Builds the tokenizer parity fixtures in tests/fixtures/tokenizer/ with Hugging Face `tokenizers`.

It trains a small byte-level BPE tokenizer (Qwen2 pre-tokenizer regex + ByteLevel, NFC normalizer,
ChatML special tokens) on a multilingual corpus embedded below, saves it the way an HF model
directory holds it, and records what HF itself answers for a separate set of test texts:

  expected.jsonl, one JSON object a line, with a "kind":
    encode  {variant, text, ids, ids_special, decoded, decoded_skip_special}
            ids of HF's encode(text) without / with special tokens, and HF's decode of `ids`
            (decode of ids_special with skip_special_tokens=True as decoded_skip_special)
    split   {pattern, text, pieces}  HF's Split(Regex(pattern), "isolated").pre_tokenize_str(text)
    nfc     {text, nfc}              HF's NFC normalizer, for the texts NFC changes
    decode  {ids, decoded, decoded_skip_special}  decode of random id sequences (partial UTF-8)
  variants.json   for each variant, the top-level tokenizer.json fields it replaces (a key with a
                  dot, "model.ignore_merges", replaces a field one level down)
  fixture_info.json  versions and counts

Usage (needs `tokenizers`): python3 scripts/make_tokenizer_fixtures.py --out tests/fixtures/tokenizer
The outputs are committed; this script is only re-run when the fixtures must change.
"""
import argparse
import json
import os
import random
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
PATTERNS = {"gpt2": GPT2_PATTERN, "qwen2": QWEN2_PATTERN, "llama3": LLAMA3_PATTERN}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# --- training corpus ---------------------------------------------------------------------------
CORPUS = [
    # English
    "The quick brown fox jumps over the lazy dog. It's a classic pangram, and we'll use it again.",
    "Mixture-of-Experts models route each token to a few experts; the router learns which ones.",
    "I'm sure they've seen it: you'd think the results're obvious, but they aren't.",
    "Fine-tuning a model needs data, a tokenizer, an optimizer and patience. Loss should fall.",
    "She sells sea shells by the sea shore. THE SHELLS SHE SELLS ARE SURELY SEASHELLS!",
    "In 2024, about 3.5 billion people used the internet every day; 1,234,567 of them were bots.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 2.71828 1e-5 -17 +23 50% $19.99",
    "Dates like 2023-11-05, times like 12:30:45, phone numbers like +1 (555) 010-9999.",
    # Arabic
    "اللغة العربية هي إحدى أكثر اللغات انتشارا في العالم، ويتحدثها أكثر من ٤٠٠ مليون شخص.",
    "مرحبا بكم في هذا الاختبار. نحن نكتب نصا قصيرا لتدريب المحلل اللغوي على الحروف العربية.",
    "الكتاب على الطاولة، والقلم في الحقيبة. هل قرأت الكتاب الجديد؟ نعم، قرأته أمس.",
    "العدد ١٢٣٤٥ مكتوب بالأرقام العربية الهندية، والعدد 12345 بالأرقام الغربية.",
    # Kazakh (Cyrillic)
    "Қазақ тілі — түркі тілдерінің бірі. Қазақстанның мемлекеттік тілі қазақ тілі болып табылады.",
    "Бүгін ауа райы жақсы, күн ашық. Біз саябаққа барып, серуендедік және балмұздақ жедік.",
    "Әлем, ғылым, қала, өнер, ұлт, үй, һәм, іс: қазақ әліпбиінің ерекше әріптері.",
    "Менің атым Айгүл. Мен Алматыда тұрамын және университетте оқимын.",
    # Russian
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!",
    # Chinese
    "机器学习是人工智能的一个分支。深度学习模型需要大量的数据和计算资源。",
    "今天天气很好，我们去公园散步吧！你吃饭了吗？我已经吃过了。",
    "混合专家模型把每个词元分配给少数几个专家，从而在不增加计算量的情况下扩大模型规模。",
    "北京是中国的首都，上海是最大的城市。长江和黄河是两条最重要的河流。",
    # Japanese and Korean
    "こんにちは、世界。今日はいい天気ですね。カタカナとひらがなと漢字を混ぜて書きます。",
    "안녕하세요, 세계! 한국어는 한글로 씁니다. 오늘 날씨가 정말 좋네요.",
    # Greek, Hebrew, Hindi, Thai, Vietnamese, Turkish, German, French
    "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Καλημέρα!",
    "שלום עולם! זהו משפט בעברית עם מספרים 123 וסימני פיסוק.",
    "नमस्ते दुनिया! यह हिंदी में एक छोटा वाक्य है। भाषा मॉडल सीख रहे हैं।",
    "สวัสดีครับ ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Tiếng Việt có nhiều dấu: ắ, ằ, ẳ, ẵ, ặ, ế, ề, ể, ễ, ệ. Xin chào các bạn!",
    "Türkçe: İstanbul, ığdır, çiçek, şeker, öğrenci, üzüm. Straße, Größe, Mädchen, Übung.",
    "Français : l'été, où, garçon, Noël, cœur, déjà vu, naïve, façade, crème brûlée.",
    # Combining characters (decomposed forms; NFC composes most of them)
    "Cafe\u0301, re\u0301sume\u0301, nai\u0308ve, A\u030angstro\u0308m, n\u0303, c\u0327a, u\u031b\u0301, "
    "a\u0323\u0302, q\u0307\u0323, e\u0304\u0301, \u1100\u1161\u11a8, \u1112\u1161\u11ab.",
    # Emoji: skin tones, ZWJ sequences, flags, keycaps, variation selectors
    "Emoji 😀 😂 🤖 🚀 🎉 👍 👍🏽 👍🏿 👋🏻 ❤️ ☺️ ✌️ 👩‍💻 👨‍👩‍👧‍👦 🧑🏾‍🚀 🏳️‍🌈 🇰🇿 🇨🇳 🇸🇦 🇺🇸 1️⃣ #️⃣",
    "Great job 👏👏👏 and thanks 🙏! Family: 👨‍👩‍👦 Love: 💕💖 Party 🥳🎊 Food 🍕🍣🥟",
    # Whitespace runs and line breaks
    "two  spaces,   three   spaces,\ttab,\t\ttwo tabs\nnew line\n\nblank line\r\nwindows line\n    indented",
    "trailing spaces   \n   leading spaces\n\n\n\nmany newlines\u00a0nbsp\u3000ideographic space",
    # Code
    "def forward(self, x):\n    h = self.norm(x)\n    return x + self.mlp(h)  # residual\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\nreturn sum;\n",
    "if __name__ == '__main__':\n    main(sys.argv[1:])\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name ASC;",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "<html><body class=\"main\"><p>Hello &amp; welcome</p></body></html>",
    "x = [i ** 2 for i in range(10) if i % 3 != 0]; print(f\"{x!r:>20}\")",
    # Chat-like text
    "user: What is the capital of Kazakhstan?\nassistant: The capital of Kazakhstan is Astana.",
    "user: 你好！请用中文回答。\nassistant: 好的，我会用中文回答你的问题。",
]


def training_corpus():
    # Repeat the corpus with small variations so BPE sees frequent pairs in every script.
    rng = random.Random(7)
    lines = []
    for rep in range(30):
        for line in CORPUS:
            lines.append(line)
            words = line.split(" ")
            rng.shuffle(words)
            lines.append(" ".join(words))
        lines.append(" ".join(str(rng.randint(0, 10**rng.randint(1, 6))) for _ in range(20)))
    return lines


# --- test texts (separate from the corpus) ------------------------------------------------------
HANDWRITTEN = [
    "",
    " ",
    "a",
    "Hello, world!",
    "Hello world",
    " Hello world",
    "  leading and trailing  ",
    "It's, I'M, they'RE, we'Ve, you'D, she'll, He'LL, don't, o'clock, 's 'S 'ſ 'K",
    "rock'n'roll isn't 'quoted' ''double''",
    "1234567890 12 123 1234 12345 3.14 -0.5 1,000,000 ٣٤٥ ١٢٣٤ Ⅻ ½ ² ³",
    "\n",
    "\r\n",
    "\n\n\n",
    "a\n\nb\r\n\r\nc\rd",
    "spaces    before\n    indented line\n\t\ttabbed\n",
    "   \n   \t  \n",
    "word   \t  word",
    "x\u00a0y\u3000z\u2009w\u0085v\u000bu\u000ct\u001cs\u2028r\u2029q\u200bp\u180eo",
    "tabs\tand\u00a0nbsp \u00a0 mix",
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "السلام عليكم ورحمة الله وبركاته ١٢٣",
    "Сәлем, әлем! Қалың қалай? Мен жақсымын.",
    "Қазақстан Республикасы — Орталық Азиядағы мемлекет.",
    "你好，世界！这是一个测试。",
    "深度学习模型的训练需要GPU和大量数据。",
    "混合专家(MoE)模型：每个token只激活2个专家。",
    "日本語のテキストとEnglishが混ざっています。",
    "한국어 텍스트와 English가 섞여 있습니다.",
    "Ελληνικά με τόνους: ά έ ή ί ό ύ ώ ΐ ΰ",
    "עברית ועוד טקסט",
    "हिन्दी पाठ का परीक्षण",
    "ภาษาไทย ทดสอบ",
    "Tiếng Việt: Người ta nói rằng học tập là suốt đời.",
    "e\u0301 vs \u00e9, A\u030a vs \u00c5 vs \u212b, \u2126 vs \u03a9, \u1f71 vs \u03ac",
    "a\u0302\u0323 vs a\u0323\u0302 vs \u1ead",
    "\u1100\u1161\u11a8 \u1100\u1161 \u11a8 \uac00\u11a8 \uac01",
    "o\u0308\u0304 u\u0308\u0301 \u0041\u0300\u0301\u0302\u0303\u0304",
    "x\u0301\u0301\u0301\u0301 combining on a letter",
    "\u0301 leading combining mark",
    "\u0915\u094d\u0937 \u0928\u093c",
    "👍👍🏽👍🏿 👩‍💻👨‍👩‍👧‍👦 🏳️‍🌈 🇰🇿🇨🇳🇺🇸 1️⃣ ❤️",
    "emoji in text🚀rocket and 🤖robot",
    "🧑🏾‍🚀🧑🏾‍🚀🧑🏾‍🚀",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there!<|im_end|>",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|endoftext|>",
    "<|im_start <|im_end| |im_end|> <|im_",
    "before <|im_end|>after",
    "calling <tool_call>{\"name\": \"f\"}</tool_call> done",
    "the <|mask|> token strips   <|mask|> spaces on its left",
    "x<|mask|>y",
    "héllo and he\u0301llo and HÉLLO",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))\n",
    "if (a && b || !c) { return -1; } else { x += 2; }",
    "path/to/file.txt C:\\Windows\\System32 https://example.com/a?b=c&d=e#f",
    "!!!??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
    "'''triple''' \"\"\"quotes\"\"\" `backticks`",
    "ALL CAPS TEXT AND lowercase text AND MiXeD CaSe",
    "The year 1999 and the year 2000 and 31337",
    "a1b2c3 x86_64 utf-8 GPT-4o Qwen3-30B-A3B",
]

ALPHABET_POOL = [
    "the", " the", "model", "tokenizer", "Expert", "ROUTER", "it's", "We'LL", "don't", "'s", "'ſ", "'",
    "0", "7", "42", "2024", "3.14", "1,000", "٣", "١٢", "Ⅻ", "½", "²",
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\u0085", "\u000b",
    ".", ",", "!", "?", ";", ":", "-", "--", "...", "(", ")", "[", "]", "{", "}", "\"", "#", "@", "$", "%",
    "&", "*", "+", "=", "/", "\\", "|", "<", ">", "_", "~", "^", "`",
    "مرحبا", "العالم", "كتاب", "،", "؟", "ال",
    "Қазақ", "тілі", "әлем", "ғылым", "ұлт", "үй", "Сәлем", "мен",
    "你好", "世界", "模型", "学习", "。", "，", "！", "的",
    "こんにちは", "カタカナ", "안녕", "한국어",
    "Ελλάδα", "שלום", "नमस्ते", "ไทย", "Việt",
    "e\u0301", "a\u0308", "\u0301", "\u0323", "\u0302", "o\u0303\u0304", "\u1100\u1161", "\u11a8", "\u212b",
    "\u2126", "\u1f71", "\u00e9",
    "😀", "👍", "🏽", "\u200d", "👩", "💻", "🇰", "🇿", "❤", "\ufe0f", "🚀", "👨‍👩‍👧‍👦",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "<tool_call>", "</tool_call>", "<|mask|>",
    "héllo", "he\u0301llo",
]


def random_texts(count, seed):
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        n = rng.randint(1, 14)
        texts.append("".join(rng.choice(ALPHABET_POOL) for _ in range(n)))
    return texts


def long_text():
    rng = random.Random(99)
    parts = []
    while sum(len(p) for p in parts) < 1500:
        parts.append(rng.choice(CORPUS[:8] + HANDWRITTEN[19:34]))
        parts.append(rng.choice([" ", "\n", "  ", "\n\n", " 12345 ", "👍🏽"]))
    return "".join(parts)


# --- building and recording -----------------------------------------------------------------------
def train_tokenizer(vocab_size):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    # Non-special added tokens (like Qwen's tool-call tags), one matched after normalisation,
    # and a special token that strips whitespace on its left.
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("</tool_call>", special=False, normalized=False),
                    AddedToken("héllo", special=False, normalized=True)])
    tok.add_special_tokens([AddedToken("<|mask|>", lstrip=True, special=True, normalized=False)])
    return tok


def variants(base_json, tok):
    bos = tok.token_to_id("<|endoftext|>")
    bytelevel_pp = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos], "tokens": ["<|endoftext|>"]}},
    }
    return {
        "qwen2": {},
        "gpt2": {
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        },
        "gpt2_prefix_space": {
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        },
        "llama3": {
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": {"type": "Sequence", "processors": [bytelevel_pp, template]},
            "model.ignore_merges": True,
        },
    }


def apply_variant(base_json, overrides):
    d = json.loads(base_json)
    for key, value in overrides.items():
        if "." in key:
            outer, inner = key.split(".", 1)
            d[outer][inner] = value
        else:
            d[key] = value
    return json.dumps(d, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=2000)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import tokenizers
    tok = train_tokenizer(args.vocab_size)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    base_json = tok.to_str()

    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        # ChatML with a default system message (ours; scripts/make_chat_fixtures.py renders it as
        # its "tokenizer_default" template)
        "chat_template": (
            "{%- if messages and messages[0].role != 'system' %}"
            "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
            "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    special_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
        "pad_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
    }
    with open(os.path.join(args.out, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special_map, f, ensure_ascii=False, indent=2)

    texts = HANDWRITTEN + random_texts(110, seed=1234) + [long_text()]
    records = []
    info = {"tokenizers_version": tokenizers.__version__, "python": sys.version.split()[0],
            "vocab_size": tok.get_vocab_size(with_added_tokens=True), "variants_failed": {}}

    all_variants = variants(base_json, tok)
    ok_variants = {}
    for name, overrides in all_variants.items():
        try:
            vt = Tokenizer.from_str(apply_variant(base_json, overrides))
            for text in texts:
                ids = vt.encode(text, add_special_tokens=False).ids
                ids_special = vt.encode(text, add_special_tokens=True).ids
                records.append({"kind": "encode", "variant": name, "text": text, "ids": ids,
                                "ids_special": ids_special,
                                "decoded": vt.decode(ids, skip_special_tokens=False),
                                "decoded_skip_special": vt.decode(ids_special, skip_special_tokens=True)})
            ok_variants[name] = overrides
        except Exception as e:  # keep the other variants; the failure is recorded
            info["variants_failed"][name] = repr(e)
            print(f"variant {name} failed: {e!r}", file=sys.stderr)

    for pname, pattern in PATTERNS.items():
        try:
            split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
            for text in texts:
                pieces = [p for p, _ in split.pre_tokenize_str(text)]
                records.append({"kind": "split", "pattern": pname, "text": text, "pieces": pieces})
        except Exception as e:
            info["variants_failed"]["split_" + pname] = repr(e)
            print(f"split {pname} failed: {e!r}", file=sys.stderr)

    nfc = normalizers.NFC()
    for text in texts:
        n = nfc.normalize_str(text)
        if n != text:
            records.append({"kind": "nfc", "text": text, "nfc": n})

    rng = random.Random(4321)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    for _ in range(60):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 10))]
        records.append({"kind": "decode", "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                        "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})

    with open(os.path.join(args.out, "expected.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "variants.json"), "w", encoding="utf-8") as f:
        json.dump(ok_variants, f, ensure_ascii=False, indent=2)
    info["num_records"] = len(records)
    info["num_texts"] = len(texts)
    with open(os.path.join(args.out, "fixture_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, ensure_ascii=False, indent=2)

    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(json.dumps(info, ensure_ascii=False))
    print(f"fixtures: {len(records)} records, {total} bytes in {args.out}")
    if total > 1_000_000:
        print("warning: fixtures exceed 1 MB", file=sys.stderr)


if __name__ == "__main__":
    main()
