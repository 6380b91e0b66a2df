// UTF-8 encoding and UTF-16 surrogate arithmetic shared by the JSON parser (core/json.cpp), the
// recipe YAML parser (train/yaml.cpp) and the tokenizer's Unicode layer (text/unicode.cpp), which
// re-exports append_utf8 as mf::text::append_utf8.
//
// Invariant: append_utf8 is given a code point <= U+10FFFF (the callers decode it from valid UTF-8
// or from a \u escape, surrogate pairs already combined); it writes the shortest form, 1 to 4 bytes,
// and does not itself reject surrogates.
#pragma once

#include <cstdint>
#include <string>

namespace mf {

// Appends the UTF-8 encoding of `cp` to `out`.
void append_utf8(std::string& out, uint32_t cp);

// UTF-16 surrogates, as JSON and YAML \uXXXX escapes write characters above U+FFFF: a high
// surrogate (U+D800..U+DBFF) followed by a low one (U+DC00..U+DFFF).
constexpr bool is_high_surrogate(uint32_t u) { return u >= 0xD800 && u <= 0xDBFF; }
constexpr bool is_low_surrogate(uint32_t u) { return u >= 0xDC00 && u <= 0xDFFF; }
// The code point (U+10000..U+10FFFF) of a high/low surrogate pair.
constexpr uint32_t combine_surrogates(uint32_t high, uint32_t low) {
    return 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
}

}  // namespace mf
