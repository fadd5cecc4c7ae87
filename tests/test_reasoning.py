"""A reasoning model's thinking apart from its answer: gpt-oss's harmony channels and <think> tags, read by
``serving/reasoning.py`` into ``reasoning_content`` (chat completions), reasoning items (Responses) and thinking
blocks (Anthropic Messages), streamed or whole, with harmony's tool calls as OpenAI tool calls.

The models are tiny random ones with a real byte-level BPE tokenizer (trained here by ``tokenizers``) holding
harmony's special tokens; a grammar (llguidance, special tokens included) makes them write the exact text each test
reads, through a real server on 127.0.0.1 and the real ``openai`` and ``anthropic`` clients."""
from __future__ import annotations

import json
import random
from pathlib import Path

import anthropic
import pytest

from conftest import make_tiny_checkpoint
from test_server import serve

from quickdraft.serving.reasoning import ReasoningFormat, reasoning_format, reasoning_style
from quickdraft.tokenizer import Tokenizer

HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|return|>", "<|call|>"]
# a sketch of gpt-oss's template: it renders the same markers (the released template adds the system header,
# tool namespaces and earlier thinking)
HARMONY_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
THINK_TEMPLATE = ("{%- for m in messages %}<|start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|end|>"
                  "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant\n{% if opened %}<think>\n"
                  "{% endif %}{%- endif %}")
THOUGHT, ANSWER = "The user wants the weather; Paris is sunny.", "It is sunny in Paris."
ANALYSIS = f'<|channel|> "analysis" <|message|> "{THOUGHT}" <|end|> <|start|> "assistant" '
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def harmony(*messages: tuple[str, str]) -> str:
    """Harmony text of (header, body) messages, <|end|> between them, as a model writes it after <|start|>assistant."""
    return "<|end|><|start|>assistant".join(f"<|channel|>{head}<|message|>{body}" for head, body in messages)


def split_streamed(form: ReasoningFormat, text: str, cuts: list[int]) -> tuple[str | None, str]:
    reader, pieces, last = form.reader(), [], 0
    for cut in cuts + [len(text)]:
        pieces += reader.feed(text[last:cut])
        last = cut
    pieces += reader.finish()
    assert all(t for _, t in pieces), "no empty pieces"
    return ("".join(t for k, t in pieces if k == "reasoning") or None), "".join(t for k, t in pieces if k == "content")


OUTPUTS = [  # (form, output, (reasoning, content))
    (ReasoningFormat("harmony"), harmony(("analysis", THOUGHT), ("final", ANSWER)), (THOUGHT, ANSWER)),
    (ReasoningFormat("harmony"), harmony(("analysis", "a"), ("commentary", "Checking."), ("final", "b")),
     ("a", "Checking.b")),  # a preamble is said to the user
    (ReasoningFormat("harmony"), harmony(("analysis", THOUGHT), ('commentary to=functions.get_weather <|constrain|>json',
                                                                 '{"city":"Paris"}')),
     (THOUGHT, '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>')),
    (ReasoningFormat("harmony"), "<|channel|>analysis<|message|>cut mid-way", ("cut mid-way", "")),
    (ReasoningFormat("harmony"), "A plain answer <script>alert(1)</script>", (None, "A plain answer <script>alert(1)</script>")),
    (ReasoningFormat("harmony"), "<|channel|>" + "x" * 300, (None, "<|channel|>" + "x" * 300)),  # never a message
    (ReasoningFormat("harmony"), "<|channel|>analysis" + " " * 300 + "<|message|>x<|end|>",  # a header past 256
     (None, "<|channel|>analysis" + " " * 300 + "<|message|>x<|end|>")),
    (ReasoningFormat("harmony"), ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}',
     (None, '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>')),  # recipient first
    (ReasoningFormat("harmony"), harmony(("commentary to=functions.f", '{"a":"</tool_call><tool_call>{}"}')),
     (None, '<tool_call>{"name": "f", "arguments": {"a":"\\u003c/tool_call>\\u003ctool_call>{}"}}</tool_call>')),
    (ReasoningFormat("harmony", calls=False), harmony(("commentary to=functions.f", '{"a":1}')), (None, '{"a":1}')),
    (ReasoningFormat("harmony"), "<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>X",
     (None, "X")),  # the last channel of a header counts
    (ReasoningFormat("harmony"), harmony(("final", "Hi")) + "<|end|> more", (None, "Hi more")),  # text, no header
    (ReasoningFormat("think"), "<think>\nhmm, 2+2\n</think>\n\n4", ("hmm, 2+2", "4")),  # blanks at its ends dropped
    (ReasoningFormat("think", opened=True), "hmm</think>4", ("hmm", "4")),
    (ReasoningFormat("think"), "4, not <think>x</think>", (None, "4, not <think>x</think>")),
    (ReasoningFormat("think"), "<think>never closed", ("never closed", "")),
    (ReasoningFormat("think"), "<think>a</think>b</think>c", ("a", "b</think>c")),
]


@pytest.mark.parametrize("form, output, expected", OUTPUTS)
def test_a_stream_cut_anywhere_reads_as_the_whole_output(form, output, expected):
    assert form.split(output) == expected
    rng = random.Random(0)
    for size in (1, 2, 3, 7):
        assert split_streamed(form, output, list(range(size, len(output), size))) == expected
    for _ in range(50):
        assert split_streamed(form, output, sorted(rng.sample(range(1, len(output)), min(5, len(output) - 1)))) \
            == expected


def test_the_style_is_read_off_the_template():
    assert reasoning_style(HARMONY_TEMPLATE) == "harmony"
    assert reasoning_style("{{ m.content.split('</think>')[-1] }}") == "think"
    assert reasoning_style("<|im_start|>{{ m.role }}") is None and reasoning_style(None) is None
    assert reasoning_format(THINK_TEMPLATE, "<|start|>assistant\n<think>\n").opened
    assert not reasoning_format(THINK_TEMPLATE, "<think>\n\n</think>\n\n").opened  # thinking switched off
    # a constrained output (a schema, a demanded call) is its grammar's from its first token: no thinking opened
    assert not reasoning_format(THINK_TEMPLATE, "<|start|>assistant\n<think>\n", constrained=True).opened


def test_a_hostile_output_reads_whole_and_streamed_alike():
    """Markers by the hundred thousand (1.2 M characters; the reader's work is linear in them, each search starting
    where the last stopped), whole and streamed in 7-character chunks: the same reading."""
    text = "<|channel|>analysis<|message|>a" + "<|end|><|channel|>analysis<|message|>a" * 30_000
    form = ReasoningFormat("harmony")
    assert form.split(text) == split_streamed(form, text, list(range(7, len(text), 7))) == ("a" * 30_001, "")


def write_tokenizer(directory: Path, template: str, corpus: tuple[str, ...] = ()) -> Path:
    """A real byte-level BPE tokenizer with harmony's special tokens, and the chat template; trained on the test's
    sentences and ``corpus`` (a template's own text, so that its prompts take few tokens)."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500 if corpus else 400, special_tokens=HARMONY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([THOUGHT, ANSWER, "analysis final commentary assistant user functions", *corpus] * 10,
                                trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "bos_token": None,
                                                                 "chat_template": template}))
    return directory


def make_model(directory: Path, template: str, corpus: tuple[str, ...] = (), max_positions: int = 512) -> Path:
    tokenizer = write_tokenizer(directory / "tokenizer", template, corpus)
    vocab = Tokenizer.from_hf_dir(tokenizer).vocab_size
    return make_tiny_checkpoint(directory / "model", vocab_size=vocab, tokenizer_from=tokenizer,
                                max_positions=max_positions)


def test_harmony_turns_end_on_return_and_call_not_on_end(tmp_path):
    tok = Tokenizer.from_hf_dir(write_tokenizer(tmp_path / "h", HARMONY_TEMPLATE))
    ids = {t: tok.token_to_id(t) for t in HARMONY_SPECIALS}
    assert ids["<|return|>"] in tok.eos_token_ids and ids["<|call|>"] in tok.eos_token_ids
    assert ids["<|end|>"] not in tok.eos_token_ids  # it closes the thinking, and the answer follows
    data = json.loads((tmp_path / "h" / "tokenizer.json").read_text())  # a vocabulary without harmony: Phi-3's end
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in ("<|return|>", "<|call|>")]
    (tmp_path / "h" / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer.from_hf_dir(tmp_path / "h").token_to_id("<|end|>") in \
        Tokenizer.from_hf_dir(tmp_path / "h").eos_token_ids


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    with serve(make_model(tmp_path_factory.mktemp("harmony"), HARMONY_TEMPLATE), "oss") as server:
        yield server


def forced(grammar: str, **body) -> dict:
    """Request fields that make the random model write exactly the grammar's text, greedily."""
    return {"temperature": 0, "max_tokens": 80, "extra_body": {"structured_outputs": {"grammar": grammar}}, **body}


ANSWERED = f'start: {ANALYSIS} <|channel|> "final" <|message|> "{ANSWER}"'
CALLED = (f'start: {ANALYSIS} <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
          '"{\\"city\\":\\"Paris\\"}" <|call|>')  # the grammar names the stop token
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_chat_completions_carry_the_thinking_apart(harmony_server):
    client = harmony_server.client()
    r = client.chat.completions.create(model="oss", messages=ASK, **forced(ANSWERED))
    message = r.choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THOUGHT
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="oss", messages=ASK, stream=True, **forced(ANSWERED)))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas[first_answer:])


def test_a_harmony_call_is_an_openai_tool_call(harmony_server):
    client = harmony_server.client()
    r = client.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], **forced(CALLED))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], stream=True,
                                                 **forced(CALLED)))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert json.loads("".join(tc.function.arguments for tc in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_and_anthropic_messages_carry_the_thinking(harmony_server):
    grammar = {"structured_outputs": {"grammar": ANSWERED}, "temperature": 0}
    r = harmony_server.client().responses.create(model="oss", input="Weather in Paris?",
                                                 max_output_tokens=80, extra_body=grammar)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER
    events = list(harmony_server.client().responses.create(model="oss", input="Weather in Paris?",
                                                           max_output_tokens=80, extra_body=grammar, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]

    claude = anthropic.Anthropic(base_url=harmony_server.url, api_key="unused", max_retries=0)
    m = claude.messages.create(model="oss", max_tokens=80, messages=ASK, extra_body=grammar)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
        [("thinking", THOUGHT), ("text", ANSWER)]
    with claude.messages.stream(model="oss", max_tokens=80, messages=ASK, extra_body=grammar) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"] and streamed.content[0].thinking == THOUGHT


def test_special_tokens_asked_away_leave_the_text_unread(harmony_server):
    """A client that asks for special tokens to be skipped gets the text without harmony's markers: all content."""
    r = harmony_server.client().chat.completions.create(model="oss", messages=ASK,
                                                        **forced(ANSWERED, extra_body={"skip_special_tokens": True,
                                                                 "structured_outputs": {"grammar": ANSWERED}}))
    assert r.choices[0].message.content == f"analysis{THOUGHT}assistantfinal{ANSWER}"
    assert "reasoning_content" not in r.choices[0].message.model_extra


def test_think_tags_through_the_server(tmp_path):
    grammar = f'start: "<think>\\n{THOUGHT}\\n</think>\\n\\n{ANSWER}"'
    with serve(make_model(tmp_path, THINK_TEMPLATE.replace("{% if opened %}", "{% if false %}")), "think") as server:
        r = server.client().chat.completions.create(model="think", messages=ASK, **forced(grammar))
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].message.model_extra["reasoning_content"] == THOUGHT  # the blank before </think> dropped


def test_a_prompt_that_opens_the_thinking(tmp_path):
    """A template that ends the prompt inside <think> (DeepSeek-R1's): the output is thinking until </think>, here all
    of it (a random model never closes it), streamed as whole; a constrained output (a schema, a demanded call) is its
    grammar's from the first token, so it is the answer."""
    with serve(make_model(tmp_path, THINK_TEMPLATE.replace("{% if opened %}", "{% if true %}")), "think") as server:
        client = server.client()
        whole = client.chat.completions.create(model="think", messages=ASK, temperature=0, max_tokens=12)
        message = whole.choices[0].message
        assert not message.content and message.model_extra["reasoning_content"]
        chunks = list(client.chat.completions.create(model="think", messages=ASK, temperature=0, max_tokens=12,
                                                     stream=True))
        assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                       if c.choices) == message.model_extra["reasoning_content"]
        chosen = client.chat.completions.create(model="think", messages=ASK, temperature=0, max_tokens=8,
                                                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert chosen.choices[0].message.content in ("yes", "no")
        assert "reasoning_content" not in chosen.choices[0].message.model_extra


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_a_grammar_may_name_a_stop_token(tmp_path, speculative):
    """A grammar that writes a stop token itself (harmony's <|call|>) ends the output there, also one that ignores
    its end and a grammar that goes on past it (a stop token ends the output wherever it stands), plain and under
    speculation; before, the token's own mask allowed it and committing it failed the request."""
    from quickdraft import LLM, SamplingParams

    llm = LLM(str(make_model(tmp_path, HARMONY_TEMPLATE)), dtype="float32", kv_cache_memory="16MiB",
              **({"speculative": speculative} if speculative else {}))
    call = llm.tokenizer.token_to_id("<|call|>")
    for grammar in ('start: "ab" <|call|>', 'start: "ab" <|call|> "cd"'):
        for ignore_eos in (False, True):
            out = llm.generate(["ab ab ab"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=ignore_eos,
                                                            structured_outputs={"grammar": grammar}))[0]
            assert out.token_ids[-1] == call and out.finish_reason == "stop"
            assert llm.tokenizer.decode(out.token_ids[:-1]) == "ab"


def test_draft_info_spells_what_each_event_carries(harmony_server):
    """The page's token spans (``stream_options.include_draft_info``) spell each event's content, never the markers
    or the thinking the reader took out of it."""
    import httpx

    body = {"messages": ASK, "stream": True, "temperature": 0, "max_tokens": 80,
            "structured_outputs": {"grammar": ANSWERED}, "stream_options": {"include_draft_info": True}}
    with httpx.stream("POST", harmony_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"] and "draft_info" in e["choices"][0]]
    assert choices and all("".join(s["text"] for s in c["draft_info"]["spans"]) == c["delta"].get("content", "")
                           for c in choices)
    assert "".join(c["delta"].get("content", "") for c in choices) == ANSWER


# a template that insists on its variables: what reaches it is what the request said
STRICT_TEMPLATE = (
    "{%- if reasoning_effort is not defined or reasoning_effort != 'high' %}{{ raise_exception('effort: ' ~ "
    "(reasoning_effort if reasoning_effort is defined else 'none')) }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and (m.thinking != 'T' or m.reasoning_content != 'T') %}"
    "{{ raise_exception('no thinking') }}{%- endif %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endfor %}<|start|>assistant{% if enable_thinking is defined and not enable_thinking %} quiet{% endif %}")


def test_template_variables_reach_the_template(tmp_path):
    """``reasoning_effort`` (chat completions; Responses' ``reasoning.effort``), ``chat_template_kwargs`` (Qwen3's
    ``enable_thinking``) and an earlier turn's ``reasoning_content`` (as ``thinking`` too, gpt-oss's name) reach the
    chat template; a bad effort or a name the server sets itself is a 400 naming it."""
    import openai

    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "T"},
               {"role": "user", "content": "Weather?"}]
    with serve(make_model(tmp_path, STRICT_TEMPLATE), "strict") as server:
        client = server.client()
        ask = dict(model="strict", messages=history, max_tokens=2, temperature=0)
        with pytest.raises(openai.BadRequestError, match="effort: none"):
            client.chat.completions.create(**ask)
        with pytest.raises(openai.BadRequestError, match="effort: low"):
            client.chat.completions.create(**ask, reasoning_effort="low")
        loud = client.chat.completions.create(**ask, reasoning_effort="high")
        quiet = client.chat.completions.create(**ask, reasoning_effort="high",
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert quiet.usage.prompt_tokens > loud.usage.prompt_tokens  # " quiet" rendered
        assert client.responses.create(model="strict", input="Weather?", max_output_tokens=2, temperature=0,
                                       reasoning={"effort": "high"}).status in ("completed", "incomplete")
        with pytest.raises(openai.BadRequestError, match="reasoning_effort must be 'low', 'medium' or 'high'"):
            client.chat.completions.create(**ask, extra_body={"reasoning_effort": "max"})
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set 'messages'"):
            client.chat.completions.create(**ask, reasoning_effort="high",
                                           extra_body={"chat_template_kwargs": {"messages": []}})


def test_stop_strings_end_what_a_message_says_never_its_markup(harmony_server):
    """A harmony output's headers and markers ("analysis", "final", "<|message|>") are markup: a stop string that
    names them does not end the output; one that a message says ends it there, as in any output."""
    client = harmony_server.client()
    r = client.chat.completions.create(model="oss", messages=ASK, stop=["final", "analysis", "<|", "assistant"],
                                       **forced(ANSWERED))
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == (ANSWER, THOUGHT)
    cut = ANSWER.index("in Paris")  # said by the answer, not the thinking
    r = client.chat.completions.create(model="oss", messages=ASK, stop=["final", "in Paris"], **forced(ANSWERED))
    assert r.choices[0].finish_reason == "stop"
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == \
        (ANSWER[:cut], THOUGHT)
    chunks = list(client.chat.completions.create(model="oss", messages=ASK, stop=["final", "in Paris"], stream=True,
                                                 **forced(ANSWERED)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER[:cut]
    r = client.chat.completions.create(model="oss", messages=ASK, stop=["weather"], **forced(ANSWERED))
    assert r.choices[0].message.model_extra["reasoning_content"] == THOUGHT[:THOUGHT.index("weather")].rstrip()
    assert not r.choices[0].message.content


def harmony_sequence(tmp_path: Path, stop: list[str]):
    """A sequence reading harmony (special tokens kept, stop strings only in what messages say), on the real BPE
    tokenizer with harmony's special tokens."""
    import torch

    from quickdraft import SamplingParams
    from quickdraft.engine.sequence import Sequence
    from quickdraft.sampling import LogitsProcessor

    tok = Tokenizer.from_hf_dir(write_tokenizer(tmp_path / "h", HARMONY_TEMPLATE))
    params = SamplingParams(max_tokens=500, stop=stop, skip_special_tokens=False,
                            stop_strings_after_token=tok.token_to_id("<|message|>"))
    seq = Sequence(request_id="r", index=0, prompt=None, prompt_ids=[1], params=params, tokenizer=tok,
                   processor=LogitsProcessor(params, [1], tok.vocab_size), generator=torch.Generator(),
                   max_model_len=1024)
    return tok, seq


def write(seq, tok, text: str) -> None:
    for token in tok.encode(text, add_special_tokens=False):
        if not seq.finished:
            seq.append([token], [False])


@pytest.mark.parametrize("output, stop, text", [
    ("It is sunny in Paris. More.", "in Paris", "It is sunny "),  # no markup at all (a grammar's JSON, say)
    ("<|channel|>final<|message|>Hello<|message|> world<|end|>", "<|", None),  # a second <|message|>: still markup
    ("<|channel|>final<|message|>Hello<|message|> world", "o w", None),  # no match across markup
    ("<|channel|>final<|message|>Hello<|message|> world STOP", " STOP", "<|channel|>final<|message|>Hello"
                                                                         "<|message|> world"),
])
def test_stop_strings_of_a_harmony_sequence(tmp_path, output, stop, text):
    tok, seq = harmony_sequence(tmp_path, [stop])
    write(seq, tok, output)
    assert (seq.finished, seq.text) == (True, text) if text is not None else not seq.finished


def test_a_resumed_harmony_sequence_finds_stop_strings_in_the_message_it_was_cut_in(tmp_path):
    tok, seq = harmony_sequence(tmp_path, [" STOP"])
    seq.resume(tok.encode("<|channel|>final<|message|>Hello", add_special_tokens=False))
    write(seq, tok, " world STOP more")
    assert seq.finished and seq.text == "<|channel|>final<|message|>Hello world"
