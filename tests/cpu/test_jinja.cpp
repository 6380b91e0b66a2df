// Jinja interpreter tests (text/jinja.h). Every expected string here was worked out by hand from
// Jinja2's documented semantics with transformers' settings (trim_blocks, lstrip_blocks, no
// trailing newline) and Python's str()/repr()/json.dumps, not produced by the code under test.
// The parity test renders our ChatML-family templates of tests/fixtures/chat on the conversations
// there and compares the text with transformers' apply_chat_template (scripts/make_chat_fixtures.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "chat_fixture_test_util.h"
#include "core/json.h"
#include "test_util.h"
#include "text/jinja.h"

namespace fs = std::filesystem;
using mf::text::jinja::Template;

namespace {

std::string render(std::string_view src, std::string_view context = "{}") {
    mf::text::jinja::RenderOptions opt;
    opt.now = 1000000000;  // 2001-09-09
    return Template::parse(src).render(mf::json::parse(context, "context"), opt).text;
}

// The error message of rendering `src`, or "" when it renders.
std::string error_of(std::string_view src, std::string_view context = "{}") {
    try {
        render(src, context);
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "";
}

#define EXPECT_RENDERS(src, expected) EXPECT_EQ(render(src), expected) << "template: " << (src)
#define EXPECT_RENDERS_WITH(src, ctx, expected) EXPECT_EQ(render(src, ctx), expected) << "template: " << (src)
#define EXPECT_REFUSED(src, fragment)                                                     \
    do {                                                                                  \
        const std::string msg = error_of(src);                                            \
        EXPECT_NE(msg.find(fragment), std::string::npos) << "template: " << (src) << "\n" \
                                                         << "error: " << msg;             \
    } while (0)

}  // namespace

TEST(Jinja, TextAndOutput) {
    EXPECT_RENDERS_WITH("Hello {{ name }}!", R"({"name": "World"})", "Hello World!");
    EXPECT_RENDERS("plain text\n", "plain text");          // keep_trailing_newline off: one newline dropped
    EXPECT_RENDERS("two newlines\n\n", "two newlines\n");  // only one
    EXPECT_RENDERS("a\r\nb\rc", "a\nb\nc");                // newlines normalised
    EXPECT_RENDERS("{{ missing }}|{{ missing is defined }}", "|False");
}

TEST(Jinja, WhitespaceControl) {
    EXPECT_RENDERS("{% if true %}\nyes\n{% endif %}\n", "yes\n");  // trim_blocks
    EXPECT_RENDERS("  {% if true %}x{% endif %}", "x");            // lstrip_blocks at the start
    EXPECT_RENDERS("a\n    {% if true %}\nb\n    {% endif %}\nc", "a\nb\nc");
    EXPECT_RENDERS("a  {%- if true -%}  b  {%- endif %}", "ab");
    EXPECT_RENDERS("a {{- ' x ' -}} b", "a x b");
    EXPECT_RENDERS("  {%+ if true %}x{% endif %}", "  x");               // + keeps the indentation
    EXPECT_RENDERS("{% if true +%}\nx{% endif %}", "\nx");               // + keeps the newline
    EXPECT_RENDERS("x  {{ 1 }}  {% if true %}y{% endif %}", "x  1  y");  // lstrip only at a line start
    EXPECT_RENDERS("a{# comment #}b", "ab");
    EXPECT_RENDERS("a\n  {# comment #}\nb", "a\nb");
    EXPECT_RENDERS("a {#- c -#} b", "ab");
    EXPECT_RENDERS("{% raw %}{{ x }}{% if %}{% endraw %}", "{{ x }}{% if %}");
    EXPECT_RENDERS("{{ 'a' }}\n{{ 'b' }}", "a\nb");  // no trim after }}
}

TEST(Jinja, Literals) {
    EXPECT_RENDERS(R"({{ 'a\nb\t\'c\' \u00e9 \x41' }})", "a\nb\t'c' é A");
    EXPECT_RENDERS(R"({{ "it's" }}|{{ 'x' "y" }})", "it's|xy");
    EXPECT_RENDERS("{{ 1.5 }} {{ 10 / 4 }} {{ 3 / 1 }} {{ 1e3 }} {{ 0.1 + 0.2 }}",
                   "1.5 2.5 3.0 1000.0 0.30000000000000004");
    EXPECT_RENDERS("{{ 1e20 * 10 }} {{ 1.5e-7 }} {{ 0.0001 }} {{ 123456789012345680.0 }}",
                   "1e+21 1.5e-07 0.0001 1.2345678901234568e+17");
    EXPECT_RENDERS("{{ none }} {{ None }} {{ true }} {{ False }} {{ 1_000 }}", "None None True False 1000");
    EXPECT_RENDERS("{{ [1, 'a', none, true] }}", "[1, 'a', None, True]");
    EXPECT_RENDERS(R"({{ {'a': "it's", 'b': [1.0]} }})", R"({'a': "it's", 'b': [1.0]})");
    EXPECT_RENDERS("{{ (1,) }} {{ (1, 2) }} {{ () }}", "(1,) (1, 2) ()");
    EXPECT_RENDERS("{{ 1, 2 }}", "(1, 2)");
    EXPECT_RENDERS(R"({{ ['a\nb'] }})", R"(['a\nb'])");
}

TEST(Jinja, Arithmetic) {
    EXPECT_RENDERS("{{ 10 // 4 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }}",
                   "2 -4 2 -2 1024 0.5");
    EXPECT_RENDERS("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7.5 // 2 }} {{ -2 ** 2 }}", "7 9 3.0 4");
    EXPECT_RENDERS("{{ true + 1 }} {{ 'ab' * 3 }} {{ [0] * 2 }} {{ 'a' + 'b' }} {{ [1] + [2] }}",
                   "2 ababab [0, 0] ab [1, 2]");
    EXPECT_RENDERS("{{ 1 ~ 'a' ~ none ~ missing }}", "1aNone");
    EXPECT_RENDERS("{{ 1 ~ 2 * 3 }} {{ (1 + 2) ~ 3 }}", "16 33");  // * binds tighter than ~, ~ tighter than +
}

TEST(Jinja, Comparisons) {
    EXPECT_RENDERS("{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }}",
                   "True False True True True");
    EXPECT_RENDERS("{{ 'b' in 'abc' }} {{ 2 not in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 1 in missing }}",
                   "True False True False");
    EXPECT_RENDERS("{{ 1 == '1' }} {{ none == none }} {{ missing == missing }} {{ true == 1 }}",
                   "False True True True");
    EXPECT_RENDERS("{{ not 1 }} {{ 0 or 'x' }} {{ 1 and 'y' }} {{ '' and 'z' }}|", "False x y |");
    EXPECT_RENDERS("{{ 'y' if true else 'n' }}{{ 'y' if false }}{{ 'a' if 0 else 'b' if 1 else 'c' }}", "yb");
}

TEST(Jinja, AttributesItemsSlices) {
    const char* ctx = R"({"d": {"a": 1, "items": 5, "n": {"m": "deep"}}, "l": [1, 2, 3, 4, 5], "s": "héllo"})";
    EXPECT_RENDERS_WITH("{{ d.a }} {{ d['a'] }} {{ d.n.m }} {{ d.missing }}|{{ d['items'] }}", ctx, "1 1 deep |5");
    EXPECT_RENDERS_WITH(
        "{{ l[0] }} {{ l[-1] }} {{ l[10] }}|{{ l[1:3] }} {{ l[::2] }} {{ l[::-1] }} {{ l[-2:] }} {{ l[1:4:2] }}", ctx,
        "1 5 |[2, 3] [1, 3, 5] [5, 4, 3, 2, 1] [4, 5] [2, 4]");
    EXPECT_RENDERS_WITH("{{ s[1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s|length }} {{ s.0 }}", ctx, "é él olléh 5 h");
    EXPECT_RENDERS_WITH("{{ none.x }}|{{ 3.x }}|{{ l.x }}", ctx, "||");
}

TEST(Jinja, Loops) {
    EXPECT_RENDERS("{% for x in [1,2,3] %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}",
                   "11,22,33");
    EXPECT_RENDERS(
        "{% for x in 'abc' %}{{ loop.previtem|default('^') }}{{ x }}{{ loop.nextitem|default('$') }} {% endfor %}",
        "^ab abc bc$ ");
    EXPECT_RENDERS(
        "{% for x in [5,6] %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.length "
        "}};{% endfor %}",
        "021True2;110False2;");
    EXPECT_RENDERS("{% for x in [] %}x{% else %}empty{% endfor %}", "empty");
    EXPECT_RENDERS("{% for x in missing %}x{% else %}none{% endfor %}", "none");
    EXPECT_RENDERS("{% for x in range(10) if x is odd %}{{ x }}{{ loop.length }};{% endfor %}", "15;35;55;75;95;");
    EXPECT_RENDERS(
        "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x "
        "}}{% endfor %}",
        "0134");
    EXPECT_RENDERS("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}", "a=1;b=2;");
    EXPECT_RENDERS("{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}", "ab");
    EXPECT_RENDERS("{% for (a, b) in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}", "37");
    EXPECT_RENDERS(
        "{% for x in [1, 2] %}{% for y in 'ab' %}{{ loop.index }}{{ y }}{% endfor %}{{ loop.index }}|{% endfor %}",
        "1a2b1|1a2b2|");
    EXPECT_RENDERS("{% for x in range(3) %}{{ loop.cycle('a', 'b') }}{% endfor %}|{{ range(2, 8, 3)|list }}",
                   "aba|[2, 5]");
}

TEST(Jinja, ScopesAndNamespaces) {
    EXPECT_RENDERS("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}", "21");
    EXPECT_RENDERS("{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", "2");
    EXPECT_RENDERS(
        "{% set ns = namespace(n=0, s='') %}{% for i in [1,2,3] %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% "
        "endfor %}{{ ns.n }} {{ ns.s }}",
        "6 123");
    EXPECT_RENDERS("{% set a, b = 1, 2 %}{{ b }}{{ a }}", "21");
    EXPECT_RENDERS("{% set x %}a{{ 1 + 1 }}b{% endset %}{{ x }}|{{ x | length }}", "a2b|3");
    EXPECT_RENDERS("{% set x | upper %}abc{% endset %}{{ x }}", "ABC");
    EXPECT_RENDERS("{% set d = dict(a=1, b='x') %}{{ d.b }}{{ d|length }}", "x2");
}

TEST(Jinja, Macros) {
    EXPECT_RENDERS(
        "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
        "{{ greet('a') }} {{ greet('b', punct='?') }} {{ greet(name='c') }} {{ greet() }}",
        "Hi a! Hi b? Hi c! Hi !");
    EXPECT_RENDERS(
        "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}in{% endcall %}",
        "<b>in</b>");
    EXPECT_RENDERS(
        "{% macro list(xs) %}{% for x in xs %}{{ x }}{% if x is iterable and x is not string %}[{{ list(x) }}]{% endif "
        "%}{% endfor %}{% endmacro %}{{ list([1, [2, [3]]]) }}",
        "1[2, [3]][2[3][3]]");
    EXPECT_RENDERS("{% macro f() %}{{ varargs|length }}{{ kwargs.k }}{% endmacro %}{{ f(1, 2, k='v') }}", "2v");
    EXPECT_RENDERS("{% set g = 'global' %}{% macro f() %}{{ g }}{% endmacro %}{{ f() }}", "global");
}

TEST(Jinja, StringMethods) {
    EXPECT_RENDERS(
        "{{ '  a b  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '\n a'.lstrip() }}|{{ 'a \n'.rstrip() }}|{{ "
        "'\u3000a'.strip() }}",
        "a b|hi|a|a|a");
    EXPECT_RENDERS("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }}",
                   "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b c']");
    EXPECT_RENDERS("{{ 'a-b-c'.replace('-', '+') }} {{ 'a-b-c'.replace('-', '', 1) }} {{ 'ab'.replace('', '.') }}",
                   "a+b+c ab-c .a.b.");
    EXPECT_RENDERS("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'abc'.startswith('c') }}",
                   "True True False");
    EXPECT_RENDERS("{{ 'Hello'.upper() }} {{ 'Hello'.lower() }} {{ 'hello wORLD'.title() }} {{ 'hELLO'.capitalize() }}",
                   "HELLO hello Hello World Hello");
    EXPECT_RENDERS("{{ 'abcb'.find('b') }} {{ 'abcb'.rfind('b') }} {{ 'abcb'.count('b') }} {{ ', '.join(['x', 'y']) }}",
                   "1 3 2 x, y");
    EXPECT_RENDERS("{{ '</think>'.join(['a', 'b']).split('</think>')[-1] }}", "b");
}

TEST(Jinja, DictAndListMethods) {
    const char* ctx = R"({"d": {"b": 1, "a": 2}})";
    EXPECT_RENDERS_WITH(
        "{{ d.keys()|list }} {{ d.values()|list }} {{ d.items()|list }} {{ d.get('a') }} {{ d.get('z') }} {{ "
        "d.get('z', 0) }}",
        ctx, "['b', 'a'] [1, 2] [('b', 1), ('a', 2)] 2 None 0");
    EXPECT_RENDERS("{{ [1, 2, 1].count(1) }} {{ [1, 2].index(2) }}", "2 1");
}

TEST(Jinja, Filters) {
    EXPECT_RENDERS(
        "{{ x|default('d') }} {{ ''|default('d') }}|{{ ''|default('d', true) }} {{ x|d('z') }} {{ none|default('n') }}",
        "d |d z None");
    EXPECT_RENDERS("{{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true)|join(',') }} {{ ['b', 'A', 'c']|sort }}",
                   "[1, 2, 3] 3,2,1 ['A', 'b', 'c']");
    EXPECT_RENDERS(
        "{{ [1, 2, 2, 3]|unique|list }} {{ ['a', 'A', 'b']|unique|list }} {{ [1, 2, 3]|sum }} {{ [1, 5, 3]|max }} {{ "
        "[4, 2]|min }}",
        "[1, 2, 3] ['a', 'b'] 6 5 2");
    EXPECT_RENDERS("{{ [{'a': 1}, {'a': 2}]|map(attribute='a')|list }} {{ ['a', 'b']|map('upper')|join }}",
                   "[1, 2] AB");
    EXPECT_RENDERS(
        "{{ [1, 2, 3, 4]|select('even')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} {{ [0, 1, '', 'x']|select|list "
        "}}",
        "[2, 4] [2, 4] [1, 'x']");
    EXPECT_RENDERS(
        "{{ [{'t': 'x'}, {'t': 'y'}, {}]|selectattr('t', 'equalto', 'y')|list }} {{ [{'t': 1}, "
        "{}]|rejectattr('t')|list }} {{ [{'t': 1}, {}]|selectattr('t', 'defined')|list|length }}",
        "[{'t': 'y'}] [{}] 1");
    EXPECT_RENDERS(
        "{{ [1, 2, 3, 4, 5]|batch(2)|list }} {{ [1, 2]|reverse|list }} {{ 'abc'|reverse }} {{ [1, 2]|first }} {{ "
        "'xy'|last }} {{ []|first }}|",
        "[[1, 2], [3, 4], [5]] [2, 1] cba 1 y |");
    EXPECT_RENDERS(
        "{{ 'hello world-wide'|title }} {{ 'hello'|capitalize }} {{ 'ABC'|lower }} {{ 'abc'|upper }} {{ '  x  '|trim "
        "}} {{ 'aXa'|trim('a') }}",
        "Hello World-Wide Hello abc ABC x X");
    EXPECT_RENDERS(
        "{{ 'a.b.c'|replace('.', '/') }} {{ [1, 2]|length }} {{ {'a': 1}|count }} {{ 'héllo'|length }} {{ {'a': "
        "1}|items|list }}",
        "a/b/c 2 1 5 [('a', 1)]");
    EXPECT_RENDERS(
        "{{ '42'|int + 1 }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.7|int }} {{ '2.5'|float }} {{ '3.5'|int }} {{ 4|float "
        "}}",
        "43 0 7 3 2.5 3 4.0");
    EXPECT_RENDERS(
        "{{ 2.5|round }} {{ 3.5|round }} {{ 3.14159|round(2) }} {{ 3.14159|round(1, 'floor') }} {{ -3|abs }} {{ "
        "7|round }}",
        "2.0 4.0 3.14 3.1 3 7");
    EXPECT_RENDERS("{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent('> ', blank=true) }}",
                   "a\n  b\n\n  c|  a\n  b|a\n> \n> b");
    EXPECT_RENDERS("{{ 1|string ~ 2 }} {{ '<a>'|safe }} {{ '<a & \"b\">'|e }} {{ 'a b  c'|wordcount }}",
                   "12 <a> &lt;a &amp; &#34;b&#34;&gt; 3");
    EXPECT_RENDERS("{% filter upper %}abc{{ 'd' }}{% endfilter %}", "ABCD");
    EXPECT_RENDERS("{{ {'b': 1, 'a': 2}|dictsort }}", "[('a', 2), ('b', 1)]");
}

TEST(Jinja, ToJson) {
    EXPECT_RENDERS(R"({{ {'a': 'é', 'b': [1, 2.5, true, none]}|tojson }})", R"({"a": "é", "b": [1, 2.5, true, null]})");
    EXPECT_RENDERS("{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}", R"({"a": 2, "b": 1})");
    EXPECT_RENDERS("{{ {'a': [1], 'e': {}}|tojson(indent=2) }}", "{\n  \"a\": [\n    1\n  ],\n  \"e\": {}\n}");
    EXPECT_RENDERS("{{ [1, {'k': 2}]|tojson(separators=(',', ':')) }}", R"([1,{"k":2}])");
    EXPECT_RENDERS(R"({{ 'a"b\n\u0001/'|tojson }})", R"("a\"b\n\u0001/")");
    EXPECT_RENDERS("{{ 'é'|tojson(ensure_ascii=true) }} {{ '😀'|tojson(true) }}", R"("\u00e9" "\ud83d\ude00")");
    EXPECT_RENDERS("{{ (1, 2)|tojson }} {{ 1.0|tojson }} {{ {1: 'x'}|tojson }}", R"([1, 2] 1.0 {"1": "x"})");
    EXPECT_RENDERS("{{ '<b>&'|tojson }}", R"("<b>&")");  // HF's tojson does not HTML-escape
}

TEST(Jinja, Tests) {
    EXPECT_RENDERS(
        "{{ x is defined }} {{ x is undefined }} {{ x is not defined }} {{ none is none }} {{ 'a' is string }}",
        "False True True True True");
    EXPECT_RENDERS(
        "{{ {} is mapping }} {{ [] is iterable }} {{ 'a' is sequence }} {{ 1 is number }} {{ true is number }}",
        "True True True True True");
    EXPECT_RENDERS(
        "{{ 1 is integer }} {{ true is integer }} {{ 1.0 is float }} {{ true is boolean }} {{ 1 is true }} {{ true is "
        "true }} {{ false is false }}",
        "True False True True False True True");
    EXPECT_RENDERS(
        "{{ 6 is divisibleby 3 }} {{ 6 is divisibleby(4) }} {{ 3 is odd }} {{ 3 is even }} {{ 'a' is eq 'a' }} {{ 2 is "
        "gt 1 }} {{ 'a' is in 'cat' }}",
        "True False True False True True True");
    EXPECT_RENDERS("{{ 'abc' is lower }} {{ 'aBc' is upper }} {{ range is callable }}", "True False True");
}

TEST(Jinja, GlobalsAndGenerationBlocks) {
    EXPECT_RENDERS("{{ strftime_now('%Y') }}", "2001");
    const Template t = Template::parse("A{% generation %}bc{% endgeneration %}D{% generation %}{% endgeneration %}");
    EXPECT_TRUE(t.has_generation_blocks());
    const mf::text::jinja::Rendered r = t.render(mf::json::Value::object());
    EXPECT_EQ(r.text, "AbcD");
    ASSERT_EQ(r.generation_spans.size(), 2u);
    EXPECT_EQ(r.generation_spans[0], std::make_pair(size_t{1}, size_t{3}));
    EXPECT_EQ(r.generation_spans[1], std::make_pair(size_t{4}, size_t{4}));
    EXPECT_FALSE(Template::parse("x").has_generation_blocks());
}

// --- errors and hostile templates ------------------------------------------------------------------

TEST(JinjaErrors, Syntax) {
    EXPECT_REFUSED("{% for x in y %}abc",
                   "chat_template:1:20: expected 'else' or 'endfor' before the end of the template "
                   "(the 'for' at 1:4 is not closed)");
    EXPECT_REFUSED("line1\n{% if x %}a", "chat_template:2:12: expected 'elif', 'else' or 'endif'");
    EXPECT_REFUSED("{% if x %}a{% endfor %}",
                   "chat_template:1:15: unexpected 'endfor' (expected 'elif', 'else' or 'endif')");
    EXPECT_REFUSED("{{ x | nosuch }}", "chat_template:1:8: no filter named 'nosuch'");
    EXPECT_REFUSED("{{ x is nosuch }}", "chat_template:1:9: no test named 'nosuch'");
    EXPECT_REFUSED("{{ 'abc }}", "chat_template:1:4: unterminated string literal");
    EXPECT_REFUSED("{{ 1 + }}", "chat_template:1:8: expected an expression, got '}}'");
    EXPECT_REFUSED("{{ x", "chat_template:1:1: unclosed '{{': expected '}}'");
    EXPECT_REFUSED("{# abc", "chat_template:1:1: unclosed comment");
    EXPECT_REFUSED("{% set %}", "expected a variable name");
    EXPECT_REFUSED("{% include 'x' %}", "the 'include' tag is not supported");
    EXPECT_REFUSED("{% frobnicate %}", "chat_template:1:4: unknown tag 'frobnicate'");
    EXPECT_REFUSED("{% break %}", "'break' outside a loop");
    EXPECT_REFUSED("{{ (1 }}", "unexpected '}'");
    EXPECT_REFUSED("{{ 99999999999999999999 }}", "out of range");
    EXPECT_REFUSED("{{ " + std::string(1000, '(') + "1" + std::string(1000, ')') + " }}",
                   "nests deeper than 200 levels");
    std::string nested_ifs;
    for (int k = 0; k < 300; ++k) nested_ifs += "{% if 1 %}";
    EXPECT_REFUSED(nested_ifs, "nests deeper than 200 levels");
    EXPECT_REFUSED("{% for x in y recursive %}{% endfor %}", "recursive loops are not supported");
}

TEST(JinjaErrors, Runtime) {
    EXPECT_REFUSED("{{ foo.bar }}", "chat_template:1:7: 'foo' is undefined");
    EXPECT_EQ(error_of("{{ d.missing.z }}", R"({"d": {}})")
                  .find("chat_template:1:13: 'dict object' has no attribute 'missing'"),
              0u)
        << error_of("{{ d.missing.z }}", R"({"d": {}})");
    EXPECT_REFUSED("{{ missing + 1 }}", "'missing' is undefined");
    EXPECT_REFUSED("{{ [1].append(2) }}", "access to attribute 'append' of 'list' object is unsafe");
    EXPECT_REFUSED("{{ {}.update({}) }}", "access to attribute 'update' of 'dict' object is unsafe");
    EXPECT_REFUSED("{{ raise_exception('bad role') }}",
                   "chat_template:1:19: the template raised an exception: bad role");
    EXPECT_REFUSED("{{ 'a' + 1 }}", "unsupported operand type(s) for +: 'str' and 'int'");
    EXPECT_REFUSED("{{ 1 + 2 ~ 3 }}", "unsupported operand type(s) for +: 'int' and 'str'");  // 1 + (2 ~ 3)
    EXPECT_REFUSED("{{ 1 // 0 }}", "integer division or modulo by zero");
    EXPECT_REFUSED("{{ 9223372036854775807 + 1 }}", "integer overflow");
    EXPECT_REFUSED("{{ 'a' < 1 }}", "'<' not supported between instances of 'str' and 'int'");
    EXPECT_REFUSED("{% for x in 5 %}{% endfor %}", "'int' object is not iterable");
    EXPECT_REFUSED("{% set a, b = [1] %}", "not enough values to unpack");
    EXPECT_REFUSED("{% set x = 1 %}{% set x.y = 2 %}", "cannot assign attribute 'y' on 'x'");
    EXPECT_REFUSED("{{ 'x' % 1 }}", "string formatting is not supported");
    EXPECT_REFUSED("{{ 'É'|lower }}", "case mapping of non-ASCII letters is not supported");
    EXPECT_REFUSED("{{ 1 | tojson(indent=[]) }}", "indent must be an integer or a string");
    EXPECT_REFUSED("{{ missing|tojson }}", "not JSON serializable");
}

TEST(JinjaErrors, HostileTemplatesAreBounded) {
    EXPECT_REFUSED("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "macro calls nest deeper than 64");
    EXPECT_REFUSED("{% for i in range(1000000000) %}{% endfor %}", "exceeds the loop limit");
    EXPECT_REFUSED(
        "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(10) %}{% endfor %}{% endfor %}{% endfor "
        "%}",
        "loops run more than 1000000 iterations");
    EXPECT_REFUSED("{{ 'a' * 100000000 }}", "exceeds 16777216 bytes");
    EXPECT_REFUSED(
        "{% set ns = namespace(s='') %}{% for i in range(1000000) %}{% set ns.s = ns.s ~ 'xxxxxxxxxx' %}{% endfor %}",
        "evaluation steps");
    EXPECT_REFUSED("{% set ns = namespace(l=[]) %}{% for i in range(1000000) %}{% set ns.l = ns.l + [i] %}{% endfor %}",
                   "evaluation steps");
    mf::text::jinja::RenderOptions small;
    small.limits.max_output = 1000;
    try {
        Template::parse("{% for i in range(100) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}")
            .render(mf::json::Value::object(), small);
        ADD_FAILURE() << "an output over max_output was rendered";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("chat_template:1:26: the template renders more than 1000 bytes"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_REFUSED("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
                   "evaluation steps");
}

// --- parity with transformers on the templates of tests/fixtures/chat -------------------------------

TEST(JinjaParity, FixtureTemplatesRenderAsTransformers) {
    const fs::path dir = fs::path(mf::test::fixtures_dir()) / "chat";
    const std::string stale = mf::test::stale_chat_fixtures(dir);
    ASSERT_TRUE(stale.empty()) << stale;
    const mf::json::Value templates =
        *mf::json::parse(mf::test::read_file(dir / "templates.json"), "templates.json").find("templates");
    std::istringstream in(mf::test::read_file(dir / "expected.jsonl"));
    std::string line;
    int num = 0;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        const mf::json::Value rec = mf::json::parse(line, "expected.jsonl");
        const std::string& name = rec.find("template")->as_string();
        const Template t = Template::parse(templates.find(name)->find("template")->as_string(), name);
        mf::json::Value ctx = mf::json::Value::object();
        if (const mf::json::Value* v = rec.find("variables"))
            for (const auto& [k, x] : v->as_object()) ctx.set(k, x);
        ctx.set("messages", *rec.find("messages"));
        ctx.set("tools", rec.find("tools") != nullptr ? *rec.find("tools") : mf::json::Value());
        ctx.set("documents", mf::json::Value());
        const mf::json::Value* agp = rec.find("add_generation_prompt");
        ctx.set("add_generation_prompt", agp != nullptr && agp->as_bool());
        EXPECT_EQ(t.render(ctx).text, rec.find("text")->as_string()) << name << " record " << num;
        ++num;
    }
    EXPECT_GE(num, 100);
}
