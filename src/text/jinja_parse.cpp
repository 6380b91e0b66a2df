// Jinja lexer and parser (jinja_ast.h). The lexer follows Jinja's with the settings transformers
// uses: newlines normalised to "\n" and one trailing newline dropped (keep_trailing_newline off);
// trim_blocks drops the first "\n" after a block or comment tag; lstrip_blocks drops the spaces
// before a block or comment tag that starts a line; "-" on a tag's side strips all whitespace on
// that side, "+" keeps it. Inside a tag, "}}" and "%}" end it only outside brackets.
// The parser is Jinja's grammar, precedence lowest first:
//   x if c else y  <  or  <  and  <  not  <  comparisons, in  <  + -  <  ~  <  * / // %  <  **
//   <  unary - +  <  postfix . [] ()  and filters | and tests `is`.
#include <charconv>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "text/jinja_ast.h"
#include "text/unicode.h"

namespace mf::text::jinja {

namespace {

constexpr int kMaxParseDepth = 200;

enum class Tok : uint8_t { text, var_begin, var_end, block_begin, block_end, name, string, integer, floating, op, eof };

struct Token {
    Tok type = Tok::eof;
    uint32_t line = 1, col = 1;
    std::string value;  // text, name, string contents (unescaped), operator
    int64_t int_value = 0;
    double float_value = 0;
};

// Python's str.isspace() / the regex \s on str (the whitespace Jinja's strip and \s see).
bool is_py_space(char32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Length in bytes of the Python whitespace code point at s[i], or 0.
size_t space_at(std::string_view s, size_t i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) return is_py_space(c) ? 1 : 0;
    size_t j = i;
    if (mf::text::find_invalid_utf8(s.substr(i, std::min<size_t>(4, s.size() - i))) == 0) return 0;
    const char32_t cp = mf::text::next_code_point(s, j);
    return is_py_space(cp) ? j - i : 0;
}

size_t rstrip_len(std::string_view s) {  // length of s.rstrip()
    size_t end = s.size();
    while (end > 0) {
        size_t start = end - 1;
        while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
        if (space_at(s, start) != end - start) break;
        end = start;
    }
    return end;
}

class Lexer {
 public:
    Lexer(std::string_view src, const std::string& name) : name_(name) {
        // keep_trailing_newline=False and newline normalisation, as Jinja's tokeniter does.
        src_.reserve(src.size());
        for (size_t i = 0; i < src.size(); ++i) {
            if (src[i] == '\r') {
                src_ += '\n';
                if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
            } else {
                src_ += src[i];
            }
        }
        if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    }

    std::vector<Token> run() {
        bool line_starting = true;
        while (pos_ < src_.size()) {
            size_t open = find_open(pos_);
            std::string_view text(src_.data() + pos_, (open == std::string::npos ? src_.size() : open) - pos_);
            if (open == std::string::npos) {
                emit_text(text, pos_);
                pos_ = src_.size();
                break;
            }
            const char kind = src_[open + 1];
            const char sign =
                open + 2 < src_.size() && (src_[open + 2] == '-' || src_[open + 2] == '+') ? src_[open + 2] : 0;
            if (sign == '-') {
                text = text.substr(0, rstrip_len(text));
            } else if (sign != '+' && kind != '{') {        // lstrip_blocks
                const size_t l_pos = text.rfind('\n') + 1;  // npos + 1 == 0
                if (l_pos > 0 || line_starting) {
                    bool all_space = l_pos < text.size();
                    for (size_t i = l_pos; i < text.size() && all_space; ++i)
                        all_space = text[i] == ' ' || text[i] == '\t' || text[i] == '\f' || text[i] == '\v';
                    if (all_space) text = text.substr(0, l_pos);
                }
            }
            emit_text(text, pos_);
            pos_ = open + 2 + (sign != 0 ? 1 : 0);
            if (kind == '#')
                line_starting = comment(open);
            else if (kind == '%' && raw_block(open))
                line_starting = false;
            else
                line_starting = tag(kind, open);
        }
        push(Tok::eof, src_.size());
        return std::move(tokens_);
    }

 private:
    [[noreturn]] void error(size_t at, const std::string& msg) const {
        uint32_t line = 1, col = 1;
        position(at, line, col);
        fail(name_, ":", line, ":", col, ": ", msg);
    }
    void position(size_t at, uint32_t& line, uint32_t& col) const {
        // Incremental: positions are asked for in increasing order (mostly).
        if (at < pos_cache_) {
            pos_cache_ = 0;
            line_cache_ = 1;
            col_cache_ = 1;
        }
        for (; pos_cache_ < at && pos_cache_ < src_.size(); ++pos_cache_) {
            const unsigned char c = static_cast<unsigned char>(src_[pos_cache_]);
            if (c == '\n') {
                ++line_cache_;
                col_cache_ = 1;
            } else if ((c & 0xC0) != 0x80) {
                ++col_cache_;
            }
        }
        line = line_cache_;
        col = col_cache_;
    }
    void push(Tok type, size_t at, std::string value = {}) {
        Token t;
        t.type = type;
        position(at, t.line, t.col);
        t.value = std::move(value);
        tokens_.push_back(std::move(t));
    }
    void emit_text(std::string_view text, size_t at) {
        if (!text.empty()) push(Tok::text, at, std::string(text));
    }

    size_t find_open(size_t from) const {
        for (size_t at = src_.find('{', from); at != std::string::npos; at = src_.find('{', at + 1))
            if (at + 1 < src_.size() && (src_[at + 1] == '{' || src_[at + 1] == '%' || src_[at + 1] == '#')) return at;
        return std::string::npos;
    }

    // After a tag's closing delimiter at `at` (its length `len`): trim_blocks / "-" handling.
    // Returns whether the consumed text ends with "\n" (Jinja's line_starting).
    bool after_close(size_t at, size_t len, char sign, bool block) {
        pos_ = at + len;
        if (sign == '-') {
            bool nl = false;
            while (pos_ < src_.size()) {
                const size_t n = space_at(src_, pos_);
                if (n == 0) break;
                nl = src_[pos_] == '\n';
                pos_ += n;
            }
            return nl;
        }
        if (block && sign != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
            ++pos_;
            return true;
        }
        return false;
    }

    bool comment(size_t open) {
        const size_t close = src_.find("#}", pos_);
        if (close == std::string::npos) error(open, "unclosed comment: expected '#}'");
        const char sign = close > pos_ && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
        return after_close(close, 2, sign, true);
    }

    // {% raw %} ... {% endraw %}: the text between is data. Returns false when the tag is not raw.
    bool raw_block(size_t open) {
        size_t i = pos_;
        while (i < src_.size() && space_at(src_, i) > 0) i += space_at(src_, i);
        if (src_.compare(i, 3, "raw") != 0) return false;
        i += 3;
        if (i < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[i])) || src_[i] == '_')) return false;
        while (i < src_.size() && space_at(src_, i) > 0) i += space_at(src_, i);
        char sign = 0;
        if (i < src_.size() && src_[i] == '-') sign = src_[i++];
        if (src_.compare(i, 2, "%}") != 0) error(i, "expected '%}' after 'raw'");
        after_close(i, 2, sign, false);  // Jinja applies no trim_blocks after raw's opening tag
        for (size_t at = src_.find("{%", pos_); at != std::string::npos; at = src_.find("{%", at + 1)) {
            size_t j = at + 2;
            const char open_sign = j < src_.size() && (src_[j] == '-' || src_[j] == '+') ? src_[j] : 0;
            if (open_sign) ++j;
            while (j < src_.size() && space_at(src_, j) > 0) j += space_at(src_, j);
            if (src_.compare(j, 6, "endraw") != 0) continue;
            j += 6;
            while (j < src_.size() && space_at(src_, j) > 0) j += space_at(src_, j);
            char close_sign = 0;
            if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) close_sign = src_[j++];
            if (src_.compare(j, 2, "%}") != 0) continue;
            std::string_view text(src_.data() + pos_, at - pos_);
            if (open_sign == '-') text = text.substr(0, rstrip_len(text));
            emit_text(text, pos_);
            after_close(j, 2, close_sign, true);
            return true;
        }
        error(open, "unclosed raw block: expected '{% endraw %}'");
    }

    // The inside of {{ }} or {% %}: tokens up to the closing delimiter (outside brackets).
    bool tag(char kind, size_t open) {
        push(kind == '{' ? Tok::var_begin : Tok::block_begin, open);
        const char close = kind == '{' ? '}' : '%';
        std::vector<char> brackets;
        for (;;) {
            while (pos_ < src_.size() && space_at(src_, pos_) > 0) pos_ += space_at(src_, pos_);
            if (pos_ >= src_.size())
                error(open, kind == '{' ? "unclosed '{{': expected '}}'" : "unclosed '{%': expected '%}'");
            const char c = src_[pos_];
            if (brackets.empty()) {
                size_t at = pos_;
                char sign = 0;
                if ((c == '-' || (c == '+' && kind == '%')) && pos_ + 1 < src_.size() && src_[pos_ + 1] == close &&
                    pos_ + 2 < src_.size() && src_[pos_ + 2] == '}') {
                    sign = c;
                    ++at;
                }
                if (src_[at] == close && at + 1 < src_.size() && src_[at + 1] == '}') {
                    push(kind == '{' ? Tok::var_end : Tok::block_end, pos_);
                    return after_close(at, 2, sign, kind == '%');
                }
            }
            if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
                const size_t start = pos_;
                while (pos_ < src_.size() &&
                       (std::isalnum(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_'))
                    ++pos_;
                push(Tok::name, start, src_.substr(start, pos_ - start));
            } else if (std::isdigit(static_cast<unsigned char>(c))) {
                number();
            } else if (c == '\'' || c == '"') {
                string_literal();
            } else {
                op(brackets);
            }
        }
    }

    void number() {
        const size_t start = pos_;
        std::string digits;
        auto take_digits = [&] {
            while (pos_ < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[pos_])) ||
                                          (src_[pos_] == '_' && pos_ + 1 < src_.size() &&
                                           std::isdigit(static_cast<unsigned char>(src_[pos_ + 1]))))) {
                if (src_[pos_] != '_') digits += src_[pos_];
                ++pos_;
            }
        };
        take_digits();
        bool is_float = false;
        if (pos_ + 1 < src_.size() && src_[pos_] == '.' && std::isdigit(static_cast<unsigned char>(src_[pos_ + 1])) &&
            !(start > 0 && src_[start - 1] == '.')) {
            is_float = true;
            digits += src_[pos_++];
            take_digits();
        }
        if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
            size_t j = pos_ + 1;
            if (j < src_.size() && (src_[j] == '+' || src_[j] == '-')) ++j;
            if (j < src_.size() && std::isdigit(static_cast<unsigned char>(src_[j]))) {
                is_float = true;
                digits += 'e';
                digits.append(src_, pos_ + 1, j - pos_ - 1);
                pos_ = j;
                take_digits();
            }
        }
        Token t;
        position(start, t.line, t.col);
        if (is_float) {
            t.type = Tok::floating;
            t.float_value = std::strtod(digits.c_str(), nullptr);
        } else {
            t.type = Tok::integer;
            const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), t.int_value);
            if (r.ec != std::errc())
                error(start, "integer literal " + digits + " is out of range (64-bit integers only)");
        }
        tokens_.push_back(std::move(t));
    }

    void string_literal() {
        const size_t start = pos_;
        const char quote = src_[pos_++];
        std::string out;
        for (;;) {
            if (pos_ >= src_.size()) error(start, "unterminated string literal");
            const char c = src_[pos_++];
            if (c == quote) break;
            if (c != '\\') {
                out += c;
                continue;
            }
            if (pos_ >= src_.size()) error(start, "unterminated string literal");
            const char e = src_[pos_++];
            switch (e) {
                case 'n':
                    out += '\n';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case '\\':
                    out += '\\';
                    break;
                case '\'':
                    out += '\'';
                    break;
                case '"':
                    out += '"';
                    break;
                case 'a':
                    out += '\a';
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'v':
                    out += '\v';
                    break;
                case '\n':
                    break;  // line continuation
                case 'x':
                case 'u':
                case 'U': {
                    const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                    uint32_t cp = 0;
                    for (size_t k = 0; k < n; ++k) {
                        const char h = pos_ < src_.size() ? src_[pos_] : 0;
                        if (!std::isxdigit(static_cast<unsigned char>(h)))
                            error(pos_, std::string("truncated \\") + e + " escape in a string literal");
                        cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                                 ? h - '0'
                                                                 : (h | 0x20) - 'a' + 10);
                        ++pos_;
                    }
                    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
                        error(pos_, "a string literal escapes a code point that UTF-8 cannot hold");
                    mf::text::append_utf8(out, cp);
                    break;
                }
                default:
                    if (e >= '0' && e <= '7') {
                        uint32_t cp = static_cast<uint32_t>(e - '0');
                        for (int k = 0; k < 2 && pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '7'; ++k)
                            cp = cp * 8 + static_cast<uint32_t>(src_[pos_++] - '0');
                        mf::text::append_utf8(out, cp);
                    } else {
                        out += '\\';  // Python keeps unknown escapes as written
                        out += e;
                    }
            }
        }
        if (mf::text::find_invalid_utf8(out) != std::string::npos) error(start, "a string literal is not valid UTF-8");
        push(Tok::string, start, std::move(out));
    }

    void op(std::vector<char>& brackets) {
        static constexpr const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                               "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};
        for (const char* o : kOps) {
            const size_t n = std::strlen(o);
            if (src_.compare(pos_, n, o) != 0) continue;
            const char c = o[0];
            if (n == 1 && (c == '(' || c == '[' || c == '{')) brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
            if (n == 1 && (c == ')' || c == ']' || c == '}')) {
                if (brackets.empty()) error(pos_, std::string("unexpected '") + c + "'");
                if (brackets.back() != c)
                    error(pos_, std::string("unexpected '") + c + "', expected '" + brackets.back() + "'");
                brackets.pop_back();
            }
            push(Tok::op, pos_, o);
            pos_ += n;
            return;
        }
        error(pos_, std::string("unexpected character ") +
                        json::quote(src_.substr(pos_, mf::text::utf8_length(static_cast<unsigned char>(src_[pos_])))));
    }

    std::string src_;
    const std::string& name_;
    size_t pos_ = 0;
    std::vector<Token> tokens_;
    mutable size_t pos_cache_ = 0;
    mutable uint32_t line_cache_ = 1, col_cache_ = 1;
};

// --- parser ---------------------------------------------------------------------------------------

std::string describe(const Token& t) {
    switch (t.type) {
        case Tok::text:
            return "text";
        case Tok::var_begin:
            return "'{{'";
        case Tok::var_end:
            return "'}}'";
        case Tok::block_begin:
            return "'{%'";
        case Tok::block_end:
            return "'%}'";
        case Tok::name:
            return "'" + t.value + "'";
        case Tok::string:
            return "a string";
        case Tok::integer:
        case Tok::floating:
            return "a number";
        case Tok::op:
            return "'" + t.value + "'";
        case Tok::eof:
            return "the end of the template";
    }
    return "?";
}

class Parser {
 public:
    Parser(std::vector<Token> tokens, Program& prog) : toks_(std::move(tokens)), prog_(prog) {}

    std::vector<StmtPtr> parse_template() {
        std::vector<StmtPtr> body = parse_body({});
        return body;
    }

 private:
    // --- token helpers
    const Token& cur() const { return toks_[at_]; }
    const Token& peek(size_t k = 1) const { return toks_[std::min(at_ + k, toks_.size() - 1)]; }
    void next() {
        if (at_ + 1 < toks_.size()) ++at_;
    }
    bool is_op(const char* o) const { return cur().type == Tok::op && cur().value == o; }
    bool is_name(const char* n) const { return cur().type == Tok::name && cur().value == n; }
    bool skip_op(const char* o) {
        if (!is_op(o)) return false;
        next();
        return true;
    }
    bool skip_name(const char* n) {
        if (!is_name(n)) return false;
        next();
        return true;
    }
    [[noreturn]] void error_at(const Token& t, const std::string& msg) const {
        fail(prog_.name, ":", t.line, ":", t.col, ": ", msg);
    }
    void expect_op(const char* o) {
        if (!skip_op(o)) error_at(cur(), std::string("expected '") + o + "', got " + describe(cur()));
    }
    std::string expect_name(const char* what) {
        if (cur().type != Tok::name) error_at(cur(), std::string("expected ") + what + ", got " + describe(cur()));
        std::string n = cur().value;
        next();
        return n;
    }
    void expect_block_end(const char* after) {
        if (cur().type != Tok::block_end)
            error_at(cur(), std::string("expected '%}' after ") + after + ", got " + describe(cur()));
        next();
    }
    int intern(const std::string& name) {
        for (size_t k = 0; k < prog_.symbols.size(); ++k)
            if (prog_.symbols[k] == name) return static_cast<int>(k);
        prog_.symbols.push_back(name);
        return static_cast<int>(prog_.symbols.size() - 1);
    }
    struct DepthGuard {
        Parser& p;
        explicit DepthGuard(Parser& parser) : p(parser) {
            if (++p.depth_ > kMaxParseDepth)
                p.error_at(p.cur(), "the template nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
        }
        ~DepthGuard() { --p.depth_; }
    };
    ExprPtr node(Op op, const Token& t) {
        auto e = std::make_unique<Expr>();
        e->op = op;
        e->line = t.line;
        e->col = t.col;
        return e;
    }

    // --- statements
    // Parses until a block tag whose name is in `ends` (left current: the name token) or eof.
    std::vector<StmtPtr> parse_body(const std::vector<std::string>& ends) {
        std::vector<StmtPtr> body;
        for (;;) {
            const Token& t = cur();
            if (t.type == Tok::eof) return body;
            if (t.type == Tok::text) {
                auto s = std::make_unique<Stmt>();
                s->kind = StmtKind::text;
                s->line = t.line;
                s->col = t.col;
                s->text = t.value;
                body.push_back(std::move(s));
                next();
            } else if (t.type == Tok::var_begin) {
                next();
                auto s = std::make_unique<Stmt>();
                s->kind = StmtKind::output;
                s->line = t.line;
                s->col = t.col;
                s->expr = parse_tuple(true, false);
                if (cur().type != Tok::var_end) error_at(cur(), "expected '}}', got " + describe(cur()));
                next();
                body.push_back(std::move(s));
            } else if (t.type == Tok::block_begin) {
                const Token& name = peek();
                if (name.type == Tok::name)
                    for (const std::string& e : ends)
                        if (name.value == e) {
                            next();
                            return body;
                        }
                next();
                body.push_back(parse_statement(ends));
            } else {
                error_at(t, "unexpected " + describe(t));
            }
        }
    }

    static std::string join_ends(const std::vector<std::string>& ends) {
        std::string s;
        for (size_t k = 0; k < ends.size(); ++k)
            s += (k == 0 ? "'" : k + 1 == ends.size() ? " or '" : ", '") + ends[k] + "'";
        return s;
    }

    // The body of a block that `open` started; returns at the end tag named in `ends` (consumed name).
    std::vector<StmtPtr> parse_block_body(const Token& open, const std::string& what,
                                          const std::vector<std::string>& ends, std::string* ended_with) {
        DepthGuard g(*this);
        std::vector<StmtPtr> body = parse_body(ends);
        if (cur().type == Tok::eof)
            error_at(cur(), "expected " + join_ends(ends) + " before the end of the template (the '" + what + "' at " +
                                std::to_string(open.line) + ":" + std::to_string(open.col) + " is not closed)");
        *ended_with = cur().value;
        next();
        return body;
    }

    StmtPtr parse_statement(const std::vector<std::string>& outer_ends) {
        DepthGuard g(*this);
        const Token t = cur();
        if (t.type != Tok::name) error_at(t, "expected a statement name after '{%', got " + describe(t));
        auto s = std::make_unique<Stmt>();
        s->line = t.line;
        s->col = t.col;
        const std::string& n = t.value;
        next();
        if (n == "if") return parse_if(std::move(s), t);
        if (n == "for") return parse_for(std::move(s), t);
        if (n == "set") return parse_set(std::move(s), t);
        if (n == "macro") return parse_macro(std::move(s), t);
        if (n == "call") return parse_call_block(std::move(s), t);
        if (n == "filter") return parse_filter_block(std::move(s), t);
        if (n == "break" || n == "continue") {
            if (loop_depth_ == 0) error_at(t, "'" + n + "' outside a loop");
            s->kind = n == "break" ? StmtKind::break_ : StmtKind::continue_;
            expect_block_end(n == "break" ? "'break'" : "'continue'");
            return s;
        }
        if (n == "generation") {
            s->kind = StmtKind::generation;
            prog_.has_generation = true;
            expect_block_end("'generation'");
            std::string end;
            s->body = parse_block_body(t, "generation", {"endgeneration"}, &end);
            expect_block_end("'endgeneration'");
            return s;
        }
        if (n == "extends" || n == "include" || n == "import" || n == "from" || n == "block" || n == "do" ||
            n == "with" || n == "autoescape" || n == "trans")
            error_at(t, "the '" + n + "' tag is not supported in chat templates");
        std::string msg =
            (n.rfind("end", 0) == 0 || n == "elif" || n == "else" ? "unexpected '" : "unknown tag '") + n + "'";
        if (!outer_ends.empty()) msg += " (expected " + join_ends(outer_ends) + ")";
        error_at(t, msg);
    }

    StmtPtr parse_if(StmtPtr s, const Token& open) {
        s->kind = StmtKind::if_;
        ExprPtr cond = parse_expression();
        expect_block_end("the 'if' condition");
        for (;;) {
            std::string end;
            std::vector<StmtPtr> body = parse_block_body(open, "if", {"elif", "else", "endif"}, &end);
            s->branches.emplace_back(std::move(cond), std::move(body));
            if (end == "endif") {
                expect_block_end("'endif'");
                return s;
            }
            if (end == "elif") {
                cond = parse_expression();
                expect_block_end("the 'elif' condition");
                continue;
            }
            expect_block_end("'else'");
            std::vector<StmtPtr> else_body = parse_block_body(open, "if", {"endif"}, &end);
            s->branches.emplace_back(nullptr, std::move(else_body));
            expect_block_end("'endif'");
            return s;
        }
    }

    Target parse_target(bool allow_attr) {
        Target tg;
        const bool paren = skip_op("(");
        do {
            const Token t = cur();
            const std::string name = expect_name("a variable name");
            if (allow_attr && !paren && tg.symbols.empty() && is_op(".")) {
                next();
                tg.attr = expect_name("an attribute name");
                tg.symbols.push_back(intern(name));
                return tg;
            }
            if (name == "true" || name == "false" || name == "none" || name == "True" || name == "False" ||
                name == "None")
                error_at(t, "cannot assign to '" + name + "'");
            tg.symbols.push_back(intern(name));
        } while (skip_op(","));
        if (paren) expect_op(")");
        tg.tuple = tg.symbols.size() > 1 || paren;
        return tg;
    }

    StmtPtr parse_for(StmtPtr s, const Token& open) {
        s->kind = StmtKind::for_;
        s->target = parse_target(false);
        if (!skip_name("in")) error_at(cur(), "expected 'in' in the 'for' loop, got " + describe(cur()));
        s->expr = parse_tuple(false, false);
        if (skip_name("if")) s->cond = parse_expression();
        if (is_name("recursive")) error_at(cur(), "recursive loops are not supported");
        expect_block_end("the 'for' loop head");
        ++loop_depth_;
        std::string end;
        s->body = parse_block_body(open, "for", {"else", "endfor"}, &end);
        --loop_depth_;
        if (end == "else") {
            expect_block_end("'else'");
            s->else_body = parse_block_body(open, "for", {"endfor"}, &end);
        }
        expect_block_end("'endfor'");
        return s;
    }

    StmtPtr parse_set(StmtPtr s, const Token& open) {
        s->target = parse_target(true);
        if (skip_op("=")) {
            s->kind = StmtKind::set;
            s->expr = parse_tuple(true, false);
            expect_block_end("the 'set' value");
            return s;
        }
        if (s->target.tuple || !s->target.attr.empty())
            error_at(cur(), "expected '=' after the 'set' target, got " + describe(cur()));
        s->kind = StmtKind::set_block;
        if (is_op("|")) s->expr = parse_filter_chain(placeholder(cur()));
        expect_block_end("the 'set' target");
        std::string end;
        const int saved = loop_depth_;
        loop_depth_ = 0;
        s->body = parse_block_body(open, "set", {"endset"}, &end);
        loop_depth_ = saved;
        expect_block_end("'endset'");
        return s;
    }

    void parse_params(Stmt& s) {
        expect_op("(");
        while (!is_op(")")) {
            if (!s.params.empty()) expect_op(",");
            const std::string name = expect_name("a parameter name");
            s.params.push_back(intern(name));
            s.param_names.push_back(name);
            if (skip_op("="))
                s.defaults.push_back(parse_expression());
            else if (!s.defaults.empty() && s.defaults.back() != nullptr)
                error_at(cur(), "parameter '" + name + "' without a default follows one with a default");
            else
                s.defaults.push_back(nullptr);
        }
        expect_op(")");
    }

    StmtPtr parse_macro(StmtPtr s, const Token& open) {
        s->kind = StmtKind::macro;
        s->text = expect_name("the macro's name");
        s->macro_symbol = intern(s->text);
        parse_params(*s);
        expect_block_end("the macro's parameters");
        std::string end;
        const int saved = loop_depth_;
        loop_depth_ = 0;
        s->body = parse_block_body(open, "macro", {"endmacro"}, &end);
        loop_depth_ = saved;
        if (cur().type == Tok::name) next();  // {% endmacro name %}
        expect_block_end("'endmacro'");
        return s;
    }

    StmtPtr parse_call_block(StmtPtr s, const Token& open) {
        s->kind = StmtKind::call_block;
        if (is_op("(")) parse_params(*s);
        s->expr = parse_expression();
        if (s->expr->op != Op::call) error_at(open, "expected a call after 'call'");
        expect_block_end("the 'call' expression");
        std::string end;
        const int saved = loop_depth_;
        loop_depth_ = 0;
        s->body = parse_block_body(open, "call", {"endcall"}, &end);
        loop_depth_ = saved;
        expect_block_end("'endcall'");
        return s;
    }

    StmtPtr parse_filter_block(StmtPtr s, const Token& open) {
        s->kind = StmtKind::filter_block;
        s->expr = parse_filter_chain(placeholder(cur()), true);
        expect_block_end("the filter");
        std::string end;
        s->body = parse_block_body(open, "filter", {"endfilter"}, &end);
        expect_block_end("'endfilter'");
        return s;
    }

    ExprPtr placeholder(const Token& t) {
        ExprPtr e = node(Op::constant, t);
        e->code = 1;
        return e;
    }

    // --- expressions
    // A comma-separated list of expressions becomes a tuple; one without comma is itself.
    ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens) {
        const Token t = cur();
        std::vector<ExprPtr> items;
        bool comma = false;
        for (;;) {
            if (!items.empty()) {
                if (!skip_op(",")) break;
                comma = true;
            }
            if (cur().type == Tok::var_end || cur().type == Tok::block_end || is_op(")") ||
                (cur().type == Tok::name &&
                 (cur().value == "if" || cur().value == "in" || cur().value == "recursive") && !items.empty()))
                break;
            if (explicit_parens && items.empty() && is_op(")")) break;
            items.push_back(with_condexpr ? parse_expression() : parse_or());
        }
        if (items.size() == 1 && !comma) return std::move(items[0]);
        if (items.empty() && !explicit_parens) error_at(t, "expected an expression, got " + describe(t));
        ExprPtr e = node(Op::tuple, t);
        e->kids = std::move(items);
        return e;
    }

    ExprPtr parse_expression() {
        DepthGuard g(*this);
        ExprPtr expr = parse_or();
        while (is_name("if")) {
            const Token t = cur();
            next();
            ExprPtr cond = parse_or();
            ExprPtr other = skip_name("else") ? parse_expression() : nullptr;
            ExprPtr e = node(Op::cond, t);
            e->kids.push_back(std::move(cond));
            e->kids.push_back(std::move(expr));
            e->kids.push_back(std::move(other));
            expr = std::move(e);
        }
        return expr;
    }

    ExprPtr binary_node(Op op, const Token& t, ExprPtr a, ExprPtr b, uint8_t code = 0) {
        ExprPtr e = node(op, t);
        e->code = code;
        e->kids.push_back(std::move(a));
        e->kids.push_back(std::move(b));
        return e;
    }

    ExprPtr parse_or() {
        ExprPtr left = parse_and();
        while (is_name("or")) {
            const Token t = cur();
            next();
            left = binary_node(Op::or_, t, std::move(left), parse_and());
        }
        return left;
    }
    ExprPtr parse_and() {
        ExprPtr left = parse_not();
        while (is_name("and")) {
            const Token t = cur();
            next();
            left = binary_node(Op::and_, t, std::move(left), parse_not());
        }
        return left;
    }
    ExprPtr parse_not() {
        if (is_name("not")) {
            DepthGuard g(*this);
            const Token t = cur();
            next();
            ExprPtr e = node(Op::not_, t);
            e->kids.push_back(parse_not());
            return e;
        }
        return parse_compare();
    }
    ExprPtr parse_compare() {
        const Token t = cur();
        ExprPtr first = parse_math1();
        ExprPtr e;
        for (;;) {
            CmpOp op;
            if (is_op("=="))
                op = CmpOp::eq;
            else if (is_op("!="))
                op = CmpOp::ne;
            else if (is_op("<"))
                op = CmpOp::lt;
            else if (is_op("<="))
                op = CmpOp::le;
            else if (is_op(">"))
                op = CmpOp::gt;
            else if (is_op(">="))
                op = CmpOp::ge;
            else if (is_name("in"))
                op = CmpOp::in;
            else if (is_name("not") && peek().type == Tok::name && peek().value == "in") {
                next();
                op = CmpOp::not_in;
            } else {
                break;
            }
            next();
            if (!e) {
                e = node(Op::compare, t);
                e->kids.push_back(std::move(first));
            }
            e->cmp.push_back(op);
            e->kids.push_back(parse_math1());
        }
        return e ? std::move(e) : std::move(first);
    }
    ExprPtr parse_math1() {
        ExprPtr left = parse_concat();
        while (is_op("+") || is_op("-")) {
            const Token t = cur();
            const BinOp op = t.value == "+" ? BinOp::add : BinOp::sub;
            next();
            left = binary_node(Op::binary, t, std::move(left), parse_concat(), static_cast<uint8_t>(op));
        }
        return left;
    }
    ExprPtr parse_concat() {
        ExprPtr left = parse_math2();
        while (is_op("~")) {
            const Token t = cur();
            next();
            left = binary_node(Op::binary, t, std::move(left), parse_math2(), static_cast<uint8_t>(BinOp::concat));
        }
        return left;
    }
    ExprPtr parse_math2() {
        ExprPtr left = parse_pow();
        for (;;) {
            BinOp op;
            if (is_op("*"))
                op = BinOp::mul;
            else if (is_op("/"))
                op = BinOp::div;
            else if (is_op("//"))
                op = BinOp::floordiv;
            else if (is_op("%"))
                op = BinOp::mod;
            else
                break;
            const Token t = cur();
            next();
            left = binary_node(Op::binary, t, std::move(left), parse_pow(), static_cast<uint8_t>(op));
        }
        return left;
    }
    ExprPtr parse_pow() {
        ExprPtr left = parse_unary(true);
        while (is_op("**")) {
            const Token t = cur();
            next();
            left = binary_node(Op::binary, t, std::move(left), parse_unary(true), static_cast<uint8_t>(BinOp::pow));
        }
        return left;
    }
    ExprPtr parse_unary(bool with_filter) {
        DepthGuard g(*this);
        const Token t = cur();
        ExprPtr e;
        if (is_op("-") || is_op("+")) {
            next();
            e = node(t.value == "-" ? Op::neg : Op::pos, t);
            e->kids.push_back(parse_unary(false));
        } else {
            e = parse_primary();
        }
        e = parse_postfix(std::move(e));
        if (with_filter) e = parse_filter_expr(std::move(e));
        return e;
    }

    ExprPtr parse_primary() {
        const Token t = cur();
        if (t.type == Tok::name) {
            next();
            ExprPtr e = node(Op::constant, t);
            if (t.value == "true" || t.value == "True")
                e->constant = Value::boolean(true);
            else if (t.value == "false" || t.value == "False")
                e->constant = Value::boolean(false);
            else if (t.value == "none" || t.value == "None")
                e->constant = Value::none();
            else {
                e->op = Op::name;
                e->name = t.value;
                e->symbol = intern(t.value);
            }
            return e;
        }
        if (t.type == Tok::string) {
            std::string s;
            while (cur().type == Tok::string) {  // adjacent literals concatenate
                s += cur().value;
                next();
            }
            ExprPtr e = node(Op::constant, t);
            e->constant = Value::string(std::move(s));
            return e;
        }
        if (t.type == Tok::integer || t.type == Tok::floating) {
            next();
            ExprPtr e = node(Op::constant, t);
            e->constant = t.type == Tok::integer ? Value::integer(t.int_value) : Value::floating(t.float_value);
            return e;
        }
        if (is_op("(")) {
            next();
            ExprPtr e = parse_tuple(true, true);
            expect_op(")");
            return e;
        }
        if (is_op("[")) {
            next();
            ExprPtr e = node(Op::list, t);
            while (!is_op("]")) {
                if (!e->kids.empty()) {
                    expect_op(",");
                    if (is_op("]")) break;
                }
                e->kids.push_back(parse_expression());
            }
            expect_op("]");
            return e;
        }
        if (is_op("{")) {
            next();
            ExprPtr e = node(Op::dict, t);
            while (!is_op("}")) {
                if (!e->kids.empty()) {
                    expect_op(",");
                    if (is_op("}")) break;
                }
                e->kids.push_back(parse_expression());
                expect_op(":");
                e->kids.push_back(parse_expression());
            }
            expect_op("}");
            return e;
        }
        error_at(t, "expected an expression, got " + describe(t));
    }

    ExprPtr parse_postfix(ExprPtr e) {
        for (;;) {
            const Token t = cur();
            if (is_op(".")) {
                next();
                if (cur().type == Tok::integer) {
                    ExprPtr idx = node(Op::constant, cur());
                    idx->constant = Value::integer(cur().int_value);
                    next();
                    e = binary_node(Op::item, t, std::move(e), std::move(idx));
                    continue;
                }
                ExprPtr a = node(Op::attr, t);
                a->name = expect_name("an attribute name after '.'");
                a->kids.push_back(std::move(e));
                e = std::move(a);
            } else if (is_op("[")) {
                next();
                e = parse_subscript(std::move(e), t);
            } else if (is_op("(")) {
                e = parse_call(std::move(e));
            } else {
                return e;
            }
        }
    }

    ExprPtr parse_subscript(ExprPtr target, const Token& t) {
        DepthGuard g(*this);
        ExprPtr parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
            if (!is_op(":") && !is_op("]")) parts[k] = parse_expression();
            if (k < 2 && skip_op(":")) {
                slice = true;
                continue;
            }
            break;
        }
        if (!slice && is_op(",")) {  // x[a, b]: a tuple key
            ExprPtr tup = node(Op::tuple, t);
            tup->kids.push_back(std::move(parts[0]));
            while (skip_op(",")) tup->kids.push_back(parse_expression());
            parts[0] = std::move(tup);
        }
        expect_op("]");
        if (!slice) {
            if (!parts[0]) error_at(t, "expected a subscript inside '[]'");
            return binary_node(Op::item, t, std::move(target), std::move(parts[0]));
        }
        ExprPtr e = node(Op::slice, t);
        e->kids.push_back(std::move(target));
        for (auto& p : parts) e->kids.push_back(std::move(p));
        return e;
    }

    // Arguments of a call, filter or test: positional then name=value.
    void parse_args(Expr& e) {
        expect_op("(");
        bool any = false;
        while (!is_op(")")) {
            if (any) {
                expect_op(",");
                if (is_op(")")) break;
            }
            any = true;
            if (is_op("*") || is_op("**")) error_at(cur(), "*args and **kwargs in calls are not supported");
            if (cur().type == Tok::name && peek().type == Tok::op && peek().value == "=") {
                e.kw_names.push_back(cur().value);
                next();
                next();
                e.kids.push_back(parse_expression());
            } else {
                if (!e.kw_names.empty()) error_at(cur(), "a positional argument follows a keyword argument");
                e.kids.push_back(parse_expression());
            }
        }
        expect_op(")");
    }

    ExprPtr parse_call(ExprPtr callee) {
        DepthGuard g(*this);
        ExprPtr e = node(Op::call, cur());
        e->kids.push_back(std::move(callee));
        parse_args(*e);
        return e;
    }

    // `| f | g(...)`; with `first_bare` the first filter has no '|' ({% filter f %}).
    ExprPtr parse_filter_chain(ExprPtr e, bool first_bare = false) {
        while (std::exchange(first_bare, false) || skip_op("|")) {
            DepthGuard g(*this);
            const Token t = cur();
            std::string name = expect_name("a filter name");
            ExprPtr f = node(Op::filter, t);
            const int code = filter_code(name);
            if (code < 0) error_at(t, "no filter named '" + name + "'");
            f->code = static_cast<uint8_t>(code);
            f->name = name;
            f->kids.push_back(std::move(e));
            if (is_op("(")) parse_args(*f);
            e = std::move(f);
        }
        return e;
    }

    ExprPtr parse_filter_expr(ExprPtr e) {
        for (;;) {
            if (is_op("|")) {
                e = parse_filter_chain(std::move(e));
            } else if (is_name("is")) {
                e = parse_test(std::move(e));
            } else if (is_op("(")) {
                e = parse_call(std::move(e));
            } else {
                return e;
            }
        }
    }

    ExprPtr parse_test(ExprPtr e) {
        DepthGuard g(*this);
        next();  // 'is'
        const bool negate = skip_name("not");
        const Token t = cur();
        std::string name;
        if (t.type == Tok::name) {
            name = t.value;
            next();
        } else if (t.type == Tok::op && (t.value == "==" || t.value == "!=" || t.value == "<" || t.value == "<=" ||
                                         t.value == ">" || t.value == ">=")) {
            name = t.value;
            next();
        } else {
            error_at(t, "expected a test name after 'is', got " + describe(t));
        }
        const int code = test_code(name);
        if (code < 0) error_at(t, "no test named '" + name + "'");
        ExprPtr test = node(Op::test, t);
        test->code = static_cast<uint8_t>(code);
        test->negate = negate;
        test->name = name;
        test->kids.push_back(std::move(e));
        if (is_op("(")) {
            parse_args(*test);
        } else if ((cur().type == Tok::name || cur().type == Tok::string || cur().type == Tok::integer ||
                    cur().type == Tok::floating || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") && !is_name("in") &&
                   !is_name("not")) {
            if (is_name("is")) error_at(cur(), "tests cannot be chained with 'is'");
            test->kids.push_back(parse_postfix(parse_primary()));
        }
        return test;
    }

    std::vector<Token> toks_;
    Program& prog_;
    size_t at_ = 0;
    int depth_ = 0;
    int loop_depth_ = 0;
};

}  // namespace

std::shared_ptr<Program> parse_program(std::string_view source, std::string name) {
    auto prog = std::make_shared<Program>();
    prog->name = std::move(name);
    if (mf::text::find_invalid_utf8(source) != std::string::npos)
        fail(prog->name, ": the template is not valid UTF-8 (at byte ", mf::text::find_invalid_utf8(source), ")");
    Lexer lexer(source, prog->name);
    Parser parser(lexer.run(), *prog);
    prog->body = parser.parse_template();
    auto sym = [&](const char* n) {
        for (size_t k = 0; k < prog->symbols.size(); ++k)
            if (prog->symbols[k] == n) return static_cast<int>(k);
        prog->symbols.emplace_back(n);
        return static_cast<int>(prog->symbols.size() - 1);
    };
    prog->sym_loop = sym("loop");
    prog->sym_caller = sym("caller");
    prog->sym_varargs = sym("varargs");
    prog->sym_kwargs = sym("kwargs");
    return prog;
}

}  // namespace mf::text::jinja
