"""OpenAI tool calling (quickdraft/serving/tools.py): request checks, constraints, prompts rendered with real chat
templates (Qwen2.5's, which knows tools, and SmolLM2's, which does not), and the calls read back, whole or streamed."""
from __future__ import annotations

import json
import random
import re
import time

import pytest

from quickdraft.errors import InvalidParameterError, ModelLoadError
from quickdraft.serving.tools import (
    ToolCall,
    arguments_valid,
    ToolCallStream,
    ToolSpec,
    parse_tool_calls,
    parse_tools,
    tool_call_style,
)
from quickdraft.serving.tool_prompts import prepare_messages
from quickdraft.tokenizer.chat import GEMMA_TEMPLATE, render_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get.time-2"}}  # no parameters: the default schema
TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _tokenizer(name: str):
    from quickdraft.engine.build import tokenizer_for
    from quickdraft.loading.load import load_checkpoint
    from quickdraft.loading.registry import resolve_model

    try:
        return tokenizer_for(load_checkpoint(resolve_model(name)))
    except ModelLoadError as exc:
        pytest.skip(f"{name} is not installed: {exc}")


@pytest.fixture(scope="module")
def qwen():
    return _tokenizer("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def smollm2():
    return _tokenizer("smollm2-135m")


def spec(choice=None, tools=TOOLS) -> ToolSpec:
    return parse_tools(tools, choice)


# ---- request checks --------------------------------------------------------------------------------------------
def _tool(**function):
    return {"type": "function", "function": {"name": "f", **function}}


BAD_REQUESTS = [
    ("get_weather", None, "tools must be a list"),
    ({"type": "function"}, None, "tools must be a list"),
    ([WEATHER, TIME, 5], None, "tools[2] must be"),
    ([{"type": "fn", "function": {"name": "f"}}], None, "tools[0] must be"),
    ([{"type": "function"}], None, "tools[0] must be"),
    ([{"type": "function", "function": "f"}], None, "tools[0] must be"),
    ([_tool(name="")], None, "tools[0].function.name must be"),
    ([_tool(name="a b")], None, "tools[0].function.name must be"),
    ([_tool(name="x" * 65)], None, "tools[0].function.name must be"),
    ([_tool(name=7)], None, "tools[0].function.name must be"),
    ([{"type": "function", "function": {}}], None, "tools[0].function.name must be"),
    ([_tool(description=5)], None, "tools[0].function.description must be a string"),
    ([_tool(description="\ud800")], None, "tools[0].function must be valid Unicode"),
    ([_tool(parameters=[])], None, "tools[0].function.parameters must be"),
    ([_tool(parameters={"type": "string"})], None, "tools[0].function.parameters must be"),
    ([_tool(parameters={"type": "object", "properties": {"a": {"description": "\udfff"}}})], None,
     "tools[0].function must be valid Unicode"),
    ([_tool(strict="yes")], None, "tools[0].function.strict must be true or false"),
    ([WEATHER, TIME, WEATHER], None, "tools[2].function.name 'get_weather' is taken"),
    ([_tool(name=f"f{i}") for i in range(129)], None, "tools must hold at most 128"),
    (TOOLS, "always", "tool_choice must be"),
    (TOOLS, 1, "tool_choice must be"),
    (TOOLS, {"type": "function"}, "tool_choice must be"),
    (TOOLS, {"type": "function", "name": "get_weather"}, "tool_choice must be"),
    (TOOLS, {"type": "other", "function": {"name": "get_weather"}}, "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name must be"),
    (TOOLS, {"type": "function", "function": {"name": ["get_weather"]}}, "tool_choice.function.name must be"),
    (None, "required", "tool_choice \"required\" needs tools"),
    ([], "required", "tool_choice \"required\" needs tools"),
    (None, {"type": "function", "function": {"name": "f"}}, "tool_choice.function.name must be"),
]


@pytest.mark.parametrize("tools, choice, message", BAD_REQUESTS)
def test_bad_tools_and_tool_choice_are_refused_naming_the_field(tools, choice, message):
    with pytest.raises(InvalidParameterError) as info:
        parse_tools(tools, choice)
    assert str(info.value).startswith(message), str(info.value)


def test_a_hostile_deep_schema_is_refused_without_recursing():
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(5000):
        node["items"] = {}
        node = node["items"]
    with pytest.raises(InvalidParameterError, match=r"^tools\[0\]\.function\.parameters is nested over"):
        parse_tools([_tool(parameters=deep)], None)


def test_checked_tools_are_normal_form():
    assert parse_tools(None, None) is None
    assert parse_tools([], "auto") is None
    assert parse_tools(None, "none") is None
    s = spec()
    assert (s.choice, s.forced, s.named) == ("auto", False, None)
    assert s.tools[1] == {"type": "function", "function": {
        "name": "get.time-2", "parameters": {"type": "object", "properties": {}}}}
    assert spec("none").choice == "none" and spec("required").choice == "required"
    named = spec({"type": "function", "function": {"name": "get_weather"}})
    assert (named.choice, named.forced, named.named) == ("get_weather", True, "get_weather")
    # a tool may be called like a choice: the flag keeps them apart
    auto = parse_tools([_tool(name="auto")], {"type": "function", "function": {"name": "auto"}})
    assert auto.named == "auto" and auto.forced
    strict = parse_tools([_tool(strict=True, parameters={"properties": {}})], None)
    assert strict.tools[0]["function"]["strict"] is True
    assert strict.tools[0]["function"]["parameters"]["type"] == "object"  # made explicit
    assert "strict" not in strict.template_tools()[0]["function"]


# ---- constraints -------------------------------------------------------------------------------------------------
def test_constraints_accept_exactly_the_valid_calls():
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    assert spec().constraint() is None and spec("none").constraint() is None
    named = spec({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert named == {"json": {**WEATHER["function"]["parameters"], "additionalProperties": False}}
    assert jsonschema_rs.is_valid(named["json"], {"city": "Paris"})
    assert not jsonschema_rs.is_valid(named["json"], {"town": "Paris"})
    assert not jsonschema_rs.is_valid(named["json"], {"city": "Paris", "weather": "invented"})
    assert len(spec("required").constraint(parallel=False)["json"]["items"]["anyOf"]) == 2
    assert spec("required").constraint(parallel=False)["json"]["maxItems"] == 1
    required = spec("required").constraint()["json"]
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get.time-2", "arguments": {}}]
    assert jsonschema_rs.is_valid(required, ok)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "get_weather", "arguments": {}}],
                [{"name": "get.time-2"}], [{"name": "get.time-2", "arguments": {}, "extra": 1}],
                {"name": "get.time-2", "arguments": {}}):
        assert not jsonschema_rs.is_valid(required, bad), bad


def test_constraints_compile_as_structured_outputs():
    from quickdraft.sampling import structured
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        outputs = structured.StructuredOutputs.of(spec(choice).constraint(), "tool_choice")
        assert outputs.grammar_text()


# ---- prompts -------------------------------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get.time-2", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def test_qwen_template_renders_tools_calls_and_results_itself(qwen):
    assert tool_call_style(qwen.chat_template) == "qwen"
    messages, tools = prepare_messages(CONVERSATION, spec(), qwen.chat_template)
    time_tool = {"type": "function", "function": {"name": "get.time-2", "parameters": {"type": "object",
                                                                                       "properties": {}}}}
    assert tools == [WEATHER, time_tool]
    # Qwen's template writes ``arguments | tojson``: it needs a dict, or the JSON text would be quoted again
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # it takes a calling message's null content as the client sent it (its ``if message.content`` skips it)
    assert messages[2]["content"] is None and messages[3]["role"] == "tool"
    prompt = qwen.apply_chat_template(messages, True, tools=tools)
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(time_tool) + "\n</tools>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get.time-2", "arguments": {}}\n</tool_call><|im_end|>\n') in prompt
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n12:00\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in prompt
    # "none": the tools are not shown, the earlier calls still render
    messages, tools = prepare_messages(CONVERSATION, spec("none"), qwen.chat_template)
    assert tools is None
    prompt = qwen.apply_chat_template(messages, True)
    assert "<tools>" not in prompt and '"arguments": {"city": "Paris"}' in prompt
    assert CONVERSATION[2]["content"] is None  # the caller's messages are left alone


# DeepSeek-R1's way: the calls are rendered only where the calling message's content is null
NULL_CONTENT_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.content is none %}<calls>{%- for c in m.tool_calls %}"
    "[{{ c.function.name }} {{ c.function.arguments }}]{%- endfor %}</calls>{%- elif m.role == 'tool' %}"
    "<out>{{ m.content }}</out>{%- else %}<{{ m.role }}>{{ m.content }}{%- endif %}{%- endfor %}")
# the usual way: the content is concatenated, so a null one would fail the render
CONCATENATING_TEMPLATE = (
    "{%- for m in messages %}{{ '<' + m.role + '>' + m.content }}{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "[{{ c.function.name }} {{ c.function.arguments }}]{%- endfor %}{%- endif %}{%- endfor %}")
# a template that prints a null content as "None"
PRINTING_TEMPLATE = NULL_CONTENT_TEMPLATE.replace("m.content is none", "m.content is none and false")
# a template that renders the calls only beside a content that is not null: null would drop them
DROPPING_TEMPLATE = (
    "{%- for m in messages %}<{{ m.role }}>{%- if m.content is not none %}{{ m.content }}{%- if m.tool_calls %}"
    "{%- for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments }}]{%- endfor %}{%- endif %}"
    "{%- endif %}{%- endfor %}")


@pytest.mark.parametrize("template, rendered", [
    (NULL_CONTENT_TEMPLATE, '<calls>[get_weather {"city": "Paris"}][get.time-2 {}]</calls><out>{"temp": 21}'),
    (CONCATENATING_TEMPLATE, '<assistant>[get_weather {"city": "Paris"}][get.time-2 {}]<user>Tool result'),
    (PRINTING_TEMPLATE, "<assistant><out>"),
    (DROPPING_TEMPLATE, '<assistant>[get_weather {"city": "Paris"}][get.time-2 {}]<user>Tool result'),
])
def test_a_calling_messages_null_content_reaches_the_templates_that_take_it(template, rendered):
    """A calling message's empty content goes on as null, as OpenAI's clients send it; the render gives null to a
    template that takes it (a probe render, as llama.cpp's template checks do: no error, no "None" printed, the
    call still there) and an empty string to any other. The calls are never lost and "None" is never printed."""
    for sent in (None, ""):
        turns = [{**m, "content": sent} if m.get("tool_calls") else m for m in CONVERSATION]
        messages, _ = prepare_messages(turns, spec(), template)
        assert messages[2]["content"] is None
        prompt = render_chat_template(template, messages, tools=[WEATHER])
        assert rendered in prompt and "None" not in prompt


@pytest.mark.parametrize("template", [None, GEMMA_TEMPLATE])
def test_a_null_content_reaches_no_template_that_cannot_take_it(template):
    """Outside the server too (``LLM.chat``, ``apply_chat_template``): ChatML's concatenation and Gemma's template get
    an empty string for a calling message's null content (no TypeError, no "None" in the prompt); a null content
    without calls is refused by name."""
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "user", "content": "y"}]
    assert "None" not in render_chat_template(template, turns)
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a string"):
        render_chat_template(NULL_CONTENT_TEMPLATE, [{"role": "user", "content": "x"},
                                                     {"role": "assistant", "content": None}])


def test_smollm2_template_gets_tools_as_text(smollm2):
    template = smollm2.chat_template
    assert tool_call_style(template) == "generic"
    messages, tools = prepare_messages(CONVERSATION, spec(), template)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("You are terse.\n\n# Tools\n") and json.dumps(WEATHER) in system
    assert "<tool_call>\n{\"name\": <function-name>" in system
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      '</tool_call>\n<tool_call>\n{"name": "get.time-2", "arguments": {}}\n'
                                      "</tool_call>")
    assert messages[3]["content"] == ('Tool result (call call_1, get_weather): {"temp": 21}\n\n'
                                      "Tool result (call call_2, get.time-2): 12:00")
    prompt = smollm2.apply_chat_template(messages, True, tools=tools)
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "You are a helpful AI assistant named SmolLM" not in prompt
    assert "<|im_start|>user\nTool result (call call_1, get_weather)" in prompt
    assert prompt.endswith("12:00<|im_end|>\n<|im_start|>assistant\n")


def test_generic_instructions_follow_the_choice(smollm2):
    template = smollm2.chat_template
    user = [{"role": "user", "content": "Weather?"}]
    auto, _ = prepare_messages(user, spec(), template)
    assert auto[0]["role"] == "system" and auto[1] == user[0]  # a system message of its own
    named, _ = prepare_messages(user, spec({"type": "function", "function": {"name": "get_weather"}}), template)
    assert "Call the function get_weather now: answer only with its arguments" in named[0]["content"]
    required, _ = prepare_messages(user, spec("required"), template)
    assert "answer only with a JSON array of calls" in required[0]["content"]
    none, _ = prepare_messages(user, spec("none"), template)
    assert none == user
    # a result with its name and no id, content None, and a Gemma-like template that alternates turns
    turns = [*user, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
             {"role": "tool", "name": "get_weather", "content": None}]
    messages, _ = prepare_messages(turns, None, GEMMA_TEMPLATE)
    assert messages[1]["content"] == ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n'
                                      "</tool_call>")
    assert messages[2] == {"role": "user", "content": "Tool result (get_weather): "}
    assert "<start_of_turn>user\nTool result (get_weather):" in render_chat_template(GEMMA_TEMPLATE, messages)
    assert smollm2.apply_chat_template(prepare_messages(turns, spec(), template)[0])


def test_a_template_printing_arguments_gets_json_text():
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                "[{{ c.function.name }} {{ c.function.arguments }}]{% endfor %}{{ '\\n' }}{% endfor %}")
    turns = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "b", "type": "function", "function": {"name": "get.time-2", "arguments": '{"x":1}'}}]},
             {"role": "assistant", "content": "plain", "tool_calls": []}]
    messages, tools = prepare_messages(turns, spec("none"), template)
    assert tools is None and "tool_calls" not in messages[1]
    expected = 'assistant:[get_weather {"city": "Paris"}][get.time-2 {"x":1}]\nassistant:plain\n'
    assert render_chat_template(template, messages) == expected  # the client's text as sent


@pytest.mark.parametrize("calls", ["x", [1], [{"function": {"name": 3}}], [{"function": {"name": "f", "arguments": 3}}],
                                   [{"id": 5, "function": {"name": "f", "arguments": "{}"}}]])
def test_bad_earlier_calls_are_refused(calls):
    with pytest.raises(InvalidParameterError, match=r"^messages\[1\]\.tool_calls"):
        prepare_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}], spec(), None)


def test_styles():
    assert tool_call_style(None) == tool_call_style(GEMMA_TEMPLATE) == "generic"
    assert tool_call_style("{{ '<|python_tag|>' }}") == "llama3"
    assert tool_call_style('{{ "parameters" }} {% if role == "ipython" %}') == "llama3"
    assert tool_call_style("{{- '[TOOL_CALLS]' }}") == "mistral"


# ---- parsing -------------------------------------------------------------------------------------------------------
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get.time-2", "parameters": {}}'
PARIS = ("get_weather", '{"city":"Paris"}')

# (style, text, content, [(name, arguments)]) for tool_choice "auto"
AUTO_CASES = [
    ("qwen", f"<tool_call>\n{W}\n</tool_call>", None, [PARIS]),
    ("qwen", f"Let me check.\n<tool_call>\n{W}\n</tool_call>", "Let me check.\n", [PARIS]),
    ("qwen", f"  \n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None,
     [PARIS, ("get.time-2", "{}")]),
    ("qwen", f"<tool_call>\n{W}", None, [PARIS]),  # the last block may lack its end
    ("qwen", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>", []),
    ("qwen", f"A<tool_call>{{\"name\": \"nope\", \"arguments\": {{}}}}</tool_call>\n<tool_call>{W}</tool_call>B",
     "A<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>B", [PARIS]),
    ("qwen", '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', []),
    ("qwen", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None, [PARIS]),
    ("qwen", '<tool_call>{"name": "get_weather", "arguments": {"t": NaN}}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"t": NaN}}</tool_call>', []),  # not JSON
    ("qwen", '<tool_call>{"name": "get_weather", "arguments": {"c": "\\ud800é"}}</tool_call>', None,
     [("get_weather", '{"c":"?é"}')]),  # a lone surrogate has no UTF-8 to send
    ("qwen", W, None, [PARIS]),  # a bare JSON call: the generic fallback reads it (small models skip the tags)
    ("qwen", f"```json\n{W}\n```", None, [PARIS]),
    ("qwen", "Just text, <tool no call.", "Just text, <tool no call.", []),
    ("llama3", W, None, [PARIS]),
    ("llama3", f"<|python_tag|>{T}; {W}", None, [("get.time-2", "{}"), PARIS]),
    ("llama3", f"Sure.<|python_tag|>{W}", "Sure.", [PARIS]),
    ("llama3", '{"name": "get_weather", "arguments": {"city": "<|python_tag|>"}}', None,
     [("get_weather", '{"city":"<|python_tag|>"}')]),
    ("llama3", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ("llama3", f"{W} and more", f"{W} and more", []),
    ("llama3", f"{W}; {{\"name\": \"nope\", \"arguments\": {{}}}}", f"{W}; {{\"name\": \"nope\", \"arguments\": {{}}}}",
     []),
    ("generic", f"<tool_call>\n{W}\n</tool_call>", None, [PARIS]),
    ("generic", f"```json\n{W}\n```", None, [PARIS]),
    ("generic", f"\n```\n[{W}, {T}]\n```\n", None, [PARIS, ("get.time-2", "{}")]),
    ("generic", f"```python\n{W}\n```", f"```python\n{W}\n```", []),
    ("generic", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("generic", "```\nprint(1)\n```", "```\nprint(1)\n```", []),
    ("generic", "{not json", "{not json", []),
    ("generic", "", "", []),
    # tagged calls in <tool_call> blocks: Qwen3-Coder's and Qwen3.5's <function=...>, GLM's <arg_key>
    ("qwen", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     None, [PARIS]),
    ("qwen", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     "Checking.\n", [PARIS]),  # a missing </parameter>
    ("qwen", "<tool_call>\n<function=get.time-2>\n</function>\n</tool_call>", None, [("get.time-2", "{}")]),
    ("qwen", "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
     "<tool_call>\n<function=nope>\n</function>\n</tool_call>", []),
    ("qwen", "<tool_call><function=get_weather>stray<parameter=city>Paris</parameter></function></tool_call>",
     "<tool_call><function=get_weather>stray<parameter=city>Paris</parameter></function></tool_call>", []),
    ("qwen", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", None,
     [PARIS]),
    ("qwen", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</tool_call>",
     "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</tool_call>", []),  # an unclosed value
    # Mistral: [TOOL_CALLS], then a JSON list (Nemo) or NAME[ARGS]{...} each (Small 3.2, Devstral, Ministral 3)
    ("mistral", f"[TOOL_CALLS][{W}]", None, [PARIS]),
    ("mistral", f'[TOOL_CALLS][{W}, {{"name": "get.time-2", "arguments": {{}}, "id": "a1b2c3d4e"}}]', None,
     [PARIS, ("get.time-2", "{}")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get.time-2[ARGS]{}', None,
     [PARIS, ("get.time-2", "{}")]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[CALL_ID]l4ajOePN9[ARGS]{"city": "Paris"}', "Sure.", [PARIS]),
    ("mistral", "[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]nope[ARGS]{}',
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]nope[ARGS]{}', []),  # all valid, or none
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', '[TOOL_CALLS]get_weather[ARGS]{"city": ', []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS][1]", "[TOOL_CALLS]get_weather[ARGS][1]", []),
    ("mistral", W, None, [PARIS]),  # no tag: read as the generic form
    ("mistral", f"Hi <tool_call>{W}</tool_call>", f"Hi <tool_call>{W}</tool_call>", []),  # not Mistral's form
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": 1e400}', '[TOOL_CALLS]get_weather[ARGS]{"city": 1e400}',
     []),  # past float's range: JSON cannot write it back
    ("mistral", "[1, 2] is a list.", "[1, 2] is a list.", []),
]


@pytest.mark.parametrize("style, text, content, calls", AUTO_CASES)
def test_auto_calls_are_read_in_each_style(style, text, content, calls):
    got_content, got = parse_tool_calls(text, spec(), style)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(CALL_ID.fullmatch(c.id) for c in got) and len({c.id for c in got}) == len(got)


def test_calls_past_the_limit_or_too_deep_to_write_stay_content():
    many = '[TOOL_CALLS]get_weather[ARGS]{"city": "x"}' * 129
    assert parse_tool_calls(many, spec(), "mistral") == (many, [])
    for depth in range(960, 1010, 3):  # decoded, but nested past what json.dumps writes back
        for style, text in (("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city":' + "[" * depth + "]" * depth + "}"),
                            ("qwen", '<tool_call>{"name": "get_weather", "arguments": {"city": ' + "[" * depth
                             + "]" * depth + "}}</tool_call>")):
            content, calls = parse_tool_calls(text, spec(), style)
            assert all(arguments_valid(c) for c in calls) and (calls or content == text)


def test_tagged_values_are_typed_by_the_tools_schema():
    """A tagged call's values are text: a string parameter keeps it as written, any other reads it as JSON (a
    template prints booleans as Python's True/False); text that is no JSON stays a string."""
    tool = _tool(name="plan", parameters={"type": "object", "properties": {
        "days": {"type": "integer"}, "metric": {"type": "boolean"}, "hours": {"type": "array"},
        "note": {"type": "string"}, "where": {"type": ["string", "null"]}, "free": {}}})
    text = ("<tool_call>\n<function=plan>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in (
        ("days", "3"), ("metric", "True"), ("hours", "[9, 18]"), ("note", "42"), ("where", "null"),
        ("free", "not json"))) + "</function>\n</tool_call>")
    _, (call,) = parse_tool_calls(text, spec(tools=[tool]), "qwen")
    assert json.loads(call.arguments) == {"days": 3, "metric": True, "hours": [9, 18], "note": "42", "where": None,
                                          "free": "not json"}
    glm = "<tool_call>plan<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>note</arg_key><arg_value>42" \
          "</arg_value></tool_call>"
    _, (call,) = parse_tool_calls(glm, spec(tools=[tool]), "qwen")
    assert json.loads(call.arguments) == {"days": 3, "note": "42"}
    nan = "<tool_call><function=plan><parameter=days>NaN</parameter></function></tool_call>"
    assert json.loads(parse_tool_calls(nan, spec(tools=[tool]), "qwen")[1][0].arguments) == {"days": "NaN"}
    strings = _tool(name="pick", parameters={"type": "object", "properties": {
        "e": {"enum": ["1", "2"]}, "a": {"anyOf": [{"type": "string"}, {"const": "x"}]}, "n": {"enum": [1, "2"]},
        "odd": {"type": [{}, "string"]}}})  # a type list with a non-name in it: its names count
    text = "<tool_call><function=pick><parameter=e>1</parameter><parameter=a>2</parameter><parameter=n>1" \
           "</parameter><parameter=odd>3</parameter></function></tool_call>"
    _, (call,) = parse_tool_calls(text, spec(tools=[strings]), "qwen")
    assert json.loads(call.arguments) == {"e": "1", "a": "2", "n": 1, "odd": "3"}


def test_named_and_required_outputs():
    named = spec({"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_tool_calls(' {"city": "Paris"} ', named, "qwen")  # the arguments as generated
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", ' {"city": "Paris"} ')]
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": ' {"city": "Paris"} '}}
    assert arguments_valid(calls[0])
    # cut short or not an object: still the demanded call (a stream sent it already), marked not valid
    for text in ('{"city": "Par', "[1]"):
        (call,) = parse_tool_calls(text, named, "qwen")[1]
        assert call.arguments == text and not arguments_valid(call)
    required = spec("required")
    content, calls = parse_tool_calls(f"[{W}, {T}]", required, "generic")
    assert content is None and [c.name for c in calls] == ["get_weather", "get.time-2"]
    assert parse_tool_calls("[]", required, "generic") == ("[]", [])
    assert parse_tool_calls(W, spec("none"), "qwen") == (W, [])
    assert parse_tool_calls(W, None, "llama3") == (W, [])


def test_hostile_outputs_are_read_in_linear_time():
    names = spec()
    texts = ["<tool_call>" * 200_000, "<tool_call>{" * 100_000 + "</tool_call>" * 50_000, "[" * 1_000_000,
             "{" * 1_000_000, ";".join([W] * 20_000), "<|python_tag|>" + "1 " * 500_000, " " * 2_000_000,
             "<tool_call>x</tool_call>" * 100_000, f"<tool_call>{W}</tool_call>" * 2_000,
             "[TOOL_CALLS]" * 200_000, "[TOOL_CALLS]get_weather[ARGS]{}" * 50_000, "[TOOL_CALLS]" + "[" * 1_000_000,
             "<tool_call><function=get_weather>" + "<parameter=a>" * 200_000 + "</parameter>",
             "<tool_call><function=get_weather>" + "<parameter=a>x</parameter>" * 100_000,
             "<tool_call>get_weather" + "<arg_key>a</arg_key>" * 200_000,
             "<tool_call>get_weather" + "<arg_key>a</arg_key><arg_value>1</arg_value>" * 100_000]
    for style in ("qwen", "llama3", "generic", "mistral"):
        for text in texts:
            started = time.perf_counter()
            content, calls = parse_tool_calls(text, names, style)
            assert time.perf_counter() - started < 2.0, (style, text[:30])
            assert len(calls) <= 128


# ---- streaming -----------------------------------------------------------------------------------------------------
def _run(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[list[dict]]]:
    per_feed = [stream.feed(p) for p in pieces] + [stream.finish()]
    deltas = [d for batch in per_feed for d in batch]
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [(d["tool_calls"][0]["function"]["name"], d["tool_calls"][0]["function"]["arguments"])
             for d in deltas if "tool_calls" in d]
    return content, calls, per_feed


STREAM_CASES = [(style, text) for style, text, _, _ in AUTO_CASES] + [
    ("qwen", "Hello <tool"), ("qwen", "<tool_cal"), ("qwen", "   "), ("llama3", "  <|python_ta"),
    ("generic", "``"), ("generic", "```js"), ("generic", "```json\n  "), ("generic", "   {\"a\": 1} text"),
    ("generic", "Hi\n" + f"<tool_call>{W}</tool_call> bye"), ("llama3", f"\n\n{W}\n"),
    ("mistral", "Hi [TOOL_CA"), ("mistral", f"Checking.\n[TOOL_CALLS][{W}]"),
]


@pytest.mark.parametrize("style, text", STREAM_CASES)
def test_a_stream_sends_what_the_whole_text_parses_to(style, text):
    content, calls = parse_tool_calls(text, spec(), style)
    expected = (content or "", [(c.name, c.arguments) for c in calls])
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(5, max(len(text) - 1, 0)))) if len(text) > 1 else []
    for pieces in (list(text), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]):
        stream = ToolCallStream(spec(), style)
        got_content, got_calls, _ = _run(stream, pieces)
        assert (got_content, got_calls) == expected, pieces
        assert [(c.name, c.arguments) for c in stream.calls] == expected[1]


def test_streams_of_random_outputs_agree_with_the_whole_text():
    fragments = [" ", "\n", "Hi", "<tool_call>", "</tool_call>", W, T, "<|python_tag|>", "```", "```json\n", "{", "}",
                 "[", "]", ";", "<tool", "_call>", "<|python", "`", '{"name": "nope", "arguments": {}}',
                 "[TOOL_CALLS]", "get_weather[ARGS]", '{"city": "Paris"}', "[TOOL_"]
    rng = random.Random(0)
    for _ in range(4000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 8)))
        style = rng.choice(["qwen", "llama3", "generic", "mistral"])
        tools = rng.choice([spec(), spec("required"), None])
        content, calls = parse_tool_calls(text, tools, style)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
        got = _run(ToolCallStream(tools, style), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        assert got[:2] == (content or "", [(c.name, c.arguments) for c in calls]), (style, text)


def test_content_streams_before_a_call_starts():
    stream = ToolCallStream(spec(), "qwen")
    text = f"Let me check the weather.\n<tool_call>\n{W}\n</tool_call>"
    content, calls, per_feed = _run(stream, list(text))
    assert content == "Let me check the weather.\n" and calls == [PARIS]
    sent = "".join(d["content"] for batch in per_feed[:len("Let me check the weather.\n") + 1] for d in batch)
    assert sent == "Let me check the weather.\n"  # before the tag was complete
    final = per_feed[-1]
    assert final[0]["tool_calls"][0]["index"] == 0 and CALL_ID.fullmatch(final[0]["tool_calls"][0]["id"])
    assert final[0]["tool_calls"][0]["type"] == "function" and [(c.name, c.arguments) for c in stream.calls] == [PARIS]
    # a partial tag is held back, then sent once it turns out to be text
    stream = ToolCallStream(spec(), "qwen")
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]
    assert stream.feed("s are fun") == [{"content": "<tools are fun"}]
    assert stream.finish() == [] and not stream.calls


def test_a_json_start_waits_for_the_end_and_code_does_not():
    stream = ToolCallStream(spec(), "llama3")
    assert stream.feed('{"name": "get_weather", ') == [] and stream.feed('"parameters": {"city": "Paris"}}') == []
    [delta] = stream.finish()
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    stream = ToolCallStream(spec(), "generic")
    assert stream.feed("```python\n") == [{"content": "```python\n"}]


def test_a_named_call_streams_its_arguments():
    stream = ToolCallStream(spec({"type": "function", "function": {"name": "get_weather"}}), "qwen")
    first = stream.feed('{"ci')
    head = first[0]["tool_calls"][0]
    assert head["index"] == 0 and CALL_ID.fullmatch(head["id"]) and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert stream.feed('ty": "Paris"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}]
    assert stream.finish() == []
    # the arguments as generated, as the whole response has them too
    assert stream.calls == [ToolCall("get_weather", '{"city": "Paris"}', head["id"])]
    named = spec({"type": "function", "function": {"name": "get_weather"}})
    assert parse_tool_calls('{"city": "Paris"}', named, "qwen")[1][0].arguments == '{"city": "Paris"}'
    cut = parse_tool_calls('{"city": "Pa', named, "qwen")[1]  # cut by max_tokens: still the call, not valid
    assert cut[0].arguments == '{"city": "Pa' and not arguments_valid(cut[0])


def test_required_waits_and_no_tools_passes_through():
    stream = ToolCallStream(spec("required"), "qwen")
    assert stream.feed(f"[{W}") == [] and stream.feed("]") == []
    assert [d["tool_calls"][0]["function"]["name"] for d in stream.finish()] == ["get_weather"]
    for plain in (ToolCallStream(None, "qwen"), ToolCallStream(spec("none"), "qwen")):
        assert plain.feed("<tool_call>") == [{"content": "<tool_call>"}] and plain.finish() == []
        assert not plain.calls


def test_tool_results_are_put_in_call_order():
    """A template that renders results without ids pairs them with calls by position: results sent in another order
    are put back in the order of the calls they answer."""
    from quickdraft.serving.protocol import in_call_order

    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("a", "b", "c")]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c", "content": "3"}, {"role": "tool", "tool_call_id": "a", "content": "1"},
                {"role": "tool", "tool_call_id": "b", "content": "2"}, {"role": "user", "content": "next"}]
    ordered = in_call_order(messages)
    assert [m["content"] for m in ordered] == ["q", None, "1", "2", "3", "next"]
    assert in_call_order(messages[:2]) == messages[:2]
