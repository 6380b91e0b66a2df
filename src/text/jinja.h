// A Jinja2 subset for chat templates, rendering as transformers' apply_chat_template does: an
// ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks on, the loopcontrols extension
// (break/continue), HF's `tojson` (json.dumps with ensure_ascii=False, indent, separators,
// sort_keys), the globals `raise_exception` and `strftime_now`, and HF's `{% generation %}` block
// (its output spans are reported for the assistant-token mask).
//
// Supported: text, {{ }}, {% %}, {# #}, {% raw %}, whitespace control (-, +); if/elif/else,
// for (loop.* incl. cycle() and changed(), for-else, `for x in y if cond`, tuple targets,
// break/continue), set (names, tuples, namespace attributes, block set), macro (defaults, kwargs,
// varargs, caller), call, filter blocks; literals, lists, dicts, tuples, attribute/item access,
// slicing, arithmetic, comparisons, and/or/not, in/not in, inline if/else, the filters and tests
// Jinja has that chat templates use (jinja_ast.h lists them), Python's `str % args` and
// str.format() (jinja_format.cpp), and Python's str/dict/list methods that do not mutate (the
// sandbox refuses append, pop, update, setdefault, ...). Values follow Python: ints are int64
// (overflow is an error), string indices count code points, str() of a float is Python's repr.
// Undefined is Jinja's default Undefined: it prints as "", is false and iterates as empty; its
// attributes are an error. Filters that return generators in Jinja (map, select, batch, slice,
// ...) return lists here: the same when iterated, joined or passed to |list.
//
// Not supported (an error, never a silent difference): extends/include/import, recursive loops,
// `{% do %}`, the globals cycler/joiner/lipsum, filters and tests not listed in jinja_ast.h,
// case mapping of non-ASCII letters, ints beyond int64.
//
// Templates are untrusted data: parsing and rendering are bounded (nesting depth, loop
// iterations, output and string sizes, total work) and every failure is an mf::Error
// "NAME:LINE:COL: what went wrong" (line and column 1-based, of the template source).
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/json.h"

namespace mf::text::jinja {

struct Limits {
    int max_depth = 400;                   // nesting of evaluation: expressions, blocks and macro calls
    int max_call_depth = 64;               // macro calls inside macro calls
    int64_t max_iterations = 1'000'000;    // loop iterations in one render, all loops together
    size_t max_output = size_t{32} << 20;  // bytes of rendered text
    size_t max_string = size_t{16} << 20;  // bytes of any string or elements of any list built
    int64_t max_work = 50'000'000;         // evaluation steps plus bytes/elements copied (a macro call: 100)
};

struct RenderOptions {
    Limits limits;
    std::optional<std::time_t> now;  // what strftime_now formats (local time); nullopt: the clock
};

struct Rendered {
    std::string text;
    // [begin, end) byte offsets into `text` of each {% generation %} block's output, in order
    // (as HF's AssistantTracker records them: offsets into the top-level output).
    std::vector<std::pair<size_t, size_t>> generation_spans;
};

struct Program;  // the parsed template (jinja_ast.h)

class Template {
 public:
    // Parses `source`; `name` prefixes error messages. mf::Error for a syntax error, an unknown
    // tag, filter or test, or a template nested deeper than the limits allow.
    static Template parse(std::string_view source, std::string name = "chat_template");

    // Renders with `context` (a JSON object: its keys are the template's variables).
    Rendered render(const json::Value& context, const RenderOptions& options = {}) const;

    bool has_generation_blocks() const;
    const std::string& name() const;

 private:
    std::shared_ptr<const Program> program_;
};

}  // namespace mf::text::jinja
