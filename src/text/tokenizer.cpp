// HF byte-level BPE tokenizer (see tokenizer.h for the pipeline).
//
// Layout: a Loader turns tokenizer.json into an Impl (validating every field it reads and naming
// the JSON path of anything it refuses); encode/decode run the pipeline over that Impl.
// BPE keeps HF's merge order exactly: a heap of candidate pairs keyed by (merge rank, position),
// symbols in a linked list, stale heap entries skipped when popped. Words already seen come from a
// cache (mutex-guarded, cleared when it reaches kCacheCapacity entries).
#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <deque>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

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
    bool special = false, normalized = false, lstrip = false, rstrip = false;
};

// What Split does with the pieces it finds (HF's SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizer {
    enum Kind { kByteLevel, kSplitRegex, kSplitString } kind = kByteLevel;
    bool add_prefix_space = false;  // ByteLevel
    bool use_regex = true;          // ByteLevel
    std::shared_ptr<const Regex> regex;
    std::string literal;
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
};

struct TemplateItem {
    bool is_sequence = false;
    std::vector<int32_t> ids;
};

struct Segment {
    size_t begin, end;
    int32_t token;  // added-token index, -1 for text
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
    std::vector<int32_t> small_char_ids;  // id of the single-char token for code points < 0x400, or -1
    // Ids -> tokens, over the vocabulary and the added tokens (added ones win).
    std::vector<std::string> tokens;
    std::vector<uint8_t> has_token, special;
    // Added tokens.
    std::vector<AddedToken> added;
    StringMap<int32_t> added_ids;
    TokenTrie raw_trie, normalized_trie;
    // Pipeline.
    bool nfc = false;
    std::vector<PreTokenizer> pre_tokenizers;
    bool has_decoder = false;
    int num_byte_level_decoders = 0;
    bool has_template = false;
    std::vector<TemplateItem> single_template;
    // Word cache.
    mutable std::mutex cache_mutex;
    mutable StringMap<std::vector<int32_t>> cache;

    void encode_segment(std::string_view text, std::vector<int32_t>& ids) const;
    void encode_words(std::string_view text, std::vector<int32_t>& ids) const;
    void bpe(std::string_view word, std::vector<int32_t>& ids) const;
    void bpe_uncached(std::string_view word, std::vector<int32_t>& ids) const;
    void find_added(const TokenTrie& trie, std::string_view s, std::vector<Segment>& out) const;
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

    void load(const json::Value& root) {
        expect_kind(root, json::Kind::object, "(root)");
        for (const char* key : {"truncation", "padding"}) {
            const json::Value* v = field(root, key);
            if (v != nullptr && !v->is_null())
                bad(key, "is not supported (must be null; moeforge truncates and pads its batches itself)");
        }
        load_model(require(root, "model", "(root)"), "model");
        load_added_tokens(root);
        load_normalizer(field(root, "normalizer"), "normalizer");
        load_pre_tokenizer(field(root, "pre_tokenizer"), "pre_tokenizer");
        load_decoder(field(root, "decoder"), "decoder");
        load_post_processor(field(root, "post_processor"), "post_processor");
        // Refresh the tries now that the normalizer is known: normalized tokens are matched
        // against normalised text, so their contents are normalised too (as HF does).
        for (size_t k = 0; k < t_.added.size(); ++k) {
            const AddedToken& a = t_.added[k];
            if (a.normalized)
                t_.normalized_trie.add(t_.nfc ? nfc(a.content) : a.content, static_cast<int32_t>(k));
            else
                t_.raw_trie.add(a.content, static_cast<int32_t>(k));
        }
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
        if (get_bool(model, "byte_fallback", path, false))
            bad(path + ".byte_fallback", "true is not supported (only false)");
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

    void load_added_tokens(const json::Value& root) {
        const json::Value* list = field(root, "added_tokens");
        if (list == nullptr || list->is_null()) return;
        expect_kind(*list, json::Kind::array, "added_tokens");
        for (size_t k = 0; k < list->size(); ++k) {
            const std::string path = "added_tokens[" + std::to_string(k) + "]";
            const json::Value& e = list->as_array()[k];
            expect_kind(e, json::Kind::object, path);
            AddedToken a;
            a.id = get_id(require(e, "id", path), path + ".id");
            const json::Value& content = require(e, "content", path);
            expect_kind(content, json::Kind::string, path + ".content");
            a.content = content.as_string();
            if (a.content.empty()) bad(path + ".content", "empty added token");
            a.special = get_bool(e, "special", path, false);
            a.normalized = get_bool(e, "normalized", path, !a.special);
            a.lstrip = get_bool(e, "lstrip", path, false);
            a.rstrip = get_bool(e, "rstrip", path, false);
            if (get_bool(e, "single_word", path, false))
                bad(path + ".single_word", "true is not supported (only false) for ", show_token(a.content));
            if (t_.added_ids.count(a.content) != 0) bad(path + ".content", show_token(a.content), " is added twice");
            t_.added_ids.emplace(a.content, a.id);
            set_token(a.id, a.content);
            t_.special[a.id] = a.special ? 1 : 0;
            t_.added.push_back(std::move(a));
        }
    }

    void load_normalizer(const json::Value* v, const std::string& path) {
        if (v == nullptr || v->is_null()) return;
        const std::string type = get_type(*v, path);
        if (type == "NFC") {
            t_.nfc = true;
        } else if (type == "Sequence") {
            const json::Value& list = require(*v, "normalizers", path);
            expect_kind(list, json::Kind::array, path + ".normalizers");
            for (size_t k = 0; k < list.size(); ++k)
                load_normalizer(&list.as_array()[k], path + ".normalizers[" + std::to_string(k) + "]");
        } else {
            bad(path + ".type", show_token(type), " is not supported (supported: NFC, Sequence)");
        }
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
            const json::Value& behavior = require(*v, "behavior", path);
            expect_kind(behavior, json::Kind::string, path + ".behavior");
            const std::string& b = behavior.as_string();
            if (b == "Removed")
                p.behavior = SplitBehavior::kRemoved;
            else if (b == "Isolated")
                p.behavior = SplitBehavior::kIsolated;
            else if (b == "MergedWithPrevious")
                p.behavior = SplitBehavior::kMergedWithPrevious;
            else if (b == "MergedWithNext")
                p.behavior = SplitBehavior::kMergedWithNext;
            else if (b == "Contiguous")
                p.behavior = SplitBehavior::kContiguous;
            else
                bad(path + ".behavior", show_token(b),
                    " is not a split behavior (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
            p.invert = get_bool(*v, "invert", path, false);
            const json::Value& pattern = require(*v, "pattern", path);
            expect_kind(pattern, json::Kind::object, path + ".pattern");
            if (const json::Value* re = field(pattern, "Regex")) {
                expect_kind(*re, json::Kind::string, path + ".pattern.Regex");
                p.kind = PreTokenizer::kSplitRegex;
                try {
                    p.regex = std::make_shared<const Regex>(re->as_string());
                } catch (const Error& e) {
                    bad(path + ".pattern.Regex", e.what());
                }
            } else if (const json::Value* str = field(pattern, "String")) {
                expect_kind(*str, json::Kind::string, path + ".pattern.String");
                if (str->as_string().empty()) bad(path + ".pattern.String", "empty split string");
                p.kind = PreTokenizer::kSplitString;
                p.literal = str->as_string();
            } else {
                bad(path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}, got ", pattern.dump());
            }
            t_.pre_tokenizers.push_back(std::move(p));
        } else {
            bad(path + ".type", show_token(type), " is not supported (supported: ByteLevel, Split, Sequence)");
        }
    }

    void load_decoder(const json::Value* v, const std::string& path) {
        if (v == nullptr || v->is_null()) return;
        t_.has_decoder = true;
        const std::string type = get_type(*v, path);
        if (type == "ByteLevel") {
            ++t_.num_byte_level_decoders;
        } else if (type == "Sequence") {
            const json::Value& list = require(*v, "decoders", path);
            expect_kind(list, json::Kind::array, path + ".decoders");
            for (size_t k = 0; k < list.size(); ++k)
                load_decoder(&list.as_array()[k], path + ".decoders[" + std::to_string(k) + "]");
        } else {
            bad(path + ".type", show_token(type), " is not supported (supported: ByteLevel, Sequence)");
        }
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

    auto resolve = [&](const char* key) -> std::optional<int32_t> {
        const std::pair<const json::Value*, const char*> files[] = {{&t.config, "tokenizer_config.json"},
                                                                    {&special_tokens_map, "special_tokens_map.json"}};
        for (const auto& [cfg, name] : files) {
            const std::optional<std::string> token = special_token_name(*cfg, key, name);
            if (!token) continue;
            const int32_t id = t.token_id(*token);
            if (id < 0) fail(name, ": ", key, ": ", show_token(*token), " is not a token of ", source);
            return id;
        }
        return std::nullopt;
    };
    tok.eos_id = resolve("eos_token");
    tok.pad_id = resolve("pad_token");
    tok.bos_id = resolve("bos_token");
    return tok;
}

Tokenizer Tokenizer::load(const std::filesystem::path& dir) {
    std::filesystem::path file = dir, base = dir;
    if (std::filesystem::is_directory(dir)) {
        file = dir / "tokenizer.json";
        if (!std::filesystem::exists(file))
            fail(dir.string(), ": no tokenizer.json in this directory (expected a Hugging Face tokenizer directory)");
    } else if (!std::filesystem::exists(dir)) {
        fail(dir.string(), ": no such tokenizer directory or file");
    } else {
        base = dir.parent_path();
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
    return from_json(read_text_file(file), file.string(), std::move(config), std::move(special_map));
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
// matches; lstrip/rstrip widen a match over neighbouring whitespace. Segments cover `s` in order.
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
        t.encode_segment(text, ids);
    } else {
        std::vector<Segment> segments;
        t.find_added(t.raw_trie, text, segments);
        for (const Segment& seg : segments) {
            if (seg.token >= 0)
                ids.push_back(t.added[seg.token].id);
            else
                t.encode_segment(text.substr(seg.begin, seg.end - seg.begin), ids);
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

// A segment between raw-matched added tokens: normalise, match normalised added tokens, encode.
void Tokenizer::Impl::encode_segment(std::string_view text, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    std::string normalized_storage;
    std::string_view normalized = text;
    if (nfc && !is_nfc_quick(text)) {
        normalized_storage = mf::text::nfc(text);
        normalized = normalized_storage;
    }
    if (normalized_trie.empty()) {
        encode_words(normalized, ids);
        return;
    }
    std::vector<Segment> segments;
    find_added(normalized_trie, normalized, segments);
    for (const Segment& seg : segments) {
        if (seg.token >= 0)
            ids.push_back(added[seg.token].id);
        else
            encode_words(normalized.substr(seg.begin, seg.end - seg.begin), ids);
    }
}

namespace {

struct BytePiece {
    size_t begin, end;
    bool is_match;
};

// HF's NormalizedString::split: turns the pieces of find_matches into the splits a behavior keeps,
// and appends the non-empty ones.
void apply_split_behavior(std::string_view s, const std::vector<BytePiece>& pieces, SplitBehavior behavior, bool invert,
                          std::vector<std::string_view>& out) {
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
        if (!sp.remove && sp.end > sp.begin) out.emplace_back(s.substr(sp.begin, sp.end - sp.begin));
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

void Tokenizer::Impl::encode_words(std::string_view text, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    if (pre_tokenizers.empty()) {
        bpe(text, ids);
        return;
    }
    // Pieces are views into `text` or into arenas; an arena is reserved to its final size before the
    // first view into it is taken, and a deque never moves its elements, so views stay valid.
    std::vector<std::string_view> pieces{text}, next;
    std::deque<std::string> arenas;
    std::string prefixed;
    std::u32string cps;
    std::vector<size_t> offsets;
    std::vector<BytePiece> found;
    const ByteLevelMap& bl = byte_level();
    for (const PreTokenizer& p : pre_tokenizers) {
        next.clear();
        if (p.kind == PreTokenizer::kByteLevel) {
            size_t total = 0;
            for (std::string_view piece : pieces)
                total += bl.mapped_size(piece) + (p.add_prefix_space && piece[0] != ' ' ? bl.utf8_length[' '] : 0);
            arenas.emplace_back().reserve(total);
        }
        for (std::string_view piece : pieces) {
            switch (p.kind) {
                case PreTokenizer::kSplitRegex:
                    regex_pieces(*p.regex, piece, cps, offsets, found);
                    apply_split_behavior(piece, found, p.behavior, p.invert, next);
                    break;
                case PreTokenizer::kSplitString:
                    string_pieces(p.literal, piece, found);
                    apply_split_behavior(piece, found, p.behavior, p.invert, next);
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
                        apply_split_behavior(source, found, SplitBehavior::kIsolated, false, next);
                        for (size_t k = first; k < next.size(); ++k) next[k] = bl.append_mapped(arenas.back(), next[k]);
                    } else {
                        next.push_back(bl.append_mapped(arenas.back(), source));
                    }
                    break;
                }
            }
        }
        pieces.swap(next);
    }
    for (std::string_view piece : pieces) bpe(piece, ids);
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
    // Initial symbols: one a character; unknown characters become unk (fused if asked) or vanish.
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
                if (const auto* pm = lookup(symbols[cur.prev].id, cur.id))
                    push({pm->first, cur.prev, pm->second});
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
        if (skip_special_tokens && t.special[id] != 0) continue;
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
    // ByteLevel decoders: each token's chars back to bytes (a token with a char outside the
    // alphabet keeps its own bytes), then bytes to text. A second ByteLevel sees one joined string.
    const ByteLevelMap& m = byte_level();
    std::vector<std::string> current;
    for (const std::string_view tok : tokens) current.emplace_back(tok);
    for (int d = 0; d < t.num_byte_level_decoders; ++d) {
        std::string bytes;
        for (const std::string& tok : current) {
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
        current.assign(1, utf8_lossy(bytes));
    }
    std::string out;  // decoders' outputs are joined with nothing
    for (const std::string& piece : current) out += piece;
    return out;
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
