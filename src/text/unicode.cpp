// Unicode tables and algorithms for the tokenizer (see unicode.h).
//
// The generated range tables are expanded once, at first use, into a two-level table
// (code point >> 8 -> block, block[code point & 255] -> 16 flag bits). Combining classes and
// decompositions are only needed on NFC's slow path and stay as sorted arrays searched by
// binary search; the composition pairs go into a hash map.
#include "text/unicode.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>

#include "core/check.h"

namespace mf::text {

namespace {

#include "text/unicode_tables.inc"

constexpr char32_t kMaxCodePoint = 0x10FFFF;
constexpr uint16_t kCategoryBits = 0x1F;
constexpr uint16_t kWhiteSpaceFlag = 0x20;
constexpr uint16_t kNfcUnsafeFlag = 0x40;
constexpr uint16_t kAlphabeticFlag = 0x80;
constexpr uint16_t kHanFlag = 0x100;

// Hangul syllable arithmetic (Unicode §3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

struct Tables {
    std::vector<uint16_t> stage1;  // (kMaxCodePoint + 1) >> 8 entries
    std::vector<uint16_t> stage2;  // 256 entries a block
    std::unordered_map<uint64_t, char32_t> compositions;
    std::unordered_map<char32_t, char32_t> folds;
    std::unordered_map<char32_t, std::vector<char32_t>> fold_sources;
};

const Tables& tables() {
    static const Tables t = [] {
        Tables out;
        std::vector<uint16_t> flat(kMaxCodePoint + 1, 0);
        const size_t num_runs = sizeof(kGeneralCategoryRuns) / sizeof(kGeneralCategoryRuns[0]);
        for (size_t i = 0; i < num_runs; ++i) {
            const uint32_t start = kGeneralCategoryRuns[i] >> 5;
            const uint32_t end = i + 1 < num_runs ? (kGeneralCategoryRuns[i + 1] >> 5) : kMaxCodePoint + 1;
            const auto cat = static_cast<uint16_t>(kGeneralCategoryRuns[i] & kCategoryBits);
            std::fill(flat.begin() + start, flat.begin() + end, cat);
        }
        auto mark = [&flat](const auto& ranges, uint16_t flag) {
            for (size_t i = 0; i + 1 < std::size(ranges); i += 2)
                for (uint32_t cp = ranges[i]; cp <= ranges[i + 1]; ++cp) flat[cp] |= flag;
        };
        mark(kWhiteSpaceRanges, kWhiteSpaceFlag);
        mark(kNfcUnsafeRanges, kNfcUnsafeFlag);
        mark(kAlphabeticRanges, kAlphabeticFlag);
        mark(kHanRanges, kHanFlag);
        std::unordered_map<std::string, uint16_t> unique_blocks;  // a block's bytes -> its index
        out.stage1.resize((kMaxCodePoint + 1) >> 8);
        for (size_t block = 0; block < out.stage1.size(); ++block) {
            const uint16_t* first = flat.data() + block * 256;
            std::string key(reinterpret_cast<const char*>(first), 256 * sizeof(uint16_t));
            auto [it, inserted] = unique_blocks.emplace(std::move(key), static_cast<uint16_t>(unique_blocks.size()));
            if (inserted) out.stage2.insert(out.stage2.end(), first, first + 256);
            out.stage1[block] = it->second;
        }
        for (size_t i = 0; i + 2 < sizeof(kDecompositions) / sizeof(uint32_t); i += 3) {
            if ((kDecompositions[i] & kComposesFlag) == 0) continue;
            const uint64_t key = (uint64_t(kDecompositions[i + 1]) << 32) | kDecompositions[i + 2];
            out.compositions.emplace(key, static_cast<char32_t>(kDecompositions[i] & ~kComposesFlag));
        }
        for (size_t i = 0; i + 3 < sizeof(kCaseFoldRuns) / sizeof(int32_t); i += 4) {
            for (int32_t k = 0; k < kCaseFoldRuns[i + 1]; ++k) {
                const auto cp = static_cast<char32_t>(kCaseFoldRuns[i] + k * kCaseFoldRuns[i + 2]);
                const auto folded = static_cast<char32_t>(static_cast<int32_t>(cp) + kCaseFoldRuns[i + 3]);
                out.folds.emplace(cp, folded);
                out.fold_sources[folded].push_back(cp);
            }
        }
        return out;
    }();
    return t;
}

inline uint16_t flags(char32_t cp) {
    if (cp > kMaxCodePoint) return 0;
    static const Tables& t = tables();
    return t.stage2[size_t(t.stage1[cp >> 8]) * 256 + (cp & 0xFF)];
}

// Index of the last run whose start is <= cp in a table of packed (start << shift | value) runs.
template <size_t N>
uint32_t run_value(const uint32_t (&table)[N], char32_t cp, int shift) {
    const uint32_t key = (static_cast<uint32_t>(cp) << shift) | ((1u << shift) - 1);
    const uint32_t* it = std::upper_bound(table, table + N, key);
    return it == table ? 0 : (*(it - 1) & ((1u << shift) - 1));
}

// Canonical decomposition of one code point, one level: returns the number of parts (0 when none).
int decompose_once(char32_t cp, char32_t* first, char32_t* second) {
    constexpr size_t n = sizeof(kDecompositions) / sizeof(uint32_t) / 3;
    size_t lo = 0, hi = n;
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        const uint32_t mid_cp = kDecompositions[mid * 3] & ~kComposesFlag;
        if (mid_cp < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == n || (kDecompositions[lo * 3] & ~kComposesFlag) != cp) return 0;
    *first = kDecompositions[lo * 3 + 1];
    *second = kDecompositions[lo * 3 + 2];
    return *second == 0 ? 1 : 2;
}

void decompose_full(char32_t cp, std::u32string& out) {
    if (cp >= kSBase && cp < kSBase + kSCount) {
        const char32_t s = cp - kSBase;
        out.push_back(kLBase + s / kNCount);
        out.push_back(kVBase + (s % kNCount) / kTCount);
        if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
        return;
    }
    char32_t a = 0, b = 0;
    const int parts = decompose_once(cp, &a, &b);
    if (parts == 0) {
        out.push_back(cp);
        return;
    }
    decompose_full(a, out);
    if (parts == 2) decompose_full(b, out);
}

// The primary composite of (a, b), or 0 when there is none.
char32_t compose_pair(char32_t a, char32_t b) {
    if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
        return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
    if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
        return a + (b - kTBase);
    const auto& m = tables().compositions;
    auto it = m.find((uint64_t(a) << 32) | b);
    return it == m.end() ? 0 : it->second;
}

// Full NFC of a short run of code points (a segment between stable starters).
void nfc_segment(const char32_t* cps, size_t n, std::u32string& scratch, std::u32string& out) {
    scratch.clear();
    for (size_t i = 0; i < n; ++i) decompose_full(cps[i], scratch);
    // Canonical ordering: stable sort of each run of non-starters by combining class.
    for (size_t i = 0; i < scratch.size();) {
        if (combining_class(scratch[i]) == 0) {
            ++i;
            continue;
        }
        size_t j = i;
        while (j < scratch.size() && combining_class(scratch[j]) != 0) ++j;
        std::stable_sort(scratch.begin() + i, scratch.begin() + j,
                         [](char32_t x, char32_t y) { return combining_class(x) < combining_class(y); });
        i = j;
    }
    // Canonical composition.
    long starter = -1;
    uint8_t last_cc = 0;
    for (char32_t c : scratch) {
        const uint8_t cc = combining_class(c);
        if (starter >= 0) {
            const bool adjacent = out.size() == size_t(starter) + 1;
            if (adjacent || (last_cc != 0 && last_cc < cc)) {
                const char32_t composite = compose_pair(out[starter], c);
                if (composite != 0) {
                    out[starter] = composite;
                    continue;
                }
            }
        }
        if (cc == 0) starter = static_cast<long>(out.size());
        last_cc = cc;
        out.push_back(c);
    }
}

}  // namespace

const char* unicode_version() { return kUnicodeVersion; }
const char* nfc_unicode_version() { return kNfcUnicodeVersion; }

Category category(char32_t cp) { return static_cast<Category>(flags(cp) & kCategoryBits); }

bool is_white_space(char32_t cp) { return (flags(cp) & kWhiteSpaceFlag) != 0; }

bool is_alphabetic(char32_t cp) { return (flags(cp) & kAlphabeticFlag) != 0; }

bool is_han(char32_t cp) { return (flags(cp) & kHanFlag) != 0; }

namespace {
constexpr uint32_t kWordCategories = kMarkMask | category_bit(Category::Nd) | category_bit(Category::Pc);
bool alphabetic_mark_nd_pc(char32_t cp) {
    const uint16_t f = flags(cp);
    return (f & kAlphabeticFlag) != 0 || ((kWordCategories >> (f & kCategoryBits)) & 1u) != 0;
}
}  // namespace

bool is_word_char(char32_t cp) { return alphabetic_mark_nd_pc(cp) || cp == 0x200C || cp == 0x200D; }

bool is_oniguruma_word_char(char32_t cp) {
    // Below U+0100 Oniguruma reads its ISO-8859-1 table, which also calls the superscripts and
    // vulgar fractions ² ³ ¹ ¼ ½ ¾ (No) word characters.
    if (cp == 0xB2 || cp == 0xB3 || cp == 0xB9 || cp == 0xBC || cp == 0xBD || cp == 0xBE) return true;
    return alphabetic_mark_nd_pc(cp);
}

uint8_t combining_class(char32_t cp) {
    if (cp < 0x300) return 0;
    return static_cast<uint8_t>(run_value(kCombiningClassRuns, cp, 8));
}

char32_t simple_case_fold(char32_t cp) {
    if (cp < 0x80) return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
    const auto& m = tables().folds;
    auto it = m.find(cp);
    return it == m.end() ? cp : it->second;
}

const std::vector<char32_t>& case_fold_sources(char32_t folded) {
    static const std::vector<char32_t> kNone;
    const auto& m = tables().fold_sources;
    auto it = m.find(folded);
    return it == m.end() ? kNone : it->second;
}

// --- UTF-8 ---------------------------------------------------------------------------------------------

namespace {

// The well-formed UTF-8 table (Unicode ch. 3, table 3-7) for a lead byte >= 0x80: the sequence
// length (0: not a lead byte) and the allowed range [lo, hi] of the second byte.
size_t utf8_lead(unsigned char b, unsigned char& lo, unsigned char& hi) {
    lo = 0x80;
    hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b == 0xE0) return lo = 0xA0, 3;
    if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) return 3;
    if (b == 0xED) return hi = 0x9F, 3;
    if (b == 0xF0) return lo = 0x90, 4;
    if (b >= 0xF1 && b <= 0xF3) return 4;
    if (b == 0xF4) return hi = 0x8F, 4;
    return 0;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    const size_t n = s.size();
    size_t i = 0;
    while (i < n) {
        // Fast path over ASCII, eight bytes at a time.
        while (i + 8 <= n) {
            uint64_t word;
            std::memcpy(&word, p + i, 8);
            if ((word & 0x8080808080808080ull) != 0) break;
            i += 8;
        }
        if (i >= n) break;
        const unsigned char b = p[i];
        if (b < 0x80) {
            ++i;
            continue;
        }
        unsigned char lo, hi;
        const size_t len = utf8_lead(b, lo, hi);
        if (len == 0) return i;
        if (i + len > n) return i;
        if (p[i + 1] < lo || p[i + 1] > hi) return i;
        for (size_t k = 2; k < len; ++k)
            if ((p[i + k] & 0xC0) != 0x80) return i;
        i += len;
    }
    return std::string_view::npos;
}

void check_utf8(std::string_view s, std::string_view what) {
    const size_t bad = find_invalid_utf8(s);
    if (bad == std::string_view::npos) return;
    std::string bytes;
    static const char* kHex = "0123456789ABCDEF";
    for (size_t k = bad; k < s.size() && k < bad + 4; ++k) {
        const auto b = static_cast<unsigned char>(s[k]);
        if (!bytes.empty()) bytes += ' ';
        bytes += kHex[b >> 4];
        bytes += kHex[b & 15];
    }
    fail(what, ": invalid UTF-8 at byte ", bad, " (bytes ", bytes, ")");
}

std::u32string to_code_points(std::string_view s) {
    std::u32string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) out.push_back(next_code_point(s, i));
    return out;
}

std::string to_utf8(std::u32string_view cps) {
    std::string out;
    out.reserve(cps.size());
    for (char32_t cp : cps) append_utf8(out, cp);
    return out;
}

std::string utf8_lossy(std::string_view bytes) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
    const size_t n = bytes.size();
    std::string out;
    out.reserve(n);
    size_t i = 0;
    while (i < n) {
        const unsigned char b = p[i];
        if (b < 0x80) {
            out += static_cast<char>(b);
            ++i;
            continue;
        }
        unsigned char lo, hi;
        const size_t len = utf8_lead(b, lo, hi);
        // The maximal prefix of a valid sequence that is there becomes one U+FFFD.
        size_t k = 1;
        if (len != 0 && i + 1 < n && p[i + 1] >= lo && p[i + 1] <= hi) {
            k = 2;
            while (k < len && i + k < n && (p[i + k] & 0xC0) == 0x80) ++k;
        }
        if (len != 0 && k == len) {
            out.append(bytes.substr(i, len));
        } else {
            out += "\xEF\xBF\xBD";
        }
        i += k;
    }
    return out;
}

// --- NFC ---------------------------------------------------------------------------------------------

bool is_nfc_quick(std::string_view s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    for (size_t i = 0; i < s.size();) {
        if (p[i] < 0x80) {
            ++i;
            continue;
        }
        const char32_t cp = next_code_point(s, i);
        if ((flags(cp) & kNfcUnsafeFlag) != 0) return false;
    }
    return true;
}

std::string nfc(std::string_view s) {
    if (is_nfc_quick(s)) return std::string(s);
    const std::u32string cps = to_code_points(s);
    std::u32string out, scratch;
    out.reserve(cps.size() + 8);
    // Segments start at each stable code point (NFC-safe, so combining class 0 and never the second
    // half of a composition): nothing before it can interact with it or anything after it.
    size_t begin = 0;
    for (size_t i = 1; i <= cps.size(); ++i) {
        if (i < cps.size() && (flags(cps[i]) & kNfcUnsafeFlag) != 0) continue;
        if (i - begin == 1 && (flags(cps[begin]) & kNfcUnsafeFlag) == 0)
            out.push_back(cps[begin]);
        else
            nfc_segment(cps.data() + begin, i - begin, scratch, out);
        begin = i;
    }
    return to_utf8(out);
}

}  // namespace mf::text
