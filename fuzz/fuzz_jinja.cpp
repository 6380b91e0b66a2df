// libFuzzer target: the Jinja interpreter (text::jinja::Template::parse and render).
// Input layout: the template text, optionally followed by a NUL byte and a JSON render context
// (an object; anything else, or no NUL, renders with a fixed small conversation).
// Any template parses or is refused with mf::Error; a parsed one renders or throws mf::Error,
// within the limits (small here, so each input stays fast), twice alike, and every generation
// span lies inside the rendered text.
#include "core/json.h"
#include "fuzz_util.h"
#include "text/jinja.h"

namespace {

const mf::json::Value& default_context() {
    static const mf::json::Value v = mf::json::parse(
        R"({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Hi ünï"},)"
        R"( {"role": "assistant", "content": "<think>r</think>ok", "tool_calls": [{"type": "function",)"
        R"( "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}}]},)"
        R"( {"role": "tool", "content": "42"}], "tools": [{"type": "function", "function": {"name": "f"}}],)"
        R"( "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})",
        "default context");
    return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view input = mf::fuzz::as_text(data, size);
    const size_t nul = input.find('\0');
    const std::string_view source = input.substr(0, nul);
    mf::fuzz::run_one([&] {
        mf::json::Value ctx;
        if (nul != std::string_view::npos) {
            try {
                ctx = mf::json::parse(input.substr(nul + 1), "context");
            } catch (const mf::Error&) {
                ctx = mf::json::Value();
            }
        }
        if (!ctx.is_object()) ctx = default_context();
        const mf::text::jinja::Template t = mf::text::jinja::Template::parse(source, "fuzz");
        mf::text::jinja::RenderOptions opt;
        opt.now = 0;
        opt.limits.max_work = 2'000'000;
        opt.limits.max_iterations = 100'000;
        opt.limits.max_output = size_t{1} << 20;
        opt.limits.max_string = size_t{1} << 20;
        const mf::text::jinja::Rendered a = t.render(ctx, opt);
        for (const auto& [begin, end] : a.generation_spans)
            MF_FUZZ_REQUIRE(begin <= end && end <= a.text.size(), "a generation span lies outside the text");
        MF_FUZZ_REQUIRE(a.text.size() <= opt.limits.max_output, "the output exceeds max_output");
        const mf::text::jinja::Rendered b = t.render(ctx, opt);
        MF_FUZZ_REQUIRE(a.text == b.text && a.generation_spans == b.generation_spans, "two renders differ");
    });
    return 0;
}
