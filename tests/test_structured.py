"""Structured outputs: constraints are checked before any model work, every output matches its constraint, and a
constraint changes nothing about exactness: greedy output is the same with and without speculation (and forced
tokens), and sampled output follows the *masked* target distribution (chi-square on a tiny model whose byte-level
vocabulary lets the grammar cut tokens in several ways)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema_rs
import pytest
import torch

import quickdraft.engine.verify_step as verify_step
from quickdraft import LLM, InvalidParameterError, SamplingParams, StructuredOutputs
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.sampling import LogitsProcessor
from quickdraft.sampling.grammar import compiler_for
from conftest import make_tiny_checkpoint
from test_cross_vocab import write_bpe_tokenizer
from test_distribution import SAMPLES, broken_verify_residual_is_p, chi_square_pvalue

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "city": {"enum": ["Paris", "London", "Rome"]}},
    "required": ["name", "age", "skills", "city"], "additionalProperties": False}


# ---- the request's side: bounded and checked ---------------------------------------------------------------
@pytest.mark.parametrize("value,message", [
    ("json", "structured_outputs must be an object"),
    ({}, "exactly one of"),
    ({"json": PERSON, "regex": "a"}, "exactly one of"),
    ({"jsonn": PERSON}, "unknown key 'jsonn'"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"regex": "a" * 70_000}, "at most 65536 characters"),
    ({"regex": "\ud800"}, "structured_outputs.regex"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "non-empty list"),
    ({"choice": ["a"] * 2000}, "at most 1024 strings"),
    ({"choice": ["a", 3]}, "made of strings"),
    ({"json": "{not json"}, "is not valid JSON"),
    ({"json": [1, 2]}, "a JSON schema"),
    ({"json_object": "yes"}, "must be true"),
])
def test_bad_constraints_are_refused_naming_the_field(value, message):
    with pytest.raises(InvalidParameterError, match=re.escape(message)):
        SamplingParams(structured_outputs=value)


def test_a_deeply_nested_schema_is_refused_without_recursing():
    schema: dict = {}
    node = schema
    for _ in range(100_000):  # deeper than Python's recursion limit: a recursive check would crash
        node["items"] = {}
        node = node["items"]
    with pytest.raises(InvalidParameterError, match="nested more than 64 levels"):
        StructuredOutputs.of({"json": schema})


@pytest.fixture(scope="module")
def smollm():
    return LLM("smollm2-135m", speculative="ngram", num_speculative_tokens=4)  # fixed k: drafts whatever the timing


CHAT = [{"role": "user", "content": "Describe a software engineer as JSON with name, age, skills and city."}]


@pytest.mark.parametrize("spec,message", [
    ({"json": {"type": "objectx"}}, "structured_outputs.json was rejected by the grammar compiler"),
    ({"regex": "[0-9"}, "unclosed character class"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"grammar": "root ::= \"a\" undefined"}, "structured_outputs.grammar"),
])
def test_what_the_compiler_rejects_is_refused_before_any_model_work(smollm, spec, message):
    before = smollm.spec_stats.rounds
    with pytest.raises(InvalidParameterError, match=re.escape(message)):
        smollm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert smollm.spec_stats.rounds == before  # nothing ran


def text_of(llm: LLM, spec: dict, chat: list[dict] = CHAT) -> str:
    out = llm.chat(chat, SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=spec))[0]
    assert out.outputs[0].finish_reason == "stop"  # the grammar completed: the sequence ends there
    return out.outputs[0].text


def test_every_kind_of_constraint_holds_on_real_weights(smollm):
    person = json.loads(text_of(smollm, {"json": PERSON}))
    jsonschema_rs.validate(PERSON, person)
    assert isinstance(json.loads(text_of(smollm, {"json_object": True}, [
        {"role": "user", "content": "Reply with a JSON object whose keys are city and country, for Paris."}])), dict)
    assert re.fullmatch(r"[0-9]{3}-(yes|no)", text_of(smollm, {"regex": r"[0-9]{3}-(yes|no)"}))
    assert text_of(smollm, {"choice": ["positive", "negative", "neutral"]}) in ("positive", "negative", "neutral")
    lark = 'start: "Answer: " ("yes" | "no") "."'
    assert re.fullmatch(r"Answer: (yes|no)\.", text_of(smollm, {"grammar": lark}))
    gbnf = 'root ::= "Answer: " ("yes" | "no") "."'
    assert re.fullmatch(r"Answer: (yes|no)\.", text_of(smollm, {"grammar": gbnf}))


def test_a_schema_compiles_once(smollm):
    compiler = compiler_for(smollm.tokenizer)
    spec = StructuredOutputs.of({"json": {**PERSON, "title": "cached"}})
    compiler.compile(spec)
    cached = dict(compiler._compiled)
    compiler.compile(spec)
    assert compiler._compiled.keys() == cached.keys() and spec.cache_key() in cached


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(smollm):
    """n-gram drafts are cut at the first token the grammar forbids; forced tokens ride in the same pass."""
    params = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs={"json": PERSON})
    prompts = [smollm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in (
        "Describe a software engineer as JSON.", "Describe a painter from Rome as JSON, with three skills.",
        "Give a JSON record of a 40 year old chef in Paris.")]
    before = dataclasses.replace(smollm.spec_stats)
    spec = [o.outputs[0].token_ids for o in smollm.generate(prompts, params)]
    plain = [o.outputs[0].token_ids for o in smollm.generate(prompts, dataclasses.replace(params, speculative=False))]
    assert spec == plain
    used = smollm.spec_stats
    assert used.draft_tokens > before.draft_tokens and used.forced_tokens > before.forced_tokens


def test_n_samples_each_follow_the_grammar(smollm):
    out = smollm.chat(CHAT, SamplingParams(n=3, max_tokens=96, temperature=0.8, seed=5,
                                           structured_outputs={"json": PERSON}))[0]
    for o in out.outputs:
        jsonschema_rs.validate(PERSON, json.loads(o.text))


# ---- the masked target distribution, with speculation ---------------------------------------------------------
# byte-level BPE over a, b, c, d: the grammar below can be written with 1- or 2-byte tokens, so masks differ by
# position and drafts (n-gram's and a draft model's) cross the grammar's rows in several ways
TOKENS = ["<eos>", "a", "b", "c", "d", "ab", "ba", "cd"]
MERGES = [("a", "b"), ("b", "a"), ("c", "d")]
REGEX = "[abc]dcd[ab][abcd]?c"  # "dcd" is forced: tokens d, cd
PROMPT = [1, 2, 3, 1, 2, 3, 5, 7]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("structured")
    tok_dir = write_bpe_tokenizer(root / "tok", TOKENS, MERGES)
    target = make_tiny_checkpoint(root / "target", arch="llama", vocab_size=len(TOKENS), layers=2, hidden=32,
                                  heads=4, kv_heads=2, seed=21, tokenizer_from=tok_dir)
    draft = make_tiny_checkpoint(root / "draft", arch="qwen2", vocab_size=len(TOKENS), layers=1, hidden=32,
                                 heads=4, kv_heads=2, seed=22, tokenizer_from=tok_dir)
    return target, draft


def tiny_llm(pair, drafter: str) -> LLM:
    target, draft = pair
    options = {"ngram": {"speculative": "ngram"}, "draft": {"draft": str(draft), "draft_weights": "float32"}}
    return LLM(str(target), weights="float32", max_num_seqs=1024, max_num_batched_tokens=16384,
               kv_cache_memory="32MiB", num_speculative_tokens=3, **options[drafter])


def exact_masked_distribution(llm: LLM, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(output) by enumeration: each step's target distribution under the request's transforms and the grammar's
    mask, until the grammar completes."""
    compiler = compiler_for(llm.tokenizer)
    dist: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        kv = SequenceKV()
        (logits,) = llm.target.forward([ForwardItem(kv, PROMPT + list(prefix), 1)])
        llm.target.free(kv)
        proc = LogitsProcessor(params, PROMPT, len(TOKENS), grammar=compiler.compile(params.structured_outputs))
        proc.accept(list(prefix))
        p = proc.probs(logits)[0].double()
        for t in torch.nonzero(p > 0).flatten().tolist():
            proc.accept([t])
            done = proc.grammar_finished
            proc.grammar.reset()
            proc.grammar.accept(list(prefix))
            if done:
                dist[prefix + (t,)] = float(prob * p[t])
            else:
                walk(prefix + (t,), prob * p[t])

    walk((), 1.0)
    assert abs(sum(dist.values()) - 1.0) < 1e-6
    return dist


def sample(llm: LLM, params: SamplingParams, n: int) -> list[tuple[int, ...]]:
    outs = llm.generate([PROMPT] * n, [dataclasses.replace(params, seed=20_000 + i) for i in range(n)])
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("drafter,temperature", [("draft", 1.0), ("ngram", 0.8)])
def test_constrained_sampling_with_speculation_follows_the_masked_target(tiny_pair, drafter, temperature):
    llm = tiny_llm(tiny_pair, drafter)
    params = SamplingParams(max_tokens=8, temperature=temperature, structured_outputs={"regex": REGEX})
    dist = exact_masked_distribution(llm, params)
    samples = sample(llm, params, SAMPLES)
    bad = [s for s in samples if not re.fullmatch(REGEX, llm.tokenizer.decode(list(s), skip_special_tokens=True))]
    assert not bad, (len(bad), bad[:5], [llm.tokenizer.decode(list(s)) for s in bad[:5]])
    stats = llm.spec_stats
    assert stats.draft_tokens > 0 and stats.forced_tokens > 0
    assert stats.accepted_tokens < stats.draft_tokens  # drafts were rejected: the residual was exercised
    assert chi_square_pvalue(samples, dist) > 0.001


def test_a_broken_verifier_fails_the_constrained_test(tiny_pair, monkeypatch):
    monkeypatch.setattr(verify_step, "verify_with_uniforms", broken_verify_residual_is_p)
    llm = tiny_llm(tiny_pair, "draft")
    params = SamplingParams(max_tokens=8, temperature=1.0, structured_outputs={"regex": REGEX})
    dist = exact_masked_distribution(llm, params)
    assert chi_square_pvalue(sample(llm, params, SAMPLES), dist) < 0.001


def test_a_tokenizer_without_byte_spellings_is_refused_clearly(tiny_dir):
    llm = LLM(str(tiny_dir(arch="llama", vocab_size=8, layers=1, hidden=32)), weights="float32",
              kv_cache_memory="8MiB")
    with pytest.raises(InvalidParameterError, match="needs the bytes each token writes"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, structured_outputs={"regex": "t1"}))


# ---- found by a hostile review -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,words", [
    ({"json": "false"}, "the schema false"),
    ({"json": False}, "exactly one of"),
    ({"json": {"$ref": "#"}}, "rejected by the grammar compiler"),
    ({"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "rejected by the grammar compiler"),
    ({"regex": "[^\\x00-\\x{10FFFF}]"}, "rejected by the grammar compiler"),
    ({"grammar": "start: /[^\\s\\S]/"}, "rejected by the grammar compiler"),
    ({"json": {"type": "string", "minLength": 10 ** 30}}, "rejected by the grammar compiler"),
])
def test_unsatisfiable_and_unbuildable_constraints_are_refused_before_model_work(smollm, spec, words):
    before = smollm.spec_stats.rounds
    with pytest.raises(InvalidParameterError, match=re.escape(words)):
        smollm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert smollm.spec_stats.rounds == before
    assert StructuredOutputs.of({"json": "true"}).json == {}  # the schema true: any JSON value


def test_property_order_is_the_schema_s_own_whatever_ran_before(smollm):
    a = {"type": "object", "properties": {"answer": {"type": "integer"}, "reasoning": {"type": "string",
                                                                                      "maxLength": 20}},
         "required": ["answer", "reasoning"], "additionalProperties": False}
    b = {**a, "properties": dict(reversed(list(a["properties"].items())))}
    for schema in (a, b):
        out = smollm.generate(["Q: 2+2? Reply in JSON."], SamplingParams(temperature=0, max_tokens=60,
                                                                           structured_outputs={"json": schema}))
        assert list(json.loads(out[0].outputs[0].text)) == list(schema["properties"])


def test_run_ahead_sampling_with_forced_tokens_keeps_q_in_step(monkeypatch):
    """A round that drafts nothing but gets forced tokens, continued by the run-ahead: its q rows must line up
    with its tokens (they were one row short, and verification failed or used the wrong rows)."""
    llm = LLM("smollm2-135m", draft="smollm2-135m", num_speculative_tokens=4, run_ahead=True, dtype="float32",
              kv_cache_memory="64MiB", max_model_len=1024)
    controller = llm.engine.planner.controller
    choose, calls = controller.choose, iter(range(10 ** 6))
    monkeypatch.setattr(controller, "choose", lambda seqs, *a, **k: [0] * len(seqs) if next(calls) % 2 == 0
                        else choose(seqs, *a, **k))  # the controller may always decide not to draft a round
    schema = {"type": "object", "properties": {
        "first_name_of_person": {"type": "string", "maxLength": 8}, "the_age_of_person_in_years": {"type": "integer"},
        "home_city_name": {"type": "string", "maxLength": 8}},
        "required": ["first_name_of_person", "the_age_of_person_in_years", "home_city_name"],
        "additionalProperties": False}
    for seed in range(6):
        # room to finish: a sampled object may wander through the whitespace JSON allows before it closes
        params = SamplingParams(temperature=1.0, max_tokens=160, seed=seed, structured_outputs={"json": schema})
        o = llm.generate(["Describe a person as JSON:"], params)[0].outputs[0]
        assert o.error is None and o.finish_reason == "stop", o.error
        jsonschema_rs.validate(schema, json.loads(o.text))
    assert llm.spec_stats.forced_tokens > 0 and llm.spec_stats.run_ahead_rounds > 0
