// Tokenizer features of the families beyond byte-level BPE (Mistral/Mixtral's SentencePiece-style
// BPE, DeepSeek-V3's, GLM-4.5's, Nemotron 3's and gpt-oss's split regexes, Kimi-K2's tiktoken file),
// on small tokenizer.json files written here by hand. Every expected encoding is worked out by hand
// from HF `tokenizers`' algorithm (the comment beside it shows the steps), never taken from the code
// under test. HF-made fixtures for the same features come from scripts/make_tokenizer_feature_fixtures.py
// (test_tokenizer_features.cpp reads them).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/json.h"
#include "test_util.h"
#include "text/regex.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

namespace fs = std::filesystem;
using mf::json::Value;
using mf::text::Regex;
using mf::text::Tokenizer;
using Ids = std::vector<int32_t>;

namespace {

Value parse(const std::string& s) { return mf::json::parse(s, "test json"); }

// --- a SentencePiece-style vocabulary (as Mistral's) ------------------------------------------------
// ids: <unk> 0, <s> 1, </s> 2, <0x00>..<0xFF> 3..258 (so <0xNN> is 3 + 0xNN), then the pieces below.
constexpr int32_t kByte0 = 3;
constexpr int32_t kMeta = 259, kH = 260, kE = 261, kL = 262, kO = 263, kMetaH = 264, kLL = 265, kMetaHe = 266,
                  kMetaHell = 267, kMetaHello = 268;

Value sp_model(bool byte_fallback, bool fuse_unk) {
    Value vocab = Value::object();
    vocab.set("<unk>", 0);
    vocab.set("<s>", 1);
    vocab.set("</s>", 2);
    for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        vocab.set(name, kByte0 + b);
    }
    const char* pieces[] = {
        "\xE2\x96\x81",     "h", "e", "l", "o", "\xE2\x96\x81h", "ll", "\xE2\x96\x81he", "\xE2\x96\x81hell",
        "\xE2\x96\x81hello"};
    for (int k = 0; k < 10; ++k) vocab.set(pieces[k], kMeta + k);
    // Merge ranks: 0 "▁ h", 1 "l l", 2 "▁h e", 3 "▁he ll", 4 "▁hell o".
    Value merges = parse(R"(["▁ h", "l l", "▁h e", "▁he ll", "▁hell o"])");
    Value model = Value::object();
    model.set("type", "BPE");
    model.set("unk_token", "<unk>");
    model.set("byte_fallback", byte_fallback);
    model.set("fuse_unk", fuse_unk);
    model.set("vocab", std::move(vocab));
    model.set("merges", std::move(merges));
    return model;
}

// HF requires every AddedToken field; these are in the vocabulary, so they keep its ids.
const char* kSpAddedTokens = R"([
    {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}])";

// Mistral 7B v0.1's pipeline: Prepend("▁") + Replace(" ", "▁") normalizers, no pre-tokenizer, and
// the decoders Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0); BOS added by the template.
Tokenizer sentencepiece_tokenizer(bool byte_fallback = true, bool fuse_unk = true) {
    Value root = Value::object();
    root.set("added_tokens", parse(kSpAddedTokens));
    root.set("normalizer", parse(R"({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})"));
    root.set("pre_tokenizer", Value());
    root.set("post_processor", parse(R"({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}})"));
    root.set("decoder", parse(R"({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})"));
    root.set("model", sp_model(byte_fallback, fuse_unk));
    return Tokenizer::from_json(root.dump(), "sp/tokenizer.json");
}

// Mixtral 8x22B's newer form: no normalizer, a Metaspace pre-tokenizer and the Metaspace decoder
// (+ ByteFallback, Fuse).
Tokenizer metaspace_tokenizer(const std::string& scheme, bool split) {
    Value root = Value::object();
    root.set("added_tokens", parse(kSpAddedTokens));
    Value meta = parse(R"({"type": "Metaspace", "replacement": "▁"})");
    meta.set("prepend_scheme", scheme);
    meta.set("split", split);
    root.set("pre_tokenizer", meta);
    Value decoders = Value::array();
    decoders.push_back(meta);
    decoders.push_back(parse(R"({"type": "ByteFallback"})"));
    decoders.push_back(parse(R"({"type": "Fuse"})"));
    Value decoder = Value::object();
    decoder.set("type", "Sequence");
    decoder.set("decoders", std::move(decoders));
    root.set("decoder", std::move(decoder));
    root.set("model", sp_model(true, true));
    return Tokenizer::from_json(root.dump(), "metaspace/tokenizer.json");
}

Ids bytes_of(const std::string& s) {
    Ids ids;
    for (unsigned char c : s) ids.push_back(kByte0 + c);
    return ids;
}

Ids cat(std::initializer_list<Ids> parts) {
    Ids out;
    for (const Ids& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

}  // namespace

// --- SentencePiece-style BPE: byte_fallback, unk, Prepend/Replace, its decoders ----------------------

TEST(SentencePieceBpe, EncodesWithPrependReplaceAndMerges) {
    const Tokenizer tok = sentencepiece_tokenizer();
    // "hello" -> normalised "▁hello" -> ▁ h e l l o; merges by rank: ▁h (0), ll (1), ▁he (2),
    // ▁hell (3), ▁hello (4).
    EXPECT_EQ(tok.encode("hello"), Ids({kMetaHello}));
    // The template adds <s> (id 1) in front with add_special_tokens.
    EXPECT_EQ(tok.encode("hello", true), Ids({1, kMetaHello}));
    // "hello hello" -> "▁hello▁hello": no pre-tokenizer, one word; both halves merge the same way
    // (no merge joins o and ▁).
    EXPECT_EQ(tok.encode("hello hello"), Ids({kMetaHello, kMetaHello}));
    // "oh" -> "▁oh": ▁ o h; no merge applies (▁h needs ▁ next to h).
    EXPECT_EQ(tok.encode("oh"), Ids({kMeta, kO, kH}));
    // The empty text stays empty: Prepend only acts on non-empty text.
    EXPECT_EQ(tok.encode(""), Ids());
    EXPECT_EQ(tok.encode("", true), Ids({1}));
}

TEST(SentencePieceBpe, ByteFallbackSpellsUnknownCharactersInBytes) {
    const Tokenizer tok = sentencepiece_tokenizer();
    // "hello ñ" -> "▁hello▁ñ": ▁hello, ▁, then ñ (C3 B1) is not in the vocabulary: <0xC3> <0xB1>.
    EXPECT_EQ(tok.encode("hello ñ"), Ids({kMetaHello, kMeta, kByte0 + 0xC3, kByte0 + 0xB1}));
    // An emoji (F0 9F 98 80) and a Chinese character (E4 B8 AD): four and three byte tokens.
    EXPECT_EQ(tok.encode("😀中"), cat({{kMeta}, bytes_of("😀"), bytes_of("中")}));
    // A newline and a tab are bytes too.
    EXPECT_EQ(tok.encode("h\n\t"), Ids({kMetaH, kByte0 + 0x0A, kByte0 + 0x09}));
}

TEST(SentencePieceBpe, UnknownCharactersWithoutByteFallback) {
    // fuse_unk: the run ññ becomes one <unk>; without it, one <unk> each.
    EXPECT_EQ(sentencepiece_tokenizer(false, true).encode("hello ññ"), Ids({kMetaHello, kMeta, 0}));
    EXPECT_EQ(sentencepiece_tokenizer(false, false).encode("hello ññ"), Ids({kMetaHello, kMeta, 0, 0}));
    // Unknown characters on both sides of a known one stay apart: ñ h ñ -> <unk> h <unk> after ▁.
    EXPECT_EQ(sentencepiece_tokenizer(false, true).encode("ñhñ"), Ids({kMeta, 0, kH, 0}));
}

TEST(SentencePieceBpe, DecodersUndoTheNormalizer) {
    const Tokenizer tok = sentencepiece_tokenizer();
    // [▁hello, ▁, <0xC3>, <0xB1>] -> Replace: " hello", " ", bytes -> ByteFallback: "ñ" -> Fuse:
    // " hello ñ" -> Strip one leading space: "hello ñ".
    EXPECT_EQ(tok.decode({kMetaHello, kMeta, kByte0 + 0xC3, kByte0 + 0xB1}), "hello ñ");
    // A run of byte tokens that is not valid UTF-8 as a whole becomes one U+FFFD per byte (HF's
    // ByteFallback), even though its first two bytes alone would be "ñ".
    EXPECT_EQ(tok.decode({kByte0 + 0xC3, kByte0 + 0xB1, kByte0 + 0xC3}), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
    // Special tokens: kept or skipped.
    EXPECT_EQ(tok.decode({1, kMetaHello, 2}), "<s> hello</s>");
    EXPECT_EQ(tok.decode({1, kMetaHello, 2}, true), "hello");
}

TEST(SentencePieceBpe, RoundTripsMultilingualText) {
    const Tokenizer tok = sentencepiece_tokenizer();
    // Every byte has a token and the decoders invert the normalizer, so decode(encode(s)) == s for
    // text without "▁" or added-token strings.
    const char* texts[] = {"hello world",
                           "مرحبا بكم في هذا الاختبار",
                           "Қазақ тілі — түркі тілдерінің бірі.",
                           "数字と漢字のテスト、中文分词测试。",
                           "emoji 🙂🌊🦓 and 👨‍👩‍👧 family",
                           "def f(x):\n    return {'k': [1, 2]}\n",
                           "  leading,\ttabs\n\n\nand   runs   ",
                           "\xC3\xB1\xCC\x83 combining"};
    for (const char* s : texts) EXPECT_EQ(tok.decode(tok.encode(s)), s) << s;
}

TEST(SentencePieceBpe, AddedTokensSplitTheTextFirst) {
    const Tokenizer tok = sentencepiece_tokenizer();
    // "<s>hello</s>": the added tokens are cut out of the raw text first; "hello" between them is
    // normalised on its own ("▁hello", Prepend applies to every segment).
    EXPECT_EQ(tok.encode("<s>hello</s>"), Ids({1, kMetaHello, 2}));
    EXPECT_EQ(tok.encode("<s>hello</s>", true), Ids({1, 1, kMetaHello, 2}));
}

// --- Metaspace --------------------------------------------------------------------------------------

TEST(Metaspace, PrependSchemes) {
    // "hello": always and first (at the start of the input) -> "▁hello" -> ▁hello; never -> "hello"
    // -> h e l l o with only "l l" applying.
    EXPECT_EQ(metaspace_tokenizer("always", false).encode("hello"), Ids({kMetaHello}));
    EXPECT_EQ(metaspace_tokenizer("first", false).encode("hello"), Ids({kMetaHello}));
    EXPECT_EQ(metaspace_tokenizer("never", false).encode("hello"), Ids({kH, kE, kLL, kO}));
    // After an added token the segment does not start at offset 0: "first" no longer prepends.
    EXPECT_EQ(metaspace_tokenizer("first", false).encode("<s>hello"), Ids({1, kH, kE, kLL, kO}));
    EXPECT_EQ(metaspace_tokenizer("always", false).encode("<s>hello"), Ids({1, kMetaHello}));
    // A piece already starting with a space (-> "▁") gets no second one: " hello" -> "▁hello".
    EXPECT_EQ(metaspace_tokenizer("always", false).encode(" hello"), Ids({kMetaHello}));
}

TEST(Metaspace, SplitMakesEachReplacementStartAWord) {
    // "hello  hello" -> "▁hello▁▁hello"; split (MergedWithNext on ▁): "▁hello" "▁" "▁hello".
    EXPECT_EQ(metaspace_tokenizer("always", true).encode("hello  hello"), Ids({kMetaHello, kMeta, kMetaHello}));
    // Without split it is one word: ▁ h e l l o ▁ ▁ h e l l o; the second ▁ merges with h (rank 0
    // at either position), the first stays alone: the same ids here.
    EXPECT_EQ(metaspace_tokenizer("always", false).encode("hello  hello"), Ids({kMetaHello, kMeta, kMetaHello}));
    // "ho ho" -> "▁ho▁ho" -> split "▁ho" "▁ho" -> each: ▁ h o -> ▁h o.
    EXPECT_EQ(metaspace_tokenizer("always", true).encode("ho ho"), Ids({kMetaH, kO, kMetaH, kO}));
}

TEST(Metaspace, DecoderDropsTheFirstTokensReplacements) {
    const Tokenizer first = metaspace_tokenizer("first", true);
    // [▁hello, ▁, ▁hello] -> token 0 loses its ▁ ("hello"), the others turn ▁ into spaces.
    EXPECT_EQ(first.decode({kMetaHello, kMeta, kMetaHello}), "hello  hello");
    // HF drops every ▁ of token 0 (not only a leading one): [▁, ▁hello] -> "" + " hello".
    EXPECT_EQ(first.decode({kMeta, kMetaHello}), " hello");
    // prepend_scheme never keeps them all.
    EXPECT_EQ(metaspace_tokenizer("never", true).decode({kMetaHello, kMeta}), " hello ");
    // Round trips for text that does not start with a space (a leading space is lost, as in HF:
    // " hello" encodes to [▁hello] and decodes to "hello").
    for (const char* s : {"hello  world", "Қазақ тілі", "中文 和 emoji 🙂", "a\nb\n\n c"})
        EXPECT_EQ(first.decode(first.encode(s)), s) << s;
    EXPECT_EQ(first.decode(first.encode(" hello")), "hello");
}

// --- pre-tokenizers: Split behaviours, Digits, Punctuation ----------------------------------------------

namespace {

// A tokenizer whose vocabulary holds the characters and the pieces listed, with ignore_merges and no
// merges: a piece that is in the vocabulary comes out as one id, any other as one id a character.
// So the ids show how the pre-tokenizer cut the text.
Tokenizer piece_tokenizer(const Value& pre_tokenizer, const std::vector<std::string>& pieces,
                          const std::string& added_tokens = "[]", const Value& normalizer = Value()) {
    Value vocab = Value::object();
    int32_t id = 0;
    for (const std::string& p : pieces) vocab.set(p, id++);
    Value model = Value::object();
    model.set("type", "BPE");
    model.set("ignore_merges", true);
    model.set("vocab", std::move(vocab));
    model.set("merges", Value::array());
    Value root = Value::object();
    root.set("model", std::move(model));
    root.set("pre_tokenizer", pre_tokenizer);
    root.set("normalizer", normalizer);
    root.set("added_tokens", parse(added_tokens));
    return Tokenizer::from_json(root.dump(), "pieces/tokenizer.json");
}

// The pieces of `text` as the tokens of piece_tokenizer's ids.
std::vector<std::string> pieces_of(const Tokenizer& tok, const std::string& text) {
    std::vector<std::string> out;
    for (int32_t id : tok.encode(text)) out.push_back(tok.id_to_token(id));
    return out;
}

using Pieces = std::vector<std::string>;

}  // namespace

TEST(PreTokenizers, SplitBehaviours) {
    // "a-b--c" split on "-": gaps and matches are a | - | b | - | - | c.
    const Pieces vocab = {"a", "b", "c", "-", "a-", "b-", "-b", "-c", "--"};
    auto split = [&](const std::string& behavior, bool invert) {
        Value p = parse(R"({"type": "Split", "pattern": {"String": "-"}})");
        p.set("behavior", behavior);
        p.set("invert", invert);
        return pieces_of(piece_tokenizer(p, vocab), "a-b--c");
    };
    EXPECT_EQ(split("Removed", false), Pieces({"a", "b", "c"}));
    EXPECT_EQ(split("Isolated", false), Pieces({"a", "-", "b", "-", "-", "c"}));
    // A match joins the split before it when that was not a match: "a-" "b-", then the second "-"
    // (after a match) stands alone.
    EXPECT_EQ(split("MergedWithPrevious", false), Pieces({"a-", "b-", "-", "c"}));
    // From the end: "-c" (match before a non-match), "-" (before a match), "-b", "a".
    EXPECT_EQ(split("MergedWithNext", false), Pieces({"a", "-b", "-", "-c"}));
    EXPECT_EQ(split("Contiguous", false), Pieces({"a", "-", "b", "--", "c"}));
    // invert: the gaps are the delimiters; Removed then keeps the dashes only.
    EXPECT_EQ(split("Removed", true), Pieces({"-", "-", "-"}));
    // Regex patterns too: \d+ isolated in "ab12c3" -> ab 12 c 3 (vocab has "ab" and "12").
    Value re = parse(R"({"type": "Split", "pattern": {"Regex": "\\d+"}, "behavior": "Isolated", "invert": false})");
    EXPECT_EQ(pieces_of(piece_tokenizer(re, {"a", "b", "c", "1", "2", "3", "ab", "12"}), "ab12c3"),
              Pieces({"ab", "12", "c", "3"}));
}

TEST(PreTokenizers, DigitsAndPunctuation) {
    const Pieces vocab = {"a", "1", "2", "3", "12", "123", ",", "!", "a1", "$", "٣", "a,", "!!"};
    // individual_digits: each digit (Nd, Nl, No: also Arabic-Indic ٣) its own piece.
    EXPECT_EQ(pieces_of(piece_tokenizer(parse(R"({"type": "Digits", "individual_digits": true})"), vocab), "a123٣"),
              Pieces({"a", "1", "2", "3", "٣"}));
    // Otherwise a run of digits is one piece (Contiguous): "a" "123".
    EXPECT_EQ(pieces_of(piece_tokenizer(parse(R"({"type": "Digits", "individual_digits": false})"), vocab), "a123"),
              Pieces({"a", "123"}));
    // Punctuation (Isolated by default): Unicode P* and ASCII punctuation, which includes "$" (a
    // symbol, Sc, in Unicode).
    const Tokenizer punct = piece_tokenizer(parse(R"({"type": "Punctuation"})"), vocab);
    EXPECT_EQ(pieces_of(punct, "a,a!!$"), Pieces({"a", ",", "a", "!", "!", "$"}));
    const Tokenizer contiguous = piece_tokenizer(parse(R"({"type": "Punctuation", "behavior": "Contiguous"})"), vocab);
    EXPECT_EQ(pieces_of(contiguous, "a!!"), Pieces({"a", "!!"}));
    const Tokenizer merged =
        piece_tokenizer(parse(R"({"type": "Punctuation", "behavior": "MergedWithPrevious"})"), vocab);
    EXPECT_EQ(pieces_of(merged, "a,1"), Pieces({"a,", "1"}));
}

TEST(PreTokenizers, SequenceAppliesEachInTurn) {
    // Digits (individual) then Punctuation: "12,a" -> "1" "2" ",a" -> "1" "2" "," "a".
    const Value seq = parse(R"({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true}, {"type": "Punctuation", "behavior": "Isolated"}]})");
    EXPECT_EQ(pieces_of(piece_tokenizer(seq, {"1", "2", ",", "a", "12", ",a"}), "12,a"), Pieces({"1", "2", ",", "a"}));
}

// --- added tokens ---------------------------------------------------------------------------------------

TEST(AddedTokens, SingleWordLstripRstripNormalized) {
    const Pieces vocab = {"a", "b", " ", "<", "x", ">", "y", "z", "_"};
    // Not in the vocabulary (9 entries): ids 9, 10, 11, 12 in order, as HF assigns them.
    const std::string added = R"([
        {"id": 9, "content": "<x>", "single_word": true, "lstrip": false, "rstrip": false, "special": false, "normalized": false},
        {"id": 10, "content": "<y>", "single_word": false, "lstrip": true, "rstrip": false, "special": true, "normalized": false},
        {"id": 11, "content": "<z>", "single_word": false, "lstrip": false, "rstrip": true, "special": true, "normalized": false},
        {"id": 12, "content": "ay", "single_word": false, "lstrip": false, "rstrip": false, "special": false, "normalized": true}])";
    // The normalizer turns every "y" into "z": normalized=true tokens are matched after it, with their
    // content normalised the same way ("ay" -> "az").
    const Value replace = parse(R"({"type": "Replace", "pattern": {"String": "y"}, "content": "z"})");
    const Tokenizer tok = piece_tokenizer(Value(), vocab, added, replace);
    // single_word: "<x>" between spaces (or at the ends) is the token; touching a word character it
    // is not, and its characters are encoded one by one.
    EXPECT_EQ(tok.encode("<x> b"), Ids({9, 2, 1}));
    EXPECT_EQ(tok.encode("a<x>"), Ids({0, 3, 4, 5}));
    EXPECT_EQ(tok.encode("<x>b"), Ids({3, 4, 5, 1}));
    EXPECT_EQ(tok.encode("_<x>"), Ids({8, 3, 4, 5}));  // "_" is a word character (\w)
    // lstrip takes the spaces before "<y>", rstrip those after "<z>"; the others stay.
    EXPECT_EQ(tok.encode("a  <y> b"), Ids({0, 10, 2, 1}));
    EXPECT_EQ(tok.encode("a <z>  b"), Ids({0, 2, 11, 1}));
    // "ay" in the raw text normalises to "az", which is the normalised content of token 12.
    EXPECT_EQ(tok.encode("bay"), Ids({1, 12}));
    // "az" typed directly normalises to itself and matches too (HF compares normalised forms).
    EXPECT_EQ(tok.encode("az"), Ids({12}));
    // Without the token, "y" alone is normalised to "z".
    EXPECT_EQ(tok.encode("y"), Ids({7}));
    // special: skipped on request.
    EXPECT_EQ(tok.decode({0, 10, 11}, true), "a");
    EXPECT_TRUE(tok.is_special(10));
    EXPECT_FALSE(tok.is_special(9));
}

TEST(AddedTokens, IdsAreAssignedAsHfDoes) {
    // HF ignores the ids a file gives (it warns): "<p>" is not in the vocabulary (2 entries) and gets
    // id 2; "a" is, and keeps 0; "<q>" gets 3. A second "<p>" entry keeps id 2 and takes its flags
    // (special), and an empty content is skipped.
    const std::string added = R"([
        {"id": 50, "content": "<p>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false},
        {"id": 7, "content": "a", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false},
        {"id": 9, "content": "", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false},
        {"id": 3, "content": "<q>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false},
        {"id": 4, "content": "<p>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}])";
    const Tokenizer tok = piece_tokenizer(Value(), {"a", "b"}, added);
    EXPECT_EQ(tok.token_to_id("<p>"), 2);
    EXPECT_EQ(tok.token_to_id("a"), 0);
    EXPECT_EQ(tok.token_to_id("<q>"), 3);
    EXPECT_EQ(tok.vocab_size(), 4u);
    EXPECT_EQ(tok.encode("<p>a<q>b"), Ids({2, 0, 3, 1}));
    EXPECT_TRUE(tok.is_special(2));
    // Every AddedToken field is required, as in HF.
    try {
        piece_tokenizer(Value(), {"a"}, R"([{"id": 1, "content": "<p>", "special": true}])");
        ADD_FAILURE() << "loaded";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("added_tokens[0]: missing field \"single_word\""), std::string::npos)
            << e.what();
    }
}

// --- normalizers -------------------------------------------------------------------------------------------

TEST(Normalizers, StripPrependReplaceNfcInOrder) {
    const Pieces vocab = {"a", "b", " ", "_", "\xC3\xA9", "e", "\xCC\x81"};
    // Strip both sides, then NFC (e + U+0301 -> é), then Replace(regex " +" -> "_"), then Prepend "_".
    const Value seq = parse(R"({"type": "Sequence", "normalizers": [
        {"type": "Strip", "strip_left": true, "strip_right": true}, {"type": "NFC"},
        {"type": "Replace", "pattern": {"Regex": " +"}, "content": "_"}, {"type": "Prepend", "prepend": "_"}]})");
    const Tokenizer tok = piece_tokenizer(Value(), vocab, "[]", seq);
    // "  a  e\u0301 b \t" -> strip -> "a  e\u0301 b" -> NFC "a  é b" -> "a_é_b" -> "_a_é_b".
    EXPECT_EQ(tok.encode("  a  e\xCC\x81 b \t"), Ids({3, 0, 3, 4, 3, 1}));
    // Only-whitespace text strips to nothing, and Prepend leaves the empty text alone.
    EXPECT_EQ(tok.encode(" \t "), Ids());
}

// --- Unicode 16 and the regex classes of the families' patterns ----------------------------------------

TEST(Unicode16, CategoriesOfRecentCodePoints) {
    using mf::text::Category;
    EXPECT_STREQ(mf::text::unicode_version(), "16.0.0");
    EXPECT_EQ(mf::text::category(0x31350), Category::Lo);  // CJK Extension H (Unicode 15.0)
    EXPECT_EQ(mf::text::category(0x2EBF0), Category::Lo);  // CJK Extension I (Unicode 15.1)
    EXPECT_EQ(mf::text::category(0x1C89), Category::Lu);   // CYRILLIC CAPITAL LETTER TJE (Unicode 16.0)
    EXPECT_EQ(mf::text::category(0x10D40), Category::Nd);  // GARAY DIGIT ZERO (Unicode 16.0)
    EXPECT_EQ(mf::text::category(0x2FFFD), Category::Cn);  // still unassigned
    EXPECT_TRUE(mf::text::is_han(0x4E2D));                 // 中
    EXPECT_TRUE(mf::text::is_han(0x31350));
    EXPECT_TRUE(mf::text::is_han(0x3005));   // 々 is Script=Han
    EXPECT_FALSE(mf::text::is_han(0x3001));  // 、 is Common (Han only in Script_Extensions)
    EXPECT_FALSE(mf::text::is_han(0x3042));  // あ is Hiragana
    // \p{L} on a Unicode 15 ideograph: a letter now (it was unassigned in the old tables).
    EXPECT_EQ(Regex(R"(\p{L}+)").split_isolated("\xF0\xB1\x8D\x90x"), std::vector<std::string>({"\xF0\xB1\x8D\x90x"}));
}

TEST(RegexClasses, WordHanIntersectionNested) {
    size_t end = 0;
    // Oniguruma's \w: Alphabetic, marks, Nd, Pc; below U+0100 its ISO-8859-1 table, which adds
    // ² ³ ¹ ¼ ½ ¾ (No). Join_Control (U+200D) is not in it; other No (①) neither.
    for (const char32_t c : {U'a', U'_', U'٣', U'Ⅻ', U'\u0301', U'中', U'²', U'½'})
        EXPECT_TRUE(Regex(R"(\w)").match_at(std::u32string(1, c), 0, &end)) << uint32_t(c);
    for (const char32_t c : {U'-', U' ', U'€', U'!', U'\u200B', U'\u200D', U'①'})
        EXPECT_FALSE(Regex(R"(\w)").match_at(std::u32string(1, c), 0, &end)) << uint32_t(c);
    EXPECT_TRUE(Regex(R"(\W)").match_at(U"-", 0, &end));
    // \p{Han} and its negation inside an intersection: letters that are not Han.
    const Regex not_han(R"([\p{L}&&[^\p{Han}]]+)");
    EXPECT_TRUE(not_han.match_at(U"abc中", 0, &end));
    EXPECT_EQ(end, 3u);
    EXPECT_FALSE(not_han.match_at(U"中", 0, &end));
    EXPECT_FALSE(not_han.match_at(U"1", 0, &end));
    // Nested classes are unions; a negated outer class negates the whole.
    EXPECT_TRUE(Regex("[a[0-9]]+").match_at(U"a1a", 0, &end));
    EXPECT_EQ(end, 3u);
    EXPECT_FALSE(Regex("[^a[0-9]]").match_at(U"5", 0, &end));
    EXPECT_TRUE(Regex("[^a[0-9]]").match_at(U"b", 0, &end));
    // Chained intersections: letters, not Han, lower case.
    EXPECT_TRUE(Regex(R"([\p{L}&&[^\p{Han}]&&\p{Ll}])").match_at(U"a", 0, &end));
    EXPECT_FALSE(Regex(R"([\p{L}&&[^\p{Han}]&&\p{Ll}])").match_at(U"A", 0, &end));
}

namespace {

// The families' split patterns (as their tokenizer.json / tokenization files spell them).
const char* kDeepSeekNumbers = R"(\p{N}{1,3})";
const char* kDeepSeekCjk = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+";
const char* kDeepSeekMain =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
    "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";
const char* kO200k =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kKimi =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|)"
    R"(\s*[\r\n]+|\s+(?!\S)|\s+)";

using Strings = std::vector<std::string>;

}  // namespace

TEST(FamilyPatterns, DeepSeekV3) {
    // Numbers in threes, then CJK runs, then the main pattern (each Split Isolated).
    EXPECT_EQ(Regex(kDeepSeekNumbers).split_isolated("ab12345c"), Strings({"ab", "123", "45", "c"}));
    EXPECT_EQ(Regex(kDeepSeekCjk).split_isolated("ab中文かなカナ한"), Strings({"ab", "中文かなカナ", "한"}));
    // "Hello": letters; ",": punctuation (alt 3; alt 1 needs a letter after it); " world": a
    // non-letter/punct/symbol char then letters (alt 2); "!\n": punctuation with its newline.
    EXPECT_EQ(Regex(kDeepSeekMain).split_isolated("Hello, world!\n"), Strings({"Hello", ",", " world", "!\n"}));
    // ".com": punctuation then ASCII letters (alt 1). " $x": alt 1 cannot start at the space, alt 2
    // needs a letter after it, alt 3 takes " $"; then "x".
    EXPECT_EQ(Regex(kDeepSeekMain).split_isolated("a.com $x"), Strings({"a", ".com", " $", "x"}));
}

TEST(FamilyPatterns, O200kAndKimi) {
    // o200k: upper-case run then lower-case run with a contraction; Lo (Han) counts as lower case.
    EXPECT_EQ(Regex(kO200k).split_isolated("Hello中文World's"), Strings({"Hello中文", "World's"}));
    // Kimi: Han runs are their own pieces and never join the letter runs.
    EXPECT_EQ(Regex(kKimi).split_isolated("Hello中文World's"), Strings({"Hello", "中文", "World's"}));
    // Shared parts: numbers in threes, " ?punct" with newlines (o200k also takes "/"), spaces.
    EXPECT_EQ(Regex(kO200k).split_isolated("x 12345 ://\n  y"), Strings({"x", " ", "123", "45", " ://\n", " ", " y"}));
    EXPECT_EQ(Regex(kKimi).split_isolated("x 12345 ://\n  y"), Strings({"x", " ", "123", "45", " ://\n", " ", " y"}));
    // (?i:'S) is case-insensitive; "I'M" is upper-case run + contraction.
    EXPECT_EQ(Regex(kKimi).split_isolated("I'M OK"), Strings({"I'M", " OK"}));
}

// --- tiktoken (Kimi-K2) ---------------------------------------------------------------------------------

namespace {

std::string base64(const std::string& bytes) {
    static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    size_t i = 0;
    for (; i + 2 < bytes.size(); i += 3) {
        const uint32_t n =
            (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8) | uint8_t(bytes[i + 2]);
        for (int s = 18; s >= 0; s -= 6) out += k[(n >> s) & 63];
    }
    if (i + 1 == bytes.size()) {
        const uint32_t n = uint32_t(uint8_t(bytes[i])) << 16;
        out += k[(n >> 18) & 63];
        out += k[(n >> 12) & 63];
        out += "==";
    } else if (i + 2 == bytes.size()) {
        const uint32_t n = (uint32_t(uint8_t(bytes[i])) << 16) | (uint32_t(uint8_t(bytes[i + 1])) << 8);
        for (int s = 18; s >= 6; s -= 6) out += k[(n >> s) & 63];
        out += '=';
    }
    return out;
}

// Ranks: the 256 bytes as 0..255, then "he" 256, "ll" 257, "hell" 258, "hello" 259, " world" 260,
// "a中" 261 (its bytes 61 E4 B8 AD).
std::string tiktoken_ranks() {
    std::string out;
    for (int b = 0; b < 256; ++b) out += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
    const char* extra[] = {"he", "ll", "hell", "hello", " world", "a\xE4\xB8\xAD"};
    for (int k = 0; k < 6; ++k) out += base64(extra[k]) + " " + std::to_string(256 + k) + "\n";
    return out;
}
constexpr int32_t kNumRanks = 262;

fs::path kimi_dir(const std::string& name, const std::string& ranks) {
    const fs::path dir = mf::test::temp_dir(name);
    mf::test::write_file(dir / "tiktoken.model", ranks);
    mf::test::write_file(dir / "tokenizer_config.json", R"({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "added_tokens_decoder": {
            "262": {"content": "[BOS]", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true},
            "263": {"content": "<|im_end|>", "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true}},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>"})");
    return dir;
}

}  // namespace

TEST(Tiktoken, KimiDirectoryLoadsWithItsPatternAndSpecialTokens) {
    const fs::path dir = kimi_dir("kimi_tok", tiktoken_ranks());
    EXPECT_TRUE(Tokenizer::found_in(dir));
    EXPECT_FALSE(Tokenizer::found_in(mf::test::temp_dir("no_tokenizer_here")));
    const Tokenizer tok = Tokenizer::load(dir);
    // 262 ranks + 256 reserved special ids.
    EXPECT_EQ(tok.vocab_size(), size_t(kNumRanks + 256));
    EXPECT_EQ(tok.bos_id, std::optional<int32_t>(262));
    EXPECT_EQ(tok.eos_id, std::optional<int32_t>(263));
    EXPECT_EQ(tok.token_to_id("<|reserved_token_270|>"), 270);
    EXPECT_TRUE(tok.is_special(270));
    // "hello world": pieces "hello" and " world", both tokens, taken whole.
    EXPECT_EQ(tok.encode("hello world"), Ids({259, 260}));
    // "hellx": bytes h e l l x; lowest-ranked pair first: he (256), then ll (257), then he+ll = hell
    // (258); x stays a byte (0x78 = 120).
    EXPECT_EQ(tok.encode("hellx"), Ids({258, 120}));
    // "a中": Kimi's pattern cuts "a" from the Han run, so the token "a中" (261) is not used: "a" is
    // byte 97 and 中 its three bytes E4 B8 AD.
    EXPECT_EQ(tok.encode("a中"), Ids({97, 0xE4, 0xB8, 0xAD}));
    // Special tokens in the text are matched as added tokens.
    EXPECT_EQ(tok.encode("[BOS]hello<|im_end|>"), Ids({262, 259, 263}));
    for (const char* s :
         {"hello world", "中文 Қазақ مرحبا 🙂", "  x\n\n\ty  ", "def f():\n    return 1\n"})
        EXPECT_EQ(tok.decode(tok.encode(s)), s) << s;
    EXPECT_EQ(tok.decode({262, 259, 263}, true), "hello");
}

TEST(Tiktoken, HostileFilesAreRefusedByName) {
    auto error_of = [](const std::string& name, const std::string& ranks) -> std::string {
        try {
            Tokenizer::load(kimi_dir(name, ranks));
        } catch (const mf::Error& e) {
            return e.what();
        }
        return "(no error)";
    };
    const std::string good = tiktoken_ranks();
    EXPECT_NE(error_of("kt1", good + "!!!! 262\n").find("line 263"), std::string::npos);
    EXPECT_NE(error_of("kt1", good + "!!!! 262\n").find("not the base64"), std::string::npos);
    EXPECT_NE(error_of("kt2", good + base64("zz") + " 5\n").find("rank 5 is also"), std::string::npos);
    EXPECT_NE(error_of("kt3", good + base64("he") + " 262\n").find("listed twice"), std::string::npos);
    EXPECT_NE(error_of("kt4", good + base64("zz") + " 99999999999\n").find("not in [0,"), std::string::npos);
    EXPECT_NE(error_of("kt5", good + base64("zz") + " 300\n").find("rank 300 is not below the number of tokens, 263"),
              std::string::npos);
    EXPECT_NE(error_of("kt6", good + base64("zz") + "\n").find("expected \"<base64 token> <rank>\""),
              std::string::npos);
    // Rank 0 given to another token: the ranks stay dense, byte 0x00 has no token.
    EXPECT_NE(error_of("kt7", base64("zz") + " 0\n" + good.substr(good.find('\n') + 1)).find("byte 0x00 has no token"),
              std::string::npos);
    EXPECT_NE(error_of("kt8", good + base64("zz") + " 26x\n").find("rank \"26x\""), std::string::npos);
    // An unknown family: no split regex to use.
    const fs::path dir = kimi_dir("kt9", good);
    mf::test::write_file(dir / "tokenizer_config.json",
                         R"({"auto_map": {"AutoTokenizer": ["tokenization_x.T", null]}})");
    try {
        Tokenizer::load(dir);
        ADD_FAILURE() << "loaded";
    } catch (const mf::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("tokenizer_config.json: auto_map.AutoTokenizer names \"tokenization_x.T\""),
                  std::string::npos)
            << msg;
        EXPECT_NE(msg.find("tokenization_kimi (Kimi-K2)"), std::string::npos) << msg;
    }
}

// --- refusals ---------------------------------------------------------------------------------------------

TEST(FamilyRefusals, UnsupportedOrMalformedPartsNameTheirJsonPath) {
    auto error_of = [](const std::function<void(Value&)>& edit) -> std::string {
        Value root = Value::object();
        root.set("model", sp_model(true, true));
        edit(root);
        try {
            Tokenizer::from_json(root.dump(), "x/tokenizer.json");
        } catch (const mf::Error& e) {
            return e.what();
        }
        return "(no error)";
    };
    auto with = [](const std::string& key, const std::string& json) {
        return [=](Value& r) { r.set(key, parse(json)); };
    };
    const std::vector<std::pair<std::function<void(Value&)>, Strings>> cases = {
        {with("pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "X"}]})"),
         {"x/tokenizer.json: pre_tokenizer.pretokenizers[1].type: \"X\" is not supported (supported: ByteLevel, Split, "
          "Metaspace, Digits, Punctuation, Sequence)"}},
        {with("normalizer", R"({"type": "NFKC"})"), {"normalizer.type: \"NFKC\" is not supported (supported: NFC,"}},
        {with("decoder", R"({"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "CTC"}]})"),
         {"decoder.decoders[1].type: \"CTC\" is not supported"}},
        {with("pre_tokenizer", R"({"type": "Metaspace", "replacement": "ab"})"),
         {"pre_tokenizer.replacement: \"ab\" is not one character"}},
        {with("pre_tokenizer", R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "sometimes"})"),
         {"pre_tokenizer.prepend_scheme: \"sometimes\" is not a prepend scheme"}},
        {with("pre_tokenizer", R"({"type": "Metaspace", "replacement": "▁", "add_prefix_space": false})"),
         {"pre_tokenizer.add_prefix_space: false does not match prepend_scheme"}},
        {with("decoder", R"({"type": "Strip", "content": " ", "start": 1, "stop": 1e300})"),
         {"decoder.stop: expected a count"}},
        {with("decoder", R"({"type": "Strip", "content": " ", "start": -1, "stop": 0})"),
         {"decoder.start: expected a count"}},
        {with("normalizer", R"({"type": "Replace", "pattern": {"Regex": "(?<=a)b"}, "content": ""})"),
         {"normalizer.pattern.Regex", "lookbehind"}},
        {with("normalizer", R"({"type": "Replace", "pattern": {"String": ""}, "content": "x"})"),
         {"normalizer.pattern.String: empty pattern string"}},
        {with("normalizer", R"({"type": "Prepend"})"), {"normalizer: missing field \"prepend\""}},
        {with("normalizer",
              R"({"type": "Replace", "pattern": {"String": " "}, "content": ")" + std::string(300, 'x') + "\"}"),
         {"normalizer.content: a string of 300 bytes is not supported (at most 256)"}},
        {with("added_tokens", R"([{"id": 1099511627776, "content": "<big>"}])"),
         {"added_tokens[0].id", "out of range"}},
        {[](Value& r) {
             Value model = sp_model(true, true);
             model.set("merges", parse(R"(["▁ zz"])"));
             r.set("model", model);
         },
         {"model.merges[0]: token \"zz\" is not in the vocabulary"}},
        {[](Value& r) {
             Value model = sp_model(true, true);
             model.set("byte_fallback", 1);
             r.set("model", model);
         },
         {"model.byte_fallback: expected a JSON boolean"}},
    };
    for (size_t k = 0; k < cases.size(); ++k) {
        const std::string msg = error_of(cases[k].first);
        for (const std::string& needle : cases[k].second)
            EXPECT_NE(msg.find(needle), std::string::npos) << "case " << k << ": " << msg;
    }
}
