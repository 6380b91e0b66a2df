// Backtracking regex engine (see regex.h).
//
// Pattern -> syntax tree (Parser) -> a small instruction program (compile) run by a backtracking
// VM with an explicit stack (Regex::run). Instructions:
//   kSet s          one code point in set s
//   kRepeatSet s    a run of code points in set s, min..max times, greedy / lazy / possessive; the
//                   greedy form pushes one stack frame that gives characters back one at a time
//   kSplit x y      try x, on failure y; with a guard (the sets that can start x, when x cannot
//                   match empty), go straight to y when the next character is in none of them
//   kJmp x
//   kLook x y neg   run the sub-program at x (ending in kMatch) at the current position, atomically;
//                   continue at y when it matched (neg: when it did not)
//   kMatch
// Unbounded repeats of general sub-expressions are loops of kSplit; bounded ones are unrolled.
#include "text/regex.h"

#include <algorithm>
#include <limits>

#include "core/check.h"
#include "text/unicode.h"

namespace mf::text {

namespace {
constexpr uint32_t kInfinite = std::numeric_limits<uint32_t>::max();
constexpr uint32_t kMaxCount = 1000;      // largest n or m in {n,m}
constexpr size_t kMaxProgram = 1u << 16;  // instructions
constexpr int kMaxDepth = 64;             // group nesting
constexpr size_t kMaxGuardSets = 16;      // sets checked before trying an alternative
enum class Mode : uint8_t { kGreedy, kLazy, kPossessive };
}  // namespace

// Properties a class may test besides categories and ranges (bits of CharSet::props / not_props).
enum : uint8_t { kPropWord = 1, kPropHan = 2, kPropAlphabetic = 4 };

struct Regex::CharSet {
    std::vector<std::pair<char32_t, char32_t>> ranges;
    uint8_t props = 0, not_props = 0;    // has one of `props`, or lacks one of `not_props`
    std::vector<CharSet> unions;         // nested classes [..[..]..]
    std::vector<CharSet> intersections;  // [a&&b]: every one must match too
    bool has_extra = false;              // any of the three above (set by finalize)
    uint32_t category_mask = 0;          // any of these categories
    std::vector<uint32_t> not_category;  // outside one of these masks (\P{..})
    bool white_space = false;            // \s
    bool not_white_space = false;        // \S
    bool negated = false;
    bool icase = false;
    uint64_t ascii[2] = {0, 0};

    bool raw(char32_t c) const {
        for (const auto& [lo, hi] : ranges)
            if (c >= lo && c <= hi) return true;
        if (category_mask != 0 || !not_category.empty()) {
            const uint32_t bit = category_bit(category(c));
            if ((category_mask & bit) != 0) return true;
            for (uint32_t m : not_category)
                if ((m & bit) == 0) return true;
        }
        if (white_space || not_white_space) {
            const bool ws = is_white_space(c);
            if ((white_space && ws) || (not_white_space && !ws)) return true;
        }
        return has_extra && raw_extra(c);
    }
    // The properties and nested classes, apart so that the common case stays small.
    [[gnu::noinline]] bool raw_extra(char32_t c) const {
        if ((props | not_props) != 0) {
            const uint8_t has =
                static_cast<uint8_t>((is_oniguruma_word_char(c) ? kPropWord : 0) | (is_han(c) ? kPropHan : 0) |
                                     (is_alphabetic(c) ? kPropAlphabetic : 0));
            if ((props & has) != 0 || (not_props & ~has) != 0) return true;
        }
        for (const CharSet& u : unions)
            if (u.matches(c)) return true;
        return false;
    }
    bool slow(char32_t c) const {
        bool m = raw(c);
        if (!m && icase) {
            const char32_t f = simple_case_fold(c);
            m = f != c && raw(f);
            if (!m)
                for (char32_t y : case_fold_sources(f))
                    if (y != c && raw(y)) {
                        m = true;
                        break;
                    }
        }
        if (has_extra) m = m && in_intersections(c);
        return m != negated;
    }
    // Out of line (NOTE: they recurse through nested sets; inlined, they bloat the matcher's loop).
    [[gnu::noinline]] bool in_intersections(char32_t c) const {
        for (const CharSet& x : intersections)
            if (!x.matches(c)) return false;
        return true;
    }
    bool matches(char32_t c) const {
        if (c < 128) return ((ascii[c >> 6] >> (c & 63)) & 1u) != 0;
        return slow(c);
    }
    void finalize() {
        has_extra = props != 0 || not_props != 0 || !unions.empty() || !intersections.empty();
        for (char32_t c = 0; c < 128; ++c)
            if (slow(c)) ascii[c >> 6] |= uint64_t(1) << (c & 63);
    }
};

struct Regex::Inst {
    enum Op : uint8_t { kSet, kRepeatSet, kSplit, kJmp, kLook, kMatch };
    Op op = kMatch;
    Mode mode = Mode::kGreedy;
    bool negate = false;
    uint32_t set = 0;
    uint32_t x = 0, y = 0;
    uint32_t min = 0, max = 0;
    uint32_t guard_begin = 0, guard_count = 0;  // kSplit: sets in Regex::guards_ that can start x
};

namespace {

struct Node {
    enum Kind : uint8_t { kEmpty, kSet, kConcat, kAlt, kRepeat, kLook };
    Kind kind = kEmpty;
    uint32_t set = 0;
    std::vector<Node> kids;
    uint32_t min = 0, max = 0;
    Mode mode = Mode::kGreedy;
    bool negate = false;
};

// What can start a match of a node: kSolid when one of the collected sets must match the first
// character (the node never matches empty), kNullable when it may also match empty, kUnknown when a
// lookahead stands in the way.
enum class Start { kSolid, kNullable, kUnknown };

Start first_sets(const Node& n, std::vector<uint32_t>& out) {
    switch (n.kind) {
        case Node::kEmpty:
            return Start::kNullable;
        case Node::kSet:
            out.push_back(n.set);
            return Start::kSolid;
        case Node::kConcat:
            for (const Node& k : n.kids) {
                const Start r = first_sets(k, out);
                if (r != Start::kNullable) return r;
            }
            return Start::kNullable;
        case Node::kAlt: {
            Start all = Start::kSolid;
            for (const Node& k : n.kids) {
                const Start r = first_sets(k, out);
                if (r == Start::kUnknown) return r;
                if (r == Start::kNullable) all = Start::kNullable;
            }
            return all;
        }
        case Node::kRepeat: {
            const Start r = first_sets(n.kids[0], out);
            return r == Start::kUnknown ? r : n.min == 0 ? Start::kNullable : r;
        }
        case Node::kLook:
            return Start::kUnknown;
    }
    return Start::kUnknown;
}

bool nullable(const Node& n) {
    switch (n.kind) {
        case Node::kEmpty:
            return true;
        case Node::kSet:
            return false;
        case Node::kConcat:
            return std::all_of(n.kids.begin(), n.kids.end(), [](const Node& k) { return nullable(k); });
        case Node::kAlt:
            return std::any_of(n.kids.begin(), n.kids.end(), [](const Node& k) { return nullable(k); });
        case Node::kRepeat:
            return n.min == 0 || nullable(n.kids[0]);
        case Node::kLook:
            return true;
    }
    return true;
}

std::string normalise_property_name(std::u32string_view name) {
    std::string out;
    for (char32_t c : name) {
        if (c == '_' || c == ' ' || c == '-') continue;
        if (c >= 'A' && c <= 'Z') c += 32;
        if (c >= 128) return "?";
        out += static_cast<char>(c);
    }
    return out;
}

// Category mask for a property name, or 0 when unknown. White_Space and Any are handled by the caller.
uint32_t property_mask(const std::string& name) {
    using C = Category;
    auto b = [](C c) { return category_bit(c); };
    struct Entry {
        const char* short_name;
        const char* long_name;
        uint32_t mask;
    };
    const uint32_t punct = b(C::Pc) | b(C::Pd) | b(C::Ps) | b(C::Pe) | b(C::Pi) | b(C::Pf) | b(C::Po);
    const uint32_t symbol = b(C::Sm) | b(C::Sc) | b(C::Sk) | b(C::So);
    const uint32_t separator = b(C::Zs) | b(C::Zl) | b(C::Zp);
    const uint32_t other = b(C::Cc) | b(C::Cf) | b(C::Cs) | b(C::Co) | b(C::Cn);
    const Entry entries[] = {
        {"l", "letter", kLetterMask},
        {"lc", "casedletter", b(C::Lu) | b(C::Ll) | b(C::Lt)},
        {"lu", "uppercaseletter", b(C::Lu)},
        {"ll", "lowercaseletter", b(C::Ll)},
        {"lt", "titlecaseletter", b(C::Lt)},
        {"lm", "modifierletter", b(C::Lm)},
        {"lo", "otherletter", b(C::Lo)},
        {"m", "mark", kMarkMask},
        {"mn", "nonspacingmark", b(C::Mn)},
        {"mc", "spacingmark", b(C::Mc)},
        {"me", "enclosingmark", b(C::Me)},
        {"n", "number", kNumberMask},
        {"nd", "decimalnumber", b(C::Nd)},
        {"nl", "letternumber", b(C::Nl)},
        {"no", "othernumber", b(C::No)},
        {"p", "punctuation", punct},
        {"pc", "connectorpunctuation", b(C::Pc)},
        {"pd", "dashpunctuation", b(C::Pd)},
        {"ps", "openpunctuation", b(C::Ps)},
        {"pe", "closepunctuation", b(C::Pe)},
        {"pi", "initialpunctuation", b(C::Pi)},
        {"pf", "finalpunctuation", b(C::Pf)},
        {"po", "otherpunctuation", b(C::Po)},
        {"s", "symbol", symbol},
        {"sm", "mathsymbol", b(C::Sm)},
        {"sc", "currencysymbol", b(C::Sc)},
        {"sk", "modifiersymbol", b(C::Sk)},
        {"so", "othersymbol", b(C::So)},
        {"z", "separator", separator},
        {"zs", "spaceseparator", b(C::Zs)},
        {"zl", "lineseparator", b(C::Zl)},
        {"zp", "paragraphseparator", b(C::Zp)},
        {"c", "other", other},
        {"cc", "control", b(C::Cc)},
        {"cf", "format", b(C::Cf)},
        {"cs", "surrogate", b(C::Cs)},
        {"co", "privateuse", b(C::Co)},
        {"cn", "unassigned", b(C::Cn)},
    };
    for (const Entry& e : entries)
        if (name == e.short_name || name == e.long_name) return e.mask;
    return 0;
}

class Parser {
 public:
    Parser(std::string_view pattern, std::vector<Regex::CharSet>& sets) : source_(pattern), sets_(sets) {
        const size_t bad = find_invalid_utf8(pattern);
        if (bad != std::string_view::npos) fail("regex: pattern is not valid UTF-8 (byte ", bad, ")");
        p_ = to_code_points(pattern);
    }

    Node parse() {
        Node n = parse_alt(false, 0);
        if (i_ < p_.size()) error(i_, "unmatched ')'");
        return n;
    }

 private:
    template <typename... Args>
    [[noreturn]] void error(size_t at, Args&&... args) {
        fail("regex /", source_, "/: at offset ", at, ": ", std::forward<Args>(args)...);
    }
    bool eof() const { return i_ >= p_.size(); }
    char32_t peek(size_t k = 0) const { return i_ + k < p_.size() ? p_[i_ + k] : 0; }
    std::string show(char32_t c) const {
        std::string s;
        append_utf8(s, c);
        return s;
    }

    uint32_t add_set(Regex::CharSet set) {
        set.finalize();
        sets_.push_back(std::move(set));
        return static_cast<uint32_t>(sets_.size() - 1);
    }
    Node set_node(Regex::CharSet set) {
        Node n;
        n.kind = Node::kSet;
        n.set = add_set(std::move(set));
        return n;
    }
    Node literal(char32_t c, bool icase) {
        Regex::CharSet s;
        s.ranges.push_back({c, c});
        s.icase = icase;
        return set_node(std::move(s));
    }

    Node parse_alt(bool icase, int depth) {
        if (depth > kMaxDepth) error(i_, "groups nested deeper than ", kMaxDepth);
        Node alt;
        alt.kind = Node::kAlt;
        alt.kids.push_back(parse_concat(icase, depth));
        while (!eof() && peek() == '|') {
            ++i_;
            alt.kids.push_back(parse_concat(icase, depth));
        }
        if (alt.kids.size() == 1) return std::move(alt.kids[0]);
        return alt;
    }

    // `icase` is by reference so that an inline (?i) changes the rest of the enclosing group.
    Node parse_concat(bool& icase, int depth) {
        Node cat;
        cat.kind = Node::kConcat;
        while (!eof() && peek() != '|' && peek() != ')') {
            const size_t atom_at = i_;
            bool flags_only = false;
            Node atom = parse_atom(icase, depth, &flags_only);
            if (flags_only) continue;
            uint32_t min = 0, max = 0;
            Mode mode = Mode::kGreedy;
            if (parse_quantifier(&min, &max, &mode)) {
                if (atom.kind == Node::kLook) error(atom_at, "a quantifier on a lookahead is not supported");
                if (atom.kind == Node::kRepeat) error(atom_at, "nested quantifiers are not supported");
                if (mode == Mode::kPossessive && atom.kind != Node::kSet)
                    error(atom_at, "possessive quantifiers are supported on single characters and classes only");
                if (max == kInfinite && nullable(atom))
                    error(atom_at, "unbounded repeat of an expression that can match empty is not supported");
                Node rep;
                rep.kind = Node::kRepeat;
                rep.min = min;
                rep.max = max;
                rep.mode = mode;
                rep.kids.push_back(std::move(atom));
                atom = std::move(rep);
                if (!eof() && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{'))
                    if (peek() != '{' || looks_like_interval()) error(i_, "nested quantifiers are not supported");
            }
            cat.kids.push_back(std::move(atom));
        }
        if (cat.kids.size() == 1) return std::move(cat.kids[0]);
        if (cat.kids.empty()) return Node{};
        return cat;
    }

    bool looks_like_interval() const {
        size_t k = i_ + 1;
        bool digits = false;
        while (k < p_.size() && p_[k] >= '0' && p_[k] <= '9') ++k, digits = true;
        if (k < p_.size() && p_[k] == ',') {
            ++k;
            while (k < p_.size() && p_[k] >= '0' && p_[k] <= '9') ++k, digits = true;
        }
        return digits && k < p_.size() && p_[k] == '}';
    }

    uint32_t parse_number() {
        uint32_t v = 0;
        const size_t at = i_;
        while (!eof() && peek() >= '0' && peek() <= '9') {
            v = v * 10 + (peek() - '0');
            if (v > kMaxCount) error(at, "repeat count above ", kMaxCount);
            ++i_;
        }
        return v;
    }

    bool parse_quantifier(uint32_t* min, uint32_t* max, Mode* mode) {
        if (eof()) return false;
        const char32_t c = peek();
        bool interval = false;
        if (c == '?')
            *min = 0, *max = 1;
        else if (c == '*')
            *min = 0, *max = kInfinite;
        else if (c == '+')
            *min = 1, *max = kInfinite;
        else if (c == '{' && looks_like_interval())
            interval = true;
        else
            return false;
        const size_t at = i_;
        ++i_;
        if (interval) {
            const bool has_min = peek() != ',';
            *min = has_min ? parse_number() : 0;
            if (peek() == ',') {
                ++i_;
                *max = peek() == '}' ? kInfinite : parse_number();
            } else {
                *max = *min;
            }
            ++i_;  // '}'
            if (*max < *min) error(at, "repeat {", *min, ",", *max, "} has max below min");
        }
        if (!eof() && peek() == '?') {
            *mode = Mode::kLazy;
            ++i_;
        } else if (!eof() && peek() == '+') {
            if (interval) error(i_, "'+' after an interval is not supported");
            *mode = Mode::kPossessive;
            ++i_;
        }
        return true;
    }

    Node parse_atom(bool& icase, int depth, bool* flags_only) {
        const size_t at = i_;
        const char32_t c = peek();
        ++i_;
        switch (c) {
            case '(':
                return parse_group(icase, depth, at, flags_only);
            case '[':
                return parse_class(icase, at);
            case '.': {
                Regex::CharSet s;
                s.ranges.push_back({'\n', '\n'});
                s.negated = true;
                return set_node(std::move(s));
            }
            case '\\': {
                Regex::CharSet s;
                s.icase = icase;
                parse_escape(s, at, false);
                return set_node(std::move(s));
            }
            case '^':
            case '$':
                error(at, "anchor '", show(c), "' is not supported");
            case '*':
            case '+':
            case '?':
                error(at, "quantifier '", show(c), "' has nothing to repeat");
            case ')':
                error(at, "unmatched ')'");
            default:
                return literal(c, icase);
        }
    }

    Node parse_group(bool& icase, int depth, size_t at, bool* flags_only) {
        Node body;
        if (peek() == '?') {
            ++i_;
            const char32_t k = peek();
            if (k == ':') {
                ++i_;
                body = parse_alt(icase, depth + 1);
            } else if (k == '=' || k == '!') {
                ++i_;
                Node look;
                look.kind = Node::kLook;
                look.negate = k == '!';
                look.kids.push_back(parse_alt(icase, depth + 1));
                body = std::move(look);
            } else if (k == '<' && (peek(1) == '=' || peek(1) == '!')) {
                error(at, "lookbehind is not supported");
            } else if (k == '<' || (k == 'P' && peek(1) == '<')) {
                // Named group: same as a plain group here (captures are not reported).
                while (!eof() && peek() != '>') ++i_;
                if (eof()) error(at, "unterminated group name");
                ++i_;
                body = parse_alt(icase, depth + 1);
            } else if (k == '-' || (k >= 'a' && k <= 'z') || (k >= 'A' && k <= 'Z')) {
                bool on = true, value = icase;
                while (!eof() && peek() != ':' && peek() != ')') {
                    const char32_t f = peek();
                    if (f == '-')
                        on = false;
                    else if (f == 'i')
                        value = on;
                    else
                        error(i_, "group flag '", show(f), "' is not supported (only i)");
                    ++i_;
                }
                if (eof()) error(at, "unterminated group");
                if (peek() == ')') {  // (?i) or (?-i): applies to the rest of the enclosing group
                    ++i_;
                    icase = value;
                    *flags_only = true;
                    return Node{};
                }
                ++i_;
                body = parse_alt(value, depth + 1);
            } else if (k == '>') {
                error(at, "atomic groups (?>...) are not supported");
            } else if (k == '#') {
                error(at, "comments (?#...) are not supported");
            } else {
                error(at, "group syntax '(?", show(k), "' is not supported");
            }
        } else {
            body = parse_alt(icase, depth + 1);
        }
        if (eof() || peek() != ')') error(at, "missing ')'");
        ++i_;
        // Wrapped, so that a quantifier after the group sees a group, not the repeat inside it.
        Node group;
        group.kind = Node::kConcat;
        group.kids.push_back(std::move(body));
        return group;
    }

    uint32_t parse_hex(size_t at, size_t min_digits, size_t max_digits, bool braced) {
        uint32_t v = 0;
        size_t n = 0;
        while (!eof() && n < max_digits) {
            const char32_t h = peek();
            uint32_t d;
            if (h >= '0' && h <= '9')
                d = h - '0';
            else if (h >= 'a' && h <= 'f')
                d = h - 'a' + 10;
            else if (h >= 'A' && h <= 'F')
                d = h - 'A' + 10;
            else
                break;
            v = v * 16 + d;
            ++n;
            ++i_;
        }
        if (n < min_digits) error(at, "bad hexadecimal escape");
        if (braced) {
            if (eof() || peek() != '}') error(at, "missing '}' in \\x{...}");
            ++i_;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) error(at, "escape names no Unicode scalar value");
        return v;
    }

    // Parses the escape after a backslash into `s`. Returns the code point for a single-character
    // escape (usable as a range endpoint in a class), or kInfinite for a class escape.
    uint32_t parse_escape(Regex::CharSet& s, size_t at, bool in_class) {
        if (eof()) error(at, "pattern ends with a backslash");
        const char32_t e = peek();
        ++i_;
        auto single = [&](char32_t cp) {
            s.ranges.push_back({cp, cp});
            return static_cast<uint32_t>(cp);
        };
        switch (e) {
            case 't':
                return single('\t');
            case 'n':
                return single('\n');
            case 'r':
                return single('\r');
            case 'f':
                return single('\f');
            case 'v':
                return single('\v');
            case 'a':
                return single(0x07);
            case 'e':
                return single(0x1B);
            case 'x':
                if (peek() == '{') {
                    ++i_;
                    return single(parse_hex(at, 1, 8, true));
                }
                return single(parse_hex(at, 1, 2, false));
            case 'u':
                return single(parse_hex(at, 4, 4, false));
            case 's':
                s.white_space = true;
                return kInfinite;
            case 'S':
                s.not_white_space = true;
                return kInfinite;
            case 'd':
                s.category_mask |= category_bit(Category::Nd);
                return kInfinite;
            case 'D':
                s.not_category.push_back(category_bit(Category::Nd));
                return kInfinite;
            case 'w':
                s.props |= kPropWord;
                return kInfinite;
            case 'W':
                s.not_props |= kPropWord;
                return kInfinite;
            case 'p':
            case 'P': {
                if (peek() != '{') error(at, "\\", show(e), " needs {name}");
                ++i_;
                bool negate = e == 'P';
                if (peek() == '^') {
                    negate = !negate;
                    ++i_;
                }
                const size_t name_at = i_;
                while (!eof() && peek() != '}') ++i_;
                if (eof()) error(at, "missing '}' in \\", show(e), "{...}");
                const std::u32string_view raw_name(p_.data() + name_at, i_ - name_at);
                ++i_;
                const std::string name = normalise_property_name(raw_name);
                uint32_t mask = property_mask(name);
                if (name == "any") mask = (1u << kNumCategories) - 1;
                if (name == "whitespace" || name == "space") {
                    (negate ? s.not_white_space : s.white_space) = true;
                    return kInfinite;
                }
                const uint8_t prop = name == "han" || name == "hani"           ? kPropHan
                                     : name == "alphabetic" || name == "alpha" ? kPropAlphabetic
                                     : name == "word"                          ? kPropWord
                                                                               : 0;
                if (prop != 0) {
                    (negate ? s.not_props : s.props) |= prop;
                    return kInfinite;
                }
                if (mask == 0)
                    error(at, "Unicode property '", to_utf8(raw_name),
                          "' is not supported (general categories, e.g. L, Lu, N, Nd, P, S, Z; White_Space, "
                          "Alphabetic, Han)");
                if (negate)
                    s.not_category.push_back(mask);
                else
                    s.category_mask |= mask;
                return kInfinite;
            }
            default:
                break;
        }
        if (e >= 128 || !((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9')))
            return single(e);  // escaped punctuation, space or non-ASCII: itself
        const char* what = "";
        switch (e) {
            case 'b':
                what = in_class ? " (backspace in a class)" : " (word boundary)";
                break;
            case 'B':
                what = " (non word boundary)";
                break;
            case 'A':
            case 'z':
            case 'Z':
            case 'G':
                what = " (anchor)";
                break;
            case 'k':
            case 'g':
                what = " (backreference or subexpression call)";
                break;
            case 'h':
            case 'H':
                what = " (hexadecimal digit class)";
                break;
            default:
                if (e >= '0' && e <= '9') what = " (backreference or octal escape)";
        }
        error(at, "escape '\\", show(e), "'", what, " is not supported");
    }

    Node parse_class(bool icase, size_t at) {
        Regex::CharSet s;
        s.icase = icase;
        if (peek() == '^') {
            s.negated = true;
            ++i_;
        }
        parse_class_items(s, at, true, 0);
        return set_node(std::move(s));
    }

    // The items of a class up to and including its ']': characters, ranges, class escapes, nested
    // classes (a union) and `&&` (the rest of the class, intersected with what came before).
    void parse_class_items(Regex::CharSet& s, size_t at, bool first, int depth) {
        if (depth > kMaxDepth) error(at, "classes nested deeper than ", kMaxDepth);
        for (;;) {
            if (eof()) error(at, "missing ']'");
            const size_t item_at = i_;
            char32_t c = peek();
            if (c == ']' && !first) {
                ++i_;
                return;
            }
            first = false;
            if (c == '[') {
                ++i_;
                Regex::CharSet sub;
                sub.icase = s.icase;
                if (peek() == '^') {
                    sub.negated = true;
                    ++i_;
                }
                parse_class_items(sub, item_at, true, depth + 1);
                sub.finalize();
                s.unions.push_back(std::move(sub));
                continue;
            }
            if (c == '&' && peek(1) == '&') {
                i_ += 2;
                Regex::CharSet rest;
                rest.icase = s.icase;
                parse_class_items(rest, item_at, false, depth + 1);
                rest.finalize();
                s.intersections.push_back(std::move(rest));
                return;
            }
            ++i_;
            uint32_t lo;
            if (c == '\\') {
                Regex::CharSet tmp;
                lo = parse_escape(tmp, item_at, true);
                if (lo == kInfinite) {
                    merge_into(s, tmp);
                    if (peek() == '-' && peek(1) != ']') error(i_, "a class escape cannot start a range");
                    continue;
                }
            } else {
                lo = c;
            }
            if (peek() == '-' && peek(1) != ']' && i_ + 1 < p_.size()) {
                ++i_;
                const size_t hi_at = i_;
                uint32_t hi;
                if (peek() == '\\') {
                    ++i_;
                    Regex::CharSet tmp;
                    hi = parse_escape(tmp, hi_at, true);
                    if (hi == kInfinite) error(hi_at, "a class escape cannot end a range");
                } else if (peek() == '[') {
                    error(hi_at, "a nested class cannot end a range");
                } else {
                    hi = peek();
                    ++i_;
                }
                if (hi < lo) error(item_at, "range out of order in class");
                s.ranges.push_back({lo, hi});
            } else {
                s.ranges.push_back({lo, lo});
            }
        }
    }

    static void merge_into(Regex::CharSet& dst, const Regex::CharSet& src) {
        dst.ranges.insert(dst.ranges.end(), src.ranges.begin(), src.ranges.end());
        dst.category_mask |= src.category_mask;
        dst.not_category.insert(dst.not_category.end(), src.not_category.begin(), src.not_category.end());
        dst.white_space |= src.white_space;
        dst.not_white_space |= src.not_white_space;
        dst.props |= src.props;
        dst.not_props |= src.not_props;
    }

    std::string_view source_;
    std::vector<Regex::CharSet>& sets_;
    std::u32string p_;
    size_t i_ = 0;
};

class Compiler {
 public:
    Compiler(std::vector<Regex::Inst>& prog, std::vector<uint32_t>& guards, const std::string& source)
        : prog_(prog), guards_(guards), source_(source) {}

    void compile(const Node& n) {
        if (prog_.size() > kMaxProgram) fail("regex /", source_, "/: pattern too large once repeats are unrolled");
        switch (n.kind) {
            case Node::kEmpty:
                return;
            case Node::kSet: {
                Regex::Inst in;
                in.op = Regex::Inst::kSet;
                in.set = n.set;
                prog_.push_back(in);
                return;
            }
            case Node::kConcat:
                for (const Node& k : n.kids) compile(k);
                return;
            case Node::kAlt: {
                std::vector<size_t> jumps;
                for (size_t a = 0; a < n.kids.size(); ++a) {
                    if (a + 1 < n.kids.size()) {
                        const size_t split = emit(Regex::Inst::kSplit);
                        std::vector<uint32_t> first;
                        if (first_sets(n.kids[a], first) == Start::kSolid && first.size() <= kMaxGuardSets) {
                            std::sort(first.begin(), first.end());
                            first.erase(std::unique(first.begin(), first.end()), first.end());
                            prog_[split].guard_begin = static_cast<uint32_t>(guards_.size());
                            prog_[split].guard_count = static_cast<uint32_t>(first.size());
                            guards_.insert(guards_.end(), first.begin(), first.end());
                        }
                        prog_[split].x = static_cast<uint32_t>(prog_.size());
                        compile(n.kids[a]);
                        jumps.push_back(emit(Regex::Inst::kJmp));
                        prog_[split].y = static_cast<uint32_t>(prog_.size());
                    } else {
                        compile(n.kids[a]);
                    }
                }
                for (size_t j : jumps) prog_[j].x = static_cast<uint32_t>(prog_.size());
                return;
            }
            case Node::kRepeat:
                compile_repeat(n);
                return;
            case Node::kLook: {
                const size_t look = emit(Regex::Inst::kLook);
                prog_[look].negate = n.negate;
                prog_[look].x = static_cast<uint32_t>(prog_.size());
                compile(n.kids[0]);
                emit(Regex::Inst::kMatch);
                prog_[look].y = static_cast<uint32_t>(prog_.size());
                return;
            }
        }
    }

 private:
    size_t emit(Regex::Inst::Op op) {
        Regex::Inst in;
        in.op = op;
        prog_.push_back(in);
        return prog_.size() - 1;
    }

    void compile_repeat(const Node& n) {
        const Node& body = n.kids[0];
        if (n.max == 0) return;
        if (body.kind == Node::kSet) {
            Regex::Inst in;
            in.op = Regex::Inst::kRepeatSet;
            in.set = body.set;
            in.min = n.min;
            in.max = n.max;
            in.mode = n.mode;
            prog_.push_back(in);
            return;
        }
        const bool lazy = n.mode == Mode::kLazy;
        for (uint32_t k = 0; k < n.min; ++k) compile(body);
        if (n.max == kInfinite) {
            // L: split(body, exit); body; jmp L; exit:
            const size_t split = emit(Regex::Inst::kSplit);
            const uint32_t body_at = static_cast<uint32_t>(prog_.size());
            compile(body);
            const size_t jmp = emit(Regex::Inst::kJmp);
            prog_[jmp].x = static_cast<uint32_t>(split);
            const uint32_t exit_at = static_cast<uint32_t>(prog_.size());
            prog_[split].x = lazy ? exit_at : body_at;
            prog_[split].y = lazy ? body_at : exit_at;
            return;
        }
        // Optional copies: split(body, end); body; split(body, end); body; ... end:
        std::vector<size_t> splits;
        for (uint32_t k = n.min; k < n.max; ++k) {
            splits.push_back(emit(Regex::Inst::kSplit));
            prog_[splits.back()].x = static_cast<uint32_t>(prog_.size());  // body (patched for lazy)
            compile(body);
        }
        const uint32_t end = static_cast<uint32_t>(prog_.size());
        for (size_t s : splits) {
            const uint32_t body_at = s + 1;
            prog_[s].x = lazy ? end : body_at;
            prog_[s].y = lazy ? body_at : end;
        }
    }

    std::vector<Regex::Inst>& prog_;
    std::vector<uint32_t>& guards_;
    const std::string& source_;
};

}  // namespace

// --- the VM ------------------------------------------------------------------------------------------

struct Regex::Context {
    enum Kind : uint32_t { kPlain, kGiveBack, kTakeMore };
    struct Frame {
        Kind kind;
        uint32_t pc;
        size_t pos;
        size_t aux;  // kGiveBack: lowest position; kTakeMore: characters taken so far
    };
    std::u32string_view text;
    std::vector<Frame> stack;
    size_t steps = 0;
    size_t step_limit = 0;
};

Regex::Regex(std::string_view pattern) : pattern_(pattern) {
    Parser parser(pattern, sets_);
    const Node root = parser.parse();
    Compiler compiler(program_, guards_, pattern_);
    compiler.compile(root);
    Inst match;
    match.op = Inst::kMatch;
    program_.push_back(match);
}

Regex::~Regex() = default;
Regex::Regex(const Regex&) = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(const Regex&) = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

bool Regex::run(Context& ctx, uint32_t pc, size_t pos, size_t* end) const {
    const size_t base = ctx.stack.size();
    const char32_t* text = ctx.text.data();
    const size_t n = ctx.text.size();
    for (;;) {
        if (++ctx.steps > ctx.step_limit) [[unlikely]]
            fail("regex /", pattern_, "/: backtracking step limit (", ctx.step_limit, ") exceeded on a text of ", n,
                 " characters (catastrophic backtracking)");
        const Inst& in = program_[pc];
        switch (in.op) {
            case Inst::kSet:
                if (pos < n && sets_[in.set].matches(text[pos])) {
                    ++pos;
                    ++pc;
                    continue;
                }
                goto backtrack;
            case Inst::kRepeatSet: {
                const CharSet& set = sets_[in.set];
                const size_t room = n - pos;
                const size_t limit = in.max == kInfinite || in.max > room ? room : in.max;
                size_t k = 0;
                if (in.mode == Mode::kLazy) {
                    while (k < in.min && k < limit && set.matches(text[pos + k])) ++k;
                    ctx.steps += k;
                    if (k < in.min) goto backtrack;
                    if (k < limit) ctx.stack.push_back({Context::kTakeMore, pc, pos + k, k});
                } else {
                    while (k < limit && set.matches(text[pos + k])) ++k;
                    ctx.steps += k;
                    if (k < in.min) goto backtrack;
                    if (in.mode == Mode::kGreedy && k > in.min)
                        ctx.stack.push_back({Context::kGiveBack, pc + 1, pos + k - 1, pos + in.min});
                }
                pos += k;
                ++pc;
                continue;
            }
            case Inst::kSplit:
                if (in.guard_count != 0) {
                    bool may_start = false;
                    if (pos < n) {
                        const uint32_t* g = guards_.data() + in.guard_begin;
                        for (uint32_t k = 0; k < in.guard_count && !may_start; ++k)
                            may_start = sets_[g[k]].matches(text[pos]);
                    }
                    if (!may_start) {
                        pc = in.y;
                        continue;
                    }
                }
                ctx.stack.push_back({Context::kPlain, in.y, pos, 0});
                pc = in.x;
                continue;
            case Inst::kJmp:
                pc = in.x;
                continue;
            case Inst::kLook: {
                size_t ignored = 0;
                const bool matched = run(ctx, in.x, pos, &ignored);
                if (matched != in.negate) {
                    pc = in.y;
                    continue;
                }
                goto backtrack;
            }
            case Inst::kMatch:
                *end = pos;
                ctx.stack.resize(base);
                return true;
        }
    backtrack:
        if (ctx.stack.size() == base) return false;
        {
            Context::Frame f = ctx.stack.back();
            ctx.stack.pop_back();
            switch (f.kind) {
                case Context::kPlain:
                    pc = f.pc;
                    pos = f.pos;
                    break;
                case Context::kGiveBack:
                    pc = f.pc;
                    pos = f.pos;
                    if (f.pos > f.aux) ctx.stack.push_back({Context::kGiveBack, f.pc, f.pos - 1, f.aux});
                    break;
                case Context::kTakeMore: {
                    const Inst& rep = program_[f.pc];
                    if (f.pos >= n || !sets_[rep.set].matches(text[f.pos])) goto backtrack;
                    pos = f.pos + 1;
                    const size_t taken = f.aux + 1;
                    if (taken < rep.max && pos < n) ctx.stack.push_back({Context::kTakeMore, f.pc, pos, taken});
                    pc = f.pc + 1;
                    break;
                }
            }
        }
    }
}

bool Regex::match_at(std::u32string_view text, size_t pos, size_t* end) const {
    Context ctx;
    ctx.text = text;
    ctx.step_limit = kBaseSteps + kStepsPerChar * text.size();
    return run(ctx, 0, pos, end);
}

bool Regex::search(std::u32string_view text, size_t from, size_t* begin, size_t* end) const {
    Context ctx;
    ctx.text = text;
    ctx.step_limit = kBaseSteps + kStepsPerChar * (text.size() - std::min(from, text.size()));
    for (size_t start = from; start <= text.size(); ++start) {
        if (run(ctx, 0, start, end)) {
            *begin = start;
            return true;
        }
    }
    return false;
}

std::vector<Regex::Piece> Regex::find_matches(std::u32string_view text) const {
    std::vector<Piece> pieces;
    if (text.empty()) {
        pieces.push_back({0, 0, false});
        return pieces;
    }
    Context ctx;
    ctx.text = text;
    ctx.step_limit = kBaseSteps + kStepsPerChar * text.size();
    // As the onig crate's find_iter: an empty match right where the previous match ended is
    // skipped by moving the search one character on.
    size_t search_from = 0, prev = 0;
    bool have_last = false;
    size_t last_match_end = 0;
    while (search_from <= text.size()) {
        size_t b = 0, e = 0;
        bool found = false;
        for (size_t start = search_from; start <= text.size(); ++start) {
            if (run(ctx, 0, start, &e)) {
                b = start;
                found = true;
                break;
            }
        }
        if (!found) break;
        if (b == e && have_last && last_match_end == e) {
            search_from += 1;
            continue;
        }
        search_from = e;
        have_last = true;
        last_match_end = e;
        if (prev != b) pieces.push_back({prev, b, false});
        pieces.push_back({b, e, true});
        prev = e;
    }
    if (prev != text.size()) pieces.push_back({prev, text.size(), false});
    return pieces;
}

std::vector<std::pair<size_t, size_t>> Regex::split_isolated(std::u32string_view text) const {
    std::vector<std::pair<size_t, size_t>> out;
    for (const Piece& p : find_matches(text))
        if (p.end > p.begin) out.push_back({p.begin, p.end});
    return out;
}

std::vector<std::string> Regex::split_isolated(std::string_view utf8) const {
    const std::u32string cps = to_code_points(utf8);
    std::vector<std::string> out;
    for (const auto& [b, e] : split_isolated(std::u32string_view(cps))) out.push_back(to_utf8(cps.substr(b, e - b)));
    return out;
}

}  // namespace mf::text
