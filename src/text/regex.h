// A small backtracking regex engine for the pre-tokenizer patterns of HF tokenizer.json files.
//
// Semantics are Oniguruma's (what HF `tokenizers` uses): leftmost match, alternatives tried in
// order and the first that lets the rest match wins, greedy quantifiers give back one character at
// a time. Matching runs over code points, so `.` and classes see whole characters.
//
// Syntax: literals; escapes \t \n \r \f \v \e \a \xHH \x{H..} \uHHHH and escaped punctuation;
// \s \S (White_Space) \d \D (Nd) \w \W (Oniguruma's word characters: Alphabetic, marks, Nd, Pc, and
// ² ³ ¹ ¼ ½ ¾) \p{..} \P{..} \p{^..} with general categories (short or
// long names), White_Space, Alphabetic and the Han script; classes [...] with ranges, negation, the
// escapes above, nested classes (a union) and `&&` intersection ([\p{L}&&[^\p{Han}]], the syntax of
// Kimi's tiktoken pattern); `.` (anything but \n); groups (...) (?:...) (?i:...) (?-i:...); lookahead
// (?=...) (?!...); alternation; quantifiers ? * + {n} {n,} {n,m}, greedy, lazy (?) or possessive (+,
// on a single character or class only). Anything else (anchors, backreferences, lookbehind, \b,
// other scripts...) is an error that names it. An unbounded repeat of something that can match empty
// is refused.
//
// The program is compiled once; match state lives on the caller's stack, so one Regex may be used
// from several threads. Every search has a step budget; running out of it is an mf::Error
// (catastrophic backtracking), never a hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mf::text {

class Regex {
 public:
    // Compiles `pattern` (UTF-8). Throws mf::Error "regex /pattern/: at offset N: problem".
    explicit Regex(std::string_view pattern);
    ~Regex();
    Regex(const Regex&);
    Regex(Regex&&) noexcept;
    Regex& operator=(const Regex&);
    Regex& operator=(Regex&&) noexcept;

    const std::string& pattern() const { return pattern_; }

    // Anchored match at `pos`: true and *end set to where the match ends.
    bool match_at(std::u32string_view text, size_t pos, size_t* end) const;
    // Leftmost match starting at or after `from`.
    bool search(std::u32string_view text, size_t from, size_t* begin, size_t* end) const;
    // The matches and the gaps between them, in order, covering the text, as HF's find_matches over
    // the onig crate's find_iter: an empty match right after the previous match is skipped, other
    // empty matches are listed (they split gaps); an empty text gives one empty gap.
    struct Piece {
        size_t begin, end;  // code point offsets
        bool is_match;
    };
    std::vector<Piece> find_matches(std::u32string_view text) const;
    // HF's Split(pattern, behavior=Isolated): find_matches without the empty pieces.
    std::vector<std::pair<size_t, size_t>> split_isolated(std::u32string_view text) const;
    // The same on UTF-8 text (valid UTF-8 required), returning the pieces; for tests and tools.
    std::vector<std::string> split_isolated(std::string_view utf8) const;

    // Steps one search may take before it is an error: kBaseSteps + kStepsPerChar * text length.
    static constexpr size_t kBaseSteps = 1u << 20;
    static constexpr size_t kStepsPerChar = 256;

    struct CharSet;
    struct Inst;
    struct Context;

 private:
    bool run(Context& ctx, uint32_t pc, size_t pos, size_t* end) const;

    std::string pattern_;
    std::vector<CharSet> sets_;
    std::vector<Inst> program_;
    std::vector<uint32_t> guards_;  // set indices referenced by kSplit guards
};

}  // namespace mf::text
