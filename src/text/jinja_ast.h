// Internals of the Jinja interpreter (jinja.h): runtime values, the syntax tree and the parsed
// program. jinja_parse.cpp builds a Program, jinja_eval.cpp runs it (with the filters, tests and
// methods), jinja_builtins.cpp holds Python's value semantics and the name tables, and
// jinja_format.cpp Python's string formatting.
//
// Values are small (kind + scalar + one shared pointer) and immutable once built, so copies share
// their strings and containers; only a namespace() object is written after it is made.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja.h"

namespace mf::text::jinja {

// --- values ----------------------------------------------------------------------------------------

enum class Kind : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, ns, callable, loop };

struct Heap {
    virtual ~Heap() = default;
};

struct Value {
    Kind kind = Kind::undefined;
    bool tuple = false;  // a list written or built as a tuple (prints as (a, b))
    union {
        bool b;
        int64_t i;
        double f;
    };
    // string: StrObj; list: ListObj; dict/ns: DictObj; callable: Callable; loop: LoopObj;
    // undefined: a StrObj naming what is undefined (or null).
    std::shared_ptr<const Heap> obj;

    Value() : i(0) {}
    static Value none() {
        Value v;
        v.kind = Kind::none;
        return v;
    }
    static Value boolean(bool x) {
        Value v;
        v.kind = Kind::boolean;
        v.b = x;
        return v;
    }
    static Value integer(int64_t x) {
        Value v;
        v.kind = Kind::integer;
        v.i = x;
        return v;
    }
    static Value floating(double x) {
        Value v;
        v.kind = Kind::floating;
        v.f = x;
        return v;
    }
    static Value string(std::string s);
    static Value undefined(std::string hint);  // hint: "'x' is undefined", shown when it is used
    static Value list(std::vector<Value> items, bool tuple = false);

    const std::string& str() const;           // kind string
    const std::vector<Value>& items() const;  // kind list
    const struct DictObj& dict() const;       // kind dict or ns
    std::string undefined_hint() const;
};

struct StrObj : Heap {
    std::string s;
    explicit StrObj(std::string x) : s(std::move(x)) {}
};
struct ListObj : Heap {
    std::vector<Value> items;
    // A (grouper, list) pair made by the groupby filter: a tuple whose two items are also its
    // attributes `grouper` and `list`, as Jinja's _GroupTuple.
    bool group = false;
    explicit ListObj(std::vector<Value> x) : items(std::move(x)) {}
};
// Keys are strings or other hashable scalars; insertion order is kept, as Python's dict does.
struct DictObj : Heap {
    std::vector<std::pair<Value, Value>> entries;
    const Value* find(std::string_view key) const;
    const Value* find(const Value& key) const;
    void set(Value key, Value v);
};
Value make_dict(std::vector<std::pair<Value, Value>> entries);
Value make_namespace(std::vector<std::pair<Value, Value>> entries);

struct Stmt;
struct Frame;
enum class Builtin : uint8_t { range, dict, namespace_, raise_exception, strftime_now, caller, joiner_call, cycle };
struct Callable : Heap {
    const Stmt* macro = nullptr;  // a macro or a call block's body; else a builtin
    Builtin builtin = Builtin::range;
    // Where the macro was defined. Weak: that frame holds the macro, and a strong pointer back
    // would be a cycle that outlives the render.
    std::weak_ptr<Frame> closure;
    Value caller;  // the {% call %} body passed to the macro
    std::string name;
};
// What one run of a for loop remembers across its iterations: the arguments of the last
// loop.changed() call.
struct LoopState {
    bool has_changed_value = false;
    Value last_changed_value;
};
struct LoopObj : Heap {
    std::shared_ptr<const std::vector<Value>> items;
    size_t index0 = 0;
    std::shared_ptr<LoopState> state;  // shared by the loop's iterations
};

// --- syntax ----------------------------------------------------------------------------------------

enum class Op : uint8_t {
    constant,
    name,
    list,
    tuple,
    dict,    // kids: key, value, key, value, ...
    attr,    // kids[0].name
    item,    // kids[0][kids[1]]
    slice,   // kids[0][kids[1]:kids[2]:kids[3]] (null kid: omitted)
    call,    // kids[0](kids[1..]); kw_names name the last kw_names.size() arguments
    filter,  // code: the filter; kids[0] | f(kids[1..])
    test,    // code: the test; kids[0] is t(kids[1..]); negate for `is not`
    neg,
    pos,
    not_,
    and_,
    or_,
    binary,   // code: BinOp
    compare,  // kids[0] op[0] kids[1] op[1] kids[2] ... (chained as Python does)
    cond,     // kids[1] if kids[0] else kids[2] (kids[2] may be null)
};
enum class BinOp : uint8_t { add, sub, mul, div, floordiv, mod, pow, concat };
enum class CmpOp : uint8_t { eq, ne, lt, le, gt, ge, in, not_in };

struct Expr {
    Op op = Op::constant;
    uint8_t code = 0;
    bool negate = false;
    uint32_t line = 0, col = 0;
    int symbol = -1;   // name: the interned variable
    std::string name;  // name, attr, filter/test/call names
    Value constant;
    std::vector<std::unique_ptr<Expr>> kids;
    std::vector<std::string> kw_names;
    std::vector<CmpOp> cmp;
};
using ExprPtr = std::unique_ptr<Expr>;

enum class StmtKind : uint8_t {
    text,
    output,
    if_,
    for_,
    set,
    set_block,
    macro,
    call_block,
    filter_block,
    break_,
    continue_,
    generation
};

// An assignment target: a name, a tuple of names, or namespace.attr.
struct Target {
    std::vector<int> symbols;  // one name, or the names of a tuple
    bool tuple = false;
    std::string attr;  // non-empty: symbols[0].attr
};

struct Stmt {
    StmtKind kind = StmtKind::text;
    uint32_t line = 0, col = 0;
    std::string text;  // text; macro name
    // output, set value, for iterable, call block's call; set/filter block's filter chain, whose
    // innermost operand is a placeholder (Op::constant with code 1) standing for the block's text.
    ExprPtr expr;
    ExprPtr cond;  // for: the loop filter
    Target target;
    std::vector<std::pair<ExprPtr, std::vector<std::unique_ptr<Stmt>>>> branches;  // if/elif (else: null condition)
    std::vector<std::unique_ptr<Stmt>> body, else_body;
    // macro / call block parameters
    std::vector<int> params;
    std::vector<std::string> param_names;
    std::vector<ExprPtr> defaults;  // aligned with params; null: none
    int macro_symbol = -1;
};
using StmtPtr = std::unique_ptr<Stmt>;

struct Program {
    std::string name;
    std::vector<StmtPtr> body;
    std::vector<std::string> symbols;  // interned names, by id
    bool has_generation = false;
    // Symbols the evaluator itself refers to.
    int sym_loop = -1, sym_caller = -1, sym_varargs = -1, sym_kwargs = -1;
};

std::shared_ptr<Program> parse_program(std::string_view source, std::string name);

// --- builtins (jinja_builtins.cpp) -------------------------------------------------------------------

// The filters and tests, declared once: X(enumerator, "name"), then aliases A(enumerator, "alias").
// clang-format off
#define MF_JINJA_FILTERS(X)                                                                             \
    X(abs, "abs") X(attr, "attr") X(batch, "batch") X(capitalize, "capitalize") X(center, "center")     \
    X(default_, "default") X(dictsort, "dictsort") X(escape, "escape") X(first, "first")                \
    X(float_, "float") X(format, "format") X(groupby, "groupby") X(indent, "indent") X(int_, "int")     \
    X(items, "items") X(join, "join") X(last, "last") X(length, "length") X(list, "list")               \
    X(lower, "lower") X(map, "map") X(max, "max") X(min, "min") X(reject, "reject")                     \
    X(rejectattr, "rejectattr") X(replace, "replace") X(reverse, "reverse") X(round, "round")           \
    X(safe, "safe") X(select, "select") X(selectattr, "selectattr") X(slice, "slice") X(sort, "sort")   \
    X(string, "string") X(sum, "sum") X(title, "title") X(tojson, "tojson") X(trim, "trim")             \
    X(truncate, "truncate") X(unique, "unique") X(upper, "upper") X(wordcount, "wordcount")
#define MF_JINJA_FILTER_ALIASES(A) A(length, "count") A(default_, "d") A(escape, "e")
#define MF_JINJA_TESTS(X)                                                                               \
    X(boolean, "boolean") X(callable, "callable") X(defined, "defined") X(divisibleby, "divisibleby")    \
    X(eq, "eq") X(even, "even") X(false_, "false") X(filter, "filter") X(float_, "float") X(ge, "ge")  \
    X(gt, "gt") X(in, "in") X(integer, "integer") X(iterable, "iterable") X(le, "le") X(lower, "lower") \
    X(lt, "lt") X(mapping, "mapping") X(ne, "ne") X(none, "none") X(number, "number") X(odd, "odd")     \
    X(sameas, "sameas") X(sequence, "sequence") X(string, "string") X(test, "test") X(true_, "true")   \
    X(undefined, "undefined") X(upper, "upper")
#define MF_JINJA_TEST_ALIASES(A)                                                                        \
    A(eq, "equalto") A(eq, "==") A(ne, "!=") A(lt, "lessthan") A(lt, "<") A(le, "<=")                  \
    A(gt, "greaterthan") A(gt, ">") A(ge, ">=")
// clang-format on

#define MF_JINJA_ENUMERATOR(e, name) e,
enum class Filter : uint8_t { MF_JINJA_FILTERS(MF_JINJA_ENUMERATOR) };
enum class Test : uint8_t { MF_JINJA_TESTS(MF_JINJA_ENUMERATOR) };
#undef MF_JINJA_ENUMERATOR

// Filter and test codes (Filter / Test values) by name; -1 when Jinja (or this subset) has none.
int filter_code(std::string_view name);
int test_code(std::string_view name);

// Python's str() and repr() of a value, and its truth value.
std::string to_str(const Value& v);
std::string to_repr(const Value& v);
std::string float_repr(double x);
bool truthy(const Value& v);
const char* type_name(const Value& v);  // Python's type name: str, int, list, dict, NoneType, ...
bool equals(const Value& a, const Value& b);
Value from_json(const json::Value& v);

// --- string formatting (jinja_format.cpp) ------------------------------------------------------------

// A formatting failure, with Python's message; the evaluator reports it at the expression.
struct FormatError {
    std::string message;
};
// Python's ascii(): repr() with every non-ASCII code point escaped.
std::string ascii_repr(const Value& v);
// Python's escape of one code point in a repr: \xNN, \uNNNN or \UNNNNNNNN.
void append_code_point_escape(std::string& out, char32_t c);
// Python's `fmt % args`: a tuple gives the arguments in order, a dict serves %(key)s, any other
// value is the one argument. FormatError on a bad conversion or argument count, or when the
// result would exceed max_size bytes.
std::string percent_format(const std::string& fmt, const Value& args, size_t max_size);
// Python's fmt.format(*args, **kwargs); `lookup` resolves {x.attr} (is_attr) and {x[key]} as the
// sandbox's getattr and getitem do.
using FieldLookup = std::function<Value(const Value& obj, const Value& key, bool is_attr)>;
std::string str_format(const std::string& fmt, const std::vector<Value>& args,
                       const std::vector<std::pair<std::string, Value>>& kwargs, const FieldLookup& lookup,
                       size_t max_size);

}  // namespace mf::text::jinja
