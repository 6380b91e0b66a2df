#!/usr/bin/env python3
"""Builds the chat-template parity fixtures in tests/fixtures/chat/ with Hugging Face `transformers`.

The templates are ours, written for these tests: ChatML-family templates in the layouts moeforge's
fast path renders (chatml, chatml_system, chatml_think, text/chat.h), each with its own tools system
turn, tool calls, tool responses and generation prompt:

  chatml_tools        ChatML turns; tools described in the system turn, tool calls as JSON in
                      <tool_call> tags, tool results gathered into a user turn of <tool_response>s
  system_default      a default system message of its own text when the conversation opens without
                      one; tools appended to that system turn; tool results as `tool` turns
  hybrid_think        hybrid thinking: answers after the last real question carry a <think> block
                      (empty on the final answer when it has no reasoning), earlier answers drop
                      theirs; enable_thinking=false closes an empty block in the generation prompt
  tokenizer_default   the fixture tokenizer's own template (tests/fixtures/tokenizer/tokenizer_config.json)

Each is written once with {% generation %} blocks around what moeforge learns in an assistant turn
(everything after "<|im_start|>assistant\n" up to and including "<|im_end|>\n"); the model's
template is that text with the generation tags removed (they render nothing), so the two cannot
drift apart. For each template and each conversation below it records what
`tokenizer.apply_chat_template` answers with the fixture tokenizer (tests/fixtures/tokenizer):

  expected.jsonl  one JSON object a line:
                  {template, format, messages, tools?, add_generation_prompt?, variables?, text,
                   input_ids, assistant_masks?}
                  text       apply_chat_template(messages, tools=..., tokenize=False, ...) with the
                             model's template
                  input_ids  apply_chat_template(..., tokenize=True) (checked equal to
                             tokenizer(text, add_special_tokens=False))
                  assistant_masks  (conversations without the generation prompt) HF's
                             return_assistant_tokens_mask=True with the generation-tagged template,
                             checked against the tags' spans mapped through the offsets
  templates.json  {"templates": {name: {"template", "format", "default_system"?}},
                   "conversations": [...]}: the model templates, the fast-path format each must be
                  recognised as (by moeforge's probes), and the training conversations
  fixture_info.json  versions, counts, problems, and the FNV-1a 64 hashes of templates.json and
                  expected.jsonl as written together: tests/cpu/test_chat.cpp refuses to compare
                  with an expected.jsonl that was not made from the templates.json beside it

With --families it renders instead the family-style templates of tests/fixtures/chat/families/
(*.jinja, ours, written in the style of DeepSeek-V3, GLM-4.5, Mistral, gpt-oss harmony, Nemotron 3,
Kimi-K2) on the cases of families/cases.json, whose expected texts were worked out by hand, and
writes families_hf.jsonl, one line per case:
  {name, text}             apply_chat_template(tokenize=False) with the case's tools,
                           add_generation_prompt and variables; or {name, error} when HF raises
  train_input_ids          apply_chat_template(tokenize=True, add_generation_prompt=False)
  train_assistant_masks    return_assistant_tokens_mask=True (templates with {% generation %})
  train_prefix_masks       templates without it: TRL's prefix rule done here with HF renderings
                           (messages[:i] with the generation prompt, messages[:i+1] without) and
                           HF's char_to_token rule on the offsets; or prefix_refused: the reason
  hand_text_equal          whether HF's text equals the hand-worked one (the script reports each
                           difference: a mismatch means the hand-worked expectation is wrong)
tests/cpu/test_chat.cpp (ChatTemplate.FamilyTemplatesMatchTransformersFixtures) compares moeforge
with it when the file is present.

Usage (needs `transformers`, on the GPU machine):
    python3 scripts/make_chat_fixtures.py --out $OUT/chat     # then copy expected.jsonl,
                                                              # templates.json, fixture_info.json
    python3 scripts/make_chat_fixtures.py --families --out $OUT/chat   # then copy families_hf.jsonl
Without transformers, --render-only renders every template and conversation with jinja2 alone
(HF's environment and tojson), checks the tagged and untagged templates agree and the generation
spans, and writes templates.json (only) to --out when given.
The outputs are committed; this script is only re-run when the fixtures must change.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "tests", "fixtures", "tokenizer")

# --- our templates, generation-tagged ----------------------------------------------------------------
# NOTE: every tag opens with "-", so removing the generation tags (and the newline trim_blocks
# drops after them) leaves the rendering unchanged.

GEN_OPEN, GEN_CLOSE = "{%- generation %}", "{%- endgeneration %}"

# Shared by chatml_tools and hybrid_think: the tools paragraph of the system turn, and one tool call.
TOOL_MACROS = r"""{%- macro tools_paragraph(tools) %}
    {{- '## Available tools\n\nEach line inside <tools></tools> describes one function you may call:\n<tools>' }}
    {%- for t in tools %}
        {{- '\n' ~ (t | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, reply with {"name": <the function>, "arguments": <a JSON object>} between <tool_call> and </tool_call>.' }}
{%- endmacro %}
{%- macro one_call(call) %}
    {%- set f = call.function if call.function is defined else call %}
    {{- '<tool_call>\n{"name": "' ~ f.name ~ '", "arguments": ' }}
    {%- if f.arguments is string %}
        {{- f.arguments }}
    {%- else %}
        {{- f.arguments | tojson }}
    {%- endif %}
    {{- '}\n</tool_call>' }}
{%- endmacro %}
{%- macro system_turn(messages, tools) %}
    {%- set opens_with_system = messages | length > 0 and messages[0].role == 'system' %}
    {%- if tools %}
        {{- '<|im_start|>system\n' }}
        {%- if opens_with_system %}
            {{- messages[0].content ~ '\n\n' }}
        {%- endif %}
        {{- tools_paragraph(tools) ~ '<|im_end|>\n' }}
    {%- elif opens_with_system %}
        {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endmacro %}
{%- macro tool_result(messages, i, text) %}
    {%- if i == 0 or messages[i - 1].role != 'tool' %}
        {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\n<tool_response>\n' ~ text ~ '\n</tool_response>' }}
    {%- if i + 1 == messages | length or messages[i + 1].role != 'tool' %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endmacro %}
"""

CHATML_TOOLS = r"""{#- moeforge test template: ChatML turns, tools in the system turn, tool calls in <tool_call>
    tags, tool results gathered into a user turn. -#}
""" + TOOL_MACROS + r"""{{- system_turn(messages, tools) }}
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'tool' %}
        {{- tool_result(messages, loop.index0, text) }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}{%- generation %}
        {{- text }}
        {%- for call in m.tool_calls or [] %}
            {{- ('\n' if text or not loop.first else '') ~ one_call(call) }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}{%- endgeneration %}
    {%- elif not (loop.first and m.role == 'system') %}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ text ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

SYSTEM_DEFAULT_TEXT = "You are the moeforge test assistant: answer plainly, and check your arithmetic."

SYSTEM_DEFAULT = r"""{#- moeforge test template: ChatML with a default system message of its own when the
    conversation opens without one; tools are appended to the system turn, tool results are turns
    of their own. -#}
{%- if messages | length > 0 and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = '""" + SYSTEM_DEFAULT_TEXT + r"""' %}
    {%- set turns = messages %}
{%- endif %}
{{- '<|im_start|>system\n' ~ system_text }}
{%- if tools %}
    {{- '\n\n# Functions\n\nThese functions are available; their JSON schemas follow, one per line.\n<tools>' }}
    {{- '\n' ~ (tools | map('tojson') | join('\n')) }}
    {{- '\n</tools>\nCall one by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for m in turns %}
    {%- if m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}{%- generation %}
        {{- m.content if m.content is string else '' }}
        {%- if m.tool_calls %}
            {%- for c in m.tool_calls %}
                {%- set f = c.function if c.function is defined else c %}
                {{- '\n<tool_call>\n' ~ ({'name': f.name, 'arguments': f.arguments} | tojson) ~ '\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}{%- endgeneration %}
    {%- else %}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

HYBRID_THINK = r"""{#- moeforge test template: ChatML with hybrid thinking. An answer after the last real question
    (a user turn that is not a whole <tool_response>) carries a <think> block, an empty one when it
    is the final answer and has no reasoning; earlier answers drop their reasoning. Reasoning is the
    reasoning_content field, else the text before </think>. -#}
""" + TOOL_MACROS + r"""{%- set seen = namespace(query=messages | length - 1) %}
{%- for m in messages %}
    {%- set is_result = m.content is string and m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>') %}
    {%- if m.role == 'user' and not is_result %}
        {%- set seen.query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{{- system_turn(messages, tools) }}
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'tool' %}
        {{- tool_result(messages, loop.index0, text) }}
    {%- elif m.role == 'assistant' %}
        {%- set part = namespace(thought='', answer=text) %}
        {%- if m.reasoning_content is string %}
            {%- set part.thought = m.reasoning_content %}
        {%- elif '</think>' in text %}
            {%- set pieces = text.split('</think>') %}
            {%- set part.thought = ((pieces | first).rstrip('\n').split('<think>') | last).lstrip('\n') %}
            {%- set part.answer = (pieces | last).lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}{%- generation %}
        {%- if loop.index0 > seen.query and (loop.last or part.thought) %}
            {{- '<think>\n' ~ part.thought.strip('\n') ~ '\n</think>\n\n' ~ part.answer.lstrip('\n') }}
        {%- else %}
            {{- part.answer }}
        {%- endif %}
        {%- for call in m.tool_calls or [] %}
            {{- ('\n' if part.answer or not loop.first else '') ~ one_call(call) }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}{%- endgeneration %}
    {%- elif not (loop.first and m.role == 'system') %}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ text ~ '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# The fixture tokenizer's template (tests/fixtures/tokenizer/tokenizer_config.json, written by
# scripts/make_tokenizer_fixtures.py) with generation blocks; the script checks both render alike.
TOKENIZER_DEFAULT_TAGGED = (
    "{%- if messages and messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' %}{%- generation %}{{- m.content + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def untagged(tagged):
    return tagged.replace(GEN_OPEN, "").replace(GEN_CLOSE, "")


def load_templates():
    """name -> (model template, generation-tagged template, moeforge format, default system text or None)."""
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        shipped = json.load(f)["chat_template"]
    out = {
        "chatml_tools": (untagged(CHATML_TOOLS), CHATML_TOOLS, "chatml", None),
        "system_default": (untagged(SYSTEM_DEFAULT), SYSTEM_DEFAULT, "chatml_system", SYSTEM_DEFAULT_TEXT),
        "hybrid_think": (untagged(HYBRID_THINK), HYBRID_THINK, "chatml_think", None),
        "tokenizer_default": (shipped, TOKENIZER_DEFAULT_TAGGED, "chatml_system", "You are a helpful assistant."),
    }
    return out


# --- conversations -----------------------------------------------------------------------------------

def U(c):
    return {"role": "user", "content": c}


def A(c, reasoning=None):
    m = {"role": "assistant", "content": c}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


def S(c):
    return {"role": "system", "content": c}


CONVERSATIONS = [
    [U("What is 2 + 3?"), A("2 + 3 = 5.")],
    [S("You are a terse assistant."), U("Capital of France?"), A("Paris.")],
    [U("Hi!"), A("Hello! How can I help?"), U("Tell me a joke."), A("Why did the tensor cross the road? To broadcast."),
     U("Another one?"), A("I'm all out of jokes.")],
    [S("Отвечай кратко."), U("Какая столица Казахстана?"), A("Астана.")],
    [U("مرحبا! كيف حالك؟"), A("أنا بخير، شكرا لك. وأنت؟")],
    [U("Сәлем! Қалың қалай?"), A("Жақсы, рахмет! Сізде ше?")],
    [S("你是一个乐于助人的助手。"), U("你好，请介绍一下机器学习。"), A("机器学习是人工智能的一个分支，让计算机从数据中学习。")],
    [U("日本語で挨拶してください。"), A("こんにちは！今日はいい天気ですね。"), U("한국어로도요."), A("안녕하세요!")],
    # content opening with newlines and ending in spaces: a token straddles the header boundary
    [U("Indent this:\n\n  x = 1"), A("\n\n    x = 1  ")],
    [U("\n leading newline in the user turn"), A("\r\nwindows newline first\r\n")],
    # empty assistant content, and one that is only a newline
    [U("Say nothing."), A(""), U("Now a newline."), A("\n")],
    # special-token text inside content
    [U("Print <|im_end|> literally, then <|im_start|>."), A("Here: <|im_end|> and <|im_start|>assistant\nok")],
    [U("mask test"), A("<|mask|> starts this answer, and <|endoftext|> sits inside")],
    # reasoning: inline <think> in the last and an earlier turn, and the reasoning_content field
    [U("Think first: 7 * 6?"), A("<think>\n7 * 6 = 42\n</think>\n\n42")],
    [U("First?"), A("<think>old reasoning</think>First answer."), U("Second?"), A("<think>\nnew reasoning\n\n</think>Second answer.")],
    [U("Use the field."), A("Answer with field.", reasoning="\nreasoning from the field\n")],
    [U("Empty field."), A("Answer.", reasoning="")],
    # assistant turns after a tool-response-looking user turn (Qwen3: still after the last query)
    [U("Look it up."), A("<think>need a tool</think>Calling."), U("<tool_response>\n42\n</tool_response>"),
     A("The answer is 42.")],
    [U("Two answers in a row?"), A("First part."), A("<think>more</think>Second part.")],
    # no user message at all, a system message in the middle, a conversation ending on a user turn
    [A("I speak first.")],
    [U("Hello"), A("Hi."), S("Be formal from now on."), U("How are you?"), A("I am well, thank you.")],
    [S("System only, then a user question."), U("No answer yet?")],
    # emoji, combining marks (NFC), tabs, trailing whitespace, digits
    [U("Emoji 👍🏽 and café (cafe\u0301)?"), A("👩‍💻 writes code\tat 3.14 o'clock   ")],
    [U("Count: 1 12 123 1234 12345"), A("1, 12, 123, 1234, 12345 — done.")],
    [U("Reverse 'stressed'."), A("desserts")],
]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Sum of two numbers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                                                      "b": {"type": "number"}}}}},
]


def CALL(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def T(c, name):
    return {"role": "tool", "name": name, "content": c}


# Conversations with tools: only the model's template renders them (moeforge's interpreter path).
TOOL_CONVERSATIONS = [
    [U("Weather in Almaty?"), {"role": "assistant", "content": "", "tool_calls": [CALL("get_weather", {"city": "Almaty"})]},
     T("sunny, 21 C", "get_weather"), A("It is sunny and 21 C in Almaty.")],
    [S("Use tools when they help."), U("2.5 + 4, and the weather in Paris?"),
     {"role": "assistant", "content": "Both at once.",
      "tool_calls": [CALL("add", {"a": 2.5, "b": 4}), CALL("get_weather", '{"city": "Paris"}')]},
     T("6.5", "add"), T("rain", "get_weather"), A("6.5, and it rains in Paris.")],
    [U("No tool needed: say hi."), A("Hi!")],
]

# Generation prompts (text and ids only): name -> (messages, extra template variables).
GENERATION_CASES = [
    ([U("Hello there.")], {}),
    ([S("Be brief."), U("Q1"), A("A1"), U("Q2")], {}),
    ([U("Quick answer, no thinking.")], {"enable_thinking": False}),
]


# --- rendering ---------------------------------------------------------------------------------------

def hf_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson filter (jinja2's own sorts keys and escapes HTML)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def jinja_env(mark_generation):
    # The environment transformers compiles chat templates in (trim_blocks, lstrip_blocks, its
    # tojson), with a stand-in for its {% generation %} extension that renders the block between
    # \x00 and \x01 when mark_generation is set: an independent way to the assistant mask.
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return "\x00" + caller() + "\x01" if mark_generation else caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = hf_tojson
    return env


def jinja_render(template, case, mark_generation=False):
    return jinja_env(mark_generation).from_string(template).render(
        messages=case["messages"], tools=case.get("tools"), documents=None,
        add_generation_prompt=case.get("add_generation_prompt", False), **case.get("variables", {}))


def generation_spans(tagged, case):
    """Rendered text and the [start, end) character spans of its generation blocks."""
    marked = jinja_render(tagged, case, True)
    text, spans, start = "", [], None
    for ch in marked:
        if ch == "\x00":
            start = len(text)
        elif ch == "\x01":
            spans.append((start, len(text)))
        else:
            text += ch
    return text, spans


def all_cases():
    """Every rendered case: {messages, tools?, add_generation_prompt?, variables?}."""
    cases = [{"messages": c} for c in CONVERSATIONS]
    cases += [{"messages": c, "tools": TOOLS} for c in TOOL_CONVERSATIONS]
    cases += [{"messages": m, "add_generation_prompt": True, "variables": v} for m, v in GENERATION_CASES]
    return cases


def mask_from_offsets(offsets, spans):
    """HF's rule: tokens from the one holding a span's first character to the one holding its last."""
    def char_to_token(c):
        for j, (s, e) in enumerate(offsets):
            if s <= c < e:
                return j
        return None

    mask = [0] * len(offsets)
    for s, e in spans:
        if e <= s:
            continue
        a, b = char_to_token(s), char_to_token(e - 1)
        if a is None or b is None:
            raise ValueError(f"span {s}:{e} has no token")
        for j in range(a, b + 1):
            mask[j] = 1
    return mask


def flat(x):
    """A list of ints from what transformers returns for one conversation (flat or [[...]])."""
    x = list(x)
    if x and isinstance(x[0], (list, tuple)) and len(x) == 1:
        x = list(x[0])
    return [int(v) for v in x]


def render_only(templates):
    for name, (original, tagged, _, _) in templates.items():
        for ci, case in enumerate(all_cases()):
            a = jinja_render(original, case)
            b = jinja_render(tagged, case)
            if a != b:
                sys.exit(f"{name} case {ci}: the tagged template renders differently:\n{a!r}\n{b!r}")
            text, spans = generation_spans(tagged, case)
            assert text == a, (name, ci)
            if not case.get("add_generation_prompt"):
                learned = [text[s:e] for s, e in spans]
                assert all(x.endswith("<|im_end|>\n") for x in learned), (name, ci, learned)
                num_answers = sum(m["role"] == "assistant" for m in case["messages"])
                assert len(learned) == num_answers, (name, ci, learned)
    print(f"render-only: {len(templates)} templates x {len(all_cases())} cases agree with their tagged forms")


FAMILIES_DIR = os.path.join(HERE, "..", "tests", "fixtures", "chat", "families")


def family_records(tok):
    """One record per case of families/cases.json, rendered by transformers (see the docstring)."""
    import re
    with open(os.path.join(FAMILIES_DIR, "cases.json"), encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    out, problems = [], []
    for c in cases:
        with open(os.path.join(FAMILIES_DIR, c["template"] + ".jinja"), encoding="utf-8") as f:
            tmpl = f.read()
        has_generation = re.search(r"\{\%-?\s*generation\s*-?\%\}", tmpl) is not None
        variables = c.get("variables", {})
        tools = c.get("tools")
        msgs = c["messages"]
        rec = {"name": c["name"]}

        def render(messages, agp):
            return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=agp,
                                           chat_template=tmpl, **variables)

        try:
            rec["text"] = render(msgs, c.get("add_generation_prompt", False))
        except Exception as e:  # the template raised: record it
            rec["error"] = f"{type(e).__name__}: {e}"
            out.append(rec)
            continue
        if "text" in c:
            rec["hand_text_equal"] = rec["text"] == c["text"]
            if not rec["hand_text_equal"]:
                problems.append(f"{c['name']}: HF renders {rec['text']!r}, the hand-worked text is {c['text']!r}")
        enc = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, add_generation_prompt=False,
                                      chat_template=tmpl, return_assistant_tokens_mask=has_generation, **variables)
        rec["train_input_ids"] = flat(enc["input_ids"])
        if has_generation:
            rec["train_assistant_masks"] = flat(enc["assistant_masks"])
        else:
            full = render(msgs, False)
            spans, refused = [], None
            for i, m in enumerate(msgs):
                if m.get("role") != "assistant":
                    continue
                try:
                    before, through = render(msgs[:i], True), render(msgs[:i + 1], False)
                except Exception as e:
                    refused = f"message {i}: {type(e).__name__}: {e}"
                    break
                if not (full.startswith(before) and full.startswith(through) and len(through) >= len(before)):
                    refused = f"message {i}: the prefixes are not prefixes of the whole rendering"
                    break
                spans.append((len(before), len(through)))
            if refused is not None:
                rec["prefix_refused"] = refused
            else:
                plain = tok(full, add_special_tokens=False, return_offsets_mapping=True)
                offsets = plain["offset_mapping"]
                if offsets and isinstance(offsets[0], list) and offsets[0] and isinstance(offsets[0][0], (list, tuple)):
                    offsets = offsets[0]
                rec["train_prefix_masks"] = mask_from_offsets([tuple(o) for o in offsets], spans)
        out.append(rec)
    return out, problems


def write_families(args, tok, transformers_version):
    records, problems = family_records(tok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "families_hf.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} family records (transformers {transformers_version}) to {args.out}; "
          f"{len(problems)} differences from the hand-worked texts")
    for p in problems:
        print("DIFFERENCE:", p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="output directory (default tests/fixtures/chat; --render-only: none)")
    ap.add_argument("--tokenizer", default=TOKENIZER_DIR)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--families", action="store_true", help="render the family-style templates (families_hf.jsonl)")
    args = ap.parse_args()
    if args.families:
        import transformers
        from transformers import AutoTokenizer
        args.out = args.out or os.path.join(HERE, "..", "tests", "fixtures", "chat")
        write_families(args, AutoTokenizer.from_pretrained(args.tokenizer), transformers.__version__)
        return
    templates = load_templates()
    if args.render_only:
        render_only(templates)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            write_templates(args.out, templates)
            print(f"wrote {os.path.join(args.out, 'templates.json')} (expected.jsonl needs transformers)")
        return

    import transformers
    from transformers import AutoTokenizer

    args.out = args.out or os.path.join(HERE, "..", "tests", "fixtures", "chat")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    records, problems = [], []
    for name, (original, tagged, fmt, _) in templates.items():
        for ci, case in enumerate(all_cases()):
            where = f"{name} case {ci}"
            try:
                rec = one_record(tok, name, original, tagged, fmt, case, where, problems)
            except Exception as e:  # keep the run's other results
                problems.append(f"{where}: {type(e).__name__}: {e}")
                rec = None
            if rec is not None:
                records.append(rec)
    write_outputs(args, templates, records, problems, transformers.__version__)


def apply(tok, template, case, **kw):
    return tok.apply_chat_template(case["messages"], tools=case.get("tools"), chat_template=template,
                                   add_generation_prompt=case.get("add_generation_prompt", False),
                                   **case.get("variables", {}), **kw)


def one_record(tok, name, original, tagged, fmt, case, where, problems):
    text = apply(tok, original, case, tokenize=False)
    tagged_text = apply(tok, tagged, case, tokenize=False)
    if text != tagged_text:
        problems.append(f"{where}: the tagged template renders differently: {text!r} vs {tagged_text!r}")
        return None
    ids = flat(apply(tok, original, case, tokenize=True, return_dict=True)["input_ids"])
    plain = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if flat(plain["input_ids"]) != ids:
        problems.append(f"{where}: apply_chat_template ids differ from tokenizer(text)")
    rec = {"template": name, "format": fmt}
    rec.update(case)
    rec.update({"text": text, "input_ids": ids})
    if case.get("add_generation_prompt"):
        return rec
    # The mask two ways: HF's return_assistant_tokens_mask, and the spans of the generation blocks
    # mapped through the offsets with HF's rule. Both are kept when they disagree.
    span_text, spans = generation_spans(tagged, case)
    offset_mask = None
    if span_text != text:
        problems.append(f"{where}: the span renderer disagrees with transformers' rendering")
    else:
        try:
            offsets = plain["offset_mapping"]
            if offsets and isinstance(offsets[0], list) and offsets[0] and isinstance(offsets[0][0], (list, tuple)):
                offsets = offsets[0]
            offset_mask = mask_from_offsets([tuple(o) for o in offsets], spans)
        except ValueError as e:
            problems.append(f"{where}: {e}")
    hf_mask = None
    try:
        out = apply(tok, tagged, case, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        if flat(out["input_ids"]) != ids:
            problems.append(f"{where}: the tagged template tokenises differently")
        hf_mask = flat(out["assistant_masks"])
    except Exception as e:  # keep the run's other results
        problems.append(f"{where}: return_assistant_tokens_mask failed: {type(e).__name__}: {e}")
    if hf_mask is not None and offset_mask is not None and hf_mask != offset_mask:
        problems.append(f"{where}: HF mask {hf_mask} != offset mask {offset_mask}")
        rec["offset_mask"] = offset_mask
    mask = hf_mask if hf_mask is not None else offset_mask
    if mask is None or len(mask) != len(ids):
        problems.append(f"{where}: no mask of the right length")
        return None
    rec["assistant_masks"] = mask
    rec["mask_source"] = "hf" if hf_mask is not None else "offsets"
    return rec


def fnv1a64(data):
    """FNV-1a 64 of bytes, as 16 hex digits (tests/cpu/test_chat.cpp computes the same)."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_templates(out_dir, templates):
    body = {"templates": {}, "conversations": CONVERSATIONS}
    for name, (original, _, fmt, default_system) in templates.items():
        t = {"template": original, "format": fmt}
        if default_system is not None:
            t["default_system"] = default_system
        body["templates"][name] = t
    data = (json.dumps(body, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
    with open(os.path.join(out_dir, "templates.json"), "wb") as f:
        f.write(data)
    return data


def write_outputs(args, templates, records, problems, transformers_version):
    templates_data = write_templates(args.out, templates)
    expected_data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    with open(os.path.join(args.out, "expected.jsonl"), "wb") as f:
        f.write(expected_data)
    with open(os.path.join(args.out, "fixture_info.json"), "w", encoding="utf-8") as f:
        json.dump({"transformers_version": transformers_version, "python": sys.version.split()[0],
                   "num_records": len(records), "num_cases": len(all_cases()),
                   "templates": sorted(templates), "problems": problems,
                   "templates_fnv1a64": fnv1a64(templates_data), "expected_fnv1a64": fnv1a64(expected_data)},
                  f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(records)} records to {args.out}; {len(problems)} problems")
    for p in problems:
        print("PROBLEM:", p)


if __name__ == "__main__":
    main()
