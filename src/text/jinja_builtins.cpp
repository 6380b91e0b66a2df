// Jinja values as Python sees them (jinja_ast.h): construction, str() and repr() (floats as
// Python's shortest repr), truth, equality, conversion from JSON, and the filter/test name tables.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/check.h"
#include "text/jinja_ast.h"
#include "text/unicode.h"

namespace mf::text::jinja {

// --- values -----------------------------------------------------------------------------------------

Value Value::string(std::string s) {
    Value v;
    v.kind = Kind::string;
    v.obj = std::make_shared<StrObj>(std::move(s));
    return v;
}

Value Value::undefined(std::string hint) {
    Value v;
    if (!hint.empty()) v.obj = std::make_shared<StrObj>(std::move(hint));
    return v;
}

Value Value::list(std::vector<Value> items, bool tuple) {
    Value v;
    v.kind = Kind::list;
    v.tuple = tuple;
    v.obj = std::make_shared<ListObj>(std::move(items));
    return v;
}

const std::string& Value::str() const { return static_cast<const StrObj&>(*obj).s; }
const std::vector<Value>& Value::items() const { return static_cast<const ListObj&>(*obj).items; }
const DictObj& Value::dict() const { return static_cast<const DictObj&>(*obj); }
std::string Value::undefined_hint() const {
    return obj ? static_cast<const StrObj&>(*obj).s : std::string("a value is undefined");
}

const Value* DictObj::find(std::string_view key) const {
    for (const auto& [k, v] : entries)
        if (k.kind == Kind::string && k.str() == key) return &v;
    return nullptr;
}
const Value* DictObj::find(const Value& key) const {
    if (key.kind == Kind::string) return find(std::string_view(key.str()));
    for (const auto& [k, v] : entries)
        if (equals(k, key)) return &v;
    return nullptr;
}
void DictObj::set(Value key, Value v) {
    for (auto& [k, old] : entries)
        if (equals(k, key)) {
            old = std::move(v);
            return;
        }
    entries.emplace_back(std::move(key), std::move(v));
}

Value make_dict(std::vector<std::pair<Value, Value>> entries) {
    auto d = std::make_shared<DictObj>();
    for (auto& [k, v] : entries) d->set(std::move(k), std::move(v));
    Value out;
    out.kind = Kind::dict;
    out.obj = std::move(d);
    return out;
}

Value make_namespace(std::vector<std::pair<Value, Value>> entries) {
    Value v = make_dict(std::move(entries));
    v.kind = Kind::ns;
    return v;
}

namespace {

const std::string& checked_utf8(const std::string& s) {
    const size_t bad = find_invalid_utf8(s);
    if (bad != std::string::npos)
        fail("the chat template's input holds a string that is not valid UTF-8 (byte ", bad, " of ",
             json::quote(s.substr(0, std::min<size_t>(bad, 40))), "...)");
    return s;
}

}  // namespace

// Strings are checked to be UTF-8: the string methods and filters index code points.
Value from_json(const json::Value& v) {
    switch (v.kind()) {
        case json::Kind::null:
            return Value::none();
        case json::Kind::boolean:
            return Value::boolean(v.as_bool());
        case json::Kind::number:
            return v.is_int() ? Value::integer(v.as_int()) : Value::floating(v.as_double());
        case json::Kind::string:
            return Value::string(v.as_string());
        case json::Kind::array: {
            std::vector<Value> items;
            items.reserve(v.size());
            for (const json::Value& e : v.as_array()) items.push_back(from_json(e));
            return Value::list(std::move(items));
        }
        case json::Kind::object: {
            auto d = std::make_shared<DictObj>();
            d->entries.reserve(v.size());
            for (const auto& [k, e] : v.as_object())
                d->entries.emplace_back(Value::string(checked_utf8(k)), from_json(e));
            Value out;
            out.kind = Kind::dict;
            out.obj = std::move(d);
            return out;
        }
    }
    return Value::none();
}

// --- Python semantics -------------------------------------------------------------------------------

bool truthy(const Value& v) {
    switch (v.kind) {
        case Kind::undefined:
        case Kind::none:
            return false;
        case Kind::boolean:
            return v.b;
        case Kind::integer:
            return v.i != 0;
        case Kind::floating:
            return v.f != 0;
        case Kind::string:
            return !v.str().empty();
        case Kind::list:
            return !v.items().empty();
        case Kind::dict:
            return !v.dict().entries.empty();
        default:
            return true;
    }
}

const char* type_name(const Value& v) {
    switch (v.kind) {
        case Kind::undefined:
            return "Undefined";
        case Kind::none:
            return "NoneType";
        case Kind::boolean:
            return "bool";
        case Kind::integer:
            return "int";
        case Kind::floating:
            return "float";
        case Kind::string:
            return "str";
        case Kind::list:
            return v.tuple ? "tuple" : "list";
        case Kind::dict:
            return "dict";
        case Kind::ns:
            return "Namespace";
        case Kind::callable:
            return "function";
        case Kind::loop:
            return "LoopContext";
    }
    return "?";
}

namespace {

bool is_numeric(const Value& v) {
    return v.kind == Kind::boolean || v.kind == Kind::integer || v.kind == Kind::floating;
}
double as_double(const Value& v) {
    return v.kind == Kind::floating ? v.f : v.kind == Kind::integer ? static_cast<double>(v.i) : (v.b ? 1.0 : 0.0);
}

}  // namespace

bool equals(const Value& a, const Value& b) {
    if (is_numeric(a) && is_numeric(b)) {
        if (a.kind != Kind::floating && b.kind != Kind::floating) {
            const int64_t x = a.kind == Kind::integer ? a.i : a.b, y = b.kind == Kind::integer ? b.i : b.b;
            return x == y;
        }
        return as_double(a) == as_double(b);
    }
    if (a.kind != b.kind) return false;
    switch (a.kind) {
        case Kind::undefined:
        case Kind::none:
            return true;
        case Kind::string:
            return a.str() == b.str();
        case Kind::list: {
            if (a.tuple != b.tuple) return false;
            const auto &x = a.items(), &y = b.items();
            if (x.size() != y.size()) return false;
            for (size_t k = 0; k < x.size(); ++k)
                if (!equals(x[k], y[k])) return false;
            return true;
        }
        case Kind::dict: {
            const auto &x = a.dict().entries, &y = b.dict().entries;
            if (x.size() != y.size()) return false;
            for (const auto& [k, v] : x) {
                const Value* w = b.dict().find(k);
                if (w == nullptr || !equals(v, *w)) return false;
            }
            return true;
        }
        default:
            return a.obj == b.obj;
    }
}

// Python's repr(float): the shortest digits that round-trip, fixed notation for exponents in
// [-4, 16), else d.ddde+XX.
std::string float_repr(double x) {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
    std::string s(buf, r.ptr);
    const size_t e = s.find('e');
    std::string mant = s.substr(0, e);
    const int exp = std::stoi(s.substr(e + 1));
    std::string sign;
    if (mant[0] == '-') {
        sign = "-";
        mant.erase(0, 1);
    }
    std::string digits;
    for (char c : mant)
        if (c != '.') digits += c;
    if (exp >= -4 && exp < 16) {
        std::string out;
        if (exp < 0) {
            out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
        } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
            out = digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
        } else {
            out = digits.substr(0, static_cast<size_t>(exp) + 1) + "." + digits.substr(static_cast<size_t>(exp) + 1);
        }
        return sign + out;
    }
    std::string out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    return sign + out + ebuf;
}

namespace {

bool printable(char32_t cp) {
    if (cp == ' ') return true;
    using mf::text::Category;
    switch (mf::text::category(cp)) {
        case Category::Cc:
        case Category::Cf:
        case Category::Cs:
        case Category::Co:
        case Category::Cn:
        case Category::Zl:
        case Category::Zp:
        case Category::Zs:
            return false;
        default:
            return true;
    }
}

std::string str_repr(const std::string& s) {
    const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
    const char q = has_single && !has_double ? '"' : '\'';
    std::string out(1, q);
    for (size_t i = 0; i < s.size();) {
        const char32_t cp = mf::text::next_code_point(s, i);
        if (cp == static_cast<char32_t>(q) || cp == '\\') {
            out += '\\';
            out += static_cast<char>(cp);
        } else if (cp == '\n') {
            out += "\\n";
        } else if (cp == '\r') {
            out += "\\r";
        } else if (cp == '\t') {
            out += "\\t";
        } else if (!printable(cp)) {
            append_code_point_escape(out, cp);
        } else {
            mf::text::append_utf8(out, cp);
        }
    }
    out += q;
    return out;
}

}  // namespace

std::string to_repr(const Value& v) {
    switch (v.kind) {
        case Kind::string:
            return str_repr(v.str());
        case Kind::list: {
            std::string out(1, v.tuple ? '(' : '[');
            const auto& items = v.items();
            for (size_t k = 0; k < items.size(); ++k) {
                if (k > 0) out += ", ";
                out += to_repr(items[k]);
            }
            if (v.tuple && items.size() == 1) out += ',';
            out += v.tuple ? ')' : ']';
            return out;
        }
        case Kind::dict: {
            std::string out = "{";
            bool first = true;
            for (const auto& [k, e] : v.dict().entries) {
                if (!first) out += ", ";
                first = false;
                out += to_repr(k) + ": " + to_repr(e);
            }
            return out + "}";
        }
        case Kind::undefined:
            return "Undefined";
        default:
            return to_str(v);
    }
}

std::string to_str(const Value& v) {
    switch (v.kind) {
        case Kind::undefined:
            return "";
        case Kind::none:
            return "None";
        case Kind::boolean:
            return v.b ? "True" : "False";
        case Kind::integer:
            return std::to_string(v.i);
        case Kind::floating:
            return float_repr(v.f);
        case Kind::string:
            return v.str();
        case Kind::list:
        case Kind::dict:
            return to_repr(v);
        case Kind::ns:
            return "<Namespace " + to_repr(make_dict(v.dict().entries)) + ">";
        case Kind::callable:
            return "<function " + static_cast<const Callable&>(*v.obj).name + ">";
        case Kind::loop:
            return "<LoopContext>";
    }
    return "";
}

// --- names ------------------------------------------------------------------------------------------

int filter_code(std::string_view name) {
#define MF_JINJA_MATCH(e, n) \
    if (name == n) return static_cast<int>(Filter::e);
    MF_JINJA_FILTERS(MF_JINJA_MATCH)
    MF_JINJA_FILTER_ALIASES(MF_JINJA_MATCH)
#undef MF_JINJA_MATCH
    return -1;
}

int test_code(std::string_view name) {
#define MF_JINJA_MATCH(e, n) \
    if (name == n) return static_cast<int>(Test::e);
    MF_JINJA_TESTS(MF_JINJA_MATCH)
    MF_JINJA_TEST_ALIASES(MF_JINJA_MATCH)
#undef MF_JINJA_MATCH
    return -1;
}

}  // namespace mf::text::jinja
