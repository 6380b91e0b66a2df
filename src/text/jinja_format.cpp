// Python's string formatting for the Jinja interpreter (jinja_ast.h): printf-style `str % args`
// (also Jinja's `format` filter) and `str.format()` with the format-spec mini-language, as
// CPython formats str, int, bool, float and None. Widths and precisions count code points.
// Failures throw FormatError with Python's message; the evaluator adds the template position.
//
// Floats: e/f/g (and their capitals) are C's printf conversions, which CPython's share digit for
// digit (both round correctly from the binary value); a format spec without a type follows
// CPython's "repr, or g keeping a .0" rule. Output is bounded by `max_size` bytes.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "text/jinja_ast.h"
#include "text/unicode.h"

namespace mf::text::jinja {

namespace {

[[noreturn]] void format_error(std::string message) { throw FormatError{std::move(message)}; }

size_t cp_len(std::string_view s) {
    size_t n = 0;
    for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return n;
}

// The first `n` code points of s.
std::string cp_prefix(const std::string& s, size_t n) {
    size_t i = 0;
    for (size_t k = 0; k < n && i < s.size(); ++k) i += mf::text::utf8_length(static_cast<unsigned char>(s[i]));
    return s.substr(0, std::min(i, s.size()));
}

bool is_number(const Value& v) {
    return v.kind == Kind::boolean || v.kind == Kind::integer || v.kind == Kind::floating;
}
int64_t int_of(const Value& v) { return v.kind == Kind::integer ? v.i : v.b ? 1 : 0; }
double double_of(const Value& v) { return v.kind == Kind::floating ? v.f : static_cast<double>(int_of(v)); }

// Digits of |x| in `base` (2, 8, 10, 16).
std::string magnitude_digits(int64_t x, int base, bool upper) {
    uint64_t m = x < 0 ? 0 - static_cast<uint64_t>(x) : static_cast<uint64_t>(x);
    const char* digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
    std::string out;
    do {
        out += digits[m % static_cast<uint64_t>(base)];
        m /= static_cast<uint64_t>(base);
    } while (m != 0);
    std::reverse(out.begin(), out.end());
    return out;
}

// Inserts `sep` every `every` digits from the right of the leading run of digits of s.
std::string group_digits(const std::string& s, char sep, int every, bool hex) {
    size_t end = 0;
    while (end < s.size() &&
           (hex ? std::isxdigit(static_cast<unsigned char>(s[end])) : std::isdigit(static_cast<unsigned char>(s[end]))))
        ++end;
    std::string out;
    for (size_t k = 0; k < end; ++k) {
        if (k > 0 && (end - k) % static_cast<size_t>(every) == 0) out += sep;
        out += s[k];
    }
    return out + s.substr(end);
}

// C's printf of a finite, non-negative double: conversion e, E, f, F, g or G.
std::string printf_double(double x, char conv, int precision, bool alt) {
    char spec[16];
    std::snprintf(spec, sizeof spec, "%%%s.*%c", alt ? "#" : "", conv);
    const int n = std::snprintf(nullptr, 0, spec, precision, x);
    std::string out(static_cast<size_t>(n) + 1, '\0');
    std::snprintf(out.data(), out.size(), spec, precision, x);
    out.resize(static_cast<size_t>(n));
    return out;
}

// |x| as CPython writes a float for conversion `conv` (e E f F g G %, or 0 for a format spec
// without a type), without its sign.
std::string float_magnitude(double x, char conv, int precision, bool alt) {
    const bool upper = conv == 'E' || conv == 'F' || conv == 'G';
    if (std::isnan(x)) return upper ? "NAN" : "nan";
    if (std::isinf(x)) return upper ? "INF" : "inf";
    const double m = std::fabs(x);
    if (conv == '%') return printf_double(m * 100, 'f', precision < 0 ? 6 : precision, alt) + "%";
    if (conv != 0) return printf_double(m, conv, precision < 0 ? 6 : precision, alt);
    if (precision < 0) return float_repr(m);
    // 'g' with at least one digit after the point: exponent form when the decimal point would
    // fall outside [-4, precision - 1) of the significant digits.
    const int p = std::max(precision, 1);
    const std::string e = printf_double(m, 'e', p - 1, false);  // d.ddde±XX
    const size_t at = e.find('e');
    std::string digits = e.substr(0, 1) + (at > 2 ? e.substr(2, at - 2) : std::string());
    const int decpt = std::stoi(e.substr(at + 1)) + 1;
    if (!alt)
        while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
    if (decpt <= -4 || decpt > p - 1) {
        std::string out(1, digits[0]);
        if (digits.size() > 1) {
            out += '.';
            out.append(digits, 1, std::string::npos);
        }
        char buf[16];
        std::snprintf(buf, sizeof buf, "e%c%02d", decpt - 1 < 0 ? '-' : '+', std::abs(decpt - 1));
        return out + buf;
    }
    if (decpt <= 0) return "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    if (static_cast<size_t>(decpt) >= digits.size())
        return digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
    return digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
}

// Pads `body` (after `sign`, which includes any 0x prefix) to `width` code points.
// align: '<' left, '>' right, '^' centre, '=' fill between the sign and the body.
std::string pad(const std::string& sign, const std::string& body, size_t width, char align, const std::string& fill) {
    const size_t len = cp_len(sign) + cp_len(body);
    if (len >= width) return sign + body;
    const size_t n = width - len;
    auto fills = [&](size_t k) {
        std::string s;
        for (size_t j = 0; j < k; ++j) s += fill;
        return s;
    };
    switch (align) {
        case '<':
            return sign + body + fills(n);
        case '^':
            return fills(n / 2) + sign + body + fills(n - n / 2);
        case '=':
            return sign + fills(n) + body;
        default:
            return fills(n) + sign + body;
    }
}

std::string sign_of(bool negative, char plus) { return negative ? "-" : plus == 0 ? "" : std::string(1, plus); }

constexpr int64_t kMaxWidth = 1'000'000;  // widths and precisions beyond this are refused

// Appends to out, refusing output beyond max_size.
void emit(std::string& out, const std::string& s, size_t max_size) {
    if (out.size() + s.size() > max_size)
        format_error("the formatted string would be longer than " + std::to_string(max_size) +
                     " bytes (Limits::max_string)");
    out += s;
}

// --- printf-style ------------------------------------------------------------------------------------

struct Percent {
    std::string key;  // %(key)s
    bool has_key = false;
    bool left = false, zero = false, alt = false;
    char plus = 0;  // '+', ' ' or 0
    int64_t width = 0, precision = -1;
    char conv = 0;
};

std::string format_char(const Value& v) {
    if (v.kind == Kind::integer || v.kind == Kind::boolean) {
        const int64_t c = int_of(v);
        if (c < 0 || c > 0x10FFFF) format_error("%c arg not in range(0x110000)");
        std::string s;
        mf::text::append_utf8(s, static_cast<char32_t>(c));
        return s;
    }
    if (v.kind == Kind::string && cp_len(v.str()) == 1) return v.str();
    format_error(std::string("%c requires an int or a unicode character, not ") + type_name(v));
}

std::string percent_one(const Percent& p, const Value& v) {
    const std::string conv(1, p.conv);
    switch (p.conv) {
        case 's':
        case 'r':
        case 'a': {
            std::string s = p.conv == 's' ? to_str(v) : p.conv == 'r' ? to_repr(v) : ascii_repr(v);
            if (p.precision >= 0) s = cp_prefix(s, static_cast<size_t>(p.precision));
            return pad("", s, static_cast<size_t>(p.width), p.left ? '<' : '>', " ");
        }
        case 'c':
            return pad("", format_char(v), static_cast<size_t>(p.width), p.left ? '<' : '>', " ");
        case 'd':
        case 'i':
        case 'u':
        case 'o':
        case 'x':
        case 'X': {
            if (!is_number(v))
                format_error("%" + conv + " format: " +
                             (p.conv == 'd' || p.conv == 'i' || p.conv == 'u' ? "a real number" : "an integer") +
                             " is required, not " + type_name(v));
            int64_t x = 0;
            if (v.kind == Kind::floating) {
                if (p.conv == 'o' || p.conv == 'x' || p.conv == 'X')
                    format_error("%" + conv + " format: an integer is required, not float");
                if (!std::isfinite(v.f)) format_error("cannot convert float " + float_repr(v.f) + " to integer");
                if (std::fabs(v.f) >= 9.2e18) format_error("%" + conv + " format: the number is out of range");
                x = static_cast<int64_t>(v.f);
            } else {
                x = int_of(v);
            }
            const int base = p.conv == 'o' ? 8 : p.conv == 'x' || p.conv == 'X' ? 16 : 10;
            std::string digits = magnitude_digits(x, base, p.conv == 'X');
            if (p.precision > static_cast<int64_t>(digits.size()))
                digits = std::string(static_cast<size_t>(p.precision) - digits.size(), '0') + digits;
            std::string sign = sign_of(x < 0, p.plus);
            if (p.alt && base != 10) sign += p.conv == 'o' ? "0o" : p.conv == 'x' ? "0x" : "0X";
            const char align = p.left ? '<' : p.zero ? '=' : '>';
            return pad(sign, digits, static_cast<size_t>(p.width), align, align == '=' ? "0" : " ");
        }
        case 'e':
        case 'E':
        case 'f':
        case 'F':
        case 'g':
        case 'G': {
            if (!is_number(v)) format_error(std::string("must be real number, not ") + type_name(v));
            const double x = double_of(v);
            const std::string body = float_magnitude(x, p.conv, static_cast<int>(p.precision), p.alt);
            const char align = p.left ? '<' : p.zero ? '=' : '>';
            return pad(sign_of(std::signbit(x) && !std::isnan(x), p.plus), body, static_cast<size_t>(p.width), align,
                       align == '=' ? "0" : " ");
        }
        default:
            return "";
    }
}

}  // namespace

std::string ascii_repr(const Value& v) {
    const std::string r = to_repr(v);
    std::string out;
    for (size_t i = 0; i < r.size();) {
        const char32_t c = mf::text::next_code_point(r, i);
        if (c < 0x80) {
            out += static_cast<char>(c);
            continue;
        }
        append_code_point_escape(out, c);
    }
    return out;
}

void append_code_point_escape(std::string& out, char32_t c) {
    char buf[16];
    if (c < 0x100)
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
    else if (c < 0x10000)
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
    else
        std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
    out += buf;
}

std::string percent_format(const std::string& fmt, const Value& args, size_t max_size) {
    // A tuple supplies the arguments in order; a dict (or a list, which CPython also takes for a
    // mapping) may be looked up by %(key)s; anything else is the one argument.
    const bool is_tuple = args.kind == Kind::list && args.tuple;
    const bool mapping = args.kind == Kind::dict || (args.kind == Kind::list && !args.tuple);
    const std::vector<Value> single{args};
    const std::vector<Value>& positional = is_tuple ? args.items() : single;
    size_t next = 0;
    auto take = [&]() -> const Value& {
        if (next >= positional.size()) format_error("not enough arguments for format string");
        return positional[next++];
    };
    std::string out;
    size_t literal = 0;
    for (size_t i = 0; i < fmt.size();) {
        if (fmt[i] != '%') {
            ++i;
            continue;
        }
        emit(out, fmt.substr(literal, i - literal), max_size);
        ++i;
        if (i < fmt.size() && fmt[i] == '%') {
            emit(out, "%", max_size);
            literal = ++i;
            continue;
        }
        Percent p;
        if (i < fmt.size() && fmt[i] == '(') {
            int depth = 1;
            const size_t start = ++i;
            while (i < fmt.size() && depth > 0) {
                if (fmt[i] == '(') ++depth;
                if (fmt[i] == ')') --depth;
                ++i;
            }
            if (depth > 0) format_error("incomplete format key");
            p.key = fmt.substr(start, i - 1 - start);
            p.has_key = true;
        }
        for (; i < fmt.size(); ++i) {
            const char c = fmt[i];
            if (c == '-')
                p.left = true;
            else if (c == '0')
                p.zero = true;
            else if (c == '#')
                p.alt = true;
            else if (c == '+')
                p.plus = '+';
            else if (c == ' ')
                p.plus = p.plus == '+' ? '+' : ' ';
            else
                break;
        }
        auto number = [&](int64_t& into, bool is_width) {
            if (i < fmt.size() && fmt[i] == '*') {
                ++i;
                const Value& v = take();
                if (v.kind != Kind::integer && v.kind != Kind::boolean) format_error("* wants int");
                into = int_of(v);
                if (is_width && into < 0) {
                    p.left = true;
                    into = -into;
                }
                if (!is_width && into < 0) into = 0;
            } else {
                into = 0;
                while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i]))) {
                    into = into * 10 + (fmt[i++] - '0');
                    if (into > kMaxWidth) break;
                }
            }
            if (into > kMaxWidth)
                format_error((is_width ? "width " : "precision ") + std::string("is bigger than ") +
                             std::to_string(kMaxWidth));
        };
        number(p.width, true);
        if (i < fmt.size() && fmt[i] == '.') {
            ++i;
            number(p.precision, false);
        }
        while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
        if (i >= fmt.size()) format_error("incomplete format");
        p.conv = fmt[i];
        // CPython takes the argument before it looks at the conversion character.
        const Value* value = nullptr;
        if (p.has_key) {
            if (args.kind != Kind::dict) format_error("format requires a mapping");
            value = args.dict().find(std::string_view(p.key));
            if (value == nullptr) format_error(to_repr(Value::string(p.key)));  // Python's KeyError
        } else {
            value = &take();
        }
        if (std::string_view("srabcdiuoxXeEfFgG").find(p.conv) == std::string_view::npos) {
            size_t at = i;
            const char32_t c = mf::text::next_code_point(fmt, at);
            char buf[64];
            std::snprintf(buf, sizeof buf, "' (0x%x) at index %zu", static_cast<unsigned>(c),
                          cp_len(std::string_view(fmt).substr(0, i)));
            std::string ch;
            mf::text::append_utf8(ch, c);
            format_error("unsupported format character '" + ch + buf);
        }
        literal = ++i;
        emit(out, percent_one(p, *value), max_size);
    }
    emit(out, fmt.substr(literal), max_size);
    if (next < positional.size() && !mapping) format_error("not all arguments converted during string formatting");
    return out;
}

// --- str.format ---------------------------------------------------------------------------------------

namespace {

struct Spec {
    std::string fill = " ";
    bool fill_given = false;
    char align = 0;  // 0: the type's default
    char sign = 0;   // '+', '-', ' '
    bool alt = false, zero = false;
    int64_t width = 0, precision = -1;
    char grouping = 0;  // ',' or '_'
    char type = 0;
};

Spec parse_spec(const std::string& s) {
    Spec sp;
    size_t i = 0;
    auto is_align = [](char c) { return c == '<' || c == '>' || c == '^' || c == '='; };
    if (!s.empty()) {
        size_t j = 0;
        mf::text::next_code_point(s, j);
        if (j < s.size() && is_align(s[j])) {
            sp.fill = s.substr(0, j);
            sp.fill_given = true;
            sp.align = s[j];
            i = j + 1;
        } else if (is_align(s[0])) {
            sp.align = s[0];
            i = 1;
        }
    }
    if (i < s.size() && (s[i] == '+' || s[i] == '-' || s[i] == ' ')) sp.sign = s[i++];
    if (i < s.size() && s[i] == '#') {
        sp.alt = true;
        ++i;
    }
    if (i < s.size() && s[i] == '0') {
        sp.zero = true;
        ++i;
    }
    auto digits = [&](int64_t& into) {
        into = 0;
        while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
            into = into * 10 + (s[i++] - '0');
            if (into > kMaxWidth) format_error("Too many decimal digits in format string");
        }
    };
    digits(sp.width);
    if (i < s.size() && (s[i] == ',' || s[i] == '_')) sp.grouping = s[i++];
    if (i < s.size() && s[i] == '.') {
        ++i;
        if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i])))
            format_error("Format specifier missing precision");
        digits(sp.precision);
    }
    if (i < s.size()) sp.type = s[i++];
    if (i < s.size()) format_error("Invalid format specifier '" + s + "'");
    return sp;
}

// The 0 flag pads with zeros unless a fill character is given.
std::string fill_of(const Spec& sp) { return sp.zero && !sp.fill_given ? "0" : sp.fill; }

std::string format_str(const std::string& s, const Spec& sp) {
    if (sp.type != 0 && sp.type != 's')
        format_error(std::string("Unknown format code '") + sp.type + "' for object of type 'str'");
    if (sp.sign != 0) format_error("Sign not allowed in string format specifier");
    if (sp.alt) format_error("Alternate form (#) not allowed in string format specifier");
    if (sp.align == '=') format_error("'=' alignment not allowed in string format specifier");
    if (sp.grouping != 0) format_error(std::string("Cannot specify '") + sp.grouping + "' with 's'.");
    const std::string body = sp.precision >= 0 ? cp_prefix(s, static_cast<size_t>(sp.precision)) : s;
    return pad("", body, static_cast<size_t>(sp.width), sp.align == 0 ? '<' : sp.align, fill_of(sp));
}

std::string format_number(const Value& v, const Spec& sp) {
    char type = sp.type;
    const bool integral = v.kind != Kind::floating;
    if (integral && std::string_view("eEfFgG%").find(type) == std::string_view::npos) {
        if (type != 0 && std::string_view("bcdoxXn").find(type) == std::string_view::npos)
            format_error(std::string("Unknown format code '") + type + "' for object of type 'int'");
        if (sp.precision >= 0) format_error("Precision not allowed in integer format specifier");
        const int64_t x = int_of(v);
        if (type == 'c') {
            if (sp.sign != 0) format_error("Sign not allowed with integer format specifier 'c'");
            return pad("", format_char(v), static_cast<size_t>(sp.width), sp.align == 0 ? '>' : sp.align, sp.fill);
        }
        const int base = type == 'b' ? 2 : type == 'o' ? 8 : type == 'x' || type == 'X' ? 16 : 10;
        std::string body = magnitude_digits(x, base, type == 'X');
        if (sp.grouping != 0) {
            if (sp.grouping == ',' && base != 10) format_error(std::string("Cannot specify ',' with '") + type + "'.");
            body = group_digits(body, sp.grouping, base == 10 ? 3 : 4, base == 16);
        }
        std::string sign = sign_of(x < 0, sp.sign == '-' ? 0 : sp.sign);
        if (sp.alt && base != 10) sign += type == 'b' ? "0b" : type == 'o' ? "0o" : type == 'x' ? "0x" : "0X";
        const char align = sp.align != 0 ? sp.align : sp.zero ? '=' : '>';
        return pad(sign, body, static_cast<size_t>(sp.width), align, fill_of(sp));
    }
    if (type != 0 && std::string_view("eEfFgGn%").find(type) == std::string_view::npos)
        format_error(std::string("Unknown format code '") + type + "' for object of type 'float'");
    if (type == 'n') type = 'g';
    const double x = double_of(v);
    if (sp.precision > 400) format_error("precision too big");
    std::string body = float_magnitude(x, type, static_cast<int>(sp.precision), sp.alt);
    if (sp.grouping != 0 && std::isfinite(x)) body = group_digits(body, sp.grouping, 3, false);
    const std::string sign = sign_of(std::signbit(x) && !std::isnan(x), sp.sign == '-' ? 0 : sp.sign);
    const char align = sp.align != 0 ? sp.align : sp.zero ? '=' : '>';
    return pad(sign, body, static_cast<size_t>(sp.width), align, fill_of(sp));
}

// format(v, spec) as Python's __format__ of str, int, bool, float, and object (None, lists, ...).
std::string format_value(const Value& v, const std::string& spec) {
    if (v.kind == Kind::string) return format_str(v.str(), parse_spec(spec));
    if (spec.empty()) return to_str(v);
    if (is_number(v)) return format_number(v, parse_spec(spec));
    format_error(std::string("unsupported format string passed to ") + type_name(v) + ".__format__");
}

class StrFormatter {
 public:
    StrFormatter(const std::vector<Value>& args, const std::vector<std::pair<std::string, Value>>& kwargs,
                 const FieldLookup& lookup, size_t max_size)
        : args_(args), kwargs_(kwargs), lookup_(lookup), max_size_(max_size) {}

    std::string run(const std::string& fmt, int depth) {
        if (depth > 1) format_error("Max string recursion exceeded");  // one level of fields in a spec
        std::string out;
        size_t i = 0;
        while (i < fmt.size()) {
            const char c = fmt[i];
            if (c == '}') {
                if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
                    emit(out, "}", max_size_);
                    i += 2;
                    continue;
                }
                format_error("Single '}' encountered in format string");
            }
            if (c != '{') {
                size_t j = i;
                while (j < fmt.size() && fmt[j] != '{' && fmt[j] != '}') ++j;
                emit(out, fmt.substr(i, j - i), max_size_);
                i = j;
                continue;
            }
            if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
                emit(out, "{", max_size_);
                i += 2;
                continue;
            }
            // A replacement field: up to the matching '}' (the spec may nest one level of fields).
            size_t j = i + 1;
            int nest = 1;
            while (j < fmt.size()) {
                if (fmt[j] == '{') ++nest;
                if (fmt[j] == '}' && --nest == 0) break;
                ++j;
            }
            if (j >= fmt.size())
                format_error(i + 1 >= fmt.size() ? "Single '{' encountered in format string"
                                                 : "expected '}' before end of string");
            emit(out, field(fmt.substr(i + 1, j - i - 1), depth), max_size_);
            i = j + 1;
        }
        return out;
    }

 private:
    std::string field(const std::string& f, int depth) {
        // field_name [!conv] [:spec]; the name ends at the first '!' or ':' outside brackets.
        size_t end = 0;
        while (end < f.size() && f[end] != '!' && f[end] != ':') {
            if (f[end] == '[') {
                while (end < f.size() && f[end] != ']') ++end;
                if (end >= f.size()) format_error("Missing ']' in format string");
            }
            ++end;
        }
        const std::string name = f.substr(0, end);
        char conv = 0;
        std::string spec;
        if (end < f.size() && f[end] == '!') {
            if (end + 1 >= f.size()) format_error("end of string while looking for conversion specifier");
            conv = f[end + 1];
            end += 2;
            if (end < f.size() && f[end] != ':') format_error("expected ':' after conversion specifier");
        }
        Value v = resolve(name);  // before the spec's own fields, which number after it
        if (end < f.size() && f[end] == ':') spec = run(f.substr(end + 1), depth + 1);
        if (conv == 'r')
            v = Value::string(to_repr(v));
        else if (conv == 's')
            v = Value::string(to_str(v));
        else if (conv == 'a')
            v = Value::string(ascii_repr(v));
        else if (conv != 0)
            format_error(std::string("Unknown conversion specifier ") + conv);
        return format_value(v, spec);
    }

    Value resolve(const std::string& name) {
        size_t i = 0;
        while (i < name.size() && name[i] != '.' && name[i] != '[') ++i;
        const std::string first = name.substr(0, i);
        Value v;
        if (first.empty() || std::all_of(first.begin(), first.end(),
                                         [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; })) {
            size_t index;
            if (first.empty()) {
                if (manual_) format_error("cannot switch from manual field specification to automatic field numbering");
                automatic_ = true;
                index = next_++;
            } else {
                if (automatic_)
                    format_error("cannot switch from automatic field numbering to manual field specification");
                manual_ = true;
                if (first.size() > 9) format_error("Too many decimal digits in format string");
                index = static_cast<size_t>(std::stoll(first));
            }
            if (index >= args_.size())
                format_error("Replacement index " + std::to_string(index) + " out of range for positional args tuple");
            v = args_[index];
        } else {
            const Value* found = nullptr;
            for (const auto& [k, x] : kwargs_)
                if (k == first) found = &x;
            if (found == nullptr) format_error(to_repr(Value::string(first)));  // Python's KeyError
            v = *found;
        }
        while (i < name.size()) {
            if (name[i] == '.') {
                size_t j = ++i;
                while (j < name.size() && name[j] != '.' && name[j] != '[') ++j;
                if (j == i) format_error("Empty attribute in format string");
                v = lookup_(v, Value::string(name.substr(i, j - i)), true);
                i = j;
            } else if (name[i] == '[') {
                const size_t close = name.find(']', i);
                const std::string key = name.substr(i + 1, close - i - 1);
                if (key.empty()) format_error("Empty attribute in format string");
                const bool digits = std::all_of(
                    key.begin(), key.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; });
                v = lookup_(v, digits && key.size() < 18 ? Value::integer(std::stoll(key)) : Value::string(key), false);
                i = close + 1;
            } else {
                format_error("Only '.' or '[' may follow ']' in format field specifier");
            }
        }
        return v;
    }

    const std::vector<Value>& args_;
    const std::vector<std::pair<std::string, Value>>& kwargs_;
    const FieldLookup& lookup_;
    size_t max_size_;
    size_t next_ = 0;
    bool automatic_ = false, manual_ = false;
};

}  // namespace

std::string str_format(const std::string& fmt, const std::vector<Value>& args,
                       const std::vector<std::pair<std::string, Value>>& kwargs, const FieldLookup& lookup,
                       size_t max_size) {
    return StrFormatter(args, kwargs, lookup, max_size).run(fmt, 0);
}

}  // namespace mf::text::jinja
