#include "core/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <unordered_set>

#include "core/check.h"
#include "core/utf8.h"

namespace mf::json {

const char* kind_name(Kind kind) {
    switch (kind) {
        case Kind::null:
            return "null";
        case Kind::boolean:
            return "boolean";
        case Kind::number:
            return "number";
        case Kind::string:
            return "string";
        case Kind::array:
            return "array";
        case Kind::object:
            return "object";
    }
    return "?";
}

const char* nonfinite_spelling(double v) {
    if (std::isnan(v)) return "NaN";
    return v < 0 ? "-Infinity" : "Infinity";
}

namespace {

// The key of transformers 5.x's float tags ({"__float__": "Infinity"}).
constexpr std::string_view kFloatTagKey = "__float__";

[[noreturn]] void wrong_kind(Kind want, Kind have) {
    fail("expected a JSON ", kind_name(want), ", got ", kind_name(have));
}

class Parser {
 public:
    Parser(std::string_view text, const std::string& source, const ParseOptions& options)
        : text_(text), source_(source), options_(options) {}

    Value parse_document() {
        skip_ws();
        Value v = parse_value(0);
        skip_ws();
        if (pos_ != text_.size()) error("unexpected text after the JSON value");
        return v;
    }

 private:
    [[noreturn]] void error(const std::string& what) const {
        size_t line = 1, col = 1;
        for (size_t i = 0; i < pos_ && i < text_.size(); ++i) {
            if (text_[i] == '\n') {
                ++line;
                col = 1;
            } else {
                ++col;
            }
        }
        // Without a source the text is a record its caller locates (a JSONL line): only the column.
        if (source_.empty() && line == 1) fail("column ", col, ": invalid JSON: ", what);
        if (source_.empty()) fail("line ", line, ", column ", col, ": invalid JSON: ", what);
        fail(source_, ":", line, ":", col, ": invalid JSON: ", what);
    }

    void skip_ws() {
        while (pos_ < text_.size() &&
               (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r'))
            ++pos_;
    }

    bool consume(std::string_view lit) {
        if (text_.substr(pos_, lit.size()) == lit) {
            pos_ += lit.size();
            return true;
        }
        return false;
    }

    Value parse_value(int depth) {
        if (depth > options_.max_depth) error("nesting deeper than " + std::to_string(options_.max_depth));
        if (pos_ >= text_.size()) error("unexpected end of input");
        const char c = text_[pos_];
        if (c == '{') return parse_object(depth);
        if (c == '[') return parse_array(depth);
        if (c == '"') return Value(parse_string());
        if (consume("true")) return Value(true);
        if (consume("false")) return Value(false);
        if (consume("null")) return Value(nullptr);
        if (c == 'I' || c == 'N' || (c == '-' && text_.substr(pos_, 2) == "-I")) return parse_nonfinite();
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        error(std::string("unexpected character '") + (c >= 32 && c < 127 ? std::string(1, c) : "\\x" + hex(c)) + "'");
    }

    // Python's bare Infinity, -Infinity, NaN (ParseOptions::nonfinite_literals).
    Value parse_nonfinite() {
        constexpr double kInf = std::numeric_limits<double>::infinity();
        const std::pair<std::string_view, double> literals[] = {
            {"Infinity", kInf}, {"-Infinity", -kInf}, {"NaN", std::numeric_limits<double>::quiet_NaN()}};
        for (const auto& [lit, v] : literals) {
            if (text_.substr(pos_, lit.size()) != lit) continue;
            if (!options_.nonfinite_literals)
                error(std::string(lit) + " is not JSON (non-finite numbers are read only from an HF config.json)");
            pos_ += lit.size();
            return Value(v);
        }
        if (!options_.nonfinite_literals) error(std::string("unexpected character '") + text_[pos_] + "'");
        error("bad literal: expected Infinity, -Infinity or NaN");
    }

    static std::string hex(char c) {
        char buf[3];
        std::snprintf(buf, sizeof buf, "%02x", static_cast<unsigned char>(c));
        return buf;
    }

    Value parse_object(int depth) {
        ++pos_;  // '{'
        constexpr size_t kHashFrom = 16;
        Value::Object obj;
        std::unordered_set<std::string> seen;
        skip_ws();
        if (pos_ < text_.size() && text_[pos_] == '}') {
            ++pos_;
            return Value(std::move(obj));
        }
        while (true) {
            skip_ws();
            if (pos_ >= text_.size() || text_[pos_] != '"') error("expected a string key");
            std::string key = parse_string();
            // Duplicate check: linear for small objects, a hash set once an object grows (a
            // sharded index has tens of thousands of keys; a hostile one may have millions).
            bool duplicate = false;
            if (obj.size() < kHashFrom) {
                for (const auto& kv : obj) duplicate = duplicate || kv.first == key;
                if (obj.size() + 1 == kHashFrom) {
                    for (const auto& kv : obj) seen.insert(kv.first);
                    seen.insert(key);
                }
            } else {
                duplicate = !seen.insert(key).second;
            }
            if (duplicate) error("duplicate key \"" + key + "\"");
            skip_ws();
            if (pos_ >= text_.size() || text_[pos_] != ':') error("expected ':' after key \"" + key + "\"");
            ++pos_;
            skip_ws();
            Value v = parse_value(depth + 1);
            obj.emplace_back(std::move(key), std::move(v));
            skip_ws();
            if (pos_ < text_.size() && text_[pos_] == ',') {
                ++pos_;
                continue;
            }
            if (pos_ < text_.size() && text_[pos_] == '}') {
                ++pos_;
                break;
            }
            error("expected ',' or '}' in object");
        }
        return Value(std::move(obj));
    }

    Value parse_array(int depth) {
        ++pos_;  // '['
        Value::Array arr;
        skip_ws();
        if (pos_ < text_.size() && text_[pos_] == ']') {
            ++pos_;
            return Value(std::move(arr));
        }
        while (true) {
            skip_ws();
            arr.push_back(parse_value(depth + 1));
            skip_ws();
            if (pos_ < text_.size() && text_[pos_] == ',') {
                ++pos_;
                continue;
            }
            if (pos_ < text_.size() && text_[pos_] == ']') {
                ++pos_;
                break;
            }
            error("expected ',' or ']' in array");
        }
        return Value(std::move(arr));
    }

    uint32_t parse_hex4() {
        if (pos_ + 4 > text_.size()) error("truncated \\u escape");
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) {
            const char c = text_[pos_++];
            v <<= 4;
            if (c >= '0' && c <= '9')
                v |= c - '0';
            else if (c >= 'a' && c <= 'f')
                v |= c - 'a' + 10;
            else if (c >= 'A' && c <= 'F')
                v |= c - 'A' + 10;
            else
                error("bad hex digit in \\u escape");
        }
        return v;
    }

    std::string parse_string() {
        ++pos_;  // '"'
        std::string out;
        while (true) {
            if (pos_ >= text_.size()) error("unterminated string");
            const unsigned char c = static_cast<unsigned char>(text_[pos_++]);
            if (c == '"') break;
            if (c < 0x20) error("control character in string");
            if (c != '\\') {
                out += static_cast<char>(c);
                continue;
            }
            if (pos_ >= text_.size()) error("unterminated escape");
            const char e = text_[pos_++];
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
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'n':
                    out += '\n';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'u': {
                    uint32_t cp = parse_hex4();
                    if (is_high_surrogate(cp)) {
                        if (!consume("\\u")) error("unpaired surrogate in \\u escape");
                        const uint32_t lo = parse_hex4();
                        if (!is_low_surrogate(lo)) error("bad low surrogate in \\u escape");
                        cp = combine_surrogates(cp, lo);
                    } else if (is_low_surrogate(cp)) {
                        error("unpaired surrogate in \\u escape");
                    }
                    append_utf8(out, cp);
                    break;
                }
                default:
                    error(std::string("bad escape '\\") + e + "'");
            }
        }
        return out;
    }

    Value parse_number() {
        const size_t start = pos_;
        bool is_int = true;
        if (text_[pos_] == '-') ++pos_;
        if (pos_ >= text_.size() || !isdigit(text_[pos_])) error("bad number");
        if (text_[pos_] == '0')
            ++pos_;
        else
            while (pos_ < text_.size() && isdigit(text_[pos_])) ++pos_;
        if (pos_ < text_.size() && text_[pos_] == '.') {
            is_int = false;
            ++pos_;
            if (pos_ >= text_.size() || !isdigit(text_[pos_])) error("bad number: digit expected after '.'");
            while (pos_ < text_.size() && isdigit(text_[pos_])) ++pos_;
        }
        if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
            is_int = false;
            ++pos_;
            if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
            if (pos_ >= text_.size() || !isdigit(text_[pos_])) error("bad number: digit expected in exponent");
            while (pos_ < text_.size() && isdigit(text_[pos_])) ++pos_;
        }
        const std::string lit(text_.substr(start, pos_ - start));
        if (is_int) {
            errno = 0;
            char* end = nullptr;
            const long long v = std::strtoll(lit.c_str(), &end, 10);
            if (errno == 0) return Value(static_cast<int64_t>(v));
        }
        const double d = std::strtod(lit.c_str(), nullptr);
        if (!std::isfinite(d)) error("number out of range");
        return Value(d);
    }

    static bool isdigit(char c) { return c >= '0' && c <= '9'; }

    std::string_view text_;
    const std::string& source_;
    ParseOptions options_;
    size_t pos_ = 0;
};

}  // namespace

bool Value::as_bool() const {
    if (kind_ != Kind::boolean) wrong_kind(Kind::boolean, kind_);
    return bool_;
}

int64_t Value::as_int() const {
    if (kind_ != Kind::number) wrong_kind(Kind::number, kind_);
    if (is_int_) return int_;
    if (std::floor(num_) == num_ && std::fabs(num_) < 9.0e15) return static_cast<int64_t>(num_);
    fail("expected an integer, got ", num_);
}

double Value::as_double() const {
    if (kind_ != Kind::number) wrong_kind(Kind::number, kind_);
    return num_;
}

const std::string& Value::as_string() const {
    if (kind_ != Kind::string) wrong_kind(Kind::string, kind_);
    return str_;
}

const Value::Array& Value::as_array() const {
    if (kind_ != Kind::array) wrong_kind(Kind::array, kind_);
    return *arr_;
}

Value::Array& Value::as_array() {
    if (kind_ != Kind::array) wrong_kind(Kind::array, kind_);
    return *arr_;
}

const Value::Object& Value::as_object() const {
    if (kind_ != Kind::object) wrong_kind(Kind::object, kind_);
    return *obj_;
}

Value::Object& Value::as_object() {
    if (kind_ != Kind::object) wrong_kind(Kind::object, kind_);
    return *obj_;
}

const Value* Value::find(std::string_view key) const {
    if (kind_ != Kind::object) return nullptr;
    for (const auto& kv : *obj_)
        if (kv.first == key) return &kv.second;
    return nullptr;
}

void Value::set(std::string key, Value v) {
    Object& obj = as_object();
    for (auto& kv : obj)
        if (kv.first == key) {
            kv.second = std::move(v);
            return;
        }
    obj.emplace_back(std::move(key), std::move(v));
}

void Value::push_back(Value v) { as_array().push_back(std::move(v)); }

size_t Value::size() const {
    if (kind_ == Kind::array) return arr_->size();
    if (kind_ == Kind::object) return obj_->size();
    return 0;
}

std::string quote(std::string_view s) {
    std::string out = "\"";
    for (const char ch : s) {
        const unsigned char c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            case '\b':
                out += "\\b";
                break;
            case '\f':
                out += "\\f";
                break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", c);
                    out += buf;
                } else {
                    out += ch;
                }
        }
    }
    return out + "\"";
}

static void newline(std::string& out, int indent, int depth) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * depth), ' ');
}

void Value::dump_to(std::string& out, int indent, int depth, NonFinite nonfinite) const {
    switch (kind_) {
        case Kind::null:
            out += "null";
            break;
        case Kind::boolean:
            out += bool_ ? "true" : "false";
            break;
        case Kind::number: {
            if (is_int_) {
                out += std::to_string(int_);
                break;
            }
            if (!std::isfinite(num_)) {  // JSON has no NaN/Inf: the spelling asked for
                if (nonfinite == NonFinite::bare) {
                    out += nonfinite_spelling(num_);
                } else if (nonfinite == NonFinite::hf_tagged) {
                    Value tag = Value::object();
                    tag.set(std::string(kFloatTagKey), Value(nonfinite_spelling(num_)));
                    tag.dump_to(out, indent, depth, nonfinite);
                } else {
                    out += "null";
                }
                break;
            }
            char buf[32];
            // %.17g round-trips every double; keep a '.' so it reads back as a float.
            std::snprintf(buf, sizeof buf, "%.17g", num_);
            std::string s = buf;
            // Prefer the shortest form that round-trips.
            for (int prec = 6; prec < 17; ++prec) {
                std::snprintf(buf, sizeof buf, "%.*g", prec, num_);
                if (std::strtod(buf, nullptr) == num_) {
                    s = buf;
                    break;
                }
            }
            if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
            out += s;
            break;
        }
        case Kind::string:
            out += quote(str_);
            break;
        case Kind::array: {
            out += '[';
            for (size_t i = 0; i < arr_->size(); ++i) {
                if (i) out += indent < 0 ? "," : ",";
                newline(out, indent, depth + 1);
                (*arr_)[i].dump_to(out, indent, depth + 1, nonfinite);
            }
            if (!arr_->empty()) newline(out, indent, depth);
            out += ']';
            break;
        }
        case Kind::object: {
            out += '{';
            for (size_t i = 0; i < obj_->size(); ++i) {
                if (i) out += ",";
                newline(out, indent, depth + 1);
                out += quote((*obj_)[i].first);
                out += indent < 0 ? ":" : ": ";
                (*obj_)[i].second.dump_to(out, indent, depth + 1, nonfinite);
            }
            if (!obj_->empty()) newline(out, indent, depth);
            out += '}';
            break;
        }
    }
}

std::string Value::dump(int indent, NonFinite nonfinite) const {
    std::string out;
    dump_to(out, indent, 0, nonfinite);
    return out;
}

std::optional<double> hf_float_tag(const Value& v, std::string_view what) {
    const Value* tag = v.find(kFloatTagKey);
    if (tag == nullptr) return std::nullopt;
    if (v.size() != 1) fail(what, ": a {\"__float__\": ...} tag holds other keys too: ", v.dump().substr(0, 80));
    if (tag->is_string()) {
        for (const double d : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN()})
            if (tag->as_string() == nonfinite_spelling(d)) return d;
    }
    fail(what, ": bad {\"__float__\": ...} tag ", v.dump().substr(0, 80),
         " (expected \"Infinity\", \"-Infinity\" or \"NaN\")");
}

Value parse(std::string_view text, const std::string& source, int max_depth) {
    ParseOptions options;
    options.max_depth = max_depth;
    return parse(text, source, options);
}

Value parse(std::string_view text, const std::string& source, const ParseOptions& options) {
    // A UTF-8 byte-order mark (Windows editors write one) at the start of a file is skipped, as
    // Python's utf-8-sig does; a record (no source) is not a file's start, and its caller (a JSONL
    // reader) skips the mark of the first line only.
    if (!source.empty() && text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
    return Parser(text, source, options).parse_document();
}

}  // namespace mf::json
