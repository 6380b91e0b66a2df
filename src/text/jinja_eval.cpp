// Jinja evaluator (jinja.h): walks the Program of jinja_parse.cpp. Scoping is Jinja's: a for
// loop, a macro call and a block capture get their own frame (assignments in them do not leak
// out; namespace() attributes are how templates carry state out of loops); if blocks do not.
// Every step charges the work budget and every loop iteration the iteration budget, so a hostile
// template ends with an error, never a hang; output and strings are capped in size.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "core/check.h"
#include "text/jinja_ast.h"
#include "text/unicode.h"

namespace mf::text::jinja {

struct Frame {
    std::vector<std::pair<int, Value>> vars;
    std::shared_ptr<Frame> parent;
    const Value* find(int sym) const {
        for (const Frame* f = this; f != nullptr; f = f->parent.get())
            for (const auto& [s, v] : f->vars)
                if (s == sym) return &v;
        return nullptr;
    }
    void set(int sym, Value v) {
        for (auto& [s, old] : vars)
            if (s == sym) {
                old = std::move(v);
                return;
            }
        vars.emplace_back(sym, std::move(v));
    }
};

namespace {

using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using FramePtr = std::shared_ptr<Frame>;

// Work units a macro call costs beyond its body (a frame, a capture buffer): about what 100
// expression steps cost, so a template that recurses exponentially stops in well under a second.
constexpr size_t kMacroCallWork = 100;

bool is_py_space(char32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

bool is_ascii(std::string_view s) {
    for (char c : s)
        if (static_cast<unsigned char>(c) >= 0x80) return false;
    return true;
}

// Byte offsets of each code point of s, plus s.size() at the end.
std::vector<size_t> cp_offsets(std::string_view s) {
    std::vector<size_t> off;
    off.reserve(s.size() + 1);
    for (size_t i = 0; i < s.size();) {
        off.push_back(i);
        i += mf::text::utf8_length(static_cast<unsigned char>(s[i]));
    }
    off.push_back(s.size());
    return off;
}

size_t cp_count(std::string_view s) {
    size_t n = 0;
    for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return n;
}

bool is_numeric(const Value& v) {
    return v.kind == Kind::boolean || v.kind == Kind::integer || v.kind == Kind::floating;
}
bool is_intlike(const Value& v) { return v.kind == Kind::boolean || v.kind == Kind::integer; }
int64_t as_int(const Value& v) { return v.kind == Kind::integer ? v.i : v.b ? 1 : 0; }
double as_double(const Value& v) { return v.kind == Kind::floating ? v.f : static_cast<double>(as_int(v)); }

}  // namespace

class Evaluator {
 public:
    Evaluator(const Program& prog, const json::Value& context, const RenderOptions& options)
        : prog_(prog), lim_(options.limits), now_(options.now) {
        MF_CHECK(context.is_object() || context.is_null(), prog.name, ": the render context must be a JSON object");
        globals_.resize(prog.symbols.size());
        for (size_t s = 0; s < prog.symbols.size(); ++s) {
            const std::string& n = prog.symbols[s];
            const json::Value* v = context.is_object() ? context.find(n) : nullptr;
            if (v != nullptr) {
                globals_[s] = from_json(*v);
            } else if (n == "range" || n == "dict" || n == "namespace" || n == "raise_exception" ||
                       n == "strftime_now") {
                auto c = std::make_shared<Callable>();
                c->name = n;
                c->builtin = n == "range"             ? Builtin::range
                             : n == "dict"            ? Builtin::dict
                             : n == "namespace"       ? Builtin::namespace_
                             : n == "raise_exception" ? Builtin::raise_exception
                                                      : Builtin::strftime_now;
                globals_[s].kind = Kind::callable;
                globals_[s].obj = std::move(c);
            } else {
                globals_[s] = Value::undefined("'" + n + "' is undefined");
            }
        }
    }

    // A namespace can be made to hold itself ({% set ns.x = ns %}): its entries are dropped when
    // the render ends so that no cycle of shared pointers outlives it.
    ~Evaluator() {
        for (const std::shared_ptr<const Heap>& ns : namespaces_)
            const_cast<DictObj&>(static_cast<const DictObj&>(*ns)).entries.clear();
    }
    Evaluator(const Evaluator&) = delete;
    Evaluator& operator=(const Evaluator&) = delete;

    Rendered run() {
        auto root = std::make_shared<Frame>();
        out_ = &result_.text;
        exec_body(prog_.body, root);
        return std::move(result_);
    }

 private:
    enum class Flow { normal, break_, continue_ };

    // --- errors and budgets
    template <typename... A>
    [[noreturn]] void error(uint32_t line, uint32_t col, A&&... args) const {
        fail(prog_.name, ":", line, ":", col, ": ", std::forward<A>(args)...);
    }
    template <typename... A>
    [[noreturn]] void error(const Expr& e, A&&... args) const {
        error(e.line, e.col, std::forward<A>(args)...);
    }
    void charge(const Expr& e, size_t n) {
        work_ += static_cast<int64_t>(n);
        if (work_ > lim_.max_work)
            error(e, "the template needs more than ", lim_.max_work, " evaluation steps (Limits::max_work)");
    }
    void check_size(const Expr& e, size_t n, const char* what) const {
        if (n > lim_.max_string)
            error(e, what, " would hold ", n, " bytes or elements, more than ", lim_.max_string,
                  " (Limits::max_string)");
    }
    [[noreturn]] void undefined_error(const Expr& e, const Value& v) const { error(e, v.undefined_hint()); }
    void require_defined(const Expr& e, const Value& v) const {
        if (v.kind == Kind::undefined) undefined_error(e, v);
    }
    struct Depth {
        Evaluator& ev;
        Depth(Evaluator& evaluator, uint32_t line, uint32_t col) : ev(evaluator) {
            if (++ev.depth_ > ev.lim_.max_depth)
                ev.error(line, col, "the template nests deeper than ", ev.lim_.max_depth, " levels while rendering");
        }
        ~Depth() { --ev.depth_; }
    };

    void write(const std::string& s, uint32_t line, uint32_t col) {
        out_->append(s);
        const size_t cap = out_ == &result_.text ? lim_.max_output : lim_.max_string;
        if (out_->size() > cap)
            error(line, col, "the template renders more than ", cap, " bytes (Limits::max_output/max_string)");
        work_ += static_cast<int64_t>(s.size());
    }

    // --- statements
    Flow exec_body(const std::vector<StmtPtr>& body, const FramePtr& frame) {
        for (const StmtPtr& s : body) {
            const Flow f = exec(*s, frame);
            if (f != Flow::normal) return f;
        }
        return Flow::normal;
    }

    Flow exec(const Stmt& s, const FramePtr& frame) {
        Depth d(*this, s.line, s.col);
        if (++work_ > lim_.max_work)
            error(s.line, s.col, "the template needs more than ", lim_.max_work,
                  " evaluation steps (Limits::max_work)");
        switch (s.kind) {
            case StmtKind::text:
                write(s.text, s.line, s.col);
                return Flow::normal;
            case StmtKind::output: {
                const Value v = eval(*s.expr, frame);
                if (v.kind != Kind::string) {
                    write(to_str(v), s.line, s.col);
                } else {
                    write(v.str(), s.line, s.col);
                }
                return Flow::normal;
            }
            case StmtKind::if_:
                for (const auto& [cond, body] : s.branches)
                    if (cond == nullptr || truthy(eval(*cond, frame))) return exec_body(body, frame);
                return Flow::normal;
            case StmtKind::for_:
                exec_for(s, frame);
                return Flow::normal;
            case StmtKind::set:
                assign(s, s.target, eval(*s.expr, frame), frame);
                return Flow::normal;
            case StmtKind::set_block: {
                Value text = Value::string(capture(s.body, std::make_shared<Frame>(Frame{{}, frame})));
                if (s.expr) text = eval_with_placeholder(*s.expr, frame, std::move(text));
                assign(s, s.target, std::move(text), frame);
                return Flow::normal;
            }
            case StmtKind::macro: {
                auto c = std::make_shared<Callable>();
                c->macro = &s;
                c->closure = frame;
                c->name = s.text;
                Value v;
                v.kind = Kind::callable;
                v.obj = std::move(c);
                frame->set(s.macro_symbol, std::move(v));
                return Flow::normal;
            }
            case StmtKind::call_block:
                exec_call_block(s, frame);
                return Flow::normal;
            case StmtKind::filter_block: {
                Value text = Value::string(capture(s.body, frame));
                write(to_str(eval_with_placeholder(*s.expr, frame, std::move(text))), s.line, s.col);
                return Flow::normal;
            }
            case StmtKind::break_:
                return Flow::break_;
            case StmtKind::continue_:
                return Flow::continue_;
            case StmtKind::generation: {
                const bool top = out_ == &result_.text;
                const size_t before = out_->size();
                const Flow f = exec_body(s.body, frame);
                const size_t len = out_->size() - before;
                const size_t start = top ? before : result_.text.size();
                result_.generation_spans.emplace_back(start, start + len);
                return f;
            }
        }
        return Flow::normal;
    }

    std::string capture(const std::vector<StmtPtr>& body, const FramePtr& frame) {
        std::string buf;
        std::string* saved = out_;
        out_ = &buf;
        try {
            exec_body(body, frame);
        } catch (...) {
            out_ = saved;
            throw;
        }
        out_ = saved;
        return buf;
    }

    Value eval_with_placeholder(const Expr& chain, const FramePtr& frame, Value v) {
        Value saved = std::move(placeholder_);
        placeholder_ = std::move(v);
        Value r = eval(chain, frame);
        placeholder_ = std::move(saved);
        return r;
    }

    void bind(const Stmt& s, const Target& t, const Value& v, Frame& frame) {
        if (!t.tuple) {
            frame.set(t.symbols[0], v);
            return;
        }
        const std::vector<Value> items = iterate(v, s.line, s.col);
        if (items.size() != t.symbols.size())
            error(s.line, s.col, items.size() < t.symbols.size() ? "not enough" : "too many",
                  " values to unpack (expected ", t.symbols.size(), ", got ", items.size(), ")");
        for (size_t k = 0; k < items.size(); ++k) frame.set(t.symbols[k], items[k]);
    }

    void assign(const Stmt& s, const Target& t, Value v, const FramePtr& frame) {
        if (t.attr.empty()) {
            bind(s, t, v, *frame);
            return;
        }
        const Value* target = frame->find(t.symbols[0]);
        if (target == nullptr) target = &globals_[static_cast<size_t>(t.symbols[0])];
        if (target->kind != Kind::ns)
            error(s.line, s.col, "cannot assign attribute '", t.attr, "' on '",
                  prog_.symbols[static_cast<size_t>(t.symbols[0])], "': it is a ", type_name(*target),
                  ", not a namespace()");
        const_cast<DictObj&>(target->dict()).set(Value::string(t.attr), std::move(v));
    }

    // The items a for loop (or list()) visits: list elements, dict keys, a string's characters.
    std::vector<Value> iterate(const Value& v, uint32_t line, uint32_t col) {
        switch (v.kind) {
            case Kind::undefined:
                return {};
            case Kind::list:
                return v.items();
            case Kind::dict: {
                std::vector<Value> keys;
                keys.reserve(v.dict().entries.size());
                for (const auto& [k, e] : v.dict().entries) keys.push_back(k);
                return keys;
            }
            case Kind::string: {
                std::vector<Value> chars;
                const std::string& s = v.str();
                for (size_t i = 0; i < s.size();) {
                    const size_t n = mf::text::utf8_length(static_cast<unsigned char>(s[i]));
                    chars.push_back(Value::string(s.substr(i, n)));
                    i += n;
                }
                return chars;
            }
            default:
                error(line, col, "'", type_name(v), "' object is not iterable");
        }
    }

    void count_iteration(uint32_t line, uint32_t col) {
        if (++iterations_ > lim_.max_iterations)
            error(line, col, "the template's loops run more than ", lim_.max_iterations,
                  " iterations (Limits::max_iterations)");
    }

    void exec_for(const Stmt& s, const FramePtr& frame) {
        const Value seq = eval(*s.expr, frame);
        std::vector<Value> items = iterate(seq, s.expr->line, s.expr->col);
        auto loop_frame = std::make_shared<Frame>(Frame{{}, frame});
        if (s.cond) {
            std::vector<Value> kept;
            for (const Value& item : items) {
                count_iteration(s.line, s.col);
                bind(s, s.target, item, *loop_frame);
                if (truthy(eval(*s.cond, loop_frame))) kept.push_back(item);
            }
            items = std::move(kept);
        }
        if (items.empty()) {
            exec_body(s.else_body, frame);
            return;
        }
        auto shared = std::make_shared<const std::vector<Value>>(std::move(items));
        auto state = std::make_shared<LoopState>();
        for (size_t k = 0; k < shared->size(); ++k) {
            count_iteration(s.line, s.col);
            bind(s, s.target, (*shared)[k], *loop_frame);
            auto loop = std::make_shared<LoopObj>();
            loop->items = shared;
            loop->index0 = k;
            loop->state = state;
            Value lv;
            lv.kind = Kind::loop;
            lv.obj = std::move(loop);
            loop_frame->set(prog_.sym_loop, std::move(lv));
            if (exec_body(s.body, loop_frame) == Flow::break_) break;
        }
    }

    void exec_call_block(const Stmt& s, const FramePtr& frame) {
        const Expr& call = *s.expr;
        auto body = std::make_shared<Callable>();
        body->macro = &s;
        body->closure = frame;
        body->name = "caller";
        Value caller;
        caller.kind = Kind::callable;
        caller.obj = std::move(body);
        const Value callee = eval(*call.kids[0], frame);
        if (callee.kind != Kind::callable || static_cast<const Callable&>(*callee.obj).macro == nullptr)
            error(call, "{% call %} needs a macro, got a ", type_name(callee));
        Args args;
        Kwargs kwargs;
        eval_args(call, 1, frame, args, kwargs);
        write(to_str(call_macro(call, static_cast<const Callable&>(*callee.obj), args, kwargs, &caller)), s.line,
              s.col);
    }

    Value call_macro(const Expr& at, const Callable& m, const Args& args, const Kwargs& kwargs, const Value* caller) {
        if (++call_depth_ > lim_.max_call_depth) {
            --call_depth_;
            error(at, "macro calls nest deeper than ", lim_.max_call_depth,
                  " (Limits::max_call_depth): infinite recursion?");
        }
        struct Guard {
            int& d;
            ~Guard() { --d; }
        } guard{call_depth_};
        charge(at, kMacroCallWork);
        const Stmt& s = *m.macro;
        std::shared_ptr<Frame> closure = m.closure.lock();
        if (!closure) error(at, "macro '", m.name, "' is called after the block that defined it has ended");
        auto frame = std::make_shared<Frame>(Frame{{}, std::move(closure)});
        std::vector<bool> given(s.params.size(), false);
        std::vector<Value> extra;
        for (size_t k = 0; k < args.size(); ++k) {
            if (k < s.params.size()) {
                frame->set(s.params[k], args[k]);
                given[k] = true;
            } else {
                extra.push_back(args[k]);
            }
        }
        std::vector<std::pair<Value, Value>> extra_kw;
        for (const auto& [name, v] : kwargs) {
            size_t k = 0;
            while (k < s.param_names.size() && s.param_names[k] != name) ++k;
            if (k == s.param_names.size()) {
                extra_kw.emplace_back(Value::string(name), v);
                continue;
            }
            if (given[k]) error(at, "macro '", m.name, "' got multiple values for argument '", name, "'");
            frame->set(s.params[k], v);
            given[k] = true;
        }
        for (size_t k = 0; k < s.params.size(); ++k) {
            if (given[k]) continue;
            if (s.defaults[k])
                frame->set(s.params[k], eval(*s.defaults[k], frame));
            else
                frame->set(s.params[k], Value::undefined("parameter '" + s.param_names[k] + "' was not provided"));
        }
        frame->set(prog_.sym_varargs, Value::list(std::move(extra), true));
        frame->set(prog_.sym_kwargs, make_dict(std::move(extra_kw)));
        if (caller != nullptr) frame->set(prog_.sym_caller, *caller);
        return Value::string(capture(s.body, frame));
    }

    // --- expressions
    void eval_args(const Expr& e, size_t first, const FramePtr& frame, Args& args, Kwargs& kwargs) {
        const size_t num_kw = e.kw_names.size();
        const size_t num_pos = e.kids.size() - first - num_kw;
        args.reserve(num_pos);
        for (size_t k = 0; k < num_pos; ++k) args.push_back(eval(*e.kids[first + k], frame));
        for (size_t k = 0; k < num_kw; ++k)
            kwargs.emplace_back(e.kw_names[k], eval(*e.kids[first + num_pos + k], frame));
    }

    Value eval(const Expr& e, const FramePtr& frame) {
        Depth d(*this, e.line, e.col);
        charge(e, 1);
        switch (e.op) {
            case Op::constant:
                return e.code == 1 ? placeholder_ : e.constant;
            case Op::name: {
                const Value* v = frame->find(e.symbol);
                return v != nullptr ? *v : globals_[static_cast<size_t>(e.symbol)];
            }
            case Op::list:
            case Op::tuple: {
                std::vector<Value> items;
                items.reserve(e.kids.size());
                for (const ExprPtr& k : e.kids) items.push_back(eval(*k, frame));
                return Value::list(std::move(items), e.op == Op::tuple);
            }
            case Op::dict: {
                std::vector<std::pair<Value, Value>> entries;
                for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
                    Value key = eval(*e.kids[k], frame);
                    check_key(*e.kids[k], key);
                    entries.emplace_back(std::move(key), eval(*e.kids[k + 1], frame));
                }
                return make_dict(std::move(entries));
            }
            case Op::attr:
                return get_attr(e, eval(*e.kids[0], frame), e.name);
            case Op::item:
                return get_item(e, eval(*e.kids[0], frame), eval(*e.kids[1], frame));
            case Op::slice:
                return eval_slice(e, frame);
            case Op::call:
                return eval_call(e, frame);
            case Op::filter: {
                Value v = eval(*e.kids[0], frame);
                Args args;
                Kwargs kwargs;
                eval_args(e, 1, frame, args, kwargs);
                return apply_filter(e, static_cast<Filter>(e.code), v, args, kwargs);
            }
            case Op::test: {
                Value v = eval(*e.kids[0], frame);
                Args args;
                Kwargs kwargs;
                eval_args(e, 1, frame, args, kwargs);
                return Value::boolean(apply_test(e, static_cast<Test>(e.code), v, args) != e.negate);
            }
            case Op::neg:
            case Op::pos: {
                const Value v = eval(*e.kids[0], frame);
                require_defined(e, v);
                if (!is_numeric(v))
                    error(e, "bad operand type for unary ", e.op == Op::neg ? "-" : "+", ": '", type_name(v), "'");
                if (e.op == Op::pos) return is_intlike(v) ? Value::integer(as_int(v)) : v;
                if (v.kind == Kind::floating) return Value::floating(-v.f);
                if (as_int(v) == INT64_MIN) error(e, "integer overflow");
                return Value::integer(-as_int(v));
            }
            case Op::not_:
                return Value::boolean(!truthy(eval(*e.kids[0], frame)));
            case Op::and_: {
                Value a = eval(*e.kids[0], frame);
                return truthy(a) ? eval(*e.kids[1], frame) : a;
            }
            case Op::or_: {
                Value a = eval(*e.kids[0], frame);
                return truthy(a) ? a : eval(*e.kids[1], frame);
            }
            case Op::binary:
                return binary(e, static_cast<BinOp>(e.code), eval(*e.kids[0], frame), eval(*e.kids[1], frame));
            case Op::compare: {
                Value left = eval(*e.kids[0], frame);
                for (size_t k = 0; k < e.cmp.size(); ++k) {
                    Value right = eval(*e.kids[k + 1], frame);
                    if (!compare(*e.kids[k + 1], e.cmp[k], left, right)) return Value::boolean(false);
                    left = std::move(right);
                }
                return Value::boolean(true);
            }
            case Op::cond:
                if (truthy(eval(*e.kids[0], frame))) return eval(*e.kids[1], frame);
                return e.kids[2] ? eval(*e.kids[2], frame) : Value::undefined("the inline if had no else branch");
        }
        return Value();
    }

    void check_key(const Expr& e, const Value& key) const {
        if (key.kind == Kind::list && !key.tuple) error(e, "unhashable type: 'list'");
        if (key.kind == Kind::dict || key.kind == Kind::ns) error(e, "unhashable type: 'dict'");
        require_defined(e, key);
    }

    Value loop_attr(const Expr& e, const LoopObj& l, const std::string& name) {
        const int64_t n = static_cast<int64_t>(l.items->size()), i = static_cast<int64_t>(l.index0);
        if (name == "index") return Value::integer(i + 1);
        if (name == "index0") return Value::integer(i);
        if (name == "revindex") return Value::integer(n - i);
        if (name == "revindex0") return Value::integer(n - i - 1);
        if (name == "first") return Value::boolean(i == 0);
        if (name == "last") return Value::boolean(i == n - 1);
        if (name == "length") return Value::integer(n);
        if (name == "depth") return Value::integer(1);
        if (name == "depth0") return Value::integer(0);
        if (name == "previtem")
            return i > 0 ? (*l.items)[static_cast<size_t>(i - 1)] : Value::undefined("there is no previous item");
        if (name == "nextitem")
            return i + 1 < n ? (*l.items)[static_cast<size_t>(i + 1)] : Value::undefined("there is no next item");
        (void)e;
        return Value::undefined("'LoopContext object' has no attribute '" + name + "'");
    }

    Value get_attr(const Expr& e, const Value& obj, const std::string& name) {
        switch (obj.kind) {
            case Kind::undefined:
                undefined_error(e, obj);
            case Kind::dict:
            case Kind::ns: {
                const Value* v = obj.dict().find(std::string_view(name));
                if (v != nullptr) return *v;
                break;
            }
            case Kind::loop:
                return loop_attr(e, static_cast<const LoopObj&>(*obj.obj), name);
            case Kind::list:
                if (static_cast<const ListObj&>(*obj.obj).group && (name == "grouper" || name == "list"))
                    return obj.items()[name == "grouper" ? 0 : 1];
                break;
            default:
                break;
        }
        return Value::undefined("'" + std::string(type_name(obj)) + " object' has no attribute '" + name + "'");
    }

    Value get_item(const Expr& e, const Value& obj, const Value& key) {
        switch (obj.kind) {
            case Kind::undefined:
                undefined_error(e, obj);
            case Kind::dict:
            case Kind::ns: {
                const Value* v = obj.dict().find(key);
                if (v != nullptr) return *v;
                break;
            }
            case Kind::list:
            case Kind::string:
                // Jinja's getitem falls back to attributes: g['grouper'] of a groupby pair.
                if (key.kind == Kind::string && obj.kind == Kind::list && static_cast<const ListObj&>(*obj.obj).group)
                    return get_attr(e, obj, key.str());
                if (is_intlike(key)) {
                    const int64_t n =
                        static_cast<int64_t>(obj.kind == Kind::list ? obj.items().size() : cp_count(obj.str()));
                    int64_t i = as_int(key);
                    if (i < 0) i += n;
                    if (i < 0 || i >= n) break;
                    if (obj.kind == Kind::list) return obj.items()[static_cast<size_t>(i)];
                    const std::string& s = obj.str();
                    if (is_ascii(s)) return Value::string(s.substr(static_cast<size_t>(i), 1));
                    const std::vector<size_t> off = cp_offsets(s);
                    return Value::string(s.substr(off[static_cast<size_t>(i)],
                                                  off[static_cast<size_t>(i) + 1] - off[static_cast<size_t>(i)]));
                }
                break;
            case Kind::loop:
                if (key.kind == Kind::string) return loop_attr(e, static_cast<const LoopObj&>(*obj.obj), key.str());
                break;
            default:
                break;
        }
        return Value::undefined("'" + std::string(type_name(obj)) + " object' has no attribute " + to_repr(key));
    }

    // Python's slice.indices(), then the selected positions.
    static std::vector<int64_t> slice_positions(int64_t n, const Value* a, const Value* b, const Value* c) {
        const int64_t step = c != nullptr ? as_int(*c) : 1;
        int64_t start, stop;
        auto clamp = [&](const Value* v, int64_t def, bool is_start) {
            if (v == nullptr) return def;
            int64_t x = as_int(*v);
            if (x < 0) x += n;
            if (step > 0) return std::clamp<int64_t>(x, 0, n);
            (void)is_start;
            return std::clamp<int64_t>(x, -1, n - 1);
        };
        start = clamp(a, step > 0 ? 0 : n - 1, true);
        stop = clamp(b, step > 0 ? n : -1, false);
        std::vector<int64_t> pos;
        if (step > 0)
            for (int64_t i = start; i < stop; i += step) pos.push_back(i);
        else
            for (int64_t i = start; i > stop; i += step) pos.push_back(i);
        return pos;
    }

    Value eval_slice(const Expr& e, const FramePtr& frame) {
        const Value obj = eval(*e.kids[0], frame);
        Value parts[3];
        const Value* ptr[3] = {nullptr, nullptr, nullptr};
        for (int k = 0; k < 3; ++k) {
            if (!e.kids[static_cast<size_t>(k) + 1]) continue;
            parts[k] = eval(*e.kids[static_cast<size_t>(k) + 1], frame);
            if (parts[k].kind == Kind::none) continue;
            if (!is_intlike(parts[k])) error(e, "slice indices must be integers or None, got a ", type_name(parts[k]));
            ptr[k] = &parts[k];
        }
        if (ptr[2] != nullptr && as_int(*ptr[2]) == 0) error(e, "slice step cannot be zero");
        if (obj.kind == Kind::undefined) undefined_error(e, obj);
        if (obj.kind == Kind::list) {
            const auto& items = obj.items();
            std::vector<Value> out;
            for (int64_t i : slice_positions(static_cast<int64_t>(items.size()), ptr[0], ptr[1], ptr[2]))
                out.push_back(items[static_cast<size_t>(i)]);
            charge(e, out.size());
            return Value::list(std::move(out), obj.tuple);
        }
        if (obj.kind == Kind::string) {
            const std::string& s = obj.str();
            const std::vector<size_t> off = cp_offsets(s);
            std::string out;
            for (int64_t i : slice_positions(static_cast<int64_t>(off.size() - 1), ptr[0], ptr[1], ptr[2]))
                out.append(s, off[static_cast<size_t>(i)],
                           off[static_cast<size_t>(i) + 1] - off[static_cast<size_t>(i)]);
            charge(e, s.size());
            return Value::string(std::move(out));
        }
        return Value::undefined("'" + std::string(type_name(obj)) + " object' cannot be sliced");
    }

    Value binary(const Expr& e, BinOp op, const Value& a, const Value& b) {
        if (op == BinOp::concat) {
            std::string s = to_str(a) + to_str(b);
            check_size(e, s.size(), "a string");
            charge(e, s.size());
            return Value::string(std::move(s));
        }
        if (op == BinOp::mod && a.kind == Kind::string)
            return Value::string(formatted(e, [&] { return percent_format(a.str(), b, lim_.max_string); }));
        require_defined(e, a);
        require_defined(e, b);
        static const char* kSym[] = {"+", "-", "*", "/", "//", "%", "**", "~"};
        auto bad = [&]() -> Value {
            error(e, "unsupported operand type(s) for ", kSym[static_cast<int>(op)], ": '", type_name(a), "' and '",
                  type_name(b), "'");
        };
        if (op == BinOp::add && a.kind == Kind::string && b.kind == Kind::string) {
            check_size(e, a.str().size() + b.str().size(), "a string");
            charge(e, a.str().size() + b.str().size());
            return Value::string(a.str() + b.str());
        }
        if (op == BinOp::add && a.kind == Kind::list && b.kind == Kind::list && a.tuple == b.tuple) {
            std::vector<Value> items = a.items();
            check_size(e, items.size() + b.items().size(), "a list");
            charge(e, items.size() + b.items().size());
            items.insert(items.end(), b.items().begin(), b.items().end());
            return Value::list(std::move(items), a.tuple);
        }
        if (op == BinOp::mul && (a.kind == Kind::string || a.kind == Kind::list) && is_intlike(b))
            return repeat(e, a, as_int(b));
        if (op == BinOp::mul && (b.kind == Kind::string || b.kind == Kind::list) && is_intlike(a))
            return repeat(e, b, as_int(a));
        if (!is_numeric(a) || !is_numeric(b)) return bad();
        if (is_intlike(a) && is_intlike(b) && op != BinOp::div) return int_op(e, op, as_int(a), as_int(b));
        const double x = as_double(a), y = as_double(b);
        switch (op) {
            case BinOp::add:
                return Value::floating(x + y);
            case BinOp::sub:
                return Value::floating(x - y);
            case BinOp::mul:
                return Value::floating(x * y);
            case BinOp::div:
                if (y == 0) error(e, "division by zero");
                return Value::floating(x / y);
            case BinOp::floordiv:
                if (y == 0) error(e, "float floor division by zero");
                return Value::floating(std::floor(x / y));
            case BinOp::mod: {
                if (y == 0) error(e, "float modulo by zero");
                double r = std::fmod(x, y);
                if (r != 0 && ((r < 0) != (y < 0))) r += y;
                return Value::floating(r);
            }
            case BinOp::pow:
                return Value::floating(std::pow(x, y));
            default:
                return bad();
        }
    }

    // Runs a formatter of jinja_format.cpp, reporting its failure at `e`.
    template <typename F>
    std::string formatted(const Expr& e, F&& run) {
        std::string out;
        try {
            out = run();
        } catch (const FormatError& x) {
            error(e, x.message);
        }
        charge(e, out.size());
        return out;
    }

    Value int_op(const Expr& e, BinOp op, int64_t x, int64_t y) {
        int64_t r = 0;
        switch (op) {
            case BinOp::add:
                if (__builtin_add_overflow(x, y, &r)) error(e, "integer overflow");
                return Value::integer(r);
            case BinOp::sub:
                if (__builtin_sub_overflow(x, y, &r)) error(e, "integer overflow");
                return Value::integer(r);
            case BinOp::mul:
                if (__builtin_mul_overflow(x, y, &r)) error(e, "integer overflow");
                return Value::integer(r);
            case BinOp::floordiv:
            case BinOp::mod: {
                if (y == 0) error(e, "integer division or modulo by zero");
                if (x == INT64_MIN && y == -1) error(e, "integer overflow");
                int64_t q = x / y, m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) {
                    --q;
                    m += y;
                }
                return Value::integer(op == BinOp::floordiv ? q : m);
            }
            case BinOp::pow: {
                if (y < 0) return Value::floating(std::pow(static_cast<double>(x), static_cast<double>(y)));
                int64_t acc = 1;
                for (int64_t k = 0; k < y; ++k) {
                    if (__builtin_mul_overflow(acc, x, &acc)) error(e, "integer overflow");
                    if (acc == 0 || acc == 1) break;
                    if (acc == -1) {
                        acc = ((y - k - 1) % 2 == 0) ? -1 : 1;
                        break;
                    }
                }
                return Value::integer(acc);
            }
            default:
                return Value();
        }
    }

    Value repeat(const Expr& e, const Value& v, int64_t n) {
        if (n <= 0) return v.kind == Kind::string ? Value::string("") : Value::list({}, v.tuple);
        const size_t unit = v.kind == Kind::string ? v.str().size() : v.items().size();
        if (unit != 0 && static_cast<uint64_t>(n) > lim_.max_string / unit)
            error(e, "repeating a ", type_name(v), " ", n, " times exceeds ", lim_.max_string,
                  " bytes or elements (Limits::max_string)");
        charge(e, unit * static_cast<size_t>(n));
        if (v.kind == Kind::string) {
            std::string s;
            for (int64_t k = 0; k < n; ++k) s += v.str();
            return Value::string(std::move(s));
        }
        std::vector<Value> items;
        for (int64_t k = 0; k < n; ++k) items.insert(items.end(), v.items().begin(), v.items().end());
        return Value::list(std::move(items), v.tuple);
    }

    // Python's <: numbers, strings (code point order = UTF-8 byte order), sequences lexicographically.
    int order(const Expr& e, const Value& a, const Value& b, const char* op) {
        if (is_numeric(a) && is_numeric(b)) {
            if (is_intlike(a) && is_intlike(b)) return as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b) ? 1 : 0;
            const double x = as_double(a), y = as_double(b);
            return x < y ? -1 : x > y ? 1 : 0;
        }
        if (a.kind == Kind::string && b.kind == Kind::string) {
            const int c = a.str().compare(b.str());
            return c < 0 ? -1 : c > 0 ? 1 : 0;
        }
        if (a.kind == Kind::list && b.kind == Kind::list && a.tuple == b.tuple) {
            const auto &x = a.items(), &y = b.items();
            for (size_t k = 0; k < x.size() && k < y.size(); ++k)
                if (!equals(x[k], y[k])) return order(e, x[k], y[k], op);
            return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
        }
        require_defined(e, a);
        require_defined(e, b);
        error(e, "'", op, "' not supported between instances of '", type_name(a), "' and '", type_name(b), "'");
    }

    bool contains(const Expr& e, const Value& item, const Value& seq) {
        switch (seq.kind) {
            case Kind::undefined:
                return false;
            case Kind::string:
                if (item.kind != Kind::string)
                    error(e, "'in <string>' requires string as left operand, not ", type_name(item));
                charge(e, seq.str().size());
                return seq.str().find(item.str()) != std::string::npos;
            case Kind::list:
                for (const Value& v : seq.items())
                    if (equals(v, item)) return true;
                return false;
            case Kind::dict:
            case Kind::ns:
                return seq.dict().find(item) != nullptr;
            default:
                error(e, "argument of type '", type_name(seq), "' is not iterable");
        }
    }

    bool compare(const Expr& e, CmpOp op, const Value& a, const Value& b) {
        switch (op) {
            case CmpOp::eq:
                return equals(a, b);
            case CmpOp::ne:
                return !equals(a, b);
            case CmpOp::lt:
                return order(e, a, b, "<") < 0;
            case CmpOp::le:
                return order(e, a, b, "<=") <= 0;
            case CmpOp::gt:
                return order(e, a, b, ">") > 0;
            case CmpOp::ge:
                return order(e, a, b, ">=") >= 0;
            case CmpOp::in:
                return contains(e, a, b);
            case CmpOp::not_in:
                return !contains(e, a, b);
        }
        return false;
    }

    // --- calls
    Value eval_call(const Expr& e, const FramePtr& frame) {
        const Expr& callee = *e.kids[0];
        if (callee.op == Op::attr) {
            const Value obj = eval(*callee.kids[0], frame);
            require_defined(callee, obj);
            if (obj.kind == Kind::string || obj.kind == Kind::list || obj.kind == Kind::dict ||
                obj.kind == Kind::loop) {
                const bool shadowed = obj.kind == Kind::dict &&
                                      obj.dict().find(std::string_view(callee.name)) != nullptr &&
                                      !is_dict_method(callee.name);
                if (!shadowed) {
                    Args args;
                    Kwargs kwargs;
                    eval_args(e, 1, frame, args, kwargs);
                    return call_method(e, obj, callee.name, args, kwargs);
                }
            }
            return call_value(e, get_attr(callee, obj, callee.name), frame);
        }
        return call_value(e, eval(callee, frame), frame);
    }

    static bool is_dict_method(const std::string& n) {
        return n == "items" || n == "keys" || n == "values" || n == "get" || n == "copy" || n == "pop" ||
               n == "popitem" || n == "setdefault" || n == "update" || n == "clear";
    }

    Value call_value(const Expr& e, const Value& fn, const FramePtr& frame) {
        if (fn.kind == Kind::undefined) undefined_error(e, fn);
        if (fn.kind != Kind::callable) error(e, "'", type_name(fn), "' object is not callable");
        Args args;
        Kwargs kwargs;
        eval_args(e, 1, frame, args, kwargs);
        const Callable& c = static_cast<const Callable&>(*fn.obj);
        if (c.macro != nullptr) return call_macro(e, c, args, kwargs, nullptr);
        return call_builtin(e, c, args, kwargs);
    }

    static const Value* arg(const Args& args, const Kwargs& kwargs, size_t index, std::string_view name) {
        if (index < args.size()) return &args[index];
        for (const auto& [k, v] : kwargs)
            if (k == name) return &v;
        return nullptr;
    }
    void check_arity(const Expr& e, const char* what, const Args& args, const Kwargs& kwargs, size_t max_args,
                     std::initializer_list<std::string_view> names) const {
        if (args.size() > max_args) error(e, what, " takes at most ", max_args, " arguments (", args.size(), " given)");
        for (const auto& [k, v] : kwargs)
            if (std::find(names.begin(), names.end(), k) == names.end())
                error(e, what, " got an unexpected keyword argument '", k, "'");
    }
    int64_t int_arg(const Expr& e, const Value* v, int64_t def, const char* what) const {
        if (v == nullptr || v->kind == Kind::none) return def;
        if (!is_intlike(*v)) error(e, what, " must be an integer, got a ", type_name(*v));
        return as_int(*v);
    }
    const std::string* str_arg(const Expr& e, const Value* v, const char* what) const {
        if (v == nullptr || v->kind == Kind::none) return nullptr;
        if (v->kind != Kind::string) error(e, what, " must be a string, got a ", type_name(*v));
        return &v->str();
    }

    Value call_builtin(const Expr& e, const Callable& c, const Args& args, const Kwargs& kwargs) {
        switch (c.builtin) {
            case Builtin::range: {
                if (!kwargs.empty() || args.empty() || args.size() > 3)
                    error(e, "range() takes 1 to 3 integer arguments");
                for (const Value& a : args)
                    if (!is_intlike(a)) error(e, "range() takes integers, got a ", type_name(a));
                const int64_t start = args.size() == 1 ? 0 : as_int(args[0]);
                const int64_t stop = args.size() == 1 ? as_int(args[0]) : as_int(args[1]);
                const int64_t step = args.size() == 3 ? as_int(args[2]) : 1;
                if (step == 0) error(e, "range() arg 3 must not be zero");
                const long double len = step > 0 ? std::ceil((static_cast<long double>(stop) - start) / step)
                                                 : std::ceil((static_cast<long double>(start) - stop) / -step);
                if (len > static_cast<long double>(lim_.max_iterations))
                    error(e, "range() of ", static_cast<double>(len), " numbers exceeds the loop limit of ",
                          lim_.max_iterations, " iterations (Limits::max_iterations)");
                std::vector<Value> out;
                for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(Value::integer(i));
                charge(e, out.size());
                return Value::list(std::move(out));
            }
            case Builtin::dict:
            case Builtin::namespace_: {
                std::vector<std::pair<Value, Value>> entries;
                for (const Value& a : args) {
                    if (a.kind != Kind::dict) error(e, c.name, "() takes keyword arguments or a dict");
                    for (const auto& kv : a.dict().entries) entries.push_back(kv);
                }
                for (const auto& [k, v] : kwargs) entries.emplace_back(Value::string(k), v);
                if (c.builtin == Builtin::dict) return make_dict(std::move(entries));
                Value ns = make_namespace(std::move(entries));
                namespaces_.push_back(ns.obj);
                return ns;
            }
            case Builtin::raise_exception: {
                const std::string msg = args.empty() ? std::string() : to_str(args[0]);
                error(e, "the template raised an exception: ", msg);
            }
            case Builtin::strftime_now: {
                if (args.size() != 1 || args[0].kind != Kind::string)
                    error(e, "strftime_now() takes one format string");
                const std::time_t t = now_ ? *now_ : std::time(nullptr);
                std::tm tm{};
                localtime_r(&t, &tm);
                char buf[512];
                const std::string& fmt = args[0].str();
                if (fmt.size() > 200) error(e, "strftime_now(): the format is longer than 200 bytes");
                const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
                if (n == 0 && !fmt.empty()) error(e, "strftime_now(): the format renders nothing or too much");
                return Value::string(std::string(buf, n));
            }
            default:
                error(e, "'", c.name, "' cannot be called here");
        }
    }

    // --- Python str helpers
    static bool in_chars(char32_t c, const std::string* chars) {
        if (chars == nullptr) return is_py_space(c);
        for (size_t i = 0; i < chars->size();)
            if (mf::text::next_code_point(*chars, i) == c) return true;
        return false;
    }
    static std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
        const std::vector<size_t> off = cp_offsets(s);
        size_t a = 0, b = off.size() - 1;
        auto cp_at = [&](size_t k) {
            size_t i = off[k];
            return mf::text::next_code_point(s, i);
        };
        if (left)
            while (a < b && in_chars(cp_at(a), chars)) ++a;
        if (right)
            while (b > a && in_chars(cp_at(b - 1), chars)) --b;
        return s.substr(off[a], off[b] - off[a]);
    }
    Value py_split(const Expr& e, const std::string& s, const std::string* sep, int64_t maxsplit) {
        std::vector<Value> parts;
        if (sep == nullptr) {
            size_t i = 0;
            const size_t n = s.size();
            auto space_len = [&](size_t at) -> size_t {
                size_t j = at;
                const char32_t c = mf::text::next_code_point(s, j);
                return is_py_space(c) ? j - at : 0;
            };
            while (i < n) {
                while (i < n && space_len(i) > 0) i += space_len(i);
                if (i >= n) break;
                if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
                    parts.push_back(Value::string(s.substr(i)));  // keeps its trailing whitespace
                    break;
                }
                size_t j = i;
                while (j < n && space_len(j) == 0) j += mf::text::utf8_length(static_cast<unsigned char>(s[j]));
                parts.push_back(Value::string(s.substr(i, j - i)));
                i = j;
            }
        } else {
            if (sep->empty()) error(e, "split(): empty separator");
            size_t i = 0;
            for (;;) {
                const size_t at = s.find(*sep, i);
                if (at == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
                    parts.push_back(Value::string(s.substr(i)));
                    break;
                }
                parts.push_back(Value::string(s.substr(i, at - i)));
                i = at + sep->size();
            }
        }
        charge(e, s.size() + parts.size());
        return Value::list(std::move(parts));
    }
    // str.rsplit: as split, but a maxsplit counts splits from the right.
    Value py_rsplit(const Expr& e, const std::string& s, const std::string* sep, int64_t maxsplit) {
        if (maxsplit < 0) return py_split(e, s, sep, -1);
        std::vector<Value> parts;
        if (sep == nullptr) {
            const std::vector<size_t> off = cp_offsets(s);
            auto space_at = [&](size_t k) {
                size_t i = off[k];
                return is_py_space(mf::text::next_code_point(s, i));
            };
            size_t k = off.size() - 1;  // code points [0, k) remain
            while (k > 0) {
                while (k > 0 && space_at(k - 1)) --k;
                if (k == 0) break;
                if (static_cast<int64_t>(parts.size()) == maxsplit) {
                    parts.push_back(Value::string(s.substr(0, off[k])));  // keeps its leading whitespace
                    break;
                }
                size_t j = k;
                while (j > 0 && !space_at(j - 1)) --j;
                parts.push_back(Value::string(s.substr(off[j], off[k] - off[j])));
                k = j;
            }
        } else {
            if (sep->empty()) error(e, "rsplit(): empty separator");
            size_t end = s.size();
            for (;;) {
                const size_t at = end < sep->size() ? std::string::npos : s.rfind(*sep, end - sep->size());
                if (at == std::string::npos || static_cast<int64_t>(parts.size()) == maxsplit) {
                    parts.push_back(Value::string(s.substr(0, end)));
                    break;
                }
                parts.push_back(Value::string(s.substr(at + sep->size(), end - at - sep->size())));
                end = at;
            }
        }
        std::reverse(parts.begin(), parts.end());
        charge(e, s.size() + parts.size());
        return Value::list(std::move(parts));
    }

    // str.splitlines(): Python's line boundaries (\r\n counts as one).
    static std::vector<std::string> split_lines(const std::string& t, bool keepends) {
        std::vector<std::string> lines;
        size_t start = 0;
        for (size_t i = 0; i < t.size();) {
            const size_t at = i;
            const char32_t c = mf::text::next_code_point(t, i);
            const bool brk = c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
                             c == 0x85 || c == 0x2028 || c == 0x2029;
            if (!brk) continue;
            if (c == '\r' && i < t.size() && t[i] == '\n') ++i;
            lines.push_back(t.substr(start, (keepends ? i : at) - start));
            start = i;
        }
        if (start < t.size()) lines.push_back(t.substr(start));
        return lines;
    }

    std::string py_replace(const Expr& e, const std::string& s, const std::string& old, const std::string& with,
                           int64_t count) {
        std::string out;
        int64_t done = 0;
        if (old.empty()) {
            const std::vector<size_t> off = cp_offsets(s);
            for (size_t k = 0; k + 1 <= off.size(); ++k) {
                if (count < 0 || done < count) {
                    out += with;
                    ++done;
                }
                if (k + 1 < off.size()) out.append(s, off[k], off[k + 1] - off[k]);
                check_size(e, out.size(), "a string");
            }
            return out;
        }
        size_t i = 0;
        for (;;) {
            const size_t at = (count >= 0 && done >= count) ? std::string::npos : s.find(old, i);
            if (at == std::string::npos) {
                out.append(s, i, std::string::npos);
                break;
            }
            out.append(s, i, at - i);
            out += with;
            check_size(e, out.size(), "a string");
            i = at + old.size();
            ++done;
        }
        charge(e, out.size());
        return out;
    }
    // Case mapping is ASCII only: a string with a cased non-ASCII letter is refused rather than
    // rendered differently from Python.
    void require_ascii_case(const Expr& e, const std::string& s, const char* what) const {
        if (is_ascii(s)) return;
        for (size_t i = 0; i < s.size();) {
            const char32_t c = mf::text::next_code_point(s, i);
            if (c < 0x80) continue;
            using mf::text::Category;
            const Category cat = mf::text::category(c);
            if (cat == Category::Lu || cat == Category::Ll || cat == Category::Lt)
                error(e, what, ": case mapping of non-ASCII letters is not supported (", json::quote(s.substr(0, 40)),
                      ")");
        }
    }
    // Jinja's title filter on text whose letters are ASCII: a word (a run between -, (, {, [, < and
    // Unicode whitespace) starts upper case and goes on lower case.
    static std::string jinja_title(const std::string& s) {
        std::string out;
        bool word_start = true;
        for (size_t i = 0; i < s.size();) {
            const char32_t c = mf::text::next_code_point(s, i);
            if (c < 0x80) {
                const int x = static_cast<int>(c);
                out += static_cast<char>(word_start ? std::toupper(x) : std::tolower(x));
            } else {
                mf::text::append_utf8(out, c);
            }
            word_start = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c);
        }
        return out;
    }

    std::string map_case(const Expr& e, const std::string& s, int mode, const char* what) {
        // mode 0 lower, 1 upper, 2 str.title, 3 capitalize, 4 Jinja's title filter
        require_ascii_case(e, s, what);
        if (mode == 4) return jinja_title(s);
        std::string out = s;
        bool prev_cased = false;
        for (size_t k = 0; k < out.size(); ++k) {
            char& c = out[k];
            const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
            switch (mode) {
                case 0:
                    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
                    break;
                case 1:
                    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
                    break;
                case 2:
                    c = static_cast<char>(prev_cased ? std::tolower(static_cast<unsigned char>(c))
                                                     : std::toupper(static_cast<unsigned char>(c)));
                    prev_cased = alpha;
                    break;
                case 3:
                    c = static_cast<char>(k == 0 ? std::toupper(static_cast<unsigned char>(c))
                                                 : std::tolower(static_cast<unsigned char>(c)));
                    break;
            }
        }
        return out;
    }

    // str.find/rfind/index/rindex/count(sub[, start[, end]]): start and end are code point
    // positions taken as a slice's; results count code points.
    Value find_in(const Expr& e, const std::string& name, const std::string& s, const Args& args) {
        const std::string& sub = args[0].str();
        const std::vector<size_t> off = cp_offsets(s);
        const int64_t n = static_cast<int64_t>(off.size() - 1);
        auto position = [&](size_t k, int64_t def) {
            int64_t x = int_arg(e, k < args.size() ? &args[k] : nullptr, def, "the start and end");
            if (x < 0) x = std::max<int64_t>(x + n, 0);
            return std::min(x, n);
        };
        const int64_t raw_start = int_arg(e, args.size() > 1 ? &args[1] : nullptr, 0, "the start");
        const int64_t a = position(1, 0), b = position(2, n);
        const bool beyond = raw_start > n;  // Python finds nothing, not even "", past the end
        auto to_cp = [&](size_t byte) {
            return static_cast<int64_t>(std::lower_bound(off.begin(), off.end(), byte) - off.begin());
        };
        if (name == "count") {
            if (beyond || a > b) return Value::integer(0);
            if (sub.empty()) return Value::integer(b - a + 1);
            const std::string_view region = std::string_view(s).substr(
                off[static_cast<size_t>(a)], off[static_cast<size_t>(b)] - off[static_cast<size_t>(a)]);
            int64_t count = 0;
            for (size_t at = region.find(sub); at != std::string::npos; at = region.find(sub, at + sub.size())) ++count;
            return Value::integer(count);
        }
        size_t at = std::string::npos;
        if (!beyond && a <= b) {
            const size_t begin = off[static_cast<size_t>(a)], end = off[static_cast<size_t>(b)];
            const std::string_view region = std::string_view(s).substr(begin, end - begin);
            const size_t r = name[0] == 'r' ? region.rfind(sub) : region.find(sub);
            if (r != std::string::npos) at = begin + r;
        }
        if (at == std::string::npos) {
            if (name == "index" || name == "rindex") error(e, "substring not found");
            return Value::integer(-1);
        }
        return Value::integer(to_cp(at));
    }

    // str.center/ljust/rjust/zfill and the center filter: align '^', '<', '>' or '=' (zfill: zeros
    // after the sign).
    std::string justify(const Expr& e, const std::string& s, int64_t width, char align, const std::string& fill) {
        const int64_t len = static_cast<int64_t>(cp_count(s));
        if (width <= len) return s;
        check_size(e, static_cast<size_t>(width) * fill.size(), "a string");
        const size_t marg = static_cast<size_t>(width - len);
        auto fills = [&](size_t k) {
            std::string out;
            for (size_t j = 0; j < k; ++j) out += fill;
            return out;
        };
        charge(e, marg * fill.size() + s.size());
        switch (align) {
            case '^': {
                // CPython's split: the odd space goes left when the width is odd.
                const size_t left = marg / 2 + (marg & static_cast<size_t>(width) & 1);
                return fills(left) + s + fills(marg - left);
            }
            case '<':
                return s + fills(marg);
            case '>':
                return fills(marg) + s;
            default:
                if (!s.empty() && (s[0] == '+' || s[0] == '-')) return s.substr(0, 1) + fills(marg) + s.substr(1);
                return fills(marg) + s;
        }
    }

    Value call_method(const Expr& e, const Value& obj, const std::string& name, const Args& args,
                      const Kwargs& kwargs) {
        const std::string what = std::string(type_name(obj)) + "." + name + "()";
        if (obj.kind == Kind::string) {
            const std::string& s = obj.str();
            charge(e, s.size());
            if (name == "strip" || name == "lstrip" || name == "rstrip") {
                check_arity(e, what.c_str(), args, kwargs, 1, {});
                const std::string* chars = str_arg(e, arg(args, kwargs, 0, ""), "the characters to strip");
                return Value::string(py_strip(s, chars, name != "rstrip", name != "lstrip"));
            }
            if (name == "split") {
                check_arity(e, what.c_str(), args, kwargs, 2, {"sep", "maxsplit"});
                return py_split(e, s, str_arg(e, arg(args, kwargs, 0, "sep"), "the separator"),
                                int_arg(e, arg(args, kwargs, 1, "maxsplit"), -1, "maxsplit"));
            }
            if (name == "replace") {
                check_arity(e, what.c_str(), args, kwargs, 3, {"count"});
                if (args.size() < 2 || args[0].kind != Kind::string || args[1].kind != Kind::string)
                    error(e, what, " takes two strings");
                return Value::string(py_replace(e, s, args[0].str(), args[1].str(),
                                                int_arg(e, arg(args, kwargs, 2, "count"), -1, "count")));
            }
            if (name == "startswith" || name == "endswith") {
                check_arity(e, what.c_str(), args, kwargs, 1, {});
                if (args.empty()) error(e, what, " takes a string or a tuple of strings");
                std::vector<Value> options =
                    args[0].kind == Kind::list && args[0].tuple ? args[0].items() : Args{args[0]};
                for (const Value& o : options) {
                    if (o.kind != Kind::string)
                        error(e, what, " takes a string or a tuple of strings, got a ", type_name(o));
                    const std::string& p = o.str();
                    if (p.size() <= s.size() &&
                        (name == "startswith" ? s.compare(0, p.size(), p) == 0
                                              : s.compare(s.size() - p.size(), p.size(), p) == 0))
                        return Value::boolean(true);
                }
                return Value::boolean(false);
            }
            if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
                check_arity(e, what.c_str(), args, kwargs, 0, {});
                const int mode = name == "lower" ? 0 : name == "upper" ? 1 : name == "title" ? 2 : 3;
                return Value::string(map_case(e, s, mode, what.c_str()));
            }
            if (name == "find" || name == "rfind" || name == "count" || name == "index" || name == "rindex") {
                check_arity(e, what.c_str(), args, kwargs, 3, {});
                if (args.empty() || args[0].kind != Kind::string) error(e, what, " takes a string");
                return find_in(e, name, s, args);
            }
            if (name == "rsplit") {
                check_arity(e, what.c_str(), args, kwargs, 2, {"sep", "maxsplit"});
                return py_rsplit(e, s, str_arg(e, arg(args, kwargs, 0, "sep"), "the separator"),
                                 int_arg(e, arg(args, kwargs, 1, "maxsplit"), -1, "maxsplit"));
            }
            if (name == "splitlines") {
                check_arity(e, what.c_str(), args, kwargs, 1, {"keepends"});
                const Value* keep = arg(args, kwargs, 0, "keepends");
                std::vector<Value> lines;
                for (std::string& l : split_lines(s, keep != nullptr && truthy(*keep)))
                    lines.push_back(Value::string(std::move(l)));
                return Value::list(std::move(lines));
            }
            if (name == "partition" || name == "rpartition") {
                check_arity(e, what.c_str(), args, kwargs, 1, {});
                if (args.empty() || args[0].kind != Kind::string) error(e, what, " takes a string");
                const std::string& sep = args[0].str();
                if (sep.empty()) error(e, what, ": empty separator");
                const size_t at = name == "partition" ? s.find(sep) : s.rfind(sep);
                if (at == std::string::npos)
                    return name == "partition" ? Value::list({obj, Value::string(""), Value::string("")}, true)
                                               : Value::list({Value::string(""), Value::string(""), obj}, true);
                return Value::list({Value::string(s.substr(0, at)), args[0], Value::string(s.substr(at + sep.size()))},
                                   true);
            }
            if (name == "removeprefix" || name == "removesuffix") {
                check_arity(e, what.c_str(), args, kwargs, 1, {});
                if (args.empty() || args[0].kind != Kind::string) error(e, what, " takes a string");
                const std::string& a = args[0].str();
                if (a.size() > s.size()) return obj;
                if (name == "removeprefix")
                    return s.compare(0, a.size(), a) == 0 ? Value::string(s.substr(a.size())) : obj;
                return s.compare(s.size() - a.size(), a.size(), a) == 0
                           ? Value::string(s.substr(0, s.size() - a.size()))
                           : obj;
            }
            if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill") {
                check_arity(e, what.c_str(), args, kwargs, name == "zfill" ? 1 : 2, {});
                if (args.empty() || !is_intlike(args[0])) error(e, what, " takes an integer width");
                std::string fill = name == "zfill" ? "0" : " ";
                if (args.size() > 1) {
                    if (args[1].kind != Kind::string || cp_count(args[1].str()) != 1)
                        error(e, what, ": the fill character must be exactly one character long");
                    fill = args[1].str();
                }
                return Value::string(justify(e, s, as_int(args[0]),
                                             name == "center"  ? '^'
                                             : name == "ljust" ? '<'
                                             : name == "rjust" ? '>'
                                                               : '=',
                                             fill));
            }
            if (name == "isupper" || name == "islower") {
                check_arity(e, what.c_str(), args, kwargs, 0, {});
                require_ascii_case(e, s, what.c_str());
                bool cased = false;
                for (char c : s) {
                    if (!std::isalpha(static_cast<unsigned char>(c))) continue;
                    cased = true;
                    if ((name == "islower") != (std::islower(static_cast<unsigned char>(c)) != 0))
                        return Value::boolean(false);
                }
                return Value::boolean(cased);
            }
            if (name == "format") {
                const FieldLookup lookup = [&](const Value& o, const Value& key, bool is_attr) {
                    return is_attr ? get_attr(e, o, key.str()) : get_item(e, o, key);
                };
                return Value::string(
                    formatted(e, [&] { return str_format(s, args, kwargs, lookup, lim_.max_string); }));
            }
            if (name == "join") {
                check_arity(e, what.c_str(), args, kwargs, 1, {});
                if (args.empty()) error(e, what, " takes one iterable");
                std::string out;
                bool first = true;
                for (const Value& v : iterate(args[0], e.line, e.col)) {
                    if (v.kind != Kind::string) error(e, what, ": sequence item is a ", type_name(v), ", expected str");
                    if (!first) out += s;
                    first = false;
                    out += v.str();
                    check_size(e, out.size(), "a string");
                }
                charge(e, out.size());
                return Value::string(std::move(out));
            }
            if (name == "isspace" || name == "isdigit" || name == "isalpha" || name == "isalnum") {
                check_arity(e, what.c_str(), args, kwargs, 0, {});
                if (s.empty()) return Value::boolean(false);
                for (size_t i = 0; i < s.size();) {
                    const char32_t c = mf::text::next_code_point(s, i);
                    bool ok;
                    if (name == "isspace") {
                        ok = is_py_space(c);
                    } else {
                        if (c >= 0x80) error(e, what, " of non-ASCII text is not supported");
                        ok = name == "isdigit"   ? std::isdigit(static_cast<int>(c)) != 0
                             : name == "isalpha" ? std::isalpha(static_cast<int>(c)) != 0
                                                 : std::isalnum(static_cast<int>(c)) != 0;
                    }
                    if (!ok) return Value::boolean(false);
                }
                return Value::boolean(true);
            }
            error(e, "'str' object has no method '", name, "' (or it is not supported)");
        }
        if (obj.kind == Kind::dict) {
            const auto& entries = obj.dict().entries;
            if (name == "items" || name == "keys" || name == "values") {
                check_arity(e, what.c_str(), args, kwargs, 0, {});
                std::vector<Value> out;
                out.reserve(entries.size());
                for (const auto& [k, v] : entries)
                    out.push_back(name == "items" ? Value::list({k, v}, true) : name == "keys" ? k : v);
                charge(e, out.size());
                return Value::list(std::move(out));
            }
            if (name == "get") {
                check_arity(e, what.c_str(), args, kwargs, 2, {});
                if (args.empty()) error(e, what, " takes a key");
                const Value* v = obj.dict().find(args[0]);
                return v != nullptr ? *v : args.size() > 1 ? args[1] : Value::none();
            }
            if (name == "copy") return make_dict(entries);
            if (name == "pop" || name == "popitem" || name == "setdefault" || name == "update" || name == "clear")
                error(e, "access to attribute '", name,
                      "' of 'dict' object is unsafe (the sandbox keeps values immutable)");
        }
        if (obj.kind == Kind::list) {
            const auto& items = obj.items();
            if (name == "copy" && !obj.tuple) {
                check_arity(e, what.c_str(), args, kwargs, 0, {});
                charge(e, items.size());
                return Value::list(items);
            }
            if (name == "index" || name == "count") {
                if (args.size() != 1) error(e, what, " takes one argument");
                int64_t n = 0;
                for (size_t k = 0; k < items.size(); ++k) {
                    if (!equals(items[k], args[0])) continue;
                    if (name == "index") return Value::integer(static_cast<int64_t>(k));
                    ++n;
                }
                if (name == "index") error(e, to_repr(args[0]), " is not in list");
                return Value::integer(n);
            }
            if (name == "append" || name == "extend" || name == "insert" || name == "pop" || name == "remove" ||
                name == "reverse" || name == "sort" || name == "clear")
                error(e, "access to attribute '", name, "' of '", type_name(obj),
                      "' object is unsafe (the sandbox keeps values immutable)");
        }
        if (obj.kind == Kind::loop && (name == "cycle" || name == "changed")) {
            if (!kwargs.empty()) error(e, "loop.", name, "() takes no keyword arguments");
            const LoopObj& loop = static_cast<const LoopObj&>(*obj.obj);
            if (name == "cycle") {
                if (args.empty()) error(e, "no items for cycling given (loop.cycle() needs at least one value)");
                return args[loop.index0 % args.size()];
            }
            // True on the first call and whenever the arguments differ from the previous call's.
            Value now = Value::list(args, true);
            LoopState& st = *loop.state;
            if (st.has_changed_value && equals(st.last_changed_value, now)) return Value::boolean(false);
            st.has_changed_value = true;
            st.last_changed_value = std::move(now);
            return Value::boolean(true);
        }
        const Value v = get_attr(e, obj, name);
        if (v.kind == Kind::undefined) error(e, v.undefined_hint(), " (called as a method)");
        error(e, "'", type_name(v), "' object is not callable");
    }

    // --- tojson (HF's: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys))
    struct JsonStyle {
        bool ensure_ascii = false;
        std::string indent;  // used when has_indent
        bool has_indent = false;
        std::string item_sep = ", ", key_sep = ": ";
        bool sort_keys = false;
    };
    // A JSON string as Python's json.dumps writes it: json::quote's escapes, and with ensure_ascii every
    // non-ASCII code point as \uXXXX (a UTF-16 surrogate pair above the BMP).
    static void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
        const std::string quoted = json::quote(s);
        if (!ensure_ascii) {
            out += quoted;
            return;
        }
        for (size_t i = 0; i < quoted.size();) {
            if (static_cast<unsigned char>(quoted[i]) < 0x80) {
                out += quoted[i++];
                continue;
            }
            const char32_t cp = mf::text::next_code_point(quoted, i);
            char buf[16];
            if (cp >= 0x10000) {
                const uint32_t v = static_cast<uint32_t>(cp) - 0x10000;
                std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
            } else {
                std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
            }
            out += buf;
        }
    }
    void json_dump(const Expr& e, std::string& out, const Value& v, const JsonStyle& st, int level) {
        Depth d(*this, e.line, e.col);
        check_size(e, out.size(), "tojson's output");
        auto newline = [&](int lvl) {
            check_size(e, out.size() + static_cast<size_t>(lvl) * st.indent.size(), "tojson's output");
            out += '\n';
            for (int k = 0; k < lvl; ++k) out += st.indent;
        };
        switch (v.kind) {
            case Kind::none:
                out += "null";
                return;
            case Kind::boolean:
                out += v.b ? "true" : "false";
                return;
            case Kind::integer:
                out += std::to_string(v.i);
                return;
            case Kind::floating:
                out += std::isnan(v.f)   ? "NaN"
                       : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity")
                                         : float_repr(v.f);
                return;
            case Kind::string:
                json_string(out, v.str(), st.ensure_ascii);
                return;
            case Kind::list: {
                const auto& items = v.items();
                if (items.empty()) {
                    out += "[]";
                    return;
                }
                out += '[';
                for (size_t k = 0; k < items.size(); ++k) {
                    if (k > 0) out += st.item_sep;
                    if (st.has_indent) newline(level + 1);
                    json_dump(e, out, items[k], st, level + 1);
                }
                if (st.has_indent) newline(level);
                out += ']';
                return;
            }
            case Kind::dict: {
                std::vector<const std::pair<Value, Value>*> entries;
                for (const auto& kv : v.dict().entries) entries.push_back(&kv);
                if (entries.empty()) {
                    out += "{}";
                    return;
                }
                if (st.sort_keys)
                    std::stable_sort(entries.begin(), entries.end(), [&](const auto* a, const auto* b) {
                        return order(e, a->first, b->first, "<") < 0;
                    });
                out += '{';
                for (size_t k = 0; k < entries.size(); ++k) {
                    if (k > 0) out += st.item_sep;
                    if (st.has_indent) newline(level + 1);
                    const Value& key = entries[k]->first;
                    if (key.kind == Kind::string)
                        json_string(out, key.str(), st.ensure_ascii);
                    else if (key.kind == Kind::none)
                        out += "\"null\"";
                    else if (key.kind == Kind::boolean)
                        out += key.b ? "\"true\"" : "\"false\"";
                    else if (key.kind == Kind::integer || key.kind == Kind::floating) {
                        out += '"';
                        json_dump(e, out, key, st, level + 1);
                        out += '"';
                    } else
                        error(e, "tojson: keys must be str, int, float, bool or None, not ", type_name(key));
                    out += st.key_sep;
                    json_dump(e, out, entries[k]->second, st, level + 1);
                }
                if (st.has_indent) newline(level);
                out += '}';
                return;
            }
            case Kind::undefined:
                error(e, "tojson: ", v.undefined_hint(), " (Object of type Undefined is not JSON serializable)");
            default:
                error(e, "tojson: Object of type ", type_name(v), " is not JSON serializable");
        }
    }
    Value tojson(const Expr& e, const Value& v, const Args& args, const Kwargs& kwargs) {
        check_arity(e, "tojson", args, kwargs, 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
        JsonStyle st;
        // Positional order of HF's tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
        if (const Value* a = arg(args, kwargs, 0, "ensure_ascii")) st.ensure_ascii = truthy(*a);
        if (const Value* a = arg(args, kwargs, 1, "indent"); a != nullptr && a->kind != Kind::none) {
            st.has_indent = true;
            if (a->kind == Kind::string)
                st.indent = a->str();
            else if (is_intlike(*a)) {
                const int64_t width = std::max<int64_t>(as_int(*a), 0);
                check_size(e, static_cast<size_t>(std::min<int64_t>(width, INT32_MAX)), "tojson's indent");
                st.indent = std::string(static_cast<size_t>(width), ' ');
            } else
                error(e, "tojson: indent must be an integer or a string");
            st.item_sep = ",";
        }
        if (const Value* a = arg(args, kwargs, 2, "separators"); a != nullptr && a->kind != Kind::none) {
            if (a->kind != Kind::list || a->items().size() != 2 || a->items()[0].kind != Kind::string ||
                a->items()[1].kind != Kind::string)
                error(e, "tojson: separators must be a pair of strings");
            st.item_sep = a->items()[0].str();
            st.key_sep = a->items()[1].str();
        }
        if (const Value* a = arg(args, kwargs, 3, "sort_keys")) st.sort_keys = truthy(*a);
        std::string out;
        json_dump(e, out, v, st, 0);
        charge(e, out.size());
        return Value::string(std::move(out));
    }

    // --- number parsing and rounding as Python's int(), float() and round()

    // int(s, base): optional sign, a 0x/0o/0b prefix matching the base (any of them for base 0),
    // digits with single underscores between them, surrounding whitespace. nullopt where Python
    // raises ValueError (or the value does not fit int64).
    static std::optional<int64_t> py_int(const std::string& raw, int64_t base) {
        if (base != 0 && (base < 2 || base > 36)) return std::nullopt;
        const std::string s = py_strip(raw, nullptr, true, true);
        size_t i = 0;
        bool negative = false;
        if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
        auto lower = [&](size_t k) { return static_cast<char>(std::tolower(static_cast<unsigned char>(s[k]))); };
        bool prefixed = false;
        if (i + 1 < s.size() && s[i] == '0') {
            const char p = lower(i + 1);
            const int64_t pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
            if (pb != 0 && (base == 0 || base == pb)) {
                base = pb;
                i += 2;
                prefixed = true;
            }
        }
        const bool zero_base = base == 0;
        if (zero_base) base = 10;
        if (prefixed && i < s.size() && s[i] == '_') ++i;  // int('0x_1f', 16)
        const size_t first = i;
        int64_t value = 0;
        bool any = false, all_zero = true;
        for (; i < s.size(); ++i) {
            if (s[i] == '_') {  // only between two digits
                if (i == first || i + 1 >= s.size() || s[i + 1] == '_') return std::nullopt;
                continue;
            }
            const char c = lower(i);
            const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                          : (c >= 'a' && c <= 'z')                    ? c - 'a' + 10
                                                                      : 99;
            if (d >= base) return std::nullopt;
            if (__builtin_mul_overflow(value, base, &value) || __builtin_add_overflow(value, d, &value))
                return std::nullopt;
            all_zero = all_zero && d == 0;
            any = true;
        }
        if (!any) return std::nullopt;
        if (zero_base && !prefixed && !all_zero && s[first] == '0') return std::nullopt;  // int('010', 0)
        return negative ? -value : value;
    }

    // float(s): decimal notation with single underscores between digits, inf/infinity/nan, and
    // surrounding whitespace (no hexadecimal, unlike strtod).
    static std::optional<double> py_float(const std::string& raw) {
        const std::string s = py_strip(raw, nullptr, true, true);
        std::string t;
        auto digit = [&](size_t k) { return k < s.size() && std::isdigit(static_cast<unsigned char>(s[k])) != 0; };
        for (size_t k = 0; k < s.size(); ++k) {
            if (s[k] == '_') {
                if (k == 0 || !digit(k - 1) || !digit(k + 1)) return std::nullopt;
                continue;
            }
            t += static_cast<char>(std::tolower(static_cast<unsigned char>(s[k])));
        }
        const std::string_view body = std::string_view(t).substr(!t.empty() && (t[0] == '+' || t[0] == '-'));
        const bool special = body == "inf" || body == "infinity" || body == "nan";
        if (body.empty() || (!special && body.find_first_not_of("0123456789.e+-") != std::string_view::npos))
            return std::nullopt;
        char* end = nullptr;
        const double d = std::strtod(t.c_str(), &end);
        if (end != t.c_str() + t.size()) return std::nullopt;
        return d;
    }

    // round(int, ndigits): exact, half to even.
    int64_t round_int(const Expr& e, int64_t x, int64_t precision) {
        if (precision >= 0) return x;
        if (precision < -18) return 0;
        int64_t scale = 1;
        for (int64_t k = 0; k < -precision; ++k) scale *= 10;
        int64_t q = x / scale, r = x % scale;
        if (r < 0) {
            --q;
            r += scale;
        }
        if (2 * r > scale || (2 * r == scale && (q % 2) != 0)) ++q;
        int64_t out = 0;
        if (__builtin_mul_overflow(q, scale, &out)) error(e, "integer overflow");
        return out;
    }

    // Jinja's wordcount: the number of runs of \\w characters (letters, numbers, _ as Python's re).
    static int64_t word_count(const std::string& s) {
        int64_t n = 0;
        bool in_word = false;
        for (size_t i = 0; i < s.size();) {
            const char32_t c = mf::text::next_code_point(s, i);
            const bool w = c == '_' || mf::text::in_categories(c, mf::text::kLetterMask | mf::text::kNumberMask);
            if (w && !in_word) ++n;
            in_word = w;
        }
        return n;
    }

    // --- filters
    // The sort key of `v`: its attribute (a dotted path, an index, or "a,b" for a list of keys),
    // lowercased unless case_sensitive.
    Value sort_key(const Expr& e, const Value& v, const Value* attribute, bool case_sensitive, bool multi = true) {
        auto fold = [&](Value key) {
            if (!case_sensitive && key.kind == Kind::string) return Value::string(map_case(e, key.str(), 0, "sort"));
            return key;
        };
        if (multi && attribute != nullptr && attribute->kind == Kind::string &&
            attribute->str().find(',') != std::string::npos) {
            std::vector<Value> keys;
            const std::string& spec = attribute->str();
            for (size_t i = 0;;) {
                const size_t comma = spec.find(',', i);
                const Value part =
                    Value::string(spec.substr(i, comma == std::string::npos ? std::string::npos : comma - i));
                keys.push_back(fold(attribute_of(e, v, &part)));
                if (comma == std::string::npos) break;
                i = comma + 1;
            }
            return Value::list(std::move(keys));
        }
        return fold(attribute_of(e, v, attribute));
    }

    Value attribute_of(const Expr& e, const Value& v, const Value* attribute) {
        if (attribute == nullptr || attribute->kind == Kind::none) return v;
        if (is_intlike(*attribute)) return get_item(e, v, *attribute);
        if (attribute->kind != Kind::string) error(e, "attribute= must be a string");
        Value cur = v;
        const std::string& path = attribute->str();
        size_t i = 0;
        for (;;) {  // "a.b.c", as Jinja's make_attrgetter
            const size_t dot = path.find('.', i);
            const std::string part = path.substr(i, dot == std::string::npos ? std::string::npos : dot - i);
            bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
                return std::isdigit(static_cast<unsigned char>(c)) != 0;
            });
            cur = digits ? get_item(e, cur, Value::integer(std::stoll(part))) : get_item(e, cur, Value::string(part));
            if (dot == std::string::npos) return cur;
            i = dot + 1;
        }
    }

    Value sorted_values(const Expr& e, std::vector<Value> items, bool reverse, bool case_sensitive,
                        const Value* attribute) {
        std::vector<std::pair<Value, Value>> keyed;
        for (Value& v : items) {
            Value key = sort_key(e, v, attribute, case_sensitive);
            keyed.emplace_back(std::move(key), std::move(v));
        }
        std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
            return reverse ? order(e, b.first, a.first, "<") < 0 : order(e, a.first, b.first, "<") < 0;
        });
        std::vector<Value> out;
        for (auto& kv : keyed) out.push_back(std::move(kv.second));
        charge(e, out.size() * 4);
        return Value::list(std::move(out));
    }

    Value select(const Expr& e, const Value& seq, const Args& args, const Kwargs& kwargs, bool attr, bool keep) {
        std::vector<Value> out;
        const size_t first = attr ? 1 : 0;
        const Value* attribute = attr ? arg(args, kwargs, 0, "") : nullptr;
        if (attr && (attribute == nullptr || attribute->kind != Kind::string))
            error(e, "selectattr/rejectattr need an attribute name");
        int test = -1;
        if (args.size() > first) {
            if (args[first].kind != Kind::string) error(e, "the test name must be a string");
            test = test_code(args[first].str());
            if (test < 0) error(e, "no test named '", args[first].str(), "'");
        }
        const Args test_args(args.begin() + static_cast<std::ptrdiff_t>(std::min(args.size(), first + 1)), args.end());
        for (const Value& v : iterate(seq, e.line, e.col)) {
            charge(e, 1);
            const Value x = attr ? attribute_of(e, v, attribute) : v;
            const bool ok = test < 0 ? truthy(x) : apply_test(e, static_cast<Test>(test), x, test_args);
            if (ok == keep) out.push_back(v);
        }
        return Value::list(std::move(out));
    }

    Value apply_filter(const Expr& e, Filter f, const Value& v, const Args& args, const Kwargs& kwargs) {
        const char* fname = e.name.c_str();
        switch (f) {
            case Filter::safe:
                return v;
            case Filter::string:
                return v.kind == Kind::string ? v : Value::string(to_str(v));
            case Filter::default_: {
                check_arity(e, fname, args, kwargs, 2, {"default_value", "boolean"});
                const Value* def = arg(args, kwargs, 0, "default_value");
                const Value* boolean = arg(args, kwargs, 1, "boolean");
                const bool use = v.kind == Kind::undefined || (boolean != nullptr && truthy(*boolean) && !truthy(v));
                return use ? (def != nullptr ? *def : Value::string("")) : v;
            }
            case Filter::length:
                switch (v.kind) {
                    case Kind::undefined:
                        return Value::integer(0);
                    case Kind::string:
                        return Value::integer(static_cast<int64_t>(cp_count(v.str())));
                    case Kind::list:
                        return Value::integer(static_cast<int64_t>(v.items().size()));
                    case Kind::dict:
                    case Kind::ns:
                        return Value::integer(static_cast<int64_t>(v.dict().entries.size()));
                    default:
                        error(e, "object of type '", type_name(v), "' has no len()");
                }
            case Filter::first:
            case Filter::last: {
                const std::vector<Value> items = iterate(v, e.line, e.col);
                if (items.empty()) return Value::undefined("the sequence is empty");
                return f == Filter::first ? items.front() : items.back();
            }
            case Filter::list:
                return Value::list(iterate(v, e.line, e.col));
            case Filter::items: {
                if (v.kind == Kind::undefined) return Value::list({});
                if (v.kind != Kind::dict) error(e, "the 'items' filter needs a mapping, got a ", type_name(v));
                return call_method(e, v, "items", {}, {});
            }
            case Filter::join: {
                check_arity(e, fname, args, kwargs, 2, {"d", "attribute"});
                const Value* sep = arg(args, kwargs, 0, "d");
                const Value* attribute = arg(args, kwargs, 1, "attribute");
                const std::string s = sep != nullptr ? to_str(*sep) : std::string();
                std::string out;
                bool first = true;
                for (const Value& x : iterate(v, e.line, e.col)) {
                    if (!first) out += s;
                    first = false;
                    out += to_str(attribute_of(e, x, attribute));
                    check_size(e, out.size(), "a string");
                }
                charge(e, out.size());
                return Value::string(std::move(out));
            }
            case Filter::lower:
                return Value::string(map_case(e, to_str(v), 0, "lower"));
            case Filter::upper:
                return Value::string(map_case(e, to_str(v), 1, "upper"));
            case Filter::title:
                return Value::string(map_case(e, to_str(v), 4, "title"));
            case Filter::capitalize:
                return Value::string(map_case(e, to_str(v), 3, "capitalize"));
            case Filter::trim: {
                check_arity(e, fname, args, kwargs, 1, {"chars"});
                return Value::string(
                    py_strip(to_str(v), str_arg(e, arg(args, kwargs, 0, "chars"), "chars"), true, true));
            }
            case Filter::replace: {
                check_arity(e, fname, args, kwargs, 3, {"old", "new", "count"});
                const Value* old = arg(args, kwargs, 0, "old");
                const Value* with = arg(args, kwargs, 1, "new");
                if (old == nullptr || with == nullptr) error(e, "replace needs the old and the new string");
                return Value::string(py_replace(e, to_str(v), to_str(*old), to_str(*with),
                                                int_arg(e, arg(args, kwargs, 2, "count"), -1, "count")));
            }
            case Filter::int_: {
                check_arity(e, fname, args, kwargs, 2, {"default", "base"});
                const Value* def = arg(args, kwargs, 0, "default");
                const Value fallback = def != nullptr ? *def : Value::integer(0);
                if (is_intlike(v)) return Value::integer(as_int(v));
                if (v.kind == Kind::floating) {
                    if (!std::isfinite(v.f) || std::fabs(v.f) >= 9.2e18) return fallback;
                    return Value::integer(static_cast<int64_t>(v.f));
                }
                if (v.kind == Kind::string) {
                    // Jinja: int(value, base), else int(float(value)), else the default.
                    const int64_t base = int_arg(e, arg(args, kwargs, 1, "base"), 10, "base");
                    if (const std::optional<int64_t> x = py_int(v.str(), base)) return Value::integer(*x);
                    const std::optional<double> d = py_float(v.str());
                    if (d && std::isfinite(*d) && std::fabs(*d) < 9.2e18)
                        return Value::integer(static_cast<int64_t>(*d));
                }
                return fallback;
            }
            case Filter::float_: {
                check_arity(e, fname, args, kwargs, 1, {"default"});
                const Value* def = arg(args, kwargs, 0, "default");
                if (is_numeric(v)) return Value::floating(as_double(v));
                if (v.kind == Kind::string)
                    if (const std::optional<double> d = py_float(v.str())) return Value::floating(*d);
                return def != nullptr ? *def : Value::floating(0.0);
            }
            case Filter::indent:
                return indent(e, to_str(v), args, kwargs);
            case Filter::unique: {
                check_arity(e, fname, args, kwargs, 2, {"case_sensitive", "attribute"});
                const Value* cs = arg(args, kwargs, 0, "case_sensitive");
                const Value* attribute = arg(args, kwargs, 1, "attribute");
                std::vector<Value> out, seen;
                for (const Value& x : iterate(v, e.line, e.col)) {
                    Value key = attribute_of(e, x, attribute);
                    if (!(cs != nullptr && truthy(*cs)) && key.kind == Kind::string)
                        key = Value::string(map_case(e, key.str(), 0, "unique"));
                    charge(e, seen.size() + 1);
                    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) continue;
                    seen.push_back(std::move(key));
                    out.push_back(x);
                }
                return Value::list(std::move(out));
            }
            case Filter::map: {
                std::vector<Value> out;
                const Value* attribute = nullptr;
                for (const auto& [k, x] : kwargs)
                    if (k == "attribute") attribute = &x;
                const Value* def = nullptr;
                for (const auto& [k, x] : kwargs)
                    if (k == "default") def = &x;
                if (attribute != nullptr) {
                    for (const Value& x : iterate(v, e.line, e.col)) {
                        Value r = attribute_of(e, x, attribute);
                        if (r.kind == Kind::undefined && def != nullptr) r = *def;
                        out.push_back(std::move(r));
                    }
                    return Value::list(std::move(out));
                }
                if (args.empty() || args[0].kind != Kind::string) error(e, "map needs a filter name or attribute=");
                const int code = filter_code(args[0].str());
                if (code < 0) error(e, "no filter named '", args[0].str(), "'");
                Expr inner;
                inner.line = e.line;
                inner.col = e.col;
                inner.name = args[0].str();
                const Args rest(args.begin() + 1, args.end());
                Kwargs kw;
                for (const auto& kv : kwargs)
                    if (kv.first != "attribute" && kv.first != "default") kw.push_back(kv);
                for (const Value& x : iterate(v, e.line, e.col)) {
                    charge(e, 1);
                    out.push_back(apply_filter(inner, static_cast<Filter>(code), x, rest, kw));
                }
                return Value::list(std::move(out));
            }
            case Filter::select:
                return select(e, v, args, kwargs, false, true);
            case Filter::reject:
                return select(e, v, args, kwargs, false, false);
            case Filter::selectattr:
                return select(e, v, args, kwargs, true, true);
            case Filter::rejectattr:
                return select(e, v, args, kwargs, true, false);
            case Filter::tojson:
                return tojson(e, v, args, kwargs);
            case Filter::escape: {
                std::string out;
                for (char c : to_str(v)) {
                    switch (c) {
                        case '&':
                            out += "&amp;";
                            break;
                        case '<':
                            out += "&lt;";
                            break;
                        case '>':
                            out += "&gt;";
                            break;
                        case '"':
                            out += "&#34;";
                            break;
                        case '\'':
                            out += "&#39;";
                            break;
                        default:
                            out += c;
                    }
                }
                return Value::string(std::move(out));
            }
            case Filter::abs:
                if (is_intlike(v)) {
                    if (as_int(v) == INT64_MIN) error(e, "integer overflow");
                    return Value::integer(std::llabs(as_int(v)));
                }
                if (v.kind == Kind::floating) return Value::floating(std::fabs(v.f));
                error(e, "bad operand type for abs(): '", type_name(v), "'");
            case Filter::round: {
                check_arity(e, fname, args, kwargs, 2, {"precision", "method"});
                // Beyond ±400 digits rounding a double is the identity or gives zero.
                const int64_t precision =
                    std::clamp<int64_t>(int_arg(e, arg(args, kwargs, 0, "precision"), 0, "precision"), -400, 400);
                const std::string* method = str_arg(e, arg(args, kwargs, 1, "method"), "method");
                if (!is_numeric(v)) error(e, "round needs a number, got a ", type_name(v));
                const double x = as_double(v);
                if (method != nullptr && *method != "common") {
                    const double scale = std::pow(10.0, static_cast<double>(precision));
                    if (*method == "ceil") return Value::floating(std::ceil(x * scale) / scale);
                    if (*method == "floor") return Value::floating(std::floor(x * scale) / scale);
                    error(e, "round: method must be common, ceil or floor");
                }
                if (is_intlike(v)) return Value::integer(round_int(e, as_int(v), precision));
                if (precision >= 0) {  // correctly rounded, half to even, as Python's round()
                    std::string buf(static_cast<size_t>(precision) + 400, '\0');
                    std::snprintf(buf.data(), buf.size(), "%.*f", static_cast<int>(precision), x);
                    return Value::floating(std::strtod(buf.c_str(), nullptr));
                }
                const double scale = std::pow(10.0, static_cast<double>(-precision));
                return Value::floating(std::nearbyint(x / scale) * scale);
            }
            case Filter::sum: {
                check_arity(e, fname, args, kwargs, 2, {"attribute", "start"});
                const Value* attribute = arg(args, kwargs, 0, "attribute");
                const Value* start = arg(args, kwargs, 1, "start");
                Value acc = start != nullptr ? *start : Value::integer(0);
                if (acc.kind == Kind::string) error(e, "sum() can't sum strings [use ''.join(seq) instead]");
                for (const Value& x : iterate(v, e.line, e.col))
                    acc = binary(e, BinOp::add, acc, attribute_of(e, x, attribute));
                return acc;
            }
            case Filter::sort: {
                check_arity(e, fname, args, kwargs, 3, {"reverse", "case_sensitive", "attribute"});
                const Value* rev = arg(args, kwargs, 0, "reverse");
                const Value* cs = arg(args, kwargs, 1, "case_sensitive");
                return sorted_values(e, iterate(v, e.line, e.col), rev != nullptr && truthy(*rev),
                                     cs != nullptr && truthy(*cs), arg(args, kwargs, 2, "attribute"));
            }
            case Filter::dictsort: {
                if (v.kind != Kind::dict) error(e, "dictsort needs a mapping");
                std::vector<Value> pairs = call_method(e, v, "items", {}, {}).items();
                const Value* cs = arg(args, kwargs, 0, "case_sensitive");
                const Value* by = arg(args, kwargs, 1, "by");
                const Value* rev = arg(args, kwargs, 2, "reverse");
                if (by != nullptr && !(by->kind == Kind::string && (by->str() == "key" || by->str() == "value")))
                    error(e, "You can only sort by either \"key\" or \"value\"");
                const Value index = Value::integer(by != nullptr && by->str() == "value" ? 1 : 0);
                return sorted_values(e, std::move(pairs), rev != nullptr && truthy(*rev), cs != nullptr && truthy(*cs),
                                     &index);
            }
            case Filter::reverse: {
                if (v.kind == Kind::string) {
                    const std::vector<size_t> off = cp_offsets(v.str());
                    std::string out;
                    for (size_t k = off.size() - 1; k-- > 0;) out.append(v.str(), off[k], off[k + 1] - off[k]);
                    return Value::string(std::move(out));
                }
                std::vector<Value> items = iterate(v, e.line, e.col);
                std::reverse(items.begin(), items.end());
                return Value::list(std::move(items));
            }
            case Filter::min:
            case Filter::max: {
                check_arity(e, fname, args, kwargs, 2, {"case_sensitive", "attribute"});
                const Value* cs = arg(args, kwargs, 0, "case_sensitive");
                const Value* attribute = arg(args, kwargs, 1, "attribute");
                const std::vector<Value> items = iterate(v, e.line, e.col);
                if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
                // Python's min() and max() keep the first of equal extremes.
                size_t best = 0;
                Value best_key = sort_key(e, items[0], attribute, cs != nullptr && truthy(*cs), false);
                for (size_t k = 1; k < items.size(); ++k) {
                    charge(e, 1);
                    Value key = sort_key(e, items[k], attribute, cs != nullptr && truthy(*cs), false);
                    const int c = order(e, key, best_key, f == Filter::min ? "<" : ">");
                    if (f == Filter::min ? c < 0 : c > 0) {
                        best = k;
                        best_key = std::move(key);
                    }
                }
                return items[best];
            }
            case Filter::batch: {
                check_arity(e, fname, args, kwargs, 2, {"linecount", "fill_with"});
                const int64_t n = int_arg(e, arg(args, kwargs, 0, "linecount"), 0, "linecount");
                if (n <= 0) error(e, "batch needs a positive size");
                const Value* fill = arg(args, kwargs, 1, "fill_with");
                if (fill != nullptr && fill->kind != Kind::none)
                    check_size(e, static_cast<size_t>(std::min<int64_t>(n, INT32_MAX)), "a batch");
                std::vector<Value> out, cur;
                for (const Value& x : iterate(v, e.line, e.col)) {
                    cur.push_back(x);
                    if (static_cast<int64_t>(cur.size()) == n) out.push_back(Value::list(std::exchange(cur, {})));
                }
                if (!cur.empty()) {
                    if (fill != nullptr && fill->kind != Kind::none)
                        while (static_cast<int64_t>(cur.size()) < n) cur.push_back(*fill);
                    out.push_back(Value::list(std::move(cur)));
                }
                return Value::list(std::move(out));
            }
            case Filter::wordcount:
                return Value::integer(word_count(to_str(v)));
            case Filter::attr: {
                // getattr() only: a dict's keys are not attributes (Jinja's attr filter).
                check_arity(e, fname, args, kwargs, 1, {"name"});
                const std::string* name = str_arg(e, arg(args, kwargs, 0, "name"), "the attribute name");
                if (name == nullptr) error(e, "attr needs an attribute name");
                if (v.kind == Kind::ns || v.kind == Kind::loop ||
                    (v.kind == Kind::list && static_cast<const ListObj&>(*v.obj).group))
                    return get_attr(e, v, *name);
                return Value::undefined("'" + std::string(type_name(v)) + " object' has no attribute '" + *name + "'");
            }
            case Filter::center: {
                check_arity(e, fname, args, kwargs, 1, {"width"});
                return Value::string(
                    justify(e, to_str(v), int_arg(e, arg(args, kwargs, 0, "width"), 80, "width"), '^', " "));
            }
            case Filter::format: {
                if (!args.empty() && !kwargs.empty())
                    error(e, "can't handle positional and keyword arguments at the same time");
                Value fargs;
                if (kwargs.empty()) {
                    fargs = Value::list(args, true);
                } else {
                    std::vector<std::pair<Value, Value>> entries;
                    for (const auto& [k, x] : kwargs) entries.emplace_back(Value::string(k), x);
                    fargs = make_dict(std::move(entries));
                }
                const std::string fmt = to_str(v);
                return Value::string(formatted(e, [&] { return percent_format(fmt, fargs, lim_.max_string); }));
            }
            case Filter::groupby:
                return group_by(e, v, args, kwargs);
            case Filter::slice: {
                check_arity(e, fname, args, kwargs, 2, {"slices", "fill_with"});
                const int64_t num_slices = int_arg(e, arg(args, kwargs, 0, "slices"), 0, "slices");
                if (num_slices <= 0) error(e, "slice needs a positive number of slices");
                check_size(e, static_cast<size_t>(std::min<int64_t>(num_slices, INT32_MAX)), "a list of slices");
                const Value* fill = arg(args, kwargs, 1, "fill_with");
                const std::vector<Value> items = iterate(v, e.line, e.col);
                // Jinja's: the first len % n slices get one item more; the others get fill_with.
                const size_t n = static_cast<size_t>(num_slices), per = items.size() / n, extra = items.size() % n;
                std::vector<Value> out;
                size_t at = 0;
                for (size_t k = 0; k < n; ++k) {
                    const size_t len = per + (k < extra ? 1 : 0);
                    std::vector<Value> part(items.begin() + static_cast<std::ptrdiff_t>(at),
                                            items.begin() + static_cast<std::ptrdiff_t>(at + len));
                    at += len;
                    if (fill != nullptr && fill->kind != Kind::none && k >= extra) part.push_back(*fill);
                    charge(e, part.size() + 1);
                    out.push_back(Value::list(std::move(part)));
                }
                return Value::list(std::move(out));
            }
            case Filter::truncate:
                return truncate(e, v, args, kwargs);
        }
        error(e, "filter '", fname, "' is not supported");
    }

    // Jinja's groupby(attribute, default=None, case_sensitive=False): sorted by the key, one
    // (grouper, list) pair per run of equal keys; the grouper is the first item's own key.
    Value group_by(const Expr& e, const Value& v, const Args& args, const Kwargs& kwargs) {
        check_arity(e, "groupby", args, kwargs, 3, {"attribute", "default", "case_sensitive"});
        const Value* attribute = arg(args, kwargs, 0, "attribute");
        if (attribute == nullptr) error(e, "groupby needs an attribute");
        const Value* def = arg(args, kwargs, 1, "default");
        const Value* cs = arg(args, kwargs, 2, "case_sensitive");
        const bool case_sensitive = cs != nullptr && truthy(*cs);
        auto key_of = [&](const Value& x, bool fold) {
            Value k = attribute_of(e, x, attribute);
            if (k.kind == Kind::undefined && def != nullptr && def->kind != Kind::none) k = *def;
            if (fold && k.kind == Kind::string) k = Value::string(map_case(e, k.str(), 0, "groupby"));
            return k;
        };
        std::vector<std::pair<Value, Value>> keyed;
        for (const Value& x : iterate(v, e.line, e.col)) keyed.emplace_back(key_of(x, !case_sensitive), x);
        std::stable_sort(keyed.begin(), keyed.end(),
                         [&](const auto& a, const auto& b) { return order(e, a.first, b.first, "<") < 0; });
        std::vector<Value> out;
        for (size_t k = 0; k < keyed.size();) {
            size_t j = k;
            std::vector<Value> members;
            while (j < keyed.size() && equals(keyed[j].first, keyed[k].first)) members.push_back(keyed[j++].second);
            charge(e, members.size() + 1);
            Value grouper = case_sensitive ? keyed[k].first : key_of(members[0], false);
            auto group =
                std::make_shared<ListObj>(std::vector<Value>{std::move(grouper), Value::list(std::move(members))});
            group->group = true;
            Value g;
            g.kind = Kind::list;
            g.tuple = true;
            g.obj = std::move(group);
            out.push_back(std::move(g));
            k = j;
        }
        return Value::list(std::move(out));
    }

    // Jinja's truncate(length=255, killwords=False, end='...', leeway=5).
    Value truncate(const Expr& e, const Value& v, const Args& args, const Kwargs& kwargs) {
        check_arity(e, "truncate", args, kwargs, 4, {"length", "killwords", "end", "leeway"});
        const int64_t length = int_arg(e, arg(args, kwargs, 0, "length"), 255, "length");
        const Value* killwords = arg(args, kwargs, 1, "killwords");
        const std::string* end_arg = str_arg(e, arg(args, kwargs, 2, "end"), "end");
        const std::string end = end_arg != nullptr ? *end_arg : "...";
        const int64_t leeway = int_arg(e, arg(args, kwargs, 3, "leeway"), 5, "leeway");
        const int64_t end_len = static_cast<int64_t>(cp_count(end));
        if (length < end_len) error(e, "expected length >= ", end_len, ", got ", length);
        if (leeway < 0) error(e, "expected leeway >= 0, got ", leeway);
        if (v.kind == Kind::undefined) return v;
        if (v.kind != Kind::string) error(e, "object of type '", type_name(v), "' has no len()");
        const std::string& s = v.str();
        const int64_t len = static_cast<int64_t>(cp_count(s));
        if (len <= length + leeway) return v;
        const std::vector<size_t> off = cp_offsets(s);
        std::string head = s.substr(0, off[static_cast<size_t>(length - end_len)]);
        if (!(killwords != nullptr && truthy(*killwords))) {
            const size_t space = head.rfind(' ');
            if (space != std::string::npos) head.resize(space);
        }
        return Value::string(head + end);
    }

    Value indent(const Expr& e, const std::string& s, const Args& args, const Kwargs& kwargs) {
        check_arity(e, "indent", args, kwargs, 3, {"width", "first", "blank"});
        const Value* width = arg(args, kwargs, 0, "width");
        const Value* first = arg(args, kwargs, 1, "first");
        const Value* blank = arg(args, kwargs, 2, "blank");
        std::string pad;
        if (width == nullptr)
            pad = "    ";
        else if (width->kind == Kind::string)
            pad = width->str();
        else
            pad = std::string(static_cast<size_t>(std::clamp<int64_t>(int_arg(e, width, 4, "width"), 0, 1024)), ' ');
        // s + "\n", split as str.splitlines() does, rejoined with "\n" + pad (blank lines unpadded
        // unless blank=True).
        const std::vector<std::string> lines = split_lines(s + "\n", false);
        std::string out;
        if (blank != nullptr && truthy(*blank)) {
            for (size_t k = 0; k < lines.size(); ++k) {
                if (k > 0) out += "\n" + pad;
                out += lines[k];
            }
        } else {
            out = lines.empty() ? std::string() : lines[0];
            for (size_t k = 1; k < lines.size(); ++k) {
                out += "\n";
                if (!lines[k].empty()) out += pad;
                out += lines[k];
            }
        }
        if (first != nullptr && truthy(*first)) out = pad + out;
        check_size(e, out.size(), "a string");
        charge(e, out.size());
        return Value::string(std::move(out));
    }

    // --- tests
    bool apply_test(const Expr& e, Test t, const Value& v, const Args& args) {
        auto need_arg = [&]() -> const Value& {
            if (args.empty()) error(e, "the '", e.name, "' test needs an argument");
            return args[0];
        };
        switch (t) {
            case Test::defined:
                return v.kind != Kind::undefined;
            case Test::undefined:
                return v.kind == Kind::undefined;
            case Test::none:
                return v.kind == Kind::none;
            case Test::boolean:
                return v.kind == Kind::boolean;
            case Test::true_:
                return v.kind == Kind::boolean && v.b;
            case Test::false_:
                return v.kind == Kind::boolean && !v.b;
            case Test::integer:
                return v.kind == Kind::integer;
            case Test::float_:
                return v.kind == Kind::floating;
            case Test::number:
                return is_numeric(v);
            case Test::string:
                return v.kind == Kind::string;
            case Test::mapping:
                return v.kind == Kind::dict;
            case Test::iterable:
                return v.kind == Kind::string || v.kind == Kind::list || v.kind == Kind::dict ||
                       v.kind == Kind::undefined;
            case Test::sequence:
                return v.kind == Kind::string || v.kind == Kind::list || v.kind == Kind::dict;
            case Test::callable:
                return v.kind == Kind::callable;
            case Test::filter:
                return v.kind == Kind::string && filter_code(v.str()) >= 0;
            case Test::test:
                return v.kind == Kind::string && test_code(v.str()) >= 0;
            case Test::odd:
            case Test::even:
            case Test::divisibleby: {
                require_defined(e, v);
                if (!is_intlike(v)) error(e, "the '", e.name, "' test needs an integer, got a ", type_name(v));
                if (t == Test::odd) return (as_int(v) % 2) != 0;
                if (t == Test::even) return (as_int(v) % 2) == 0;
                const Value& d = need_arg();
                if (!is_intlike(d) || as_int(d) == 0) error(e, "divisibleby needs a non-zero integer");
                return as_int(v) % as_int(d) == 0;
            }
            case Test::eq:
                return equals(v, need_arg());
            case Test::ne:
                return !equals(v, need_arg());
            case Test::lt:
                return order(e, v, need_arg(), "<") < 0;
            case Test::le:
                return order(e, v, need_arg(), "<=") <= 0;
            case Test::gt:
                return order(e, v, need_arg(), ">") > 0;
            case Test::ge:
                return order(e, v, need_arg(), ">=") >= 0;
            case Test::in:
                return contains(e, v, need_arg());
            case Test::sameas: {
                const Value& o = need_arg();
                if (v.kind != o.kind) return false;
                if (v.kind == Kind::none || v.kind == Kind::undefined) return true;
                if (v.kind == Kind::boolean) return v.b == o.b;
                return v.obj != nullptr && v.obj == o.obj;
            }
            case Test::lower:
            case Test::upper: {
                if (v.kind != Kind::string) return false;
                require_ascii_case(e, v.str(), e.name.c_str());
                bool cased = false;
                for (char c : v.str()) {
                    if (!std::isalpha(static_cast<unsigned char>(c))) continue;
                    cased = true;
                    if ((t == Test::lower) != (std::islower(static_cast<unsigned char>(c)) != 0)) return false;
                }
                return cased;
            }
        }
        return false;
    }

    const Program& prog_;
    const Limits& lim_;
    std::optional<std::time_t> now_;
    std::vector<Value> globals_;
    std::vector<std::shared_ptr<const Heap>> namespaces_;
    Rendered result_;
    std::string* out_ = nullptr;
    Value placeholder_;
    int depth_ = 0, call_depth_ = 0;
    int64_t iterations_ = 0, work_ = 0;
};

// --- public ----------------------------------------------------------------------------------------

Template Template::parse(std::string_view source, std::string name) {
    Template t;
    t.program_ = parse_program(source, std::move(name));
    return t;
}

Rendered Template::render(const json::Value& context, const RenderOptions& options) const {
    MF_CHECK(program_ != nullptr, "render of a Template that was never parsed");
    Evaluator ev(*program_, context, options);
    return ev.run();
}

bool Template::has_generation_blocks() const { return program_ != nullptr && program_->has_generation; }

const std::string& Template::name() const {
    MF_CHECK(program_ != nullptr, "name of a Template that was never parsed");
    return program_->name;
}

}  // namespace mf::text::jinja
