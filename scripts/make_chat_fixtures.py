#!/usr/bin/env python3
"""Builds the chat-template parity fixtures in tests/fixtures/chat/ with Hugging Face `transformers`.

For each Qwen ChatML template below and each conversation below, it records what
`tokenizer.apply_chat_template` answers with the fixture tokenizer (tests/fixtures/tokenizer):

  expected.jsonl  one JSON object a line:
                  {template, format, messages, text, input_ids, assistant_masks}
                  text       apply_chat_template(messages, tokenize=False) with the model's template
                  input_ids  apply_chat_template(messages, tokenize=True) (checked equal to
                             tokenizer(text, add_special_tokens=False))
                  assistant_masks  HF's return_assistant_tokens_mask=True, computed with a
                             generation-tagged copy of the template (below) that marks what moeforge
                             learns in an assistant turn: everything after "<|im_start|>assistant\\n"
                             up to and including "<|im_end|>\\n". The script checks that the tagged
                             copy renders exactly the model's template text for every conversation.
  templates.json  {name: {"template": the model's chat_template, "format": moeforge's chat format}}
  fixture_info.json  versions and counts

The templates are the chat_template strings Qwen ships (Apache-2.0) in tokenizer_config.json:
Qwen2-Instruct (the fixture tokenizer's own), Qwen2.5-Instruct, Qwen3 (hybrid thinking, incl.
Qwen3-30B-A3B) and Qwen3-Instruct-2507. They are test inputs: moeforge must recognise and render
them. The generation-tagged copies are ours and cover system/user/assistant messages only.

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
    python3 scripts/make_chat_fixtures.py --out $OUT/chat
    python3 scripts/make_chat_fixtures.py --families --out $OUT/chat   # then copy families_hf.jsonl
Without transformers, --render-only checks the tagged copies against the originals with jinja2 alone.
The outputs are committed; this script is only re-run when the fixtures must change.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "tests", "fixtures", "tokenizer")

# --- the models' templates --------------------------------------------------------------------------

QWEN2_5 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

QWEN3_INSTRUCT_2507 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# --- generation-tagged copies (ours): what moeforge learns in an assistant turn ---------------------

def tagged_default_system(system_text):
    return (
        "{%- if messages[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\\n" + system_text + "<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}")


TAGGED_CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}")

TAGGED_QWEN3 = (
    # last user message that is not a tool response
    "{%- set ns = namespace(found=false, last_query=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}"
    "{%- if not ns.found and m.role == 'user' and not (m.content.startswith('<tool_response>') and "
    "m.content.endswith('</tool_response>')) %}"
    "{%- set ns.found = true %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set text = message.content %}{%- set thought = '' %}"
    "{%- if message.reasoning_content is string %}{%- set thought = message.reasoning_content %}"
    "{%- elif '</think>' in text %}"
    "{%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or thought) %}"
    "{{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + text.lstrip('\\n') }}"
    "{%- else %}{{- text }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}")


def load_templates():
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        qwen2 = json.load(f)["chat_template"]
    return {
        # name: (model template, generation-tagged copy, moeforge chat format)
        "qwen2": (qwen2, tagged_default_system("You are a helpful assistant."), "chatml_qwen2"),
        "qwen2_5": (QWEN2_5, tagged_default_system("You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
                    "chatml_qwen2_5"),
        "qwen3": (QWEN3, TAGGED_QWEN3, "chatml_qwen3"),
        "qwen3_instruct_2507": (QWEN3_INSTRUCT_2507, TAGGED_CHATML, "chatml"),
    }


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


# --- rendering ---------------------------------------------------------------------------------------

def jinja_env(mark_generation):
    # The environment transformers compiles chat templates in (trim_blocks, lstrip_blocks), with a
    # stand-in for its {% generation %} extension that renders the block between \x00 and \x01
    # when mark_generation is set: an independent way to the assistant mask.
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

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])


def generation_spans(tagged, conv):
    """Rendered text and the [start, end) character spans of its generation blocks."""
    marked = jinja_env(True).from_string(tagged).render(messages=conv, add_generation_prompt=False)
    text, spans, start = "", [], None
    for ch in marked:
        if ch == "\x00":
            start = len(text)
        elif ch == "\x01":
            spans.append((start, len(text)))
        else:
            text += ch
    return text, spans


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
    env = jinja_env(False)
    for name, (original, tagged, _) in templates.items():
        for conv in CONVERSATIONS:
            a = env.from_string(original).render(messages=conv, add_generation_prompt=False)
            b = env.from_string(tagged).render(messages=conv, add_generation_prompt=False)
            if a != b:
                sys.exit(f"{name}: tagged copy renders differently for {conv!r}:\n{a!r}\n{b!r}")
            text, _ = generation_spans(tagged, conv)
            assert text == a
    print(f"render-only: {len(templates)} templates x {len(CONVERSATIONS)} conversations agree")


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
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "fixtures", "chat"))
    ap.add_argument("--tokenizer", default=TOKENIZER_DIR)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--families", action="store_true", help="render the family-style templates (families_hf.jsonl)")
    args = ap.parse_args()
    if args.families:
        import transformers
        from transformers import AutoTokenizer
        write_families(args, AutoTokenizer.from_pretrained(args.tokenizer), transformers.__version__)
        return
    templates = load_templates()
    if args.render_only:
        render_only(templates)
        return

    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    records, problems = [], []
    for name, (original, tagged, fmt) in templates.items():
        for ci, conv in enumerate(CONVERSATIONS):
            where = f"{name} conversation {ci}"
            try:
                rec = one_record(tok, name, original, tagged, fmt, conv, where, problems)
            except Exception as e:  # keep the run's other results
                problems.append(f"{where}: {type(e).__name__}: {e}")
                rec = None
            if rec is not None:
                records.append(rec)
    write_outputs(args, templates, records, problems, transformers.__version__)


def one_record(tok, name, original, tagged, fmt, conv, where, problems):
    text = tok.apply_chat_template(conv, tokenize=False, chat_template=original)
    tagged_text = tok.apply_chat_template(conv, tokenize=False, chat_template=tagged)
    if text != tagged_text:
        problems.append(f"{where}: the tagged copy renders differently: {text!r} vs {tagged_text!r}")
        return None
    enc = tok.apply_chat_template(conv, tokenize=True, return_dict=True, chat_template=original)
    ids = flat(enc["input_ids"])
    plain = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if flat(plain["input_ids"]) != ids:
        problems.append(f"{where}: apply_chat_template ids differ from tokenizer(text)")
    # The mask two ways: HF's return_assistant_tokens_mask, and the spans of the generation blocks
    # mapped through the offsets with HF's rule. Both are kept when they disagree.
    span_text, spans = generation_spans(tagged, conv)
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
        out = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      chat_template=tagged)
        if flat(out["input_ids"]) != ids:
            problems.append(f"{where}: the tagged copy tokenises differently")
        hf_mask = flat(out["assistant_masks"])
    except Exception as e:  # keep the run's other results
        problems.append(f"{where}: return_assistant_tokens_mask failed: {type(e).__name__}: {e}")
    if hf_mask is not None and offset_mask is not None and hf_mask != offset_mask:
        problems.append(f"{where}: HF mask {hf_mask} != offset mask {offset_mask}")
    mask = hf_mask if hf_mask is not None else offset_mask
    if mask is None or len(mask) != len(ids):
        problems.append(f"{where}: no mask of the right length")
        return None
    rec = {"template": name, "format": fmt, "messages": conv, "text": text, "input_ids": ids,
           "assistant_masks": mask, "mask_source": "hf" if hf_mask is not None else "offsets"}
    if hf_mask is not None and offset_mask is not None and hf_mask != offset_mask:
        rec["offset_mask"] = offset_mask
    return rec


def write_outputs(args, templates, records, problems, transformers_version):
    with open(os.path.join(args.out, "expected.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "templates.json"), "w", encoding="utf-8") as f:
        json.dump({name: {"template": t[0], "format": t[2]} for name, t in templates.items()}, f, ensure_ascii=False,
                  indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "fixture_info.json"), "w", encoding="utf-8") as f:
        json.dump({"transformers_version": transformers_version, "python": sys.version.split()[0],
                   "num_records": len(records), "num_conversations": len(CONVERSATIONS),
                   "templates": sorted(templates), "problems": problems}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(records)} records to {args.out}; {len(problems)} problems")
    for p in problems:
        print("PROBLEM:", p)


if __name__ == "__main__":
    main()
