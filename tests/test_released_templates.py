"""Released chat templates: the ones llama.cpp tests its own chat handling with (gpt-oss, Llama 3.x, Qwen 2.5/3,
Mistral, Phi, Gemma, DeepSeek and more, as their model repositories ship them), fetched from llama-cpp-python's
source on PyPI by ``make templates`` (``tools/fetch_templates.py``).

Each renders a conversation as transformers renders it. What a template writes for an assistant's turn (its thinking,
its answer, its tool call) is what the model was trained to write, so the server's readers must read it back as that
turn: a harmony analysis as reasoning, a ``<tool_call>`` or a Llama 3 JSON call as the call."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from quickdraft.serving.reasoning import reasoning_format, reasoning_style
from quickdraft.serving.tool_prompts import prepare_messages, short_call_id
from quickdraft.serving.tools import parse_tool_calls, parse_tools, tool_call_style
from quickdraft.tokenizer import Tokenizer
from quickdraft.tokenizer.chat import ChatTemplateError, render_chat_template

_spec = importlib.util.spec_from_file_location(
    "fetch_templates", Path(__file__).resolve().parent.parent / "tools" / "fetch_templates.py")
fetch_templates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_templates)
TEMPLATES = fetch_templates.templates_dir()
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja")) or ["(none fetched)"]

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
USER = {"role": "user", "content": "Weather in Paris?"}
# the call as an OpenAI client sends it back: arguments as JSON text, no content
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
THOUGHT, ANSWER = "The user asks about Paris; it is sunny there.", "It is sunny in Paris."
# the thinking under both names templates read it by (Qwen3: reasoning_content, gpt-oss: thinking)
ANSWERING = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT, "thinking": THOUGHT}
CONVERSATIONS = {  # (messages, tools), the calls' arguments as objects: transformers' convention
    "plain": ([{"role": "user", "content": "Hello!"}], None),
    "system": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}], None),
    "turns": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
               {"role": "user", "content": "日本語 😀 <b>{{ x }}</b>"}], None),
    "tools": ([USER], [WEATHER]),
    "call": ([USER, {**CALL, "content": "", "tool_calls": [{**CALL["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], [WEATHER]),
}
# the end of a turn, a stop token the engine never puts in the text
TURN_ENDS = ("<|return|>", "<|call|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|end_of_text|>",
             "<|endoftext|>", "</s>")


def template(name: str) -> str:
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"released chat templates not fetched (`make templates`): {path}")
    return path.read_text(encoding="utf-8")


def transformers_render(source: str, messages: list[dict], tools, add_generation_prompt: bool = True) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[copy.deepcopy(messages)], tools=tools, chat_template=source,
                                        add_generation_prompt=add_generation_prompt, **SPECIAL)
    return rendered[0]


@pytest.mark.parametrize("name", NAMES)
def test_every_released_template_renders_as_transformers_does(name):
    source = template(name)
    rendered = 0
    for label, (messages, tools) in CONVERSATIONS.items():
        try:
            expected = transformers_render(source, messages, tools)
        except Exception as exc:  # the template refuses the conversation (no system role, ids of 9 characters...)
            with pytest.raises((ChatTemplateError, TypeError, ValueError)):
                render_chat_template(source, copy.deepcopy(messages), special_tokens=SPECIAL, tools=tools)
            print(f"{name} {label}: refused by both, {type(exc).__name__}")
            continue
        got = render_chat_template(source, copy.deepcopy(messages), special_tokens=SPECIAL, tools=tools)
        assert got == expected, f"{name}, conversation {label!r}"
        rendered += 1
    if rendered == 0:
        pytest.skip(f"{name}: transformers renders none of the conversations (the template wants other variables)")


@pytest.mark.parametrize("name", NAMES)
def test_an_openai_clients_call_history_renders_wherever_transformers_renders_it(name):
    """OpenAI clients send a call's arguments as JSON text, where a template that iterates them (Qwen3-Coder, GLM,
    MiniMax) needs an object; and ids like this server's, where Mistral's templates take 9 letters and digits only.
    What the server passes renders wherever transformers renders the call in one of these forms, and the same text
    where transformers is given what the server gives the template."""
    source = template(name)
    history = [USER, CALL, {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    messages, tools = prepare_messages(copy.deepcopy(history), parse_tools([WEATHER], "auto"), source)
    forms = []
    for call_id in ("call_1", short_call_id("call_1")):
        for arguments in ({"city": "Paris"}, '{"city": "Paris"}'):
            call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            try:
                forms.append(transformers_render(source, [USER, {**CALL, "content": "", "tool_calls": [call]},
                                                          {**history[2], "tool_call_id": call_id}], tools))
            except Exception:
                pass
    if not forms:
        pytest.skip(f"{name}: transformers renders this call in none of the forms")
    got = render_chat_template(source, copy.deepcopy(messages), special_tokens=SPECIAL, tools=tools)
    assert "get_weather" in got and "Paris" in got
    # a calling message's null content reaches the template as null, or as "" where it cannot take null (it fails,
    # or prints "None"): render_chat_template's own fit
    expected = []
    for fitted in (messages, [{**m, "content": m["content"] or ""} for m in messages]):
        try:
            expected.append(transformers_render(source, fitted, tools))
        except Exception:
            pass
    assert got in expected


def output_of(source: str, turn: dict, tool: dict = WEATHER) -> tuple[str, str]:
    """(the prompt, what the model writes after it) for a turn the template renders after USER: the rendered
    conversation with the turn, less the one that asks for it, less the turn's end."""
    spec = parse_tools([tool], "auto")
    messages, tools = prepare_messages([copy.deepcopy(USER)], spec, source)
    prompt = render_chat_template(source, messages, True, special_tokens=SPECIAL, tools=tools)
    messages, tools = prepare_messages([copy.deepcopy(USER), copy.deepcopy(turn)], spec, source)
    whole = render_chat_template(source, messages, False, special_tokens=SPECIAL, tools=tools)
    assert whole.startswith(prompt), "the template renders the turn after its own generation prompt"
    out, before = whole[len(prompt):], None
    while out != before:
        before = out = out.rstrip()
        for end in TURN_ENDS:
            out = out.removesuffix(end)
    return prompt, out


def read(source: str, prompt: str, output: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(thinking, content, calls) of an output, read as the server reads a chat completion's."""
    reading = reasoning_format(source, prompt[-64:])
    thought, text = (None, output) if reading is None else reading.split(output)
    content, calls = parse_tool_calls(text, parse_tools([WEATHER], "auto"), tool_call_style(source))
    return thought, content, [(c.name, json.loads(c.arguments)) for c in calls]


# the released templates of the families quickdraft runs, with the forms read off them
FORMS = {
    "openai-gpt-oss-120b": ("harmony", "generic"),  # harmony's calls are read by the reasoning reader
    "Qwen-Qwen3-0.6B": ("think", "qwen"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "qwen"),
    "meta-llama-Llama-3.1-8B-Instruct": (None, "llama3"),
    "meta-llama-Llama-3.2-3B-Instruct": (None, "llama3"),
    "meta-llama-Llama-3.3-70B-Instruct": (None, "llama3"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (None, "qwen"),
    "microsoft-Phi-3.5-mini-instruct": (None, "generic"),
    "HuggingFaceTB-SmolLM3-3B": ("think", "generic"),
    "ibm-granite-granite-4.0": (None, "qwen"),
    "mistralai-Mistral-Nemo-Instruct-2407": (None, "mistral"),  # [TOOL_CALLS][{...}]
    "Mistral-Small-3.2-24B-Instruct-2506": (None, "mistral"),  # [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}
    "unsloth-mistral-Devstral-Small-2507": (None, "mistral"),  # [TOOL_CALLS]NAME[ARGS]{...}
    "mistralai-Ministral-3-14B-Reasoning-2512": (None, "mistral"),
    "Qwen3-Coder": (None, "qwen"),  # <tool_call><function=NAME><parameter=KEY>...
    "Qwen3.5-4B": ("think", "qwen"),
    "GLM-4.6": ("think", "qwen"),  # <tool_call>NAME<arg_key>KEY</arg_key><arg_value>...
}
# the templates that render a last turn's thinking
WITH_THINKING = {"openai-gpt-oss-120b", "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "GLM-4.6"}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_forms_are_read_off_released_templates(name):
    source = template(name)
    assert (reasoning_style(source), tool_call_style(source)) == FORMS[name]


@pytest.mark.parametrize("name", sorted(FORMS))
def test_an_answer_a_released_template_writes_reads_back(name):
    source = template(name)
    prompt, output = output_of(source, ANSWERING)
    thought, content, calls = read(source, prompt, output)
    assert (content, calls) == (ANSWER, []), output
    assert thought == (THOUGHT if name in WITH_THINKING else None), output


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_call_a_released_template_writes_reads_back(name):
    source = template(name)
    prompt, output = output_of(source, CALL)
    thought, content, calls = read(source, prompt, output)
    assert calls == [("get_weather", {"city": "Paris"})], output
    assert (thought, content) == (None, None), output


@pytest.mark.parametrize("name", ["Qwen-QwQ-32B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                                  "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"])
def test_templates_that_open_the_thinking_leave_the_output_in_it(name):
    """These templates drop earlier thinking and end the prompt inside ``<think>``: the output starts as
    thinking and its ``</think>`` starts the answer. (llama.cpp's copies of two of them close the thinking at once
    unless ``enable_thinking``, a template variable a request may set: then all of the output is the answer.)"""
    source = template(name)
    messages, _ = prepare_messages([copy.deepcopy(USER)], None, source)
    prompt = render_chat_template(source, messages, True, special_tokens=SPECIAL, enable_thinking=True)
    assert prompt.rstrip().endswith("<think>")
    assert read(source, prompt, f"{THOUGHT}\n</think>\n\n{ANSWER}") == (THOUGHT, ANSWER, [])
    closed = render_chat_template(source, messages, True, special_tokens=SPECIAL, enable_thinking=False)
    if closed.rstrip().endswith("</think>"):
        assert read(source, closed, ANSWER) == (None, ANSWER, [])


PLAN = {"type": "function", "function": {"name": "plan", "description": "Plan a trip", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array", "items": {
                                         "type": "integer"}}, "note": {"type": "string"}},
    "required": ["city"]}}}
PLAN_ARGUMENTS = {"city": "São Paulo", "days": 3, "metric": True, "hours": [9, 18], "note": "42"}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_typed_arguments_a_released_template_writes_read_back(name):
    """Integers, booleans, lists and a string of digits, written as the template writes them (JSON, or tags whose
    text is typed by the tool's schema), read back as the same arguments."""
    source = template(name)
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_2", "type": "function", "function": {
        "name": "plan", "arguments": json.dumps(PLAN_ARGUMENTS, ensure_ascii=False)}}]}
    prompt, output = output_of(source, call, PLAN)
    reading = reasoning_format(source, prompt[-64:])
    text = output if reading is None else reading.split(output)[1]
    _, calls = parse_tool_calls(text, parse_tools([PLAN], "auto"), tool_call_style(source))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("plan", PLAN_ARGUMENTS)], output


def test_the_released_gpt_oss_template_through_the_server(tmp_path):
    """gpt-oss's own template behind the real server and client: a tool call read from the harmony it is made to
    write, then the call and its result sent back as OpenAI history (rendered by the template, arguments as an
    object) and the answer read apart from its thinking; ``reasoning_effort`` reaches the template's system text."""
    from test_reasoning import ANSWERED, ASK, CALLED, THOUGHT as SAID, ANSWER as ANSWERED_TEXT, forced, make_model
    from test_server import serve

    source = template("openai-gpt-oss-120b")
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL["tool_calls"][0]]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    corpus = tuple(render_chat_template(source, copy.deepcopy(m), special_tokens=SPECIAL, tools=[WEATHER])
                   for m in (ASK, history))
    with serve(make_model(tmp_path, source, corpus, max_positions=2048), "oss") as server:
        client = server.client()
        called = client.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], **forced(CALLED))
        (call,) = called.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert called.choices[0].message.model_extra["reasoning_content"] == SAID
        sent_back = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        answered = client.chat.completions.create(model="oss", messages=sent_back, tools=[WEATHER],
                                                  reasoning_effort="high", **forced(ANSWERED))
        message = answered.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == (ANSWERED_TEXT, SAID)
    tokenizer = Tokenizer.from_hf_dir(tmp_path / "tokenizer")
    messages, tools = prepare_messages(sent_back, parse_tools([WEATHER], "auto"), source)
    prompts = {effort: tokenizer.encode(render_chat_template(source, copy.deepcopy(messages), special_tokens=SPECIAL,
                                                              tools=tools, reasoning_effort=effort)) for effort in
               ("high", "medium")}
    assert "Reasoning: high" in tokenizer.decode(prompts["high"])
    assert answered.usage.prompt_tokens == len(prompts["high"]) != len(prompts["medium"])
