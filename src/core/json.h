// JSON values, a strict parser for untrusted input and a writer.
//
// The parser accepts RFC 8259 JSON only (no comments, no trailing commas), limits nesting depth,
// and reports errors as "<source>:<line>:<col>: <problem>". Objects keep their key order, so a
// config read and written back keeps the layout HF wrote. Numbers remember whether they were
// written as integers, so `"hidden_size": 2048` and `2048.0` can be told apart when validating.
//
// Non-finite numbers: JSON has none, but HF config.json files do. Python's json module writes and
// reads bare `Infinity`, `-Infinity` and `NaN` (the Hub's Nemotron-H configs hold
// `"time_step_limit": [0.0, Infinity]`), and transformers 5.x's save_pretrained writes them as tag
// objects `{"__float__": "Infinity"}` instead. The parser takes the bare literals only when its caller
// opts in (ParseOptions::hf_config(), for HF config.json alone); hf_float_tag reads the tags; dump
// writes either spelling on request (NonFinite).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/check.h"

namespace mf::json {

enum class Kind : uint8_t { null, boolean, number, string, array, object };
const char* kind_name(Kind kind);

// How dump() writes a number that is not finite.
enum class NonFinite : uint8_t {
    null,       // null: strict JSON, the value is lost (the default)
    bare,       // Infinity, -Infinity, NaN: Python json.dumps' spelling, as in the Hub's config.json files
    hf_tagged,  // {"__float__": "Infinity"} (or "-Infinity", "NaN"): what transformers 5.x writes; strict JSON
};

// Python's spelling of a non-finite double: "Infinity", "-Infinity" or "NaN" (the literal and the tag's
// string alike).
const char* nonfinite_spelling(double v);

struct ParseOptions {
    int max_depth = 128;
    // Take Python's bare Infinity, -Infinity and NaN as numbers. Without it they are an error at their
    // line and column. Only for HF config.json files (json.dumps writes them; JSON has no such literal).
    bool nonfinite_literals = false;

    static ParseOptions hf_config() {
        ParseOptions o;
        o.nonfinite_literals = true;
        return o;
    }
};

class Value {
 public:
    using Array = std::vector<Value>;
    using Object = std::vector<std::pair<std::string, Value>>;

    Value() = default;
    Value(std::nullptr_t) {}
    Value(bool b) : kind_(Kind::boolean), bool_(b) {}
    Value(int v) : Value(static_cast<int64_t>(v)) {}
    Value(int64_t v) : kind_(Kind::number), is_int_(true), int_(v), num_(static_cast<double>(v)) {}
    Value(double v) : kind_(Kind::number), num_(v) {}
    Value(const char* s) : kind_(Kind::string), str_(s) {}
    Value(std::string s) : kind_(Kind::string), str_(std::move(s)) {}
    Value(Array a) : kind_(Kind::array), arr_(std::make_shared<Array>(std::move(a))) {}
    Value(Object o) : kind_(Kind::object), obj_(std::make_shared<Object>(std::move(o))) {}
    static Value array() { return Value(Array{}); }
    static Value object() { return Value(Object{}); }

    Kind kind() const { return kind_; }
    bool is_null() const { return kind_ == Kind::null; }
    bool is_bool() const { return kind_ == Kind::boolean; }
    bool is_number() const { return kind_ == Kind::number; }
    bool is_int() const { return kind_ == Kind::number && is_int_; }
    bool is_string() const { return kind_ == Kind::string; }
    bool is_array() const { return kind_ == Kind::array; }
    bool is_object() const { return kind_ == Kind::object; }

    // Accessors throw mf::Error naming the expected and actual kind when the kind is wrong.
    bool as_bool() const;
    int64_t as_int() const;  // integer-valued numbers only
    double as_double() const;
    const std::string& as_string() const;
    const Array& as_array() const;
    Array& as_array();
    const Object& as_object() const;
    Object& as_object();

    // Object access: find returns nullptr when absent; set replaces or appends.
    const Value* find(std::string_view key) const;
    void set(std::string key, Value v);
    void push_back(Value v);
    size_t size() const;

    // indent < 0: one line; else pretty-printed with `indent` spaces per level.
    std::string dump(int indent = -1, NonFinite nonfinite = NonFinite::null) const;

 private:
    void dump_to(std::string& out, int indent, int depth, NonFinite nonfinite) const;
    Kind kind_ = Kind::null;
    bool bool_ = false;
    bool is_int_ = false;
    int64_t int_ = 0;
    double num_ = 0;
    std::string str_;
    std::shared_ptr<Array> arr_;
    std::shared_ptr<Object> obj_;
};

// Parses `text`; `source` names the file (or "<stdin>") in error messages ("SOURCE:LINE:COL: ...");
// an empty source is for a record whose caller names file and line itself (a JSONL line: the error
// then says "column COL: ..."). Duplicate object keys are an error: a config that says two things
// about one field is ambiguous. A UTF-8 byte-order mark at the start of a document with a source (a
// file) is skipped; in a record (empty source) it is an error.
Value parse(std::string_view text, const std::string& source, const ParseOptions& options);
// Strict RFC 8259 JSON (ParseOptions with this depth limit).
Value parse(std::string_view text, const std::string& source, int max_depth = 128);

// The number an HF float tag stands for: an object whose only key is "__float__" with the string
// "Infinity", "-Infinity" or "NaN" (transformers 5.x's encoding of non-finite config values). nullopt
// when `v` is no object or has no "__float__" key; an error naming `what` for a malformed tag (another
// string, a non-string, other keys beside it), which transformers would silently keep as a dict.
std::optional<double> hf_float_tag(const Value& v, std::string_view what);

// Escapes a string as a JSON string literal (with quotes).
std::string quote(std::string_view s);

}  // namespace mf::json
