"""The APIs agents speak, through a real ``quickdraft serve`` app on 127.0.0.1 and the real clients: OpenAI's
Responses (``openai``'s ``responses.create``), Anthropic's Messages (``anthropic``'s ``messages.create`` /
``messages.stream``), ``/tokenize``, ``/detokenize`` and ``/v1/embeddings``. Greedy outputs equal the chat
completions route's for the same conversation; hostile bodies fail alone with 4xx in each API's own error shape."""
from __future__ import annotations

import base64
import json

import anthropic
import httpx
import jsonschema_rs
import numpy as np
import pytest

from test_server import serve

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
CLAUDE_WEATHER = {"name": "get_weather", "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5-Coder-0.5B (it calls tools) with suffix decoding, the agents' drafter."""
    with serve("qwen2.5-coder-0.5b", "qwen", speculative="suffix", kv_cache_memory="256MiB",
               max_model_len=4096) as server:
        yield server


def claude(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                               timeout=120, **kwargs)


def chat_text(server, messages: list[dict], max_tokens: int, **kwargs):
    r = server.client().chat.completions.create(model="qwen", messages=messages, max_tokens=max_tokens,
                                                temperature=0, **kwargs)
    return r.choices[0]


# ---- Responses ------------------------------------------------------------------------------------------------
def test_responses_plain_and_streamed_equal_chat_completions(qwen):
    client = qwen.client()
    r = client.responses.create(model="qwen", instructions="Answer briefly.", input="Say hello in French.",
                                max_output_tokens=24, **GREEDY)
    chat = chat_text(qwen, [{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": "Say hello in French."}], 24)
    assert r.status == "completed" and r.output_text == chat.message.content and r.output_text
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 10
    assert r.usage.model_extra["speculative"]["target_passes"] >= 1

    events = list(client.responses.create(model="qwen", instructions="Answer briefly.", input="Say hello in French.",
                                          max_output_tokens=24, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_responses_cut_by_max_output_tokens_is_incomplete(qwen):
    r = qwen.client().responses.create(model="qwen", input="Write a long story about a dragon.",
                                       max_output_tokens=5, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_responses_function_call_round_trip(qwen):
    client = qwen.client()
    first = client.responses.create(model="qwen", input=ASK, tools=[WEATHER], max_output_tokens=60, **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    chat = chat_text(qwen, [{"role": "user", "content": ASK}], 60, tools=[CHAT_WEATHER])
    assert chat.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in chat.message.tool_calls] == \
        [(calls[0].name, calls[0].arguments)]

    result = json.dumps({"temperature": 18, "sky": "cloudy"})
    output_item = {"type": "function_call_output", "call_id": calls[0].call_id, "output": result}
    continued = client.responses.create(model="qwen", previous_response_id=first.id, input=[output_item],
                                        tools=[WEATHER], max_output_tokens=40, **GREEDY)
    whole = client.responses.create(model="qwen", tools=[WEATHER], max_output_tokens=40, **GREEDY, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        output_item])
    chat = chat_text(qwen, [{"role": "user", "content": ASK},
                            {"role": "assistant", "content": None, "tool_calls": [{
                                "id": calls[0].call_id, "type": "function",
                                "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                            {"role": "tool", "tool_call_id": calls[0].call_id, "content": result}], 40,
                     tools=[CHAT_WEATHER])
    assert continued.output_text == whole.output_text == (chat.message.content or "")
    assert continued.usage.input_tokens == whole.usage.input_tokens


def test_responses_streamed_function_call(qwen):
    events = list(qwen.client().responses.create(model="qwen", input=ASK, tools=[WEATHER], max_output_tokens=60,
                                                 stream=True, **GREEDY))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == arguments and events[-1].type == "response.completed"


def test_responses_json_schema_output(qwen):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = qwen.client().responses.create(model="qwen", input="Describe a chef as JSON.", max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "chef", "schema": schema}},
                                       **GREEDY)
    jsonschema_rs.validate(schema, json.loads(r.output_text))


def test_previous_response_that_is_not_kept_is_a_404(qwen):
    client = qwen.client()
    kept = client.responses.create(model="qwen", input="Hi", max_output_tokens=2, **GREEDY)
    unkept = client.responses.create(model="qwen", input="Hi", max_output_tokens=2, store=False, **GREEDY)
    for response_id in (unkept.id, "resp_nonexistent"):
        r = httpx.post(f"{qwen.url}/v1/responses", timeout=30,
                       json={"model": "qwen", "input": "and?", "previous_response_id": response_id})
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    store = qwen.app.state.context.responses
    for _ in range(store.max_responses):  # evicted once max_responses newer ones are kept
        store.put(f"resp_filler{_}", None, [{"role": "user", "content": "x"}])
    r = httpx.post(f"{qwen.url}/v1/responses", json={"input": "and?", "previous_response_id": kept.id}, timeout=30)
    assert r.status_code == 404 and "last 1024 responses" in r.json()["error"]["message"]


# ---- Anthropic Messages ------------------------------------------------------------------------------------------
def test_messages_plain_and_streamed_equal_chat_completions(qwen):
    client = claude(qwen)
    m = client.messages.create(model="qwen", max_tokens=24, system="Answer briefly.",
                               messages=[{"role": "user", "content": "Say hello in French."}], extra_body=GREEDY)
    chat = chat_text(qwen, [{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": "Say hello in French."}], 24)
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat_usage_prompt(qwen)
    with client.messages.stream(model="qwen", max_tokens=24, system="Answer briefly.", extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Say hello in French."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == m.usage.output_tokens


def test_llama_cpp_samplers_on_every_route(qwen):
    """DRY and mirostat by llama.cpp's names are honoured by Responses and Messages as by chat completions (a greedy
    DRY answer differs from plain greedy's), and a bad value is a 400 there too."""
    messages = [{"role": "user", "content": "Write the word hello ten times, comma separated."}]
    dry = {"dry_multiplier": 1.0, "dry_allowed_length": 2}
    plain = chat_text(qwen, messages, 24).message.content
    damped = chat_text(qwen, messages, 24, extra_body=dry).message.content
    assert damped != plain
    r = qwen.client().responses.create(model="qwen", input=messages[0]["content"], max_output_tokens=24,
                                       extra_body=dry, **GREEDY)
    m = claude(qwen).messages.create(model="qwen", max_tokens=24, messages=messages, extra_body={**GREEDY, **dry})
    assert r.output_text == m.content[0].text == damped
    pinned = {"temperature": 1.2, "seed": 3, "mirostat": 2, "mirostat_tau": 0, "mirostat_eta": 0}  # greedy
    m = claude(qwen).messages.create(model="qwen", max_tokens=24, messages=messages, extra_body=pinned)
    assert m.content[0].text == plain
    for path, body in (("/v1/responses", {"input": "hi", "mirostat": 3}),
                       ("/v1/messages", {"max_tokens": 5, "messages": messages, "dry_multiplier": -1})):
        bad = httpx.post(f"{qwen.url}{path}", json={"model": "qwen", **body}, timeout=30)
        assert bad.status_code == 400 and ("mirostat must be" in bad.text or "dry_multiplier must be" in bad.text)


def chat_usage_prompt(server) -> int:
    r = server.client().chat.completions.create(model="qwen", max_tokens=1, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello in French."}])
    return r.usage.prompt_tokens


def test_messages_stop_reasons(qwen):
    client = claude(qwen)
    ask = [{"role": "user", "content": "Count from 1 to 9, one number a line."}]
    m = client.messages.create(model="qwen", max_tokens=4, messages=ask, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4
    stops = ["nothing like this", "range("]  # the answer is a Python loop
    m = client.messages.create(model="qwen", max_tokens=60, messages=ask, stop_sequences=stops, extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "range(" and "range" not in m.content[0].text
    with client.messages.stream(model="qwen", max_tokens=60, messages=ask, stop_sequences=stops,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "range("
    assert final.content[0].text == m.content[0].text


def test_messages_tool_use_round_trip(qwen):
    client = claude(qwen)
    first = client.messages.create(model="qwen", max_tokens=60, tools=[CLAUDE_WEATHER], extra_body=GREEDY,
                                   messages=[{"role": "user", "content": ASK}])
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    with client.messages.stream(model="qwen", max_tokens=60, tools=[CLAUDE_WEATHER], extra_body=GREEDY,
                                messages=[{"role": "user", "content": ASK}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == {"city": "Paris"}

    result = json.dumps({"temperature": 18, "sky": "cloudy"})
    second = client.messages.create(model="qwen", max_tokens=40, tools=[CLAUDE_WEATHER], extra_body=GREEDY, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input", "text"})
                                          for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    chat = chat_text(qwen, [{"role": "user", "content": ASK},
                            {"role": "assistant", "content": None, "tool_calls": [{
                                "id": use.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
                            {"role": "tool", "tool_call_id": use.id, "content": result}], 40, tools=[CHAT_WEATHER])
    text = "".join(b.text for b in second.content if b.type == "text")
    assert text == (chat.message.content or "")


def test_count_tokens_is_what_messages_reads(qwen):
    client = claude(qwen)
    messages = [{"role": "user", "content": ASK}]
    counted = client.messages.count_tokens(model="qwen", messages=messages, tools=[CLAUDE_WEATHER], system="Be brief.")
    m = client.messages.create(model="qwen", max_tokens=1, messages=messages, tools=[CLAUDE_WEATHER],
                               system="Be brief.", extra_body=GREEDY)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 20


def test_messages_api_key_header_and_error_shape(tiny_dir):
    from test_server import ServerThread
    from quickdraft import LLM
    from quickdraft.serving import create_app
    from quickdraft.serving.guard import ServerLimits

    app = create_app(LLM(str(tiny_dir()), kv_cache_memory="16MiB"), "tiny", limits=ServerLimits(api_key="sekrit"))
    with ServerThread(app) as server:
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "t1 t2"}]}
        for headers in ({"x-api-key": "sekrit"}, {"Authorization": "Bearer sekrit"}):
            assert httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=30).status_code == 200
        with pytest.raises(anthropic.AuthenticationError):
            claude(server, api_key="wrong").messages.create(**body)
        r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=30)
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-api-key": "wrong"}, timeout=30,
                       json={"messages": [{"role": "user", "content": "t1"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there


# ---- tokenize, detokenize, embeddings ------------------------------------------------------------------------------
def test_tokenize_and_detokenize(qwen):
    tokenizer = qwen.app.state.llm.tokenizer
    text = "def héllo():  return '日本'"
    r = httpx.post(f"{qwen.url}/tokenize", json={"content": text}, timeout=30).json()
    assert r["tokens"] == tokenizer.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    pieces = httpx.post(f"{qwen.url}/tokenize", json={"content": text, "with_pieces": True}, timeout=30).json()
    assert [p["id"] for p in pieces["tokens"]] == r["tokens"]
    spelled = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                       for p in pieces["tokens"])
    assert spelled.decode() == text
    back = httpx.post(f"{qwen.url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["content"] == text


def test_embeddings(qwen):
    client = qwen.client()
    texts = ["def add(a, b): return a + b", "The weather in Paris is cloudy.", "x"]
    floats = client.embeddings.create(model="qwen", input=texts)
    encoded = client.embeddings.create(model="qwen", input=texts, encoding_format="base64")
    hidden = qwen.app.state.llm.model.config.hidden_size
    assert [d.index for d in floats.data] == [0, 1, 2] and all(len(d.embedding) == hidden for d in floats.data)
    vectors = np.array([d.embedding for d in floats.data])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in encoded.data])
    assert np.array_equal(decoded, vectors.astype(np.float32))  # little-endian float32, as OpenAI sends them
    alone = client.embeddings.create(model="qwen", input=texts[1]).data[0].embedding
    assert np.allclose(alone, vectors[1], atol=1e-5)  # a batch gives each input what it gets alone
    assert floats.usage.prompt_tokens == sum(len(qwen.app.state.llm.tokenizer.encode(t, False)) for t in texts)
    mean = client.embeddings.create(model="qwen", input=texts[0], extra_body={"pooling": "mean"}).data[0].embedding
    assert not np.allclose(mean, vectors[0], atol=1e-3)
    assert qwen.wait_idle()["quickdraft_kv_blocks_used"] == 0


# ---- hostile bodies ------------------------------------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000
OPENAI_BAD = [
    ("/v1/responses", {"input": [{"type": "banana"}]}, 400),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 5000}, 400),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**12}, 400),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("/v1/responses", {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "xml"}}}, 400),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400),
    ("/v1/responses", {"input": "\ud800"}, 400),
    ("/v1/responses", {"input": "hi", "model": "gpt-5"}, 404),
    ("/v1/responses", {"input": "hi", "metadata": {"a": float("nan")}}, 400),  # echoed back: must be JSON
    ("/v1/responses", {"input": "hi", "user": "\ud800"}, 400),
    ("/v1/responses", {"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "a": {"type": "number", "default": float("inf")}}}}]}, 400),
    ("/tokenize", {"content": "a " * 1_100_000}, 400),
    ("/tokenize", {"content": 5}, 400),
    ("/tokenize", {"content": "\ud800"}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/v1/embeddings", {"input": []}, 400),
    ("/v1/embeddings", {"input": ["a"] * 3000}, 400),
    ("/v1/embeddings", {"input": [[10**9]]}, 400),
    ("/v1/embeddings", {"input": ""}, 400),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400),
    ("/v1/embeddings", {"input": "a", "dimensions": 5}, 400),
    ("/v1/embeddings", {"input": [[1] * 5000]}, 400),
]
CLAUDE_BAD = [
    {"messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    {"max_tokens": 10**12, "messages": [{"role": "user", "content": "hi"}]},
    {"max_tokens": 5, "messages": []},
    {"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_none", "content": "1"}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "bash_20250124"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "maybe"}},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}] * 5000},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "x"},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")},
]


@pytest.mark.parametrize("path,body,status", OPENAI_BAD, ids=lambda x: str(x)[:40])
def test_hostile_openai_shaped_bodies(qwen, path, body, status):
    r = httpx.post(f"{qwen.url}{path}", content=json.dumps({"model": "qwen", **body}), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"]["message"], str)


@pytest.mark.parametrize("body", CLAUDE_BAD, ids=lambda x: str(x)[:60])
def test_hostile_anthropic_bodies(qwen, body):
    r = httpx.post(f"{qwen.url}/v1/messages", content=json.dumps({"model": "qwen", **body}), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings"])
def test_content_nested_100000_deep_is_a_400(qwen, path):
    field = "input" if path in ("/v1/responses", "/v1/embeddings") else "messages"
    text = f'{{"model": "qwen", "max_tokens": 5, "{field}": {DEEP}}}'
    r = httpx.post(f"{qwen.url}{path}", content=text, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    shape = r.json()
    assert (shape["type"] == "error") if path.startswith("/v1/messages") else ("error" in shape)
    assert httpx.get(f"{qwen.url}/health", timeout=10).status_code == 200
