#!/usr/bin/env python3
"""Checks the hand-worked Jinja expectations against Jinja2 itself (no transformers needed).

The expected renderings in tests/cpu/test_jinja.cpp (EXPECT_RENDERS*) and the cases of
tests/fixtures/chat/families/cases.json (texts, learned spans: {% generation %} blocks or TRL's
prefix rule, refusals) were worked out by hand. This script renders them with jinja2 configured as
transformers' apply_chat_template configures it (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, HF's tojson, raise_exception, strftime_now) and prints every
difference: one means the hand-worked expectation is wrong, never a reason to change it to what
moeforge renders. Run from anywhere:  python3 scripts/check_jinja_expectations.py
"""
import os
os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import json, sys
import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

def env(mark):
    class Generation(Extension):
        tags = {"generation"}
        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)
        def _render(self, caller):
            return "\x00" + caller() + "\x01" if mark else caller()
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)
    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    return e

D = "tests/fixtures/chat/families"
cases = json.load(open(f"{D}/cases.json"))["cases"]
bad = 0
for c in cases:
    t = open(f"{D}/{c['template']}.jinja").read()
    v = c.get("variables", {})
    def r(msgs, agp, mark=False):
        return env(mark).from_string(t).render(messages=msgs, tools=c.get("tools"), documents=None, add_generation_prompt=agp, **v)
    try:
        text = r(c["messages"], c.get("add_generation_prompt", False))
    except Exception as e:
        ok = "render_error" in c and c["render_error"].split(": ")[-1] in str(e)
        print(("OK  " if ok else "BAD ") + c["name"], "raised", e); bad += not ok; continue
    if text != c.get("text"):
        print("BAD", c["name"], "text differs:\n  jinja2:", repr(text), "\n  hand:  ", repr(c.get("text"))); bad += 1; continue
    full = r(c["messages"], False)
    if "{% generation" in t or "{%- generation" in t:
        marked = r(c["messages"], False, True)
        learned, cur, inside = [], "", False
        for ch in marked:
            if ch == "\x00": inside, cur = True, ""
            elif ch == "\x01": inside = False; learned.append(cur)
            elif inside: cur += ch
        refused = None
    else:
        learned, refused = [], None
        for i, msg in enumerate(c["messages"]):
            if msg["role"] != "assistant": continue
            try:
                b, th = r(c["messages"][:i], True), r(c["messages"][:i+1], False)
            except Exception as e:
                refused = f"cannot find assistant message {i}'s span"; break
            if not (full.startswith(b) and full.startswith(th) and len(th) >= len(b)):
                refused = f"cannot find assistant message {i}'s span"; break
            learned.append(full[len(b):len(th)])
    if refused:
        ok = c.get("mask_error") == refused
    else:
        ok = "mask_error" not in c and learned == c.get("learned")
    print(("OK  " if ok else "BAD ") + c["name"], refused or learned if not ok else "")
    bad += not ok
print("families: bad:", bad)
family_bad = bad


# --- test_jinja.cpp ---
import re, datetime
src = open("tests/cpu/test_jinja.cpp").read()

def parse_literals(s, i):
    """Parse adjacent C++ string literals from s[i:]; return (value, new_i)."""
    out = ""
    while True:
        while s[i] in " \n\t": i += 1
        if s.startswith('R"(', i):
            j = s.index(')"', i + 3); out += s[i+3:j]; i = j + 2
        elif s[i] == '"':
            i += 1
            while s[i] != '"':
                if s[i] == "\\":
                    e = s[i+1]
                    out += {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "r": "\r"}.get(e, None) or ("\\" + e)
                    i += 2
                else:
                    out += s[i]; i += 1
            i += 1
        else:
            return out, i

def env2():
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    e.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    def raise_exception(m): raise jinja2.exceptions.TemplateError(m)
    e.globals["raise_exception"] = raise_exception
    e.globals["strftime_now"] = lambda f: datetime.datetime.fromtimestamp(1000000000).strftime(f)
    return e

n = bad = 0
for m in re.finditer(r"EXPECT_RENDERS(_WITH)?\(", src):
    if src[src.rfind("\n", 0, m.start()) + 1:m.start()].startswith("#define"):
        continue  # the macro itself
    i = m.end()
    try:
        tmpl, i = parse_literals(src, i)
        assert src[i] == ","; i += 1
        ctx = "{}"
        if m.group(1):
            # context: a literal or a variable name `ctx`
            j = i
            while src[j] in " \n": j += 1
            if src.startswith("ctx", j):
                # find the nearest preceding const char* ctx = R"(...)";
                k = src.rfind("const char* ctx = ", 0, m.start())
                ctx, _ = parse_literals(src, k + len("const char* ctx = "))
                i = j + 3
            else:
                ctx, i = parse_literals(src, i)
            assert src[i] == ","; i += 1
        exp, i = parse_literals(src, i)
    except Exception as ex:
        print("SKIP (parse)", src[m.start():m.start()+60].replace("\n", " ")); continue
    n += 1
    try:
        got = env2().from_string(tmpl).render(**json.loads(ctx))
    except Exception as ex:
        got = f"<error {type(ex).__name__}: {ex}>"
    if got != exp:
        bad += 1
        print("DIFF", repr(tmpl), "\n   jinja2:", repr(got), "\n   test:  ", repr(exp))
print("test_jinja.cpp:", n, "checked,", bad, "differ")
sys.exit(1 if bad or family_bad else 0)
