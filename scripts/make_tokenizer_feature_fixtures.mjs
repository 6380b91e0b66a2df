// Builds HF-parity fixtures for the tokenizer features of the model families (issue 24) in
// tests/fixtures/tokenizer_features/, with Hugging Face `tokenizers` itself: its Node binding
// (npm `tokenizers`, the Rust library of the Python package, same version 0.23.2) and, for the
// tiktoken file, OpenAI's tiktoken core (npm `tiktoken`, the Rust crate compiled to WASM).
//
// Tokenizer files are written here as tokenizer.json JSON and loaded by HF (Tokenizer.fromString),
// so HF parses every field the C++ loader reads. Two bases:
//   ../tokenizer/tokenizer.json  the byte-level BPE that make_tokenizer_fixtures.py trained with
//                                HF (2000 tokens, multilingual corpus)
//   sp_base.json                 SentencePiece-style BPE as Mistral/Mixtral ship it, derived from
//                                it: each token whose bytes are UTF-8 with spaces spelt "▁", the
//                                merges among them, <unk> <s> </s> and the 256 <0xNN> tokens first;
//                                byte_fallback, fuse_unk, Prepend("▁") + Replace(" ", "▁"),
//                                decoders Replace/ByteFallback/Fuse/Strip, a <s> template
// Each fixture <name>.json = {"name", "description", "base", "set", "cases", "decode_cases"}: "set"
// replaces tokenizer.json fields of the base ("model.ignore_merges" one level down); cases record
// for every test text (Arabic, Kazakh, Chinese, emoji, code, whitespace runs, added-token strings,
// Unicode 15/16 code points) HF's encode without/with special tokens and decode without/with
// skipping special tokens; decode_cases decode random id lists. refusals.json lists tokenizer.json
// files HF refuses to load (the C++ loader must refuse them too). kimi_tiktoken/ holds a
// tiktoken.model (the base's byte-level tokens as ranks), a Kimi-K2 style tokenizer_config.json and
// expected.json from tiktoken with Kimi's split regex. fixture_info.json: versions and counts.
// unicode_classes.json: for each regex class the patterns use (\p{L}, \p{Lu}, ..., \s, \w, \d,
// \p{Han}, Kimi's intersection), the code points HF's Oniguruma puts in it, as ranges.
// tests/cpu/test_tokenizer_features.cpp reads them (and exits 77, skipped, when they are absent).
//
// Usage:
//   npm install --prefix /tmp/hfnode tokenizers@0.23.2 tiktoken@1.0.22
//   node scripts/make_tokenizer_feature_fixtures.mjs --node-modules /tmp/hfnode/node_modules \
//        --out tests/fixtures/tokenizer_features
import { createRequire } from 'node:module';
import { mkdirSync, readFileSync, writeFileSync, readdirSync, statSync } from 'node:fs';
import { join, dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const args = Object.fromEntries(
    process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith('--') ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
if (!args.out || !args['node-modules']) {
    console.error('usage: make_tokenizer_feature_fixtures.mjs --node-modules DIR --out DIR');
    process.exit(2);
}
const require = createRequire(join(resolve(args['node-modules']), 'noop.js'));
const { Tokenizer } = require('tokenizers');
const { Tiktoken } = require('tiktoken');
const packageVersion = (name) =>
    JSON.parse(readFileSync(join(resolve(args['node-modules']), name, 'package.json'), 'utf8')).version;
const versions = { tokenizers: packageVersion('tokenizers'), tiktoken: packageVersion('tiktoken'), node: process.version };
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const out = resolve(args.out);
mkdirSync(out, { recursive: true });

const META = '\u2581';
const O200K =
    String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|` +
    String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|` +
    String.raw`\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
const TEKKEN =
    String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|` +
    String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|` +
    String.raw`\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
const GLM45 = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
const KIMI = [
    String.raw`[\p{Han}]+`,
    String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
    String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
    String.raw`\p{N}{1,3}`,
    String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
    String.raw`\s*[\r\n]+`,
    String.raw`\s+(?!\S)`,
    String.raw`\s+`,
].join('|');
const DEEPSEEK_V3 = [
    String.raw`\p{N}{1,3}`,
    '[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+',
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*" +
        '|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
];

// --- test texts ----------------------------------------------------------------------------------------
const HANDWRITTEN = [
    '', ' ', 'a', 'hello world', ' hello', '  two leading', 'trailing  ', 'Hello, world!', "It's, I'M, they'RE, don't",
    '1234567890 12 123 1234 ٣٤٥ ١٢٣٤ Ⅻ ½ ² 3.14 -0.5 1,000,000', '\n', '\r\n', '\n\n\n', 'a\n\nb\r\n\r\nc\rd',
    'spaces    before\n    indented line\n\t\ttabbed\n', '   \n   \t  \n', 'word   \t  word',
    'x\u00a0y\u3000z\u2009w\u0085v\u000bu\u000ct\u2028r\u2029q\u200bp',
    'مرحبا بالعالم! كيف حالك اليوم؟', 'السلام عليكم ورحمة الله وبركاته ١٢٣',
    'Сәлем, әлем! Қалың қалай? Мен жақсымын.', 'Қазақстан Республикасы — Орталық Азиядағы мемлекет.',
    '机器学习是人工智能的一个分支。', '你好，世界！今天天气很好。', '中文Hello世界World\'s 日本語テキストとひらがな', '한국어 문장도 있어요.',
    'Emoji 😀 😂 🤖 🚀 👍🏽 ❤️ 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇰🇿 1️⃣', 'emoji😀without🤖spaces',
    'def forward(self, x):\n    h = self.norm(x)\n    return x + self.mlp(h)  # residual\n',
    'for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\n', '{"key": [1, 2, 3], "nested": {"a": null}}',
    'x = [i ** 2 for i in range(10) if i % 3 != 0]', 'SELECT id FROM t WHERE a >= 18;', 'path/to/file.txt https://x.org/a?b=c',
    'Cafe\u0301 café re\u0301sume\u0301 A\u030angstro\u0308m \u1100\u1161\u11a8', 'Türkçe İstanbul ığdır Straße Größe',
    '\u{31350}\u{2EBF0} \u1c89\u1c8a \u{10D40}\u{10D41} new in Unicode 15 and 16',
    '▁already▁metaspace ▁', '<s>hello</s>', 'x<s>y</s>z', '<s> <s>', '<|endoftext|>hi<|im_start|>user\nhey<|im_end|>',
    '<x> a<x> <x>b _<x> (<x>) <x>', 'é<x> 中<x> ²<x> \u200d<x> ①<x> <x>\u200d <x>_ ٣<x>', 'a  <y> b', 'a <z>  b', '<both>   mid  <both>x', 'new york and New York, i love new york',
    'the world, hello world', 'a,b;c!d?e...f--g', '$19.99 & 50% off!!', 'I\'M OK, he\'Ll see; WE\'RE', '<0x41> <0xZZ>',
];
const FRAGMENTS = [
    'hello', 'world', ' ', '  ', '\n', '\t', ',', '.', '!', '?', '123', '4567', '٣', 'Қазақ', 'тілі', 'مرحبا', 'العالم',
    '中文', '世界', '日本', 'テスト', '😀', '👍🏽', '👨‍👩‍👧', 'e\u0301', 'é', "'s", "'LL", 'def', '()', '{}', '->', '==',
    'new york', '<s>', '</s>', '<x>', '<y>', '<z>', '▁', 'ß', 'İ', '\u{31350}', '\u00a0', '\r\n',
];
function randomTexts(n, seed) {
    let state = BigInt(seed);
    const next = () => {
        state = (state * 6364136223846793005n + 1442695040888963407n) & ((1n << 64n) - 1n);
        return Number(state >> 33n);
    };
    const texts = [];
    for (let k = 0; k < n; ++k) {
        const len = 1 + (next() % 12);
        let s = '';
        for (let i = 0; i < len; ++i) s += FRAGMENTS[next() % FRAGMENTS.length];
        texts.push(s);
    }
    return texts;
}
const TEXTS = [...HANDWRITTEN, ...randomTexts(40, 2024)];

// --- tokenizer.json pieces ----------------------------------------------------------------------------
const added = (id, content, flags = {}) => ({
    id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true, ...flags,
});
const split = (pattern, behavior = 'Isolated', invert = false) => ({ type: 'Split', pattern: { Regex: pattern }, behavior, invert });
const byteLevel = (addPrefixSpace = false, useRegex = false) =>
    ({ type: 'ByteLevel', add_prefix_space: addPrefixSpace, trim_offsets: true, use_regex: useRegex });
const seq = (pretokenizers) => ({ type: 'Sequence', pretokenizers });
const metaspace = (scheme, splitOn) => ({ type: 'Metaspace', replacement: META, prepend_scheme: scheme, split: splitOn });

function bytesToUnicode() {
    const bs = [];
    for (let b = 0x21; b <= 0x7e; ++b) bs.push(b);
    for (let b = 0xa1; b <= 0xac; ++b) bs.push(b);
    for (let b = 0xae; b <= 0xff; ++b) bs.push(b);
    const cs = [...bs];
    let n = 0;
    for (let b = 0; b < 256; ++b)
        if (!bs.includes(b)) {
            bs.push(b);
            cs.push(256 + n++);
        }
    const charToByte = new Map();
    bs.forEach((b, i) => charToByte.set(String.fromCodePoint(cs[i]), b));
    return charToByte;
}
const CHAR_TO_BYTE = bytesToUnicode();
const tokenBytes = (token) => Buffer.from([...token].map((c) => CHAR_TO_BYTE.get(c)));
const utf8 = new TextDecoder('utf-8', { fatal: true });
function asText(token) {
    try {
        return utf8.decode(tokenBytes(token));
    } catch {
        return null;
    }
}

const BL_PATH = join(repo, 'tests/fixtures/tokenizer/tokenizer.json');
const blJson = JSON.parse(readFileSync(BL_PATH, 'utf8'));
const blAdded = new Set(blJson.added_tokens.map((a) => a.content));

function makeSpBase() {
    const vocab = { '<unk>': 0, '<s>': 1, '</s>': 2 };
    for (let b = 0; b < 256; ++b) vocab[`<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`] = 3 + b;
    const conv = (t) => {
        const s = asText(t);
        return s === null ? null : s.replaceAll(' ', META);
    };
    const entries = Object.entries(blJson.model.vocab).sort((a, b) => a[1] - b[1]);
    for (const [token] of entries) {
        if (blAdded.has(token)) continue;
        const s = conv(token);
        if (s !== null && s.length > 0 && !(s in vocab)) vocab[s] = Object.keys(vocab).length;
    }
    const merges = [];
    for (const m of blJson.model.merges) {
        const [a, b] = Array.isArray(m) ? m : m.split(' ');
        const ua = conv(a), ub = conv(b), uab = conv(a + b);
        if (ua !== null && ub !== null && uab !== null && ua in vocab && ub in vocab && uab in vocab) merges.push([ua, ub]);
    }
    return {
        version: '1.0', truncation: null, padding: null,
        added_tokens: [added(0, '<unk>'), added(1, '<s>'), added(2, '</s>')],
        normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: META }, { type: 'Replace', pattern: { String: ' ' }, content: META }] },
        pre_tokenizer: null,
        post_processor: {
            type: 'TemplateProcessing',
            single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
            pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
                { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
            special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
        },
        decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: META }, content: ' ' }, { type: 'ByteFallback' },
            { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
        model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
            fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab, merges },
    };
}
const spJson = makeSpBase();
const SP_ADDED = spJson.added_tokens;
const BL_ADDED = blJson.added_tokens;
const nextId = (base) => Math.max(...Object.values(base.model.vocab), ...base.added_tokens.map((a) => a.id)) + 1;

function fixtureSpecs() {
    const sp = (name, description, set) => ({ name, description, base: 'sp_base.json', json: spJson, set });
    const bl = (name, description, set) => ({ name, description, base: '../tokenizer/tokenizer.json', json: blJson, set });
    const specs = [
        sp('sp_byte_fallback', 'Mistral v0.1: byte_fallback, fuse_unk, Prepend+Replace, Strip decoder, <s> template', {}),
        sp('sp_unk_fused', 'no byte_fallback: runs of unknown characters fuse into one <unk>', { 'model.byte_fallback': false }),
        sp('sp_unk_unfused', 'no byte_fallback, fuse_unk false', { 'model.byte_fallback': false, 'model.fuse_unk': false }),
        sp('sp_ignore_merges', 'byte_fallback with ignore_merges', { 'model.ignore_merges': true }),
    ];
    const metaDecoder = (scheme, splitOn) => ({ type: 'Sequence', decoders: [metaspace(scheme, splitOn), { type: 'ByteFallback' }, { type: 'Fuse' }] });
    for (const scheme of ['always', 'first', 'never'])
        for (const splitOn of [true, false])
            specs.push(sp(`metaspace_${scheme}_${splitOn ? 'split' : 'nosplit'}`,
                `Metaspace pre-tokenizer and decoder, prepend_scheme ${scheme}, split ${splitOn}`,
                { normalizer: null, pre_tokenizer: metaspace(scheme, splitOn), decoder: metaDecoder(scheme, splitOn) }));
    specs.push(sp('metaspace_legacy_add_prefix_space', 'Metaspace written with add_prefix_space true and no prepend_scheme',
        { normalizer: null, pre_tokenizer: { type: 'Metaspace', replacement: META, add_prefix_space: true },
            decoder: { type: 'Metaspace', replacement: META, add_prefix_space: true } }));
    specs.push(sp('sp_normalizer_chain', 'Strip, NFC, Replace(regex), Prepend, Replace normalizers', {
        normalizer: { type: 'Sequence', normalizers: [{ type: 'Strip', strip_left: true, strip_right: true }, { type: 'NFC' },
            { type: 'Replace', pattern: { Regex: ' {2,}' }, content: ' ' }, { type: 'Prepend', prepend: META },
            { type: 'Replace', pattern: { String: ' ' }, content: META }] },
    }));
    const spNext = nextId(spJson);
    specs.push(sp('sp_added_flags', 'added tokens: single_word, lstrip, rstrip, both, normalized true/false', {
        added_tokens: [...SP_ADDED,
            added(spNext, '<x>', { single_word: true, special: false }),
            added(spNext + 1, '<y>', { lstrip: true }),
            added(spNext + 2, '<z>', { rstrip: true }),
            added(spNext + 3, '<both>', { lstrip: true, rstrip: true }),
            added(spNext + 4, 'new york', { normalized: true, special: false }),
            added(spNext + 5, 'café', { normalized: true, special: false })],
    }));
    specs.push(sp('metaspace_first_added_flags', 'Metaspace (first, split) with normalized and raw added tokens', {
        normalizer: null, pre_tokenizer: metaspace('first', true), decoder: metaDecoder('first', true),
        added_tokens: [...SP_ADDED,
            added(spNext, '<x>', { single_word: true, special: false }),
            added(spNext + 1, '<y>', { lstrip: true }),
            added(spNext + 2, '<z>', { rstrip: true }),
            added(spNext + 4, 'new york', { normalized: true, special: false })],
    }));
    const blNext = nextId(blJson);
    specs.push(bl('bl_added_flags', 'byte-level: single_word, lstrip, rstrip, normalized added tokens (NFC normalizer)', {
        added_tokens: [...BL_ADDED,
            added(blNext, '<x>', { single_word: true, special: false }),
            added(blNext + 1, '<y>', { lstrip: true }),
            added(blNext + 2, '<z>', { rstrip: true }),
            added(blNext + 3, '<both>', { lstrip: true, rstrip: true }),
            added(blNext + 4, ' world', { normalized: true, special: false }),
            added(blNext + 5, 'cafe\u0301', { normalized: true, special: false })],
    }));
    specs.push(bl('o200k', 'gpt-oss: o200k split + ByteLevel', { pre_tokenizer: seq([split(O200K), byteLevel()]) }));
    specs.push(bl('o200k_ignore_merges', 'o200k split with ignore_merges', { pre_tokenizer: seq([split(O200K), byteLevel()]), 'model.ignore_merges': true }));
    specs.push(bl('deepseek_v3', 'DeepSeek-V3: three Splits (numbers, CJK, main) + ByteLevel, an empty normalizer Sequence',
        { normalizer: { type: 'Sequence', normalizers: [] }, pre_tokenizer: seq([...DEEPSEEK_V3.map((p) => split(p)), byteLevel()]) }));
    specs.push(bl('glm45', 'GLM-4.5: Llama-3 style split + ByteLevel', { normalizer: null, pre_tokenizer: seq([split(GLM45), byteLevel()]) }));
    specs.push(bl('nemotron_tekken', 'Nemotron 3: tekken split + ByteLevel', { normalizer: null, pre_tokenizer: seq([split(TEKKEN), byteLevel()]) }));
    specs.push(bl('kimi_split', "Kimi-K2's Han-aware split (class intersection) + ByteLevel, ignore_merges",
        { normalizer: null, pre_tokenizer: seq([split(KIMI), byteLevel()]), 'model.ignore_merges': true }));
    specs.push(bl('bytelevel_gpt2_regex', 'ByteLevel with its own GPT-2 regex and add_prefix_space', { pre_tokenizer: byteLevel(true, true) }));
    for (const behavior of ['Removed', 'Isolated', 'MergedWithPrevious', 'MergedWithNext', 'Contiguous'])
        for (const invert of [false, true])
            specs.push(bl(`split_${behavior}${invert ? '_invert' : ''}`, `Split behaviour ${behavior}, invert ${invert}`,
                { pre_tokenizer: seq([split(String.raw`\s+|[,.;]`, behavior, invert), byteLevel()]) }));
    specs.push(bl('split_string_merged_with_next', 'Split on a string, MergedWithNext',
        { pre_tokenizer: seq([{ type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithNext', invert: false }, byteLevel()]) }));
    specs.push(bl('digits_punctuation', 'Digits(individual) + Punctuation(Contiguous) + ByteLevel(use_regex)',
        { pre_tokenizer: seq([{ type: 'Digits', individual_digits: true }, { type: 'Punctuation', behavior: 'Contiguous' }, byteLevel(false, true)]) }));
    specs.push(bl('digits_contiguous', 'Digits(contiguous) + Punctuation(MergedWithNext) + ByteLevel(add_prefix_space)',
        { pre_tokenizer: seq([{ type: 'Digits', individual_digits: false }, { type: 'Punctuation', behavior: 'MergedWithNext' }, byteLevel(true, false)]) }));
    return specs;
}

function applySet(base, set) {
    const root = structuredClone(base);
    for (const [key, value] of Object.entries(set)) {
        const dot = key.indexOf('.');
        if (dot < 0) root[key] = value;
        else root[key.slice(0, dot)][key.slice(dot + 1)] = value;
    }
    return root;
}

async function recordCases(tok) {
    const cases = [];
    for (const text of TEXTS) {
        const ids = [...(await tok.encode(text, null, { addSpecialTokens: false })).getIds()];
        const idsSpecial = [...(await tok.encode(text, null, { addSpecialTokens: true })).getIds()];
        cases.push({ text, ids, ids_special: idsSpecial, decoded: await tok.decode(ids, false),
            decoded_skip_special: await tok.decode(idsSpecial, true) });
    }
    const size = tok.getVocabSize(true);
    let state = 12345;
    const rand = (n) => {
        state = (state * 1103515245 + 12345) % 2147483648;
        return state % n;
    };
    const decodeCases = [];
    for (let k = 0; k < 30; ++k) {
        const ids = Array.from({ length: 1 + rand(8) }, () => rand(size));
        decodeCases.push({ ids, decoded: await tok.decode(ids, false), decoded_skip_special: await tok.decode(ids, true) });
    }
    return { cases, decodeCases };
}

// tokenizer.json files HF refuses to load: the loader must refuse them as well.
function refusals() {
    const bad = [
        ['metaspace add_prefix_space false without prepend_scheme never',
            { pre_tokenizer: { type: 'Metaspace', replacement: META, add_prefix_space: false } }],
        ['metaspace replacement of two characters', { pre_tokenizer: { type: 'Metaspace', replacement: 'ab', prepend_scheme: 'always', split: true } }],
        ['metaspace unknown prepend_scheme', { pre_tokenizer: { type: 'Metaspace', replacement: META, prepend_scheme: 'sometimes', split: true } }],
        ['split without behavior', { pre_tokenizer: { type: 'Split', pattern: { String: ' ' }, invert: false } }],
        ['strip decoder without stop', { decoder: { type: 'Strip', content: ' ', start: 1 } }],
        ['replace normalizer without content', { normalizer: { type: 'Replace', pattern: { String: ' ' } } }],
        ['byte_fallback not a boolean', { 'model.byte_fallback': 'yes' }],
        ['unknown pre-tokenizer type', { pre_tokenizer: { type: 'NoSuchPreTokenizer' } }],
        ['merge of a token not in the vocabulary', { 'model.merges': [['\u2581', 'no-such-token']] }],
    ];
    const outList = [];
    for (const [what, set] of bad) {
        const json = applySet(spJson, set);
        let hfError = null;
        try {
            Tokenizer.fromString(JSON.stringify(json));
        } catch (e) {
            hfError = String(e.message ?? e);
        }
        if (hfError === null) {
            console.log(`refusal "${what}": HF loads it; left out`);
            continue;
        }
        outList.push({ what, set, hf_error: hfError });
    }
    return outList;
}

function kimiTiktoken() {
    // Ranks: the base's model tokens (not its added tokens) as bytes, in id order.
    const entries = Object.entries(blJson.model.vocab).filter(([t]) => !blAdded.has(t)).sort((a, b) => a[1] - b[1]);
    const lines = entries.map(([t], rank) => `${tokenBytes(t).toString('base64')} ${rank}`);
    const n = lines.length;
    const singles = new Set(entries.filter(([t]) => tokenBytes(t).length === 1).map(([t]) => tokenBytes(t)[0]));
    if (singles.size !== 256) throw new Error(`the base has ${singles.size} single-byte tokens, tiktoken needs 256`);
    const special = { '[BOS]': n, '<|im_end|>': n + 1 };
    for (let i = n + 2; i < n + 256; ++i) special[`<|reserved_token_${i}|>`] = i;
    const ranks = lines.join('\n') + '\n';
    const enc = new Tiktoken(ranks, special, KIMI);
    const dir = join(out, 'kimi_tiktoken');
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'tiktoken.model'), ranks);
    const decoderEntries = {};
    for (const [content, id] of Object.entries(special).slice(0, 2))
        decoderEntries[String(id)] = { content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: true };
    writeFileSync(join(dir, 'tokenizer_config.json'), JSON.stringify({
        auto_map: { AutoTokenizer: ['tokenization_kimi.TikTokenTokenizer', null] },
        added_tokens_decoder: decoderEntries, bos_token: '[BOS]', eos_token: '<|im_end|>',
    }, null, 1) + '\n');
    const lossy = new TextDecoder('utf-8');
    const cases = [];
    for (const text of [...TEXTS, '[BOS]hello<|im_end|>', `x<|reserved_token_${n + 40}|>y`]) {
        const ids = [...enc.encode(text, 'all')];
        cases.push({ text, ids, decoded: lossy.decode(enc.decode(Uint32Array.from(ids))) });
    }
    enc.free();
    writeFileSync(join(dir, 'expected.json'), JSON.stringify({ num_ranks: n, cases }) + '\n');
    return cases.length;
}

// Which code points HF's regex engine (Oniguruma, Unicode 16) puts in each class the families'
// patterns use: Split(class, Removed) over every scalar value but the surrogates; what it removes
// matched. Stored as inclusive [first, last] ranges a class.
function unicodeClasses() {
    const classes = ['\\p{L}', '\\p{Lu}', '\\p{Ll}', '\\p{Lt}', '\\p{Lm}', '\\p{Lo}', '\\p{M}', '\\p{Mn}', '\\p{Mc}',
        '\\p{Me}', '\\p{N}', '\\p{Nd}', '\\p{Nl}', '\\p{No}', '\\p{P}', '\\p{S}', '\\p{Sm}', '\\p{Sc}', '\\p{Sk}',
        '\\p{So}', '\\p{Z}', '\\p{Zs}', '\\p{C}', '\\p{Cc}', '\\p{Cf}', '\\p{Co}', '\\p{Cn}', '\\s', '\\w', '\\d',
        '\\p{Han}', '[^\\r\\n\\p{L}\\p{N}]', '[\\p{L}&&[^\\p{Han}]]', '(?i:[a-z])', '(?i:[sdtmlvre])', '(?i:k|s)'];
    const scalars = [];
    for (let cp = 0; cp <= 0x10ffff; ++cp)
        if (cp < 0xd800 || cp > 0xdfff) scalars.push(cp);
    const chunk = 1 << 15;
    const result = {};
    for (const cls of classes) {
        const tok = Tokenizer.fromString(JSON.stringify({ ...spJson, normalizer: null, pre_tokenizer: split(cls, 'Removed') }));
        const pre = tok.getPreTokenizer();
        const matched = new Uint8Array(0x110000);
        for (let start = 0; start < scalars.length; start += chunk) {
            const part = scalars.slice(start, start + chunk);
            part.forEach((cp) => (matched[cp] = 1));
            for (const [, [b, e]] of pre.preTokenizeString(String.fromCodePoint(...part)))
                for (let k = b; k < e; ++k) matched[part[k]] = 0;
        }
        const ranges = [];
        for (let cp = 0; cp <= 0x10ffff; ++cp) {
            if (!matched[cp]) continue;
            const last = ranges[ranges.length - 1];
            if (last && last[1] + 1 === cp) last[1] = cp;
            else ranges.push([cp, cp]);
        }
        result[cls] = ranges;
    }
    writeFileSync(join(out, 'unicode_classes.json'), JSON.stringify({ note: 'surrogates D800-DFFF not tested', classes: result }) + '\n');
    return classes.length;
}

const counts = {};
const failed = {};
writeFileSync(join(out, 'sp_base.json'), JSON.stringify(spJson) + '\n');
for (const spec of fixtureSpecs()) {
    const json = applySet(spec.json, spec.set);
    let tok;
    try {
        tok = Tokenizer.fromString(JSON.stringify(json));
    } catch (e) {
        failed[spec.name] = String(e.message ?? e);
        console.error(`${spec.name}: HF refused it: ${failed[spec.name]}`);
        continue;
    }
    const { cases, decodeCases } = await recordCases(tok);
    writeFileSync(join(out, `${spec.name}.json`), JSON.stringify({
        name: spec.name, description: spec.description, base: spec.base, set: spec.set, cases, decode_cases: decodeCases,
    }) + '\n');
    counts[spec.name] = cases.length + decodeCases.length;
}
const refused = refusals();
writeFileSync(join(out, 'refusals.json'), JSON.stringify({ base: 'sp_base.json', refusals: refused }, null, 1) + '\n');
counts.refusals = refused.length;
counts.kimi_tiktoken = kimiTiktoken();
counts.unicode_classes = unicodeClasses();
const total = Object.values(counts).reduce((a, b) => a + b, 0);
const info = { versions, counts, failed, total };
writeFileSync(join(out, 'fixture_info.json'), JSON.stringify(info, null, 2) + '\n');
let bytes = 0;
const walk = (d) => readdirSync(d).forEach((f) => {
    const p = join(d, f);
    if (statSync(p).isDirectory()) walk(p);
    else bytes += statSync(p).size;
});
walk(out);
console.log(JSON.stringify(info));
console.log(`${Object.keys(counts).length} fixtures, ${total} records, ${bytes} bytes in ${out}`);
