// HF BPE tokenizers: tokenizer.json or a tiktoken ranks file (see tokenizer.h for the pipeline).
//
// Layout: a Loader turns tokenizer.json (or a tiktoken file plus a synthesised tokenizer.json for
// its split regex, ByteLevel and special tokens) into an Impl, validating every field it reads and
// naming the JSON path of anything it refuses; encode/decode run the pipeline over that Impl:
// normalizers and decoders are flat lists (Sequences unrolled), pre-tokenizers cut views into the
// text or into arenas that never reallocate.
// BPE keeps HF's merge order exactly: a heap of candidate pairs keyed by (merge rank, position),
// symbols in a linked list, stale heap entries skipped when popped. Words already seen come from a
// cache (mutex-guarded, cleared when it reaches kCacheCapacity entries).
#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/check.h"
#include "io/file.h"
#include "text/regex.h"
#include "text/unicode.h"

namespace mf::text {

namespace {

constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;  // far above any real vocabulary
constexpr size_t kCacheCapacity = 1u << 18;
constexpr size_t kMaxCachedWordBytes = 256;
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// GPT-2's byte <-> char map: printable bytes map to themselves, the rest to U+0100 and up.
struct ByteLevelMap {
    std::array<std::array<char, 2>, 256> utf8;  // UTF-8 of the char standing for each byte (1 or 2 bytes)
    std::array<uint8_t, 256> utf8_length;
    std::array<int16_t, 0x144> char_to_byte;  // -1 when the char is not in the alphabet
    ByteLevelMap() {
        char_to_byte.fill(-1);
        char32_t next = 256;
        for (int b = 0; b < 256; ++b) {
            const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
            const char32_t c = printable ? static_cast<char32_t>(b) : next++;
            std::string s;
            append_utf8(s, c);
            utf8_length[b] = static_cast<uint8_t>(s.size());
            utf8[b] = {s[0], s.size() > 1 ? s[1] : '\0'};
            char_to_byte[c] = static_cast<int16_t>(b);
        }
    }
    size_t mapped_size(std::string_view s) const {
        size_t n = 0;
        for (unsigned char b : s) n += utf8_length[b];
        return n;
    }
    // Appends the mapped form of `s` to `out`, which must have room (no reallocation: views into
    // `out` stay valid).
    std::string_view append_mapped(std::string& out, std::string_view s) const {
        const size_t begin = out.size();
        for (unsigned char b : s) out.append(utf8[b].data(), utf8_length[b]);
        return std::string_view(out).substr(begin);
    }
};
const ByteLevelMap& byte_level() {
    static const ByteLevelMap m;
    return m;
}

// Appends `s` to `out` with every match of the pattern (a literal, or `regex` when not null)
// replaced by `content`: matches found left to right without overlap, as HF's Replace.
void replace_all(std::string_view s, const std::string& literal, const Regex* regex, std::string_view content,
                 std::string& out) {
    if (regex == nullptr) {
        size_t prev = 0;
        for (size_t at = s.find(literal); at != std::string_view::npos; at = s.find(literal, at + literal.size())) {
            out.append(s.substr(prev, at - prev));
            out.append(content);
            prev = at + literal.size();
        }
        out.append(s.substr(prev));
        return;
    }
    std::u32string cps;
    std::vector<size_t> offsets;
    for (size_t i = 0; i < s.size();) {
        offsets.push_back(i);
        cps.push_back(next_code_point(s, i));
    }
    offsets.push_back(s.size());
    for (const Regex::Piece& p : regex->find_matches(std::u32string_view(cps))) {
        if (p.is_match)
            out.append(content);
        else
            out.append(s.substr(offsets[p.begin], offsets[p.end] - offsets[p.begin]));
    }
}

// True when s[start, stop) has no word character right before or right after it.
bool single_word_at(std::string_view s, size_t start, size_t stop) {
    if (start > 0) {
        size_t prev = start - 1;
        while (prev > 0 && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
        if (is_word_char(next_code_point(s, prev))) return false;
    }
    if (stop < s.size()) {
        size_t i = stop;
        if (is_word_char(next_code_point(s, i))) return false;
    }
    return true;
}

std::string show_token(std::string_view s) {
    std::string q = json::quote(s);
    if (q.size() > 120) q = q.substr(0, 110) + "...\"";
    return q;
}

// Byte trie over added-token contents, for leftmost-longest matching.
class TokenTrie {
 public:
    TokenTrie() : nodes_(1) { first_.fill(false); }
    bool empty() const { return nodes_.size() == 1; }
    void add(std::string_view s, int32_t token_index) {
        int32_t node = 0;
        for (unsigned char c : s) {
            int32_t child = find_child(node, c);
            if (child < 0) {
                child = static_cast<int32_t>(nodes_.size());
                nodes_[node].kids.push_back({c, child});
                nodes_.emplace_back();
            }
            node = child;
        }
        if (nodes_[node].token < 0) nodes_[node].token = token_index;
        first_[static_cast<unsigned char>(s[0])] = true;
    }
    bool may_start(unsigned char c) const { return first_[c]; }
    // The longest token matching at s[pos], as its index (or -1) and its length.
    int32_t longest_at(std::string_view s, size_t pos, size_t* len) const {
        int32_t node = 0, best = -1;
        for (size_t k = pos; k < s.size(); ++k) {
            node = find_child(node, static_cast<unsigned char>(s[k]));
            if (node < 0) break;
            if (nodes_[node].token >= 0) {
                best = nodes_[node].token;
                *len = k - pos + 1;
            }
        }
        return best;
    }

 private:
    struct Node {
        std::vector<std::pair<unsigned char, int32_t>> kids;
        int32_t token = -1;
    };
    int32_t find_child(int32_t node, unsigned char c) const {
        for (const auto& [k, child] : nodes_[node].kids)
            if (k == c) return child;
        return -1;
    }
    std::vector<Node> nodes_;
    std::array<bool, 256> first_;
};

struct AddedToken {
    std::string content;
    int32_t id = 0;
    bool special = false, normalized = false, lstrip = false, rstrip = false, single_word = false;
};

// What Split does with the pieces it finds (HF's SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Metaspace's prepend_scheme: when the replacement character goes in front of a piece.
enum class PrependScheme { kAlways, kFirst, kNever };

struct PreTokenizer {
    enum Kind { kByteLevel, kSplitRegex, kSplitString, kMetaspace, kDigits, kPunctuation } kind = kByteLevel;
    bool add_prefix_space = false;  // ByteLevel
    bool use_regex = true;          // ByteLevel
    std::shared_ptr<const Regex> regex;
    std::string literal;  // Split's string; Metaspace's replacement (UTF-8)
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
    PrependScheme prepend = PrependScheme::kAlways;  // Metaspace
    bool split = true;                               // Metaspace
};

// One normalizer of the chain (a Sequence is flattened).
struct Normalizer {
    enum Kind { kNfc, kReplace, kPrepend, kStrip } kind = kNfc;
    std::shared_ptr<const Regex> regex;  // Replace with {"Regex": ...}
    std::string literal;                 // Replace with {"String": ...}
    std::string content;                 // Replace's replacement, Prepend's text
    bool strip_left = false, strip_right = false;
};

// One decoder of the chain (a Sequence is flattened); each maps a list of token strings to another.
struct Decoder {
    enum Kind { kByteLevel, kByteFallback, kFuse, kStrip, kReplace, kMetaspace } kind = kByteLevel;
    std::shared_ptr<const Regex> regex;  // Replace
    std::string literal;                 // Replace's string pattern; Metaspace's replacement
    std::string content;                 // Replace
    char32_t strip_char = 0;             // Strip
    size_t strip_start = 0, strip_stop = 0;
    bool prepend = true;  // Metaspace: prepend_scheme is not never
};

struct TemplateItem {
    bool is_sequence = false;
    std::vector<int32_t> ids;
};

struct Segment {
    size_t begin, end;
    int32_t token;  // added-token index, -1 for text
};

struct BytePiece {
    size_t begin, end;
    bool is_match;
};

}  // namespace

struct Tokenizer::Impl {
    std::string source;
    json::Value config;
    // Model.
    StringMap<int32_t> vocab;
    std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left << 32 | right) -> (rank, id)
    bool ignore_merges = false;
    int32_t unk_id = -1;
    bool fuse_unk = false;
    bool byte_fallback = false;
    std::array<int32_t, 256> byte_ids;    // id of "<0xNN>" for each byte, or -1 (byte_fallback)
    std::vector<int32_t> small_char_ids;  // id of the single-char token for code points < 0x400, or -1
    // Ids -> tokens, over the vocabulary and the added tokens (added ones win).
    std::vector<std::string> tokens;
    std::vector<uint8_t> has_token, special;
    std::vector<uint8_t> skip_on_decode;  // dropped by decode(skip_special_tokens)
    // Added tokens.
    std::vector<AddedToken> added;
    StringMap<int32_t> added_ids;
    TokenTrie raw_trie, normalized_trie;
    // Pipeline.
    std::vector<Normalizer> normalizers;
    bool nfc_only = false;  // the normalizer is NFC alone (its quick check skips text already in NFC)
    std::vector<PreTokenizer> pre_tokenizers;
    bool has_decoder = false;
    std::vector<Decoder> decoders;
    bool has_template = false;
    std::vector<TemplateItem> single_template;
    // Word cache.
    mutable std::mutex cache_mutex;
    mutable StringMap<std::vector<int32_t>> cache;

    std::string normalize(std::string_view text) const;
    void encode_segment(std::string_view text, bool at_origin, std::vector<int32_t>& ids) const;
    void encode_words(std::string_view text, bool at_origin, std::vector<int32_t>& ids) const;
    void metaspace(const PreTokenizer& p, std::string_view piece, bool at_origin, std::string& arena,
                   std::vector<BytePiece>& found, std::vector<std::string_view>& out,
                   std::vector<uint8_t>& out_origin) const;
    void bpe(std::string_view word, std::vector<int32_t>& ids) const;
    void bpe_uncached(std::string_view word, std::vector<int32_t>& ids) const;
    void find_added(const TokenTrie& trie, std::string_view s, std::vector<Segment>& out) const;
    static void run_decoder(const Decoder& d, std::vector<std::string>& tokens);
    int32_t token_id(std::string_view token) const;
};

// --- loading -----------------------------------------------------------------------------------------

namespace {

class Loader {
 public:
    explicit Loader(Tokenizer::Impl& impl) : t_(impl) {}

    template <typename... Args>
    [[noreturn]] void bad(const std::string& path, Args&&... args) const {
        fail(t_.source, ": ", path, ": ", std::forward<Args>(args)...);
    }

    const json::Value* field(const json::Value& obj, std::string_view key) const {
        return obj.is_object() ? obj.find(key) : nullptr;
    }
    const json::Value& require(const json::Value& obj, std::string_view key, const std::string& path) const {
        const json::Value* v = field(obj, key);
        if (v == nullptr) bad(path, "missing field \"", key, "\"");
        return *v;
    }
    void expect_kind(const json::Value& v, json::Kind kind, const std::string& path) const {
        if (v.kind() != kind) bad(path, "expected a JSON ", json::kind_name(kind), ", got ", json::kind_name(v.kind()));
    }
    bool get_bool(const json::Value& obj, std::string_view key, const std::string& path, bool dflt) const {
        const json::Value* v = field(obj, key);
        if (v == nullptr || v->is_null()) return dflt;
        expect_kind(*v, json::Kind::boolean, path + "." + std::string(key));
        return v->as_bool();
    }
    std::string get_type(const json::Value& obj, const std::string& path) const {
        expect_kind(obj, json::Kind::object, path);
        const json::Value& v = require(obj, "type", path);
        expect_kind(v, json::Kind::string, path + ".type");
        return v.as_string();
    }
    int32_t get_id(const json::Value& v, const std::string& path) const {
        if (!v.is_int()) bad(path, "expected an integer token id, got ", v.dump());
        const int64_t id = v.as_int();
        if (id < 0 || id > kMaxTokenId) bad(path, "token id ", id, " is out of range [0, ", kMaxTokenId, "]");
        return static_cast<int32_t>(id);
    }
    // A string field that must be null or one of `allowed` (the values we implement).
    void expect_null_or_empty(const json::Value& obj, std::string_view key, const std::string& path) const {
        const json::Value* v = field(obj, key);
        if (v == nullptr || v->is_null()) return;
        if (v->is_string() && v->as_string().empty()) return;
        bad(path + "." + std::string(key), v->dump(), " is not supported (only null)");
    }

    // `model_ready`: the vocabulary and merges are already in the Impl (a tiktoken file), and `root`
    // has no "model".
    void load(const json::Value& root, bool model_ready = false) {
        expect_kind(root, json::Kind::object, "(root)");
        for (const char* key : {"truncation", "padding"}) {
            const json::Value* v = field(root, key);
            if (v != nullptr && !v->is_null())
                bad(key, "is not supported (must be null; moeforge truncates and pads its batches itself)");
        }
        if (!model_ready) load_model(require(root, "model", "(root)"), "model");
        load_added_tokens(root, !model_ready, model_ready);
        load_normalizer(field(root, "normalizer"), "normalizer");
        load_pre_tokenizer(field(root, "pre_tokenizer"), "pre_tokenizer");
        load_decoder(field(root, "decoder"), "decoder");
        load_post_processor(field(root, "post_processor"), "post_processor");
        // Refresh the tries now that the normalizer is known: normalized tokens are matched
        // against normalised text, so their contents are normalised too, and (as HF 0.23) the
        // normalised form is then the token's string for id_to_token and decode.
        for (size_t k = 0; k < t_.added.size(); ++k) {
            const AddedToken& a = t_.added[k];
            if (a.normalized) {
                const std::string normalized = t_.normalize(a.content);
                if (!normalized.empty()) t_.normalized_trie.add(normalized, static_cast<int32_t>(k));
                t_.tokens[a.id] = normalized;
            } else {
                t_.raw_trie.add(a.content, static_cast<int32_t>(k));
            }
        }
        // decode(skip_special_tokens) drops a token whose string is a special token's content
        // (HF tests the string, so a normalised special token whose form changed is kept).
        std::unordered_set<std::string_view> special_contents;
        for (const AddedToken& a : t_.added)
            if (a.special) special_contents.insert(a.content);
        t_.skip_on_decode.assign(t_.tokens.size(), 0);
        for (size_t id = 0; id < t_.tokens.size(); ++id)
            if (t_.has_token[id] != 0 && special_contents.count(t_.tokens[id]) != 0) t_.skip_on_decode[id] = 1;
    }

 private:
    void set_token(int32_t id, const std::string& token) {
        if (static_cast<size_t>(id) >= t_.tokens.size()) {
            t_.tokens.resize(id + size_t(1));
            t_.has_token.resize(id + size_t(1), 0);
            t_.special.resize(id + size_t(1), 0);
        }
        t_.tokens[id] = token;
        t_.has_token[id] = 1;
    }

    void load_model(const json::Value& model, const std::string& path) {
        expect_kind(model, json::Kind::object, path);
        std::string type = "BPE";
        if (field(model, "type") != nullptr)
            type = get_type(model, path);
        else if (field(model, "merges") == nullptr)
            bad(path, "missing field \"type\"");
        if (type != "BPE") bad(path + ".type", show_token(type), " is not supported (supported: BPE)");

        const json::Value* dropout = field(model, "dropout");
        if (dropout != nullptr && !dropout->is_null() && !(dropout->is_number() && dropout->as_double() == 0.0))
            bad(path + ".dropout", dropout->dump(), " is not supported (only null)");
        expect_null_or_empty(model, "continuing_subword_prefix", path);
        expect_null_or_empty(model, "end_of_word_suffix", path);
        t_.byte_fallback = get_bool(model, "byte_fallback", path, false);
        t_.fuse_unk = get_bool(model, "fuse_unk", path, false);
        t_.ignore_merges = get_bool(model, "ignore_merges", path, false);

        const json::Value& vocab = require(model, "vocab", path);
        expect_kind(vocab, json::Kind::object, path + ".vocab");
        t_.vocab.reserve(vocab.size());
        for (const auto& [token, v] : vocab.as_object()) {
            const std::string entry = path + ".vocab[" + show_token(token) + "]";
            const int32_t id = get_id(v, entry);
            if (token.empty()) bad(entry, "empty token");
            if (static_cast<size_t>(id) < t_.has_token.size() && t_.has_token[id] != 0)
                bad(entry, "id ", id, " is also used by ", show_token(t_.tokens[id]));
            t_.vocab.emplace(token, id);
            set_token(id, token);
        }
        set_byte_ids();
        t_.small_char_ids.assign(0x400, -1);
        for (const auto& [token, id] : t_.vocab) {
            size_t i = 0;
            const char32_t c = next_code_point(token, i);
            if (i == token.size() && c < 0x400) t_.small_char_ids[c] = id;
        }

        const json::Value* unk = field(model, "unk_token");
        if (unk != nullptr && !unk->is_null()) {
            expect_kind(*unk, json::Kind::string, path + ".unk_token");
            auto it = t_.vocab.find(unk->as_string());
            if (it == t_.vocab.end())
                bad(path + ".unk_token", show_token(unk->as_string()), " is not in the vocabulary");
            t_.unk_id = it->second;
        }

        const json::Value& merges = require(model, "merges", path);
        expect_kind(merges, json::Kind::array, path + ".merges");
        const auto& list = merges.as_array();
        t_.merges.reserve(list.size());
        for (size_t r = 0; r < list.size(); ++r) {
            const std::string entry = path + ".merges[" + std::to_string(r) + "]";
            std::string left, right;
            if (list[r].is_string()) {
                const std::string& s = list[r].as_string();
                const size_t space = s.find(' ');
                if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
                    bad(entry, show_token(s), " is not two tokens separated by one space");
                left = s.substr(0, space);
                right = s.substr(space + 1);
            } else if (list[r].is_array() && list[r].size() == 2 && list[r].as_array()[0].is_string() &&
                       list[r].as_array()[1].is_string()) {
                left = list[r].as_array()[0].as_string();
                right = list[r].as_array()[1].as_string();
            } else {
                bad(entry, "expected \"a b\" or [\"a\", \"b\"], got ", list[r].dump());
            }
            auto a = t_.vocab.find(left), b = t_.vocab.find(right), ab = t_.vocab.find(left + right);
            if (a == t_.vocab.end()) bad(entry, "token ", show_token(left), " is not in the vocabulary");
            if (b == t_.vocab.end()) bad(entry, "token ", show_token(right), " is not in the vocabulary");
            if (ab == t_.vocab.end())
                bad(entry, "merged token ", show_token(left + right), " is not in the vocabulary");
            const uint64_t key = (uint64_t(uint32_t(a->second)) << 32) | uint32_t(b->second);
            t_.merges[key] = {static_cast<int32_t>(r), ab->second};  // a repeated pair keeps its last rank, as HF
        }
    }

    // The "<0xNN>" tokens byte_fallback uses (HF spells them with two upper-case hex digits).
    void set_byte_ids() {
        for (int b = 0; b < 256; ++b) {
            char name[8];
            std::snprintf(name, sizeof name, "<0x%02X>", b);
            auto it = t_.vocab.find(std::string_view(name));
            t_.byte_ids[b] = it == t_.vocab.end() ? -1 : it->second;
        }
    }

    // added_tokens as HF 0.23 reads them: every AddedToken field is required (in tokenizer.json;
    // `strict_fields` false: tokenizer_config.json's entries, which transformers fills in), an empty
    // content is skipped, a content listed again takes the new flags; and the ids written in the file
    // are checked but not used (HF only warns when they differ): a content the model has keeps the
    // model's id, any other gets the next id after the vocabulary (its number of entries), in order.
    // `keep_ids`: use the given ids (a tiktoken family's special tokens have fixed ids).
    void load_added_tokens(const json::Value& root, bool strict_fields, bool keep_ids) {
        const json::Value* list = field(root, "added_tokens");
        if (list == nullptr || list->is_null()) return;
        expect_kind(*list, json::Kind::array, "added_tokens");
        int64_t next_id = static_cast<int64_t>(t_.vocab.size());
        for (size_t k = 0; k < list->size(); ++k) {
            const std::string path = "added_tokens[" + std::to_string(k) + "]";
            const json::Value& e = list->as_array()[k];
            expect_kind(e, json::Kind::object, path);
            AddedToken a;
            const int32_t given_id = get_id(require(e, "id", path), path + ".id");
            a.content = get_string(e, "content", path);
            if (strict_fields)
                for (const char* key : {"single_word", "lstrip", "rstrip", "normalized", "special"})
                    if (field(e, key) == nullptr)
                        bad(path, "missing field \"", key, "\" (HF requires every AddedToken field)");
            a.special = get_bool(e, "special", path, false);
            a.normalized = get_bool(e, "normalized", path, !a.special);
            a.lstrip = get_bool(e, "lstrip", path, false);
            a.rstrip = get_bool(e, "rstrip", path, false);
            a.single_word = get_bool(e, "single_word", path, false);
            if (a.content.empty()) continue;
            if (keep_ids) {
                a.id = given_id;
            } else if (auto it = t_.added_ids.find(a.content); it != t_.added_ids.end()) {
                a.id = it->second;
            } else if (auto v = t_.vocab.find(a.content); v != t_.vocab.end()) {
                a.id = v->second;
            } else {
                if (next_id > kMaxTokenId) bad(path, "the token would get id ", next_id, ", above ", kMaxTokenId);
                a.id = static_cast<int32_t>(next_id++);
            }
            set_token(a.id, a.content);
            t_.special[a.id] = a.special ? 1 : 0;
            auto same = std::find_if(t_.added.begin(), t_.added.end(),
                                     [&](const AddedToken& b) { return b.content == a.content; });
            t_.added_ids[a.content] = a.id;
            if (same != t_.added.end())
                *same = std::move(a);
            else
                t_.added.push_back(std::move(a));
        }
    }

    // A {"String": s} or {"Regex": r} pattern (Replace, Split): the literal or the compiled regex.
    void load_pattern(const json::Value& obj, const std::string& path, std::string* literal,
                      std::shared_ptr<const Regex>* regex) const {
        const json::Value& pattern = require(obj, "pattern", path);
        expect_kind(pattern, json::Kind::object, path + ".pattern");
        if (const json::Value* re = field(pattern, "Regex")) {
            expect_kind(*re, json::Kind::string, path + ".pattern.Regex");
            try {
                *regex = std::make_shared<const Regex>(re->as_string());
            } catch (const Error& e) {
                bad(path + ".pattern.Regex", e.what());
            }
        } else if (const json::Value* str = field(pattern, "String")) {
            expect_kind(*str, json::Kind::string, path + ".pattern.String");
            if (str->as_string().empty()) bad(path + ".pattern.String", "empty pattern string");
            *literal = str->as_string();
        } else {
            bad(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, got ", pattern.dump());
        }
    }
    std::string get_string(const json::Value& obj, std::string_view key, const std::string& path) const {
        const json::Value& v = require(obj, key, path);
        expect_kind(v, json::Kind::string, path + "." + std::string(key));
        return v.as_string();
    }
    // What Replace puts in and Prepend adds: a few characters in every real file. The bound keeps a
    // hostile file from multiplying the text (a megabyte for every space) in encode or decode.
    static constexpr size_t kMaxInsertBytes = 256;
    std::string get_short_string(const json::Value& obj, std::string_view key, const std::string& path) const {
        std::string s = get_string(obj, key, path);
        if (s.size() > kMaxInsertBytes)
            bad(path + "." + std::string(key), "a string of ", s.size(), " bytes is not supported (at most ",
                kMaxInsertBytes, ")");
        return s;
    }
    // A field holding exactly one character (Metaspace's replacement, Strip's content).
    char32_t get_char(const json::Value& obj, std::string_view key, const std::string& path) const {
        const std::string s = get_string(obj, key, path);
        size_t i = 0;
        const char32_t c = s.empty() ? 0 : next_code_point(s, i);
        if (s.empty() || i != s.size()) bad(path + "." + std::string(key), show_token(s), " is not one character");
        return c;
    }
    size_t get_count(const json::Value& obj, std::string_view key, const std::string& path) const {
        const json::Value& v = require(obj, key, path);
        if (!v.is_int() || v.as_int() < 0 || v.as_int() > (int64_t(1) << 20))
            bad(path + "." + std::string(key), "expected a count in [0, 2^20], got ", v.dump());
        return static_cast<size_t>(v.as_int());
    }

    void load_normalizer(const json::Value* v, const std::string& path) {
        if (v == nullptr || v->is_null()) return;
        const std::string type = get_type(*v, path);
        Normalizer n;
        if (type == "NFC") {
            n.kind = Normalizer::kNfc;
        } else if (type == "Sequence") {
            const json::Value& list = require(*v, "normalizers", path);
            expect_kind(list, json::Kind::array, path + ".normalizers");
            for (size_t k = 0; k < list.size(); ++k)
                load_normalizer(&list.as_array()[k], path + ".normalizers[" + std::to_string(k) + "]");
            t_.nfc_only = t_.normalizers.size() == 1 && t_.normalizers[0].kind == Normalizer::kNfc;
            return;
        } else if (type == "Replace") {
            n.kind = Normalizer::kReplace;
            load_pattern(*v, path, &n.literal, &n.regex);
            n.content = get_short_string(*v, "content", path);
        } else if (type == "Prepend") {
            n.kind = Normalizer::kPrepend;
            n.content = get_short_string(*v, "prepend", path);
        } else if (type == "Strip") {
            n.kind = Normalizer::kStrip;
            n.strip_left = get_bool(*v, "strip_left", path, false);
            n.strip_right = get_bool(*v, "strip_right", path, false);
        } else {
            bad(path + ".type", show_token(type),
                " is not supported (supported: NFC, Replace, Prepend, Strip, Sequence)");
        }
        t_.normalizers.push_back(std::move(n));
        t_.nfc_only = t_.normalizers.size() == 1 && t_.normalizers[0].kind == Normalizer::kNfc;
    }

    SplitBehavior get_behavior(const json::Value& obj, const std::string& path, bool required) const {
        const json::Value* behavior = field(obj, "behavior");
        if (behavior == nullptr && !required) return SplitBehavior::kIsolated;
        if (behavior == nullptr) bad(path, "missing field \"behavior\"");
        expect_kind(*behavior, json::Kind::string, path + ".behavior");
        const std::string& b = behavior->as_string();
        if (b == "Removed") return SplitBehavior::kRemoved;
        if (b == "Isolated") return SplitBehavior::kIsolated;
        if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
        if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
        if (b == "Contiguous") return SplitBehavior::kContiguous;
        bad(path + ".behavior", show_token(b),
            " is not a split behavior (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
    }

    // Metaspace's prepend_scheme, or the add_prefix_space of older files (as HF reads them: an absent
    // scheme is "always", and add_prefix_space false must come with "never").
    PrependScheme get_prepend_scheme(const json::Value& obj, const std::string& path) const {
        PrependScheme scheme = PrependScheme::kAlways;
        if (const json::Value* v = field(obj, "prepend_scheme"); v != nullptr && !v->is_null()) {
            expect_kind(*v, json::Kind::string, path + ".prepend_scheme");
            const std::string& s = v->as_string();
            if (s == "always")
                scheme = PrependScheme::kAlways;
            else if (s == "first")
                scheme = PrependScheme::kFirst;
            else if (s == "never")
                scheme = PrependScheme::kNever;
            else
                bad(path + ".prepend_scheme", show_token(s), " is not a prepend scheme (always, first, never)");
        }
        const json::Value* aps = field(obj, "add_prefix_space");
        if (aps != nullptr && !aps->is_null()) {
            expect_kind(*aps, json::Kind::boolean, path + ".add_prefix_space");
            if (!aps->as_bool()) {
                if (scheme != PrependScheme::kNever)
                    bad(path + ".add_prefix_space", "false does not match prepend_scheme (HF refuses this too)");
                scheme = PrependScheme::kNever;
            }
        }
        return scheme;
    }

    void load_pre_tokenizer(const json::Value* v, const std::string& path) {
        if (v == nullptr || v->is_null()) return;
        const std::string type = get_type(*v, path);
        if (type == "Sequence") {
            const json::Value& list = require(*v, "pretokenizers", path);
            expect_kind(list, json::Kind::array, path + ".pretokenizers");
            for (size_t k = 0; k < list.size(); ++k)
                load_pre_tokenizer(&list.as_array()[k], path + ".pretokenizers[" + std::to_string(k) + "]");
        } else if (type == "ByteLevel") {
            PreTokenizer p;
            p.kind = PreTokenizer::kByteLevel;
            p.add_prefix_space = get_bool(*v, "add_prefix_space", path, true);
            p.use_regex = get_bool(*v, "use_regex", path, true);
            if (p.use_regex) p.regex = std::make_shared<const Regex>(kGpt2Pattern);
            t_.pre_tokenizers.push_back(std::move(p));
        } else if (type == "Split") {
            PreTokenizer p;
            p.behavior = get_behavior(*v, path, true);
            p.invert = get_bool(*v, "invert", path, false);
            load_pattern(*v, path, &p.literal, &p.regex);
            p.kind = p.regex ? PreTokenizer::kSplitRegex : PreTokenizer::kSplitString;
            t_.pre_tokenizers.push_back(std::move(p));
        } else if (type == "Metaspace") {
            PreTokenizer p;
            p.kind = PreTokenizer::kMetaspace;
            append_utf8(p.literal, get_char(*v, "replacement", path));
            p.prepend = get_prepend_scheme(*v, path);
            p.split = get_bool(*v, "split", path, true);
            t_.pre_tokenizers.push_back(std::move(p));
        } else if (type == "Digits") {
            PreTokenizer p;
            p.kind = PreTokenizer::kDigits;
            p.behavior =
                get_bool(*v, "individual_digits", path, false) ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
            t_.pre_tokenizers.push_back(std::move(p));
        } else if (type == "Punctuation") {
            PreTokenizer p;
            p.kind = PreTokenizer::kPunctuation;
            p.behavior = get_behavior(*v, path, false);
            t_.pre_tokenizers.push_back(std::move(p));
        } else {
            bad(path + ".type", show_token(type),
                " is not supported (supported: ByteLevel, Split, Metaspace, Digits, Punctuation, Sequence)");
        }
    }

    void load_decoder(const json::Value* v, const std::string& path) {
        if (v == nullptr || v->is_null()) return;
        t_.has_decoder = true;
        const std::string type = get_type(*v, path);
        Decoder d;
        if (type == "ByteLevel") {
            d.kind = Decoder::kByteLevel;
        } else if (type == "Sequence") {
            const json::Value& list = require(*v, "decoders", path);
            expect_kind(list, json::Kind::array, path + ".decoders");
            for (size_t k = 0; k < list.size(); ++k)
                load_decoder(&list.as_array()[k], path + ".decoders[" + std::to_string(k) + "]");
            return;
        } else if (type == "ByteFallback") {
            d.kind = Decoder::kByteFallback;
        } else if (type == "Fuse") {
            d.kind = Decoder::kFuse;
        } else if (type == "Strip") {
            d.kind = Decoder::kStrip;
            d.strip_char = get_char(*v, "content", path);
            d.strip_start = get_count(*v, "start", path);
            d.strip_stop = get_count(*v, "stop", path);
        } else if (type == "Replace") {
            d.kind = Decoder::kReplace;
            load_pattern(*v, path, &d.literal, &d.regex);
            d.content = get_short_string(*v, "content", path);
        } else if (type == "Metaspace") {
            d.kind = Decoder::kMetaspace;
            append_utf8(d.literal, get_char(*v, "replacement", path));
            d.prepend = get_prepend_scheme(*v, path) != PrependScheme::kNever;
        } else {
            bad(path + ".type", show_token(type),
                " is not supported (supported: ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, Sequence)");
        }
        t_.decoders.push_back(std::move(d));
    }

    void load_post_processor(const json::Value* v, const std::string& path) {
        if (v == nullptr || v->is_null()) return;
        const std::string type = get_type(*v, path);
        if (type == "ByteLevel") return;  // changes offsets only
        if (type == "Sequence") {
            const json::Value& list = require(*v, "processors", path);
            expect_kind(list, json::Kind::array, path + ".processors");
            for (size_t k = 0; k < list.size(); ++k)
                load_post_processor(&list.as_array()[k], path + ".processors[" + std::to_string(k) + "]");
            return;
        }
        if (type != "TemplateProcessing")
            bad(path + ".type", show_token(type),
                " is not supported (supported: ByteLevel, TemplateProcessing, Sequence)");
        if (t_.has_template) bad(path, "more than one TemplateProcessing is not supported");
        t_.has_template = true;
        const json::Value& specials = require(*v, "special_tokens", path);
        expect_kind(specials, json::Kind::object, path + ".special_tokens");
        const json::Value& single = require(*v, "single", path);
        expect_kind(single, json::Kind::array, path + ".single");
        for (size_t k = 0; k < single.size(); ++k) {
            const std::string item_path = path + ".single[" + std::to_string(k) + "]";
            const json::Value& item = single.as_array()[k];
            expect_kind(item, json::Kind::object, item_path);
            TemplateItem ti;
            if (const json::Value* seq = field(item, "Sequence")) {
                const json::Value& id = require(*seq, "id", item_path + ".Sequence");
                if (!id.is_string() || id.as_string() != "A")
                    bad(item_path + ".Sequence.id", id.dump(),
                        " is not supported in a single-sequence template (only \"A\")");
                ti.is_sequence = true;
            } else if (const json::Value* sp = field(item, "SpecialToken")) {
                const json::Value& id = require(*sp, "id", item_path + ".SpecialToken");
                expect_kind(id, json::Kind::string, item_path + ".SpecialToken.id");
                const json::Value* def = specials.find(id.as_string());
                if (def == nullptr)
                    bad(item_path + ".SpecialToken.id", show_token(id.as_string()), " is not in ", path,
                        ".special_tokens");
                const std::string def_path = path + ".special_tokens[" + show_token(id.as_string()) + "]";
                const json::Value& ids = require(*def, "ids", def_path);
                expect_kind(ids, json::Kind::array, def_path + ".ids");
                for (size_t i = 0; i < ids.size(); ++i) {
                    const std::string id_path = def_path + ".ids[" + std::to_string(i) + "]";
                    const int32_t tid = get_id(ids.as_array()[i], id_path);
                    if (static_cast<size_t>(tid) >= t_.has_token.size() || t_.has_token[tid] == 0)
                        bad(id_path, "token id ", tid, " is not in the vocabulary");
                    ti.ids.push_back(tid);
                }
            } else {
                bad(item_path, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got ", item.dump());
            }
            t_.single_template.push_back(std::move(ti));
        }
    }

 public:
    // A tiktoken ranks file: one "<base64 of the token's bytes> <rank>" a line; the rank is the id
    // and the merge priority. Tokens are stored ByteLevel-mapped (as HF's tiktoken conversion does),
    // every split of a token into two tokens is a merge of the token's rank (so BPE merges the
    // lowest-ranked adjacent pair first, leftmost on ties: tiktoken's rule), and a piece that is a
    // token is taken whole (ignore_merges: tiktoken looks pieces up before merging).
    void load_tiktoken(std::string_view text) {
        const ByteLevelMap& bl = byte_level();
        StringMap<int32_t> by_bytes;
        std::vector<std::string> bytes_of;
        // Ranks are 0..N-1 for N tokens (one a non-empty line): a larger rank is refused before any
        // table grows to it.
        int64_t num_lines = 0;
        for (size_t pos = 0; pos < text.size();) {
            size_t eol = text.find('\n', pos);
            if (eol == std::string_view::npos) eol = text.size();
            if (eol > pos && !(eol == pos + 1 && text[pos] == '\r')) ++num_lines;
            pos = eol + 1;
        }
        size_t line_no = 0;
        for (size_t pos = 0; pos < text.size();) {
            size_t eol = text.find('\n', pos);
            if (eol == std::string_view::npos) eol = text.size();
            std::string_view line = text.substr(pos, eol - pos);
            pos = eol + 1;
            ++line_no;
            if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
            if (line.empty()) continue;
            const std::string where = "line " + std::to_string(line_no);
            const size_t space = line.find(' ');
            if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos)
                bad(where, "expected \"<base64 token> <rank>\", got ", show_token(line));
            std::string token;
            if (!decode_base64(line.substr(0, space), token) || token.empty())
                bad(where, show_token(line.substr(0, space)), " is not the base64 of a non-empty token");
            const std::string_view rank_text = line.substr(space + 1);
            int64_t rank = 0;
            for (char c : rank_text) {
                if (c < '0' || c > '9' || rank > kMaxTokenId)
                    bad(where, "rank ", show_token(rank_text), " is not in [0, ", kMaxTokenId, "]");
                rank = rank * 10 + (c - '0');
            }
            if (rank_text.empty() || rank > kMaxTokenId)
                bad(where, "rank ", show_token(rank_text), " is not in [0, ", kMaxTokenId, "]");
            if (rank >= num_lines)
                bad(where, "rank ", rank, " is not below the number of tokens, ", num_lines, " (ranks are 0..N-1)");
            const auto id = static_cast<int32_t>(rank);
            if (static_cast<size_t>(id) < t_.has_token.size() && t_.has_token[id] != 0)
                bad(where, "rank ", id, " is also the rank of an earlier token");
            if (!by_bytes.emplace(token, id).second)
                bad(where, "token ", show_token(line.substr(0, space)), " is listed twice");
            std::string mapped;
            mapped.reserve(bl.mapped_size(token));
            bl.append_mapped(mapped, token);
            t_.vocab.emplace(mapped, id);
            set_token(id, mapped);
            if (bytes_of.size() <= static_cast<size_t>(id)) bytes_of.resize(id + size_t(1));
            bytes_of[id] = std::move(token);
        }
        if (t_.vocab.empty()) bad("(file)", "no tokens");
        for (int b = 0; b < 256; ++b)
            if (by_bytes.find(std::string_view(reinterpret_cast<const char*>(&b), 1)) == by_bytes.end())
                bad("(file)", "byte 0x", "0123456789abcdef"[b >> 4], "0123456789abcdef"[b & 15],
                    " has no token (tiktoken needs all 256 single bytes)");
        for (size_t id = 0; id < bytes_of.size(); ++id) {
            const std::string_view token = bytes_of[id];
            for (size_t k = 1; k < token.size(); ++k) {
                auto a = by_bytes.find(token.substr(0, k)), b = by_bytes.find(token.substr(k));
                if (a == by_bytes.end() || b == by_bytes.end()) continue;
                const uint64_t key = (uint64_t(uint32_t(a->second)) << 32) | uint32_t(b->second);
                t_.merges[key] = {static_cast<int32_t>(id), static_cast<int32_t>(id)};
            }
        }
        t_.ignore_merges = true;
        set_byte_ids();
        t_.small_char_ids.assign(0x400, -1);
        for (const auto& [token, id] : t_.vocab) {
            size_t i = 0;
            const char32_t c = next_code_point(token, i);
            if (i == token.size() && c < 0x400) t_.small_char_ids[c] = id;
        }
    }

    // Standard base64 (RFC 4648, '=' padding), strictly: false on any other character or length.
    static bool decode_base64(std::string_view in, std::string& out) {
        auto value = [](char c) -> int {
            if (c >= 'A' && c <= 'Z') return c - 'A';
            if (c >= 'a' && c <= 'z') return c - 'a' + 26;
            if (c >= '0' && c <= '9') return c - '0' + 52;
            if (c == '+') return 62;
            if (c == '/') return 63;
            return -1;
        };
        if (in.size() % 4 != 0) return false;
        for (size_t i = 0; i < in.size(); i += 4) {
            const bool last = i + 4 == in.size();
            int v[4];
            int pad = 0;
            for (int k = 0; k < 4; ++k) {
                if (last && in[i + k] == '=' && k >= 2) {
                    v[k] = 0;
                    ++pad;
                    continue;
                }
                if (pad > 0) return false;
                v[k] = value(in[i + k]);
                if (v[k] < 0) return false;
            }
            const uint32_t n = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
            out += static_cast<char>(n >> 16);
            if (pad < 2) out += static_cast<char>((n >> 8) & 0xFF);
            if (pad < 1) out += static_cast<char>(n & 0xFF);
        }
        return true;
    }

 private:
    Tokenizer::Impl& t_;
};

// "eos_token" of a tokenizer_config.json / special_tokens_map.json: a string, or an AddedToken
// object with "content". Returns nullopt when absent or null.
std::optional<std::string> special_token_name(const json::Value& cfg, const char* key, const std::string& file) {
    const json::Value* v = cfg.is_object() ? cfg.find(key) : nullptr;
    if (v == nullptr || v->is_null()) return std::nullopt;
    if (v->is_string()) return v->as_string();
    if (v->is_object()) {
        const json::Value* c = v->find("content");
        if (c != nullptr && c->is_string()) return c->as_string();
    }
    fail(file, ": ", key, ": expected a token string or {\"content\": ...}, got ", v->dump());
}

// Tokenizer files are regular files of bounded size (the largest HF tokenizer.json files are tens of
// MB): a FIFO or /dev/zero put in their place is refused, never waited on or read without end.
constexpr size_t kMaxTokenizerFileBytes = size_t{512} << 20;

std::string read_text_file(const std::filesystem::path& path) {
    return io::read_text_file(path, kMaxTokenizerFileBytes);
}

}  // namespace

namespace {

// Kimi-K2's split regex (`pat_str` of its tokenization_kimi.py, which the tiktoken file lacks).
constexpr const char* kKimiPattern =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|)"
    R"(\s*[\r\n]+|\s+(?!\S)|\s+)";

// Families that ship a tiktoken ranks file and a Python tokenizer class instead of tokenizer.json,
// recognised by the module their tokenizer_config.json's auto_map names.
struct TiktokenFamily {
    const char* name;
    const char* module;        // in auto_map.AutoTokenizer[0], e.g. "tokenization_kimi.TikTokenTokenizer"
    const char* pattern;       // the class's split regex
    int num_reserved_special;  // ids N .. N+num-1 (N = number of ranks) are special tokens
};
constexpr TiktokenFamily kTiktokenFamilies[] = {{"Kimi-K2", "tokenization_kimi", kKimiPattern, 256}};

const TiktokenFamily& tiktoken_family(const json::Value& config, const std::string& config_file) {
    std::string module;
    const json::Value* auto_map = config.is_object() ? config.find("auto_map") : nullptr;
    const json::Value* tok = auto_map != nullptr && auto_map->is_object() ? auto_map->find("AutoTokenizer") : nullptr;
    if (tok != nullptr && tok->is_array() && tok->size() > 0 && tok->as_array()[0].is_string())
        module = tok->as_array()[0].as_string();
    for (const TiktokenFamily& f : kTiktokenFamilies)
        if (module.rfind(std::string(f.module) + ".", 0) == 0) return f;
    std::string known;
    for (const TiktokenFamily& f : kTiktokenFamilies)
        known += std::string(known.empty() ? "" : ", ") + f.module + " (" + f.name + ")";
    fail(config_file, ": auto_map.AutoTokenizer names ",
         module.empty() ? std::string("no tokenizer class") : show_token(module),
         "; a tiktoken.model needs its family's split regex, known for: ", known);
}

// tokenizer.json-style added_tokens for a tiktoken family: the entries of tokenizer_config.json's
// added_tokens_decoder (id -> AddedToken), and "<|reserved_token_ID|>" for the family's other
// reserved special ids (as Kimi's TikTokenTokenizer names them).
json::Value tiktoken_added_tokens(const json::Value& config, const std::string& config_file, size_t num_ranks,
                                  const TiktokenFamily& family) {
    json::Value out = json::Value::array();
    std::set<int64_t> listed;
    const json::Value* decoder = config.is_object() ? config.find("added_tokens_decoder") : nullptr;
    if (decoder != nullptr && !decoder->is_null()) {
        if (!decoder->is_object()) fail(config_file, ": added_tokens_decoder: expected a JSON object");
        for (const auto& [key, entry] : decoder->as_object()) {
            const std::string path = config_file + ": added_tokens_decoder[" + show_token(key) + "]";
            char* end = nullptr;
            const long long id = std::strtoll(key.c_str(), &end, 10);
            if (key.empty() || *end != '\0' || id < 0 || id > kMaxTokenId)
                fail(path, ": the key is not a token id in [0, ", kMaxTokenId, "]");
            if (!entry.is_object()) fail(path, ": expected a JSON object");
            json::Value e = entry;
            e.set("id", static_cast<int64_t>(id));
            if (e.find("special") == nullptr) e.set("special", true);
            out.push_back(std::move(e));
            listed.insert(id);
        }
    }
    for (int k = 0; k < family.num_reserved_special; ++k) {
        const auto id = static_cast<int64_t>(num_ranks) + k;
        if (listed.count(id) != 0) continue;
        json::Value e = json::Value::object();
        e.set("id", id);
        e.set("content", "<|reserved_token_" + std::to_string(id) + "|>");
        e.set("special", true);
        e.set("normalized", false);
        out.push_back(std::move(e));
    }
    return out;
}

// eos/pad/bos from tokenizer_config.json, else special_tokens_map.json.
void resolve_special_ids(Tokenizer& tok, const json::Value& special_tokens_map, const std::string& source) {
    auto resolve = [&](const char* key) -> std::optional<int32_t> {
        const std::pair<const json::Value*, const char*> files[] = {{&tok.config(), "tokenizer_config.json"},
                                                                    {&special_tokens_map, "special_tokens_map.json"}};
        for (const auto& [cfg, name] : files) {
            const std::optional<std::string> token = special_token_name(*cfg, key, name);
            if (!token) continue;
            const int32_t id = tok.token_to_id(*token);
            if (id < 0) fail(name, ": ", key, ": ", show_token(*token), " is not a token of ", source);
            return id;
        }
        return std::nullopt;
    };
    tok.eos_id = resolve("eos_token");
    tok.pad_id = resolve("pad_token");
    tok.bos_id = resolve("bos_token");
}

}  // namespace

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, const std::string& source, json::Value config,
                               json::Value special_tokens_map) {
    Tokenizer tok;
    tok.impl_ = std::make_shared<Impl>();
    Impl& t = *tok.impl_;
    t.source = source;
    check_utf8(tokenizer_json, source);
    const json::Value root = json::parse(tokenizer_json, source);
    Loader(t).load(root);
    t.config = std::move(config);
    resolve_special_ids(tok, special_tokens_map, source);
    return tok;
}

Tokenizer Tokenizer::from_tiktoken(std::string_view ranks, const std::string& source, const std::string& pattern,
                                   json::Value added_tokens, json::Value config, json::Value special_tokens_map) {
    Tokenizer tok;
    tok.impl_ = std::make_shared<Impl>();
    Impl& t = *tok.impl_;
    t.source = source;
    Loader loader(t);
    loader.load_tiktoken(ranks);
    json::Value split = json::Value::object(), regex = json::Value::object(), byte_level = json::Value::object();
    split.set("type", "Split");
    regex.set("Regex", pattern);
    split.set("pattern", std::move(regex));
    split.set("behavior", "Isolated");
    byte_level.set("type", "ByteLevel");
    byte_level.set("add_prefix_space", false);
    byte_level.set("use_regex", false);
    json::Value list = json::Value::array(), pre = json::Value::object(), decoder = json::Value::object();
    list.push_back(std::move(split));
    list.push_back(std::move(byte_level));
    pre.set("type", "Sequence");
    pre.set("pretokenizers", std::move(list));
    decoder.set("type", "ByteLevel");
    json::Value root = json::Value::object();
    root.set("added_tokens", std::move(added_tokens));
    root.set("pre_tokenizer", std::move(pre));
    root.set("decoder", std::move(decoder));
    loader.load(root, true);
    t.config = std::move(config);
    resolve_special_ids(tok, special_tokens_map, source);
    return tok;
}

Tokenizer Tokenizer::load(const std::filesystem::path& dir) {
    std::filesystem::path file = dir, base = dir;
    bool tiktoken = false;
    if (std::filesystem::is_directory(dir)) {
        file = dir / "tokenizer.json";
        if (!std::filesystem::exists(file)) {
            file = dir / "tiktoken.model";
            tiktoken = true;
            if (!std::filesystem::exists(file))
                fail(dir.string(),
                     ": no tokenizer.json (nor tiktoken.model) in this directory (expected a Hugging "
                     "Face tokenizer directory)");
        }
    } else if (!std::filesystem::exists(dir)) {
        fail(dir.string(), ": no such tokenizer directory or file");
    } else {
        base = dir.parent_path();
        tiktoken = dir.filename() == "tiktoken.model";
    }
    auto optional_json = [&](const char* name) -> json::Value {
        const std::filesystem::path p = base / name;
        if (!std::filesystem::exists(p)) return {};
        const std::string text = read_text_file(p);
        check_utf8(text, p.string());
        return json::parse(text, p.string());
    };
    json::Value config = optional_json("tokenizer_config.json");
    json::Value special_map = optional_json("special_tokens_map.json");
    if (!tiktoken) return from_json(read_text_file(file), file.string(), std::move(config), std::move(special_map));
    const std::string config_file = (base / "tokenizer_config.json").string();
    const TiktokenFamily& family = tiktoken_family(config, config_file);
    const std::string ranks = read_text_file(file);
    size_t num_ranks = 0;  // non-empty lines: the ranks of a file load_tiktoken accepts
    for (size_t pos = 0; pos < ranks.size();) {
        size_t eol = ranks.find('\n', pos);
        if (eol == std::string::npos) eol = ranks.size();
        if (eol > pos && !(eol == pos + 1 && ranks[pos] == '\r')) ++num_ranks;
        pos = eol + 1;
    }
    json::Value added = tiktoken_added_tokens(config, config_file, num_ranks, family);
    return from_tiktoken(ranks, file.string(), family.pattern, std::move(added), std::move(config),
                         std::move(special_map));
}

bool Tokenizer::found_in(const std::filesystem::path& dir) {
    std::error_code ec;
    return std::filesystem::is_regular_file(dir / "tokenizer.json", ec) ||
           std::filesystem::is_regular_file(dir / "tiktoken.model", ec);
}

const Tokenizer::Impl& Tokenizer::impl() const {
    if (impl_ == nullptr) fail("Tokenizer used before it was loaded (use Tokenizer::load or Tokenizer::from_json)");
    return *impl_;
}

// --- encoding ----------------------------------------------------------------------------------------

int32_t Tokenizer::Impl::token_id(std::string_view token) const {
    if (auto it = added_ids.find(token); it != added_ids.end()) return it->second;
    if (auto it = vocab.find(token); it != vocab.end()) return it->second;
    return -1;
}

// Added tokens in `s` as HF's AddedVocabulary::find_matches: leftmost-longest, non-overlapping
// matches; a single_word token next to a word character (\\w) is no match (and the scan goes on
// after it); lstrip/rstrip widen a match over neighbouring whitespace. Segments cover `s` in order.
void Tokenizer::Impl::find_added(const TokenTrie& trie, std::string_view s, std::vector<Segment>& out) const {
    size_t start_offset = 0;
    size_t pos = 0;
    while (pos < s.size()) {
        if (!trie.may_start(static_cast<unsigned char>(s[pos]))) {
            ++pos;
            continue;
        }
        size_t len = 0;
        const int32_t k = trie.longest_at(s, pos, &len);
        if (k < 0) {
            ++pos;
            continue;
        }
        size_t start = pos, stop = pos + len;
        const AddedToken& a = added[k];
        if (a.single_word && !single_word_at(s, start, stop)) {
            pos += len;
            continue;
        }
        if (a.lstrip) {
            size_t left = start;
            while (left > 0) {
                size_t prev = left - 1;
                while (prev > 0 && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
                size_t i = prev;
                if (!is_white_space(next_code_point(s, i))) break;
                left = prev;
            }
            start = std::max(left, start_offset);
        }
        if (a.rstrip) {
            while (stop < s.size()) {
                size_t i = stop;
                if (!is_white_space(next_code_point(s, i))) break;
                stop = i;
            }
        }
        if (start_offset < start) out.push_back({start_offset, start, -1});
        out.push_back({start, stop, k});
        start_offset = stop;
        pos += len;
    }
    if (start_offset < s.size()) out.push_back({start_offset, s.size(), -1});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
    const Impl& t = impl();
    check_utf8(text, "tokenizer input text");
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    if (t.raw_trie.empty()) {
        t.encode_segment(text, true, ids);
    } else {
        std::vector<Segment> segments;
        t.find_added(t.raw_trie, text, segments);
        for (const Segment& seg : segments) {
            if (seg.token >= 0)
                ids.push_back(t.added[seg.token].id);
            else
                t.encode_segment(text.substr(seg.begin, seg.end - seg.begin), seg.begin == 0, ids);
        }
    }
    if (add_special_tokens && t.has_template) {
        std::vector<int32_t> out;
        out.reserve(ids.size() + 4);
        for (const TemplateItem& item : t.single_template) {
            if (item.is_sequence)
                out.insert(out.end(), ids.begin(), ids.end());
            else
                out.insert(out.end(), item.ids.begin(), item.ids.end());
        }
        ids = std::move(out);
    }
    return ids;
}

// The normalizer chain over `text` (HF's normalizers, which see each segment between added tokens).
std::string Tokenizer::Impl::normalize(std::string_view text) const {
    std::string cur(text), next;
    for (const Normalizer& n : normalizers) {
        switch (n.kind) {
            case Normalizer::kNfc:
                if (!is_nfc_quick(cur)) cur = nfc(cur);
                break;
            case Normalizer::kPrepend:
                if (!cur.empty()) cur.insert(0, n.content);
                break;
            case Normalizer::kStrip: {
                size_t begin = 0, end = cur.size();
                if (n.strip_left)
                    while (begin < end) {
                        size_t i = begin;
                        if (!is_white_space(next_code_point(cur, i))) break;
                        begin = i;
                    }
                if (n.strip_right)
                    while (end > begin) {
                        size_t prev = end - 1;
                        while (prev > begin && (static_cast<unsigned char>(cur[prev]) & 0xC0) == 0x80) --prev;
                        size_t i = prev;
                        if (!is_white_space(next_code_point(cur, i))) break;
                        end = prev;
                    }
                cur = cur.substr(begin, end - begin);
                break;
            }
            case Normalizer::kReplace:
                next.clear();
                replace_all(cur, n.literal, n.regex.get(), n.content, next);
                cur.swap(next);
                break;
        }
    }
    return cur;
}

// A segment between raw-matched added tokens: normalise, match normalised added tokens, encode.
// `at_origin`: the segment starts at offset 0 of the input (Metaspace's prepend_scheme "first").
void Tokenizer::Impl::encode_segment(std::string_view text, bool at_origin, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    std::string normalized_storage;
    std::string_view normalized = text;
    if (nfc_only) {
        if (!is_nfc_quick(text)) {
            normalized_storage = mf::text::nfc(text);
            normalized = normalized_storage;
        }
    } else if (!normalizers.empty()) {
        normalized_storage = normalize(text);
        normalized = normalized_storage;
    }
    if (normalized_trie.empty()) {
        encode_words(normalized, at_origin, ids);
        return;
    }
    std::vector<Segment> segments;
    find_added(normalized_trie, normalized, segments);
    for (const Segment& seg : segments) {
        if (seg.token >= 0)
            ids.push_back(added[seg.token].id);
        else
            encode_words(normalized.substr(seg.begin, seg.end - seg.begin), at_origin && seg.begin == 0, ids);
    }
}

namespace {

// HF's NormalizedString::split: turns the pieces of find_matches into the splits a behavior keeps,
// and appends the non-empty ones to `out`, with whether each starts at the input's offset 0 to
// `out_origin` (`origin`: `s` does).
void apply_split_behavior(std::string_view s, const std::vector<BytePiece>& pieces, SplitBehavior behavior, bool invert,
                          bool origin, std::vector<std::string_view>& out, std::vector<uint8_t>& out_origin) {
    struct Split {
        size_t begin, end;
        bool remove;
    };
    std::vector<Split> splits;
    splits.reserve(pieces.size());
    bool previous_match = false;
    switch (behavior) {
        case SplitBehavior::kIsolated:
            for (const BytePiece& p : pieces) splits.push_back({p.begin, p.end, false});
            break;
        case SplitBehavior::kRemoved:
            for (const BytePiece& p : pieces) splits.push_back({p.begin, p.end, p.is_match != invert});
            break;
        case SplitBehavior::kContiguous:
            for (const BytePiece& p : pieces) {
                const bool m = p.is_match != invert;
                if (m == previous_match && !splits.empty())
                    splits.back().end = p.end;
                else
                    splits.push_back({p.begin, p.end, false});
                previous_match = m;
            }
            break;
        case SplitBehavior::kMergedWithPrevious:
            for (const BytePiece& p : pieces) {
                const bool m = p.is_match != invert;
                if (m && !previous_match && !splits.empty())
                    splits.back().end = p.end;
                else
                    splits.push_back({p.begin, p.end, false});
                previous_match = m;
            }
            break;
        case SplitBehavior::kMergedWithNext:
            for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
                const bool m = it->is_match != invert;
                if (m && !previous_match && !splits.empty())
                    splits.back().begin = it->begin;
                else
                    splits.push_back({it->begin, it->end, false});
                previous_match = m;
            }
            std::reverse(splits.begin(), splits.end());
            break;
    }
    for (const Split& sp : splits)
        if (!sp.remove && sp.end > sp.begin) {
            out.emplace_back(s.substr(sp.begin, sp.end - sp.begin));
            out_origin.push_back(origin && sp.begin == 0 ? 1 : 0);
        }
}

// Pieces of `piece` by a character predicate: each matching character is one match (HF's split
// with a char pattern, as Digits and Punctuation use), in bytes.
template <typename Pred>
void char_pieces(std::string_view piece, Pred pred, std::vector<BytePiece>& out) {
    out.clear();
    size_t gap = 0;
    for (size_t i = 0; i < piece.size();) {
        const size_t at = i;
        if (pred(next_code_point(piece, i))) {
            if (at > gap) out.push_back({gap, at, false});
            out.push_back({at, i, true});
            gap = i;
        }
    }
    if (gap < piece.size() || piece.empty()) out.push_back({gap, piece.size(), false});
}

bool is_punctuation(char32_t c) {
    constexpr uint32_t kPunctuation = category_bit(Category::Pc) | category_bit(Category::Pd) |
                                      category_bit(Category::Ps) | category_bit(Category::Pe) |
                                      category_bit(Category::Pi) | category_bit(Category::Pf) |
                                      category_bit(Category::Po);
    const bool ascii_punct =
        (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
    return ascii_punct || in_categories(c, kPunctuation);
}

// Pieces of `piece` found by `regex`, in bytes.
void regex_pieces(const Regex& regex, std::string_view piece, std::u32string& cps, std::vector<size_t>& offsets,
                  std::vector<BytePiece>& out) {
    cps.clear();
    offsets.clear();
    for (size_t i = 0; i < piece.size();) {
        offsets.push_back(i);
        cps.push_back(next_code_point(piece, i));
    }
    offsets.push_back(piece.size());
    out.clear();
    for (const Regex::Piece& p : regex.find_matches(std::u32string_view(cps)))
        out.push_back({offsets[p.begin], offsets[p.end], p.is_match});
}

// Pieces of `piece` found by a literal string (non-overlapping, left to right), in bytes.
void string_pieces(std::string_view literal, std::string_view piece, std::vector<BytePiece>& out) {
    out.clear();
    size_t prev = 0;
    for (size_t at = piece.find(literal); at != std::string_view::npos; at = piece.find(literal, at + literal.size())) {
        if (at > prev) out.push_back({prev, at, false});
        out.push_back({at, at + literal.size(), true});
        prev = at + literal.size();
    }
    if (prev < piece.size() || piece.empty()) out.push_back({prev, piece.size(), false});
}

}  // namespace

void Tokenizer::Impl::encode_words(std::string_view text, bool at_origin, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    if (pre_tokenizers.empty()) {
        bpe(text, ids);
        return;
    }
    // Pieces are views into `text` or into arenas; an arena is reserved to its final size before the
    // first view into it is taken, and a deque never moves its elements, so views stay valid.
    // `origin[k]`: piece k starts at the input's offset 0.
    std::vector<std::string_view> pieces{text}, next;
    std::vector<uint8_t> origin{static_cast<uint8_t>(at_origin ? 1 : 0)}, next_origin;
    std::deque<std::string> arenas;
    std::string prefixed;
    std::u32string cps;
    std::vector<size_t> offsets;
    std::vector<BytePiece> found;
    const ByteLevelMap& bl = byte_level();
    for (const PreTokenizer& p : pre_tokenizers) {
        next.clear();
        next_origin.clear();
        if (p.kind == PreTokenizer::kByteLevel) {
            size_t total = 0;
            for (std::string_view piece : pieces)
                total += bl.mapped_size(piece) + (p.add_prefix_space && piece[0] != ' ' ? bl.utf8_length[' '] : 0);
            arenas.emplace_back().reserve(total);
        } else if (p.kind == PreTokenizer::kMetaspace) {
            size_t total = 0;
            for (std::string_view piece : pieces) total += (piece.size() + 1) * p.literal.size();
            arenas.emplace_back().reserve(total);
        }
        for (size_t k = 0; k < pieces.size(); ++k) {
            const std::string_view piece = pieces[k];
            const bool o = origin[k] != 0;
            switch (p.kind) {
                case PreTokenizer::kSplitRegex:
                    regex_pieces(*p.regex, piece, cps, offsets, found);
                    apply_split_behavior(piece, found, p.behavior, p.invert, o, next, next_origin);
                    break;
                case PreTokenizer::kSplitString:
                    string_pieces(p.literal, piece, found);
                    apply_split_behavior(piece, found, p.behavior, p.invert, o, next, next_origin);
                    break;
                case PreTokenizer::kDigits:
                    char_pieces(piece, is_number, found);
                    apply_split_behavior(piece, found, p.behavior, false, o, next, next_origin);
                    break;
                case PreTokenizer::kPunctuation:
                    char_pieces(piece, is_punctuation, found);
                    apply_split_behavior(piece, found, p.behavior, false, o, next, next_origin);
                    break;
                case PreTokenizer::kMetaspace:
                    metaspace(p, piece, o, arenas.back(), found, next, next_origin);
                    break;
                case PreTokenizer::kByteLevel: {
                    std::string_view source = piece;
                    if (p.add_prefix_space && piece[0] != ' ') {
                        prefixed.assign(1, ' ');
                        prefixed += piece;
                        source = prefixed;
                    }
                    if (p.use_regex) {
                        const size_t first = next.size();
                        regex_pieces(*p.regex, source, cps, offsets, found);
                        apply_split_behavior(source, found, SplitBehavior::kIsolated, false, o, next, next_origin);
                        for (size_t n = first; n < next.size(); ++n) next[n] = bl.append_mapped(arenas.back(), next[n]);
                    } else {
                        next.push_back(bl.append_mapped(arenas.back(), source));
                        next_origin.push_back(o ? 1 : 0);
                    }
                    break;
                }
            }
        }
        pieces.swap(next);
        origin.swap(next_origin);
    }
    for (std::string_view piece : pieces) bpe(piece, ids);
}

// HF's Metaspace pre-tokenizer on one piece: spaces become the replacement, which is prepended
// (always; first: only at the input's start; never) unless the piece starts with it; with split,
// each replacement starts a new piece (MergedWithNext). The rewritten text goes to `arena`.
void Tokenizer::Impl::metaspace(const PreTokenizer& p, std::string_view piece, bool at_origin, std::string& arena,
                                std::vector<BytePiece>& found, std::vector<std::string_view>& out,
                                std::vector<uint8_t>& out_origin) const {
    const size_t begin = arena.size();
    const std::string_view rep = p.literal;
    const bool starts = piece.substr(0, 1) == " " || piece.substr(0, rep.size()) == rep;
    if (!starts && (p.prepend == PrependScheme::kAlways || (p.prepend == PrependScheme::kFirst && at_origin)))
        arena.append(rep);
    for (char c : piece) {
        if (c == ' ')
            arena.append(rep);
        else
            arena.push_back(c);
    }
    const std::string_view rewritten = std::string_view(arena).substr(begin);
    if (!p.split) {
        out.push_back(rewritten);
        out_origin.push_back(at_origin ? 1 : 0);
        return;
    }
    string_pieces(rep, rewritten, found);
    apply_split_behavior(rewritten, found, SplitBehavior::kMergedWithNext, false, at_origin, out, out_origin);
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& ids) const {
    if (word.empty()) return;
    const bool cacheable = word.size() <= kMaxCachedWordBytes;
    if (cacheable) {
        std::lock_guard<std::mutex> lock(cache_mutex);
        auto it = cache.find(word);
        if (it != cache.end()) {
            ids.insert(ids.end(), it->second.begin(), it->second.end());
            return;
        }
    }
    const size_t first = ids.size();
    bpe_uncached(word, ids);
    if (cacheable) {
        std::vector<int32_t> value(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.end());
        std::lock_guard<std::mutex> lock(cache_mutex);
        if (cache.size() >= kCacheCapacity) cache.clear();
        cache.emplace(std::string(word), std::move(value));
    }
}

void Tokenizer::Impl::bpe_uncached(std::string_view word, std::vector<int32_t>& ids) const {
    if (ignore_merges) {
        if (auto it = vocab.find(word); it != vocab.end()) {
            ids.push_back(it->second);
            return;
        }
    }
    struct Symbol {
        int32_t id;
        int32_t prev, next;
        bool alive;
    };
    std::vector<Symbol> symbols;
    symbols.reserve(word.size());
    // Initial symbols: one a character; an unknown character becomes its bytes' <0xNN> tokens
    // (byte_fallback, when all exist), else unk (fused if asked), else nothing.
    int32_t pending_unk = -1;
    auto add = [&](int32_t id) {
        const auto idx = static_cast<int32_t>(symbols.size());
        symbols.push_back({id, idx - 1, idx + 1, true});
    };
    for (size_t i = 0; i < word.size();) {
        const size_t at = i;
        const char32_t c = next_code_point(word, i);
        int32_t id = c < 0x400 ? small_char_ids[c] : -1;
        if (id < 0 && c >= 0x400) {
            auto it = vocab.find(word.substr(at, i - at));
            if (it != vocab.end()) id = it->second;
        }
        if (id >= 0) {
            if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
            add(id);
        } else if (byte_fallback && std::all_of(word.begin() + static_cast<std::ptrdiff_t>(at),
                                                word.begin() + static_cast<std::ptrdiff_t>(i), [this](char b) {
                                                    return byte_ids[static_cast<unsigned char>(b)] >= 0;
                                                })) {
            // As HF: the bytes' tokens go in without flushing a pending unk (it follows them).
            for (size_t k = at; k < i; ++k) add(byte_ids[static_cast<unsigned char>(word[k])]);
        } else if (unk_id >= 0) {
            if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
            pending_unk = unk_id;
        }
    }
    if (pending_unk >= 0) add(pending_unk);
    if (symbols.empty()) return;
    symbols.back().next = -1;

    if (symbols.size() > 1) {
        struct Candidate {
            int32_t rank, pos, new_id;
            bool operator<(const Candidate& o) const {  // std::priority_queue pops the largest
                return rank != o.rank ? rank > o.rank : pos > o.pos;
            }
        };
        auto lookup = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
            auto it = merges.find((uint64_t(uint32_t(a)) << 32) | uint32_t(b));
            return it == merges.end() ? nullptr : &it->second;
        };
        // A max-heap by Candidate::operator< (what std::priority_queue does), on reserved storage.
        std::vector<Candidate> heap;
        heap.reserve(symbols.size() * 2);
        auto push = [&heap](const Candidate& c) {
            heap.push_back(c);
            std::push_heap(heap.begin(), heap.end());
        };
        for (size_t k = 0; k + 1 < symbols.size(); ++k)
            if (const auto* m = lookup(symbols[k].id, symbols[k + 1].id))
                push({m->first, static_cast<int32_t>(k), m->second});
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end());
            const Candidate top = heap.back();
            heap.pop_back();
            Symbol& cur = symbols[top.pos];
            if (!cur.alive || cur.next < 0) continue;
            Symbol& right = symbols[cur.next];
            const auto* m = lookup(cur.id, right.id);
            if (m == nullptr || m->second != top.new_id) continue;  // stale entry
            cur.id = top.new_id;
            right.alive = false;
            cur.next = right.next;
            if (cur.next >= 0) symbols[cur.next].prev = top.pos;
            if (cur.prev >= 0)
                if (const auto* pm = lookup(symbols[cur.prev].id, cur.id)) push({pm->first, cur.prev, pm->second});
            if (cur.next >= 0)
                if (const auto* nm = lookup(cur.id, symbols[cur.next].id)) push({nm->first, top.pos, nm->second});
        }
    }
    for (const Symbol& s : symbols)
        if (s.alive) ids.push_back(s.id);
}

// --- decoding and lookups --------------------------------------------------------------------------------

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
    const Impl& t = impl();
    std::vector<std::string_view> tokens;
    tokens.reserve(ids.size());
    for (size_t k = 0; k < ids.size(); ++k) {
        const int32_t id = ids[k];
        if (id < 0 || static_cast<size_t>(id) >= t.tokens.size() || t.has_token[id] == 0)
            fail("decode: id ", id, " at position ", k, " is not a token id (vocabulary size ", t.tokens.size(), ")");
        if (skip_special_tokens && t.skip_on_decode[id] != 0) continue;
        tokens.push_back(t.tokens[id]);
    }
    if (!t.has_decoder) {
        std::string out;
        for (size_t k = 0; k < tokens.size(); ++k) {
            if (k > 0) out += ' ';
            out += tokens[k];
        }
        return out;
    }
    std::vector<std::string> current(tokens.begin(), tokens.end());
    for (const Decoder& d : t.decoders) Impl::run_decoder(d, current);
    std::string out;  // decoders' outputs are joined with nothing
    for (const std::string& piece : current) out += piece;
    return out;
}

namespace {

// ByteLevel: each token's chars back to bytes (a token with a char outside the alphabet keeps its own
// bytes), then all bytes to one text, invalid UTF-8 replaced as Rust's from_utf8_lossy.
void decode_byte_level(std::vector<std::string>& tokens) {
    const ByteLevelMap& m = byte_level();
    std::string bytes;
    for (const std::string& tok : tokens) {
        const size_t mark = bytes.size();
        bool all_mapped = true;
        for (size_t i = 0; i < tok.size();) {
            const char32_t c = next_code_point(tok, i);
            if (c >= m.char_to_byte.size() || m.char_to_byte[c] < 0) {
                all_mapped = false;
                break;
            }
            bytes += static_cast<char>(m.char_to_byte[c]);
        }
        if (!all_mapped) {
            bytes.resize(mark);
            bytes += tok;
        }
    }
    tokens.assign(1, utf8_lossy(bytes));
}

// The byte of a "<0xNN>" token (exactly six bytes, two hex digits as Rust's u8::from_str_radix
// reads them, which also takes a '+' sign), or -1.
int fallback_byte(std::string_view tok) {
    if (tok.size() != 6 || tok.substr(0, 3) != "<0x" || tok[5] != '>') return -1;
    auto hex = [](char c) {
        return c >= '0' && c <= '9'   ? c - '0'
               : c >= 'a' && c <= 'f' ? c - 'a' + 10
               : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                      : -1;
    };
    if (tok[3] == '+') return hex(tok[4]);
    const int hi = hex(tok[3]), lo = hex(tok[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// ByteFallback: runs of <0xNN> tokens become their text when it is valid UTF-8, else one U+FFFD each.
void decode_byte_fallback(std::vector<std::string>& tokens) {
    std::vector<std::string> out;
    std::string run;
    size_t run_length = 0;
    auto flush = [&] {
        if (run_length == 0) return;
        if (find_invalid_utf8(run) == std::string_view::npos)
            out.push_back(run);
        else
            for (size_t k = 0; k < run_length; ++k) out.emplace_back("\xEF\xBF\xBD");
        run.clear();
        run_length = 0;
    };
    for (std::string& tok : tokens) {
        const int b = fallback_byte(tok);
        if (b >= 0) {
            run += static_cast<char>(b);
            ++run_length;
            continue;
        }
        flush();
        out.push_back(std::move(tok));
    }
    flush();
    tokens = std::move(out);
}

// Strip: up to `start` leading and `stop` trailing copies of one character off each token.
void decode_strip(const Decoder& d, std::vector<std::string>& tokens) {
    for (std::string& tok : tokens) {
        const std::u32string cps = to_code_points(tok);
        size_t begin = 0, end = cps.size();
        while (begin < d.strip_start && begin < cps.size() && cps[begin] == d.strip_char) ++begin;
        for (size_t k = 0; k < d.strip_stop && end > begin && cps[end - 1] == d.strip_char; ++k) --end;
        tok = to_utf8(std::u32string_view(cps).substr(begin, end - begin));
    }
}

// Metaspace: the replacement becomes a space, except in the first token (all of its replacements
// are dropped there, as HF does) when a prefix was prepended.
void decode_metaspace(const Decoder& d, std::vector<std::string>& tokens) {
    for (size_t k = 0; k < tokens.size(); ++k) {
        std::string out;
        replace_all(tokens[k], d.literal, nullptr, k == 0 && d.prepend ? "" : " ", out);
        tokens[k] = std::move(out);
    }
}

}  // namespace

void Tokenizer::Impl::run_decoder(const Decoder& d, std::vector<std::string>& tokens) {
    switch (d.kind) {
        case Decoder::kByteLevel:
            decode_byte_level(tokens);
            return;
        case Decoder::kByteFallback:
            decode_byte_fallback(tokens);
            return;
        case Decoder::kFuse: {
            std::string all;
            for (const std::string& tok : tokens) all += tok;
            tokens.assign(1, std::move(all));
            return;
        }
        case Decoder::kStrip:
            decode_strip(d, tokens);
            return;
        case Decoder::kReplace:
            for (std::string& tok : tokens) {
                std::string out;
                replace_all(tok, d.literal, d.regex.get(), d.content, out);
                tok = std::move(out);
            }
            return;
        case Decoder::kMetaspace:
            decode_metaspace(d, tokens);
            return;
    }
}

int32_t Tokenizer::token_to_id(std::string_view token) const { return impl().token_id(token); }

std::string Tokenizer::id_to_token(int32_t id) const {
    const Impl& t = impl();
    if (id < 0 || static_cast<size_t>(id) >= t.tokens.size() || t.has_token[id] == 0)
        fail("id_to_token: ", id, " is not a token id (vocabulary size ", t.tokens.size(), ")");
    return t.tokens[id];
}

bool Tokenizer::is_special(int32_t id) const {
    const Impl& t = impl();
    return id >= 0 && static_cast<size_t>(id) < t.special.size() && t.special[id] != 0;
}

size_t Tokenizer::vocab_size() const { return impl().tokens.size(); }

const json::Value& Tokenizer::config() const { return impl().config; }

}  // namespace mf::text
