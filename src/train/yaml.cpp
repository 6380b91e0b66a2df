// The recipe YAML subset (see yaml.h). The text is first cut into logical lines (indent + content;
// blank and comment-only lines dropped, the leading `---` consumed); a recursive descent then
// walks the lines by indentation. A mapping or sequence nested inside a sequence item
// (`- key: v`) is parsed by rewriting that line in place so it starts at the item's column, which
// keeps one code path for "a block that starts at column N". Everything inside a line (keys,
// scalars, flow collections) is read by a cursor that never leaves the line, so multi-line
// scalars and flow collections are refused rather than half-read.
#include "train/yaml.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/utf8.h"

namespace mf::train {

int YamlDocument::line_of(const std::string& path) const {
    const auto it = lines.find(path);
    return it == lines.end() ? 0 : it->second;
}

namespace {

using json::Value;

bool is_blank(char c) { return c == ' ' || c == '\t'; }
bool is_flow_indicator(char c) { return c == ',' || c == '[' || c == ']' || c == '{' || c == '}'; }

// Printable form of a character for messages.
std::string show_char(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) return std::string("'") + c + "'";
    static const char* kHex = "0123456789abcdef";
    return std::string("byte 0x") + kHex[u >> 4] + kHex[u & 15];
}

std::string clip(std::string_view s, size_t max_len = 40) {
    if (s.size() <= max_len) return std::string(s);
    return std::string(s.substr(0, max_len)) + "...";
}

std::string join_path(const std::string& parent, const std::string& key) {
    return parent.empty() ? key : parent + "." + key;
}

std::string index_path(const std::string& parent, size_t index) { return parent + "[" + std::to_string(index) + "]"; }

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is invalid (overlong forms,
// surrogates and code points above U+10FFFF included).
size_t utf8_sequence_length(std::string_view s, size_t i) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) return 1;
    size_t len = 0;
    uint32_t cp = 0;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        len = 2;
        cp = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        len = 3;
        cp = b0 & 0x0F;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        len = 4;
        cp = b0 & 0x07;
    } else {
        return 0;
    }
    if (i + len > s.size()) return 0;
    for (size_t k = 1; k < len; ++k) {
        const auto b = static_cast<unsigned char>(s[i + k]);
        if ((b & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (b & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    return len;
}

struct Line {
    int number = 0;         // 1-based line number in the file
    int indent = 0;         // column of the first content character
    std::string_view text;  // from that column to the end of the line (no '\r', comments kept)
};

// A position inside one line.
struct Cursor {
    std::string_view s;
    size_t pos = 0;
    int line = 0;  // 0: no line (a command-line value)

    bool done() const { return pos >= s.size(); }
    char peek() const { return s[pos]; }
    void skip_blanks() {
        while (pos < s.size() && is_blank(s[pos])) ++pos;
    }
};

class Parser {
 public:
    Parser(const std::string& source, YamlDocument* doc, bool command_line)
        : source_(source), doc_(doc), command_line_(command_line) {}

    // --- whole documents -----------------------------------------------------------------------

    Value parse_document(std::string_view text) {
        if (text.size() > kMaxYamlBytes)
            error(1, "the file is " + std::to_string(text.size()) + " bytes; recipes are limited to " +
                         std::to_string(kMaxYamlBytes) + " bytes");
        split_lines(text);
        if (lines_.empty()) return Value::object();
        const Line& first = lines_[0];
        if (is_sequence_item(first.text))
            error(first.number, "the top level of a recipe must be a mapping ('key: value'), not a sequence");
        Value root = parse_mapping(first.indent, "", 1);
        if (cur_ < lines_.size())
            error(lines_[cur_].number, "this line is indented less than the first line of the document (column " +
                                           std::to_string(first.indent + 1) + ")");
        return root;
    }

    // --- a single value on one line (command-line overrides) ---------------------------------

    Value parse_single_value(std::string_view text) {
        if (text.size() > kMaxYamlBytes)
            error(0, "the value is longer than " + std::to_string(kMaxYamlBytes) + " bytes");
        check_characters(text, 0);
        Cursor c{text, 0, 0};
        c.skip_blanks();
        if (at_end_or_comment(c)) return Value(nullptr);
        Value v = parse_block_value(c, "", 1);
        expect_line_end(c, "the value");
        return v;
    }

 private:
    [[noreturn]] void error(int line, const std::string& what) const {
        if (line > 0) fail(source_, ":", line, ": ", what);
        fail(source_, ": ", what);
    }

    void record(const std::string& path, int line) {
        if (doc_ != nullptr && line > 0) doc_->lines.emplace(path, line);
    }

    void check_depth(int depth, int line) const {
        if (depth > kMaxYamlDepth) error(line, "nesting deeper than " + std::to_string(kMaxYamlDepth) + " levels");
    }

    // Control characters (other than tab) and invalid UTF-8 are refused up front, so every later
    // step deals with printable text only.
    void check_characters(std::string_view text, int line) const {
        for (size_t i = 0; i < text.size();) {
            const auto c = static_cast<unsigned char>(text[i]);
            if ((c < 0x20 && c != '\t') || c == 0x7F)
                error(line, "control character " + show_char(text[i]) + " in the text");
            const size_t len = utf8_sequence_length(text, i);
            if (len == 0) error(line, "invalid UTF-8 (" + show_char(text[i]) + ")");
            i += len;
        }
    }

    // Cuts the text into content lines, dropping blank and comment-only lines. Handles a UTF-8
    // BOM, CRLF line ends, a leading `---`, and refuses tabs in indentation, later `---` and `...`.
    void split_lines(std::string_view text) {
        if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
        int number = 0;
        bool seen_marker = false;
        size_t start = 0;
        while (start <= text.size()) {
            size_t end = text.find('\n', start);
            if (end == std::string_view::npos) end = text.size();
            std::string_view raw = text.substr(start, end - start);
            start = end + 1;
            ++number;
            if (!raw.empty() && raw.back() == '\r') raw.remove_suffix(1);
            check_characters(raw, number);
            size_t indent = 0;
            while (indent < raw.size() && raw[indent] == ' ') ++indent;
            size_t first = indent;
            while (first < raw.size() && is_blank(raw[first])) ++first;
            if (first == raw.size() || raw[first] == '#') continue;  // blank or comment-only
            if (first != indent) error(number, "tab character in indentation (YAML indentation must use spaces only)");
            std::string_view content = raw.substr(indent);
            if (indent == 0 && is_marker(content, "---")) {
                if (seen_marker || !lines_.empty())
                    error(number, "a second document ('---') is not supported: a recipe is one document");
                seen_marker = true;
                Cursor c{content, 3, number};
                if (!at_end_or_comment(c)) error(number, "content on the '---' line is not supported");
                continue;
            }
            if (indent == 0 && is_marker(content, "..."))
                error(number, "the document end marker '...' is not supported");
            if (indent == 0 && content[0] == '%') error(number, "YAML directives ('%') are not supported");
            if (indent > 10000) error(number, "indentation deeper than 10000 columns");
            lines_.push_back(Line{number, static_cast<int>(indent), content});
        }
    }

    static bool is_marker(std::string_view content, std::string_view marker) {
        return content.substr(0, 3) == marker && (content.size() == 3 || is_blank(content[3]));
    }

    static bool is_sequence_item(std::string_view text) {
        return !text.empty() && text[0] == '-' && (text.size() == 1 || is_blank(text[1]));
    }

    // --- blocks --------------------------------------------------------------------------------

    // Parses the block that starts at lines_[cur_], whose column is `indent`.
    Value parse_block(int indent, const std::string& path, int depth) {
        const Line& line = lines_[cur_];
        check_depth(depth, line.number);
        if (is_sequence_item(line.text)) return parse_sequence(indent, path, depth, false);
        if (is_mapping_entry(line)) return parse_mapping(indent, path, depth);
        error(line.number,
              "expected 'key: value' or '- item' here; a value on its own line is not supported (write "
              "it on the line of its key)");
    }

    Value parse_mapping(int indent, const std::string& path, int depth) {
        check_depth(depth, lines_[cur_].number);
        Value obj = Value::object();
        std::map<std::string, int> key_lines;
        while (cur_ < lines_.size()) {
            const Line line = lines_[cur_];
            if (line.indent < indent) break;
            if (line.indent > indent) error(line.number, unexpected_indent_message(line, indent));
            if (is_sequence_item(line.text))
                error(line.number, "a sequence item ('- ...') where a 'key: value' entry was expected");
            Cursor c{line.text, 0, line.number};
            std::string key = parse_block_key(c);
            const auto [it, inserted] = key_lines.emplace(key, line.number);
            if (!inserted)
                error(line.number,
                      "duplicate key '" + key + "' (first defined on line " + std::to_string(it->second) + ")");
            const std::string key_path = join_path(path, key);
            record(key_path, line.number);
            c.skip_blanks();
            Value value;
            if (at_end_or_comment(c)) {
                ++cur_;
                if (cur_ < lines_.size() && lines_[cur_].indent > indent) {
                    value = parse_block(lines_[cur_].indent, key_path, depth + 1);
                } else if (cur_ < lines_.size() && lines_[cur_].indent == indent &&
                           is_sequence_item(lines_[cur_].text)) {
                    // "key:\n- a\n- b": a sequence may sit at its key's own column.
                    value = parse_sequence(indent, key_path, depth + 1, true);
                }  // else: an empty value, null
            } else {
                value = parse_block_value(c, key_path, depth + 1);
                expect_line_end(c, "the value of '" + key + "'");
                ++cur_;
                if (cur_ < lines_.size() && lines_[cur_].indent > indent)
                    error(lines_[cur_].number, "unexpected indentation: '" + key + "' on line " +
                                                   std::to_string(line.number) +
                                                   " already has a value (multi-line values are not supported)");
            }
            obj.as_object().emplace_back(std::move(key), std::move(value));
        }
        return obj;
    }

    // `compact`: the sequence is the value of a key at the same column, so a line that is not an
    // item ends it (and belongs to the enclosing mapping).
    Value parse_sequence(int indent, const std::string& path, int depth, bool compact) {
        check_depth(depth, lines_[cur_].number);
        Value arr = Value::array();
        while (cur_ < lines_.size()) {
            const Line line = lines_[cur_];
            if (line.indent < indent) break;
            if (line.indent > indent) error(line.number, unexpected_indent_message(line, indent));
            if (!is_sequence_item(line.text)) {
                if (compact) break;
                error(line.number, "expected a sequence item ('- ...') at this indentation");
            }
            const std::string item_path = index_path(path, arr.size());
            record(item_path, line.number);
            Cursor c{line.text, 1, line.number};
            c.skip_blanks();
            Value item;
            if (at_end_or_comment(c)) {
                ++cur_;
                if (cur_ < lines_.size() && lines_[cur_].indent > indent)
                    item = parse_block(lines_[cur_].indent, item_path, depth + 1);
            } else {
                const Line rest{line.number, indent + static_cast<int>(c.pos), line.text.substr(c.pos)};
                if (is_sequence_item(rest.text) || is_mapping_entry(rest)) {
                    // "- key: v" / "- - x": the nested block starts at the item's column.
                    lines_[cur_] = rest;
                    item = parse_block(rest.indent, item_path, depth + 1);
                } else {
                    item = parse_block_value(c, item_path, depth + 1);
                    expect_line_end(c, "the sequence item");
                    ++cur_;
                    if (cur_ < lines_.size() && lines_[cur_].indent > indent)
                        error(lines_[cur_].number, "unexpected indentation: the item on line " +
                                                       std::to_string(line.number) +
                                                       " already has a value (multi-line values are not supported)");
                }
            }
            arr.push_back(std::move(item));
        }
        return arr;
    }

    static std::string unexpected_indent_message(const Line& line, int indent) {
        return "unexpected indentation (column " + std::to_string(line.indent + 1) + ", expected column " +
               std::to_string(indent + 1) + ")";
    }

    // True when the line reads "key: ..." (plain or quoted key).
    bool is_mapping_entry(const Line& line) {
        Cursor c{line.text, 0, line.number};
        const char first = c.peek();
        if (first == '"' || first == '\'') {
            if (first == '"')
                parse_double_quoted(c);
            else
                parse_single_quoted(c);
            c.skip_blanks();
            return !c.done() && c.peek() == ':' && (c.pos + 1 == c.s.size() || is_blank(c.s[c.pos + 1]));
        }
        if (first == '[' || first == '{') return false;
        for (size_t i = 0; i < c.s.size(); ++i) {
            if (c.s[i] == '#' && i > 0 && is_blank(c.s[i - 1])) return false;
            if (c.s[i] == ':' && (i + 1 == c.s.size() || is_blank(c.s[i + 1]))) return true;
        }
        return false;
    }

    // Reads "key:" and leaves the cursor after the ':'.
    std::string parse_block_key(Cursor& c) {
        std::string key;
        const char first = c.peek();
        if (first == '"') {
            key = parse_double_quoted(c);
        } else if (first == '\'') {
            key = parse_single_quoted(c);
        } else {
            if (first == '[' || first == '{') error(c.line, "flow collections as keys are not supported");
            check_plain_start(c, false);
            key = std::string(scan_plain(c, false));
        }
        c.skip_blanks();
        if (c.done() || c.peek() != ':') {
            const bool colon_without_space = c.s.find(':') != std::string_view::npos;
            error(c.line, "expected 'key: value', found '" + clip(c.s) + "'" +
                              (colon_without_space ? " (a space is needed after the ':' of a key)" : ""));
        }
        ++c.pos;
        if (!c.done() && !is_blank(c.peek())) error(c.line, "expected a space after ':' following key '" + key + "'");
        if (key.empty()) error(c.line, "empty key before ':'");
        return key;
    }

    // --- scalars and flow collections on one line ---------------------------------------------

    bool at_end_or_comment(Cursor& c) const {
        c.skip_blanks();
        if (c.done()) return true;
        return !command_line_ && c.peek() == '#' && (c.pos == 0 || is_blank(c.s[c.pos - 1]));
    }

    void expect_line_end(Cursor& c, const std::string& what) const {
        if (!at_end_or_comment(c)) error(c.line, "unexpected text '" + clip(c.s.substr(c.pos)) + "' after " + what);
    }

    // Refuses the YAML features outside the subset that announce themselves by a first character.
    void check_plain_start(const Cursor& c, bool flow) const {
        const char ch = c.peek();
        const bool next_is_space =
            c.pos + 1 >= c.s.size() || is_blank(c.s[c.pos + 1]) || (flow && is_flow_indicator(c.s[c.pos + 1]));
        switch (ch) {
            case '&':
                error(c.line, "anchors ('&name') are not supported");
            case '*':
                if (command_line_) return;
                {
                    size_t end = c.pos + 1;
                    while (end < c.s.size() && !is_blank(c.s[end]) && !is_flow_indicator(c.s[end])) ++end;
                    error(c.line,
                          "aliases ('*name') are not supported; a glob pattern starting with '*' must be quoted, "
                          "e.g. \"" +
                              clip(c.s.substr(c.pos, end - c.pos), 20) + "\"");
                }
            case '!':
                error(c.line, "tags ('!') are not supported");
            case '|':
            case '>':
                error(c.line, "block scalars ('|' and '>') are not supported; write the value on one line");
            case '%':
            case '@':
            case '`':
                error(c.line, std::string("a plain value cannot start with '") + ch + "'; quote it");
            case ',':
            case ']':
            case '}':
                error(c.line, std::string("unexpected '") + ch + "'");
            case '?':
                if (next_is_space) error(c.line, "complex keys ('? ') are not supported");
                return;
            case ':':
                if (next_is_space) error(c.line, "missing key before ':'");
                return;
            case '-':
                if (next_is_space) error(c.line, "a sequence item ('- ') is not allowed here");
                return;
            default:
                return;
        }
    }

    // Scans a plain scalar: it ends at ": ", at " #" (a comment), at the end of the line and, in
    // flow context, at a flow indicator. Returns it without trailing blanks.
    std::string_view scan_plain(Cursor& c, bool flow) const {
        const size_t start = c.pos;
        size_t end = start;
        while (!c.done()) {
            const char ch = c.peek();
            if (ch == '#' && !command_line_ && c.pos > start && is_blank(c.s[c.pos - 1])) break;
            if (ch == ':') {
                const bool last = c.pos + 1 == c.s.size();
                if (last || is_blank(c.s[c.pos + 1]) || (flow && is_flow_indicator(c.s[c.pos + 1]))) break;
            }
            if (flow && is_flow_indicator(ch)) break;
            ++c.pos;
            if (!is_blank(ch)) end = c.pos;
        }
        return c.s.substr(start, end - start);
    }

    uint32_t parse_hex4(Cursor& c) const {
        if (c.pos + 4 > c.s.size()) error(c.line, "truncated \\u escape (4 hex digits expected)");
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) {
            const char h = c.s[c.pos++];
            v <<= 4;
            if (h >= '0' && h <= '9')
                v |= static_cast<uint32_t>(h - '0');
            else if (h >= 'a' && h <= 'f')
                v |= static_cast<uint32_t>(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F')
                v |= static_cast<uint32_t>(h - 'A' + 10);
            else
                error(c.line, "bad hex digit " + show_char(h) + " in \\u escape");
        }
        return v;
    }

    std::string parse_double_quoted(Cursor& c) const {
        ++c.pos;  // '"'
        std::string out;
        while (true) {
            if (c.done())
                error(c.line, "unterminated double-quoted string (a quoted value must end on the line it starts)");
            const char ch = c.s[c.pos++];
            if (ch == '"') return out;
            if (ch != '\\') {
                out += ch;
                continue;
            }
            if (c.done()) error(c.line, "unterminated escape at the end of the line");
            const char e = c.s[c.pos++];
            switch (e) {
                case '"':
                    out += '"';
                    break;
                case '\\':
                    out += '\\';
                    break;
                case '/':
                    out += '/';
                    break;
                case 'n':
                    out += '\n';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 'u': {
                    uint32_t cp = parse_hex4(c);
                    if (is_high_surrogate(cp)) {
                        if (c.s.substr(c.pos, 2) != "\\u") error(c.line, "unpaired surrogate in \\u escape");
                        c.pos += 2;
                        const uint32_t lo = parse_hex4(c);
                        if (!is_low_surrogate(lo)) error(c.line, "bad low surrogate in \\u escape");
                        cp = combine_surrogates(cp, lo);
                    } else if (is_low_surrogate(cp)) {
                        error(c.line, "unpaired surrogate in \\u escape");
                    }
                    if (cp == 0) error(c.line, "\\u0000 (a NUL character) is not allowed in a string");
                    append_utf8(out, cp);
                    break;
                }
                default:
                    error(c.line, "unsupported escape '\\" + std::string(1, e) +
                                      "' in a double-quoted string (supported: \\\" \\\\ \\/ \\n \\t \\r \\uXXXX)");
            }
        }
    }

    std::string parse_single_quoted(Cursor& c) const {
        ++c.pos;  // '\''
        std::string out;
        while (true) {
            if (c.done())
                error(c.line, "unterminated single-quoted string (a quoted value must end on the line it starts)");
            const char ch = c.s[c.pos++];
            if (ch == '\'') {
                if (!c.done() && c.peek() == '\'') {  // '' is an escaped quote
                    out += '\'';
                    ++c.pos;
                    continue;
                }
                return out;
            }
            out += ch;
        }
    }

    // A value after "key:" or "- " in block context.
    Value parse_block_value(Cursor& c, const std::string& path, int depth) {
        check_depth(depth, c.line);
        const char ch = c.peek();
        if (ch == '[') return parse_flow_sequence(c, path, depth);
        if (ch == '{') return parse_flow_mapping(c, path, depth);
        if (ch == '"') return Value(parse_double_quoted(c));
        if (ch == '\'') return Value(parse_single_quoted(c));
        check_plain_start(c, false);
        const std::string_view text = scan_plain(c, false);
        if (!c.done() && c.peek() == ':')
            error(c.line, "': ' inside a plain value ('" + clip(c.s.substr(c.pos - text.size())) +
                              "'); nested mappings go on the next lines, or quote the value");
        return type_plain(text, c.line);
    }

    // An item of a flow sequence or a value of a flow mapping.
    Value parse_flow_item(Cursor& c, const std::string& path, int depth) {
        check_depth(depth, c.line);
        const char ch = c.peek();
        if (ch == '[' || ch == '{') {
            return ch == '[' ? parse_flow_sequence(c, path, depth) : parse_flow_mapping(c, path, depth);
        }
        if (ch == '"') return Value(parse_double_quoted(c));
        if (ch == '\'') return Value(parse_single_quoted(c));
        check_plain_start(c, true);
        const std::string_view text = scan_plain(c, true);
        if (text.empty()) error(c.line, "empty item in a flow collection");
        return type_plain(text, c.line);
    }

    // After an item: skips blanks and returns the next significant character, refusing the end
    // of the line (flow collections must close on the line they open).
    char flow_next(Cursor& c, char closer) const {
        c.skip_blanks();
        if (c.done() || (!command_line_ && c.peek() == '#' && is_blank(c.s[c.pos - 1])))
            error(c.line, std::string("unterminated flow collection: '") + closer +
                              "' expected before the end of the line (flow collections must fit on one line)");
        return c.peek();
    }

    Value parse_flow_sequence(Cursor& c, const std::string& path, int depth) {
        check_depth(depth, c.line);
        ++c.pos;  // '['
        Value arr = Value::array();
        while (true) {
            if (flow_next(c, ']') == ']') {
                ++c.pos;
                break;
            }  // also accepts a trailing comma, as YAML does
            const std::string item_path = index_path(path, arr.size());
            record(item_path, c.line);
            arr.push_back(parse_flow_item(c, item_path, depth + 1));
            const char next = flow_next(c, ']');
            if (next == ',') {
                ++c.pos;
                continue;
            }
            if (next == ']') {
                ++c.pos;
                break;
            }
            if (next == ':') error(c.line, "'key: value' pairs inside a flow sequence are not supported");
            error(c.line, "expected ',' or ']' in a flow sequence, found " + show_char(next));
        }
        return arr;
    }

    Value parse_flow_mapping(Cursor& c, const std::string& path, int depth) {
        check_depth(depth, c.line);
        ++c.pos;  // '{'
        Value obj = Value::object();
        std::map<std::string, int> seen;
        while (true) {
            if (flow_next(c, '}') == '}') {
                ++c.pos;
                break;
            }
            std::string key;
            const char first = c.peek();
            if (first == '"')
                key = parse_double_quoted(c);
            else if (first == '\'')
                key = parse_single_quoted(c);
            else if (first == '[' || first == '{')
                error(c.line, "flow collections as keys are not supported");
            else {
                check_plain_start(c, true);
                key = std::string(scan_plain(c, true));
            }
            if (key.empty()) error(c.line, "empty key in a flow mapping");
            if (flow_next(c, '}') != ':')
                error(c.line, "expected ': ' after key '" + key + "' in a flow mapping (write '{key: value}')");
            ++c.pos;
            if (!seen.emplace(key, 0).second) error(c.line, "duplicate key '" + key + "' in a flow mapping");
            const std::string key_path = join_path(path, key);
            record(key_path, c.line);
            Value value;
            const char next = flow_next(c, '}');
            if (next != ',' && next != '}') value = parse_flow_item(c, key_path, depth + 1);
            obj.as_object().emplace_back(std::move(key), std::move(value));
            const char after = flow_next(c, '}');
            if (after == ',') {
                ++c.pos;
                continue;
            }
            if (after == '}') {
                ++c.pos;
                break;
            }
            error(c.line, "expected ',' or '}' in a flow mapping, found " + show_char(after));
        }
        return obj;
    }

    // --- typing plain scalars (YAML 1.2 core schema) -------------------------------------------

    static bool all_of(std::string_view s, bool (*pred)(char)) {
        if (s.empty()) return false;
        for (const char ch : s)
            if (!pred(ch)) return false;
        return true;
    }
    static bool is_digit(char ch) { return ch >= '0' && ch <= '9'; }
    static bool is_octal(char ch) { return ch >= '0' && ch <= '7'; }
    static bool is_hex(char ch) { return is_digit(ch) || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F'); }

    // [-+]? ( \. [0-9]+ | [0-9]+ ( \. [0-9]* )? ) ( [eE] [-+]? [0-9]+ )?
    static bool is_core_float(std::string_view s) {
        size_t i = 0;
        if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
        size_t int_digits = 0;
        while (i < s.size() && is_digit(s[i])) {
            ++i;
            ++int_digits;
        }
        size_t frac_digits = 0;
        if (i < s.size() && s[i] == '.') {
            ++i;
            while (i < s.size() && is_digit(s[i])) {
                ++i;
                ++frac_digits;
            }
        }
        if (int_digits == 0 && frac_digits == 0) return false;
        if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
            ++i;
            if (i < s.size() && (s[i] == '-' || s[i] == '+')) ++i;
            if (i == s.size() || !is_digit(s[i])) return false;
            while (i < s.size() && is_digit(s[i])) ++i;
        }
        return i == s.size();
    }

    Value parse_int(std::string_view digits, int base, bool negative, std::string_view text, int line) const {
        uint64_t magnitude = 0;
        const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), magnitude, base);
        const uint64_t limit = negative ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1;
        if (ec != std::errc() || ptr != digits.data() + digits.size() || magnitude > limit)
            error(line, "integer " + clip(text) + " is out of range (64-bit signed)");
        if (negative)
            return Value(magnitude == limit ? std::numeric_limits<int64_t>::min() : -static_cast<int64_t>(magnitude));
        return Value(static_cast<int64_t>(magnitude));
    }

    Value type_plain(std::string_view s, int line) const {
        if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return Value(nullptr);
        if (s == "true" || s == "True" || s == "TRUE") return Value(true);
        if (s == "false" || s == "False" || s == "FALSE") return Value(false);
        const bool negative = s[0] == '-';
        const std::string_view unsigned_part = (s[0] == '-' || s[0] == '+') ? s.substr(1) : s;
        if (all_of(unsigned_part, is_digit)) return parse_int(unsigned_part, 10, negative, s, line);
        if (s.size() > 2 && s.substr(0, 2) == "0o" && all_of(s.substr(2), is_octal))
            return parse_int(s.substr(2), 8, false, s, line);
        if (s.size() > 2 && s.substr(0, 2) == "0x" && all_of(s.substr(2), is_hex))
            return parse_int(s.substr(2), 16, false, s, line);
        if (is_core_float(s)) {
            double v = 0;
            const auto [ptr, ec] =
                std::from_chars(unsigned_part.data(), unsigned_part.data() + unsigned_part.size(), v);
            if (ec != std::errc() || ptr != unsigned_part.data() + unsigned_part.size() || !std::isfinite(v))
                error(line, "number " + clip(s) + " is out of range");
            return Value(negative ? -v : v);
        }
        if (unsigned_part == ".inf" || unsigned_part == ".Inf" || unsigned_part == ".INF")
            return Value(negative ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity());
        if (s == ".nan" || s == ".NaN" || s == ".NAN") return Value(std::numeric_limits<double>::quiet_NaN());
        return Value(std::string(s));
    }

    const std::string& source_;
    YamlDocument* doc_;
    bool command_line_;
    std::vector<Line> lines_;
    size_t cur_ = 0;
};

}  // namespace

YamlDocument parse_yaml_document(std::string_view text, const std::string& source) {
    YamlDocument doc;
    Parser parser(source, &doc, false);
    doc.root = parser.parse_document(text);
    return doc;
}

json::Value parse_yaml(std::string_view text, const std::string& source) {
    return parse_yaml_document(text, source).root;
}

json::Value parse_yaml_value(std::string_view text, const std::string& source, bool command_line) {
    Parser parser(source, nullptr, command_line);
    return parser.parse_single_value(text);
}

}  // namespace mf::train
