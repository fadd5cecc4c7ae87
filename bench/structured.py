"""Schema-constrained generation: plain vs constrained vs constrained + speculation + forced tokens, in one run.

Usage: python bench/structured.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--tokens 160] [--prompts-per-schema 2]
         [--name structured]

Setups: smollm2-135m with suffix decoding (its global cache learns the JSON's shape from earlier outputs: there is no
smaller SmolLM2 to draft with) and the Qwen pair (1.5B target, 0.5B draft). Each setup loads one engine; the
configs are per-request parameters on it, run back to back per prompt (greedy, chat template; tokens/s is decode
speed after the first token):
- plain: no constraint, no speculation: the model's own answer (the prompt asks for the JSON only);
- constrained: the schema, no speculation and no forced tokens (``speculative=False``);
- constrained+spec: the schema with the setup's drafter and grammar-forced tokens;
- spec: no constraint, with the drafter (free text, for reference).
Six realistic schemas (a profile, an order, an event, a search call's arguments, a review's classification, an
address book), each with --prompts-per-schema prompts. Every constrained output is checked: it parses, validates
against its schema, and constrained+spec equals constrained token for token. The grammar's own time (mask, commit,
draft check, forced tokens) is measured inside the run and reported per generated token and against a plain step.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import jsonschema_rs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, memory_bandwidth_gbs, save, table, weight_bytes_per_token  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.sampling import grammar as grammar_module  # noqa: E402
from quickdraft.sampling.grammar import compiler_for  # noqa: E402
from quickdraft.sampling.structured import StructuredOutputs  # noqa: E402

SETUPS = {"smollm2-135m": {"speculative": "suffix"}, "qwen2.5-coder-1.5b": {"draft": "qwen2.5-coder-0.5b"},
          "qwen2.5-coder-1.5b+suffix": {"draft": "qwen2.5-coder-0.5b", "speculative": "suffix"}}
# suffix decoding drafts from earlier outputs: each config gets its own engine, so no config drafts from another
# config's output of the same prompt (greedy: the very same text); a draft model keeps no state across requests
OWN_ENGINE_PER_CONFIG = {"smollm2-135m", "qwen2.5-coder-1.5b+suffix"}
CONFIGS = ("plain", "constrained", "constrained+spec", "spec")
S, I = {"type": "string", "maxLength": 60}, {"type": "integer"}
SCHEMAS = {
    "profile": ({"type": "object", "properties": {
        "name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": S,
        "skills": {"type": "array", "items": S, "maxItems": 5}, "city": S},
        "required": ["name", "age", "email", "skills", "city"], "additionalProperties": False},
        ["a senior backend engineer from Berlin", "a retired teacher who paints"]),
    "order": ({"type": "object", "properties": {
        "order_id": S, "customer": S, "items": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"product": S, "quantity": I, "unit_price": {"type": "number"}},
            "required": ["product", "quantity", "unit_price"], "additionalProperties": False}},
        "currency": {"enum": ["USD", "EUR", "GBP"]}, "paid": {"type": "boolean"}},
        "required": ["order_id", "customer", "items", "currency", "paid"], "additionalProperties": False},
        ["an online order of two books and a lamp", "a café bill for three coffees and a cake"]),
    "event": ({"type": "object", "properties": {
        "title": S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "start_time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}, "duration_minutes": I,
        "attendees": {"type": "array", "items": S, "maxItems": 4}, "location": S},
        "required": ["title", "date", "start_time", "duration_minutes", "attendees", "location"],
        "additionalProperties": False},
        ["a team planning meeting next Monday morning", "a dentist appointment on March 3rd 2025"]),
    "search_call": ({"type": "object", "properties": {
        "query": S, "filters": {"type": "object", "properties": {
            "language": {"enum": ["python", "rust", "go", "javascript"]}, "min_stars": I,
            "updated_after": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
            "required": ["language", "min_stars", "updated_after"], "additionalProperties": False},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["query", "filters", "limit"], "additionalProperties": False},
        ["search arguments for popular Python web frameworks", "search arguments for Rust async runtimes"]),
    "review": ({"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "mixed"]}, "score": {"type": "integer", "minimum": 1,
                                                                            "maximum": 5},
        "aspects": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "aspect": S, "sentiment": {"enum": ["positive", "negative"]}},
            "required": ["aspect", "sentiment"], "additionalProperties": False}}, "summary": S},
        "required": ["sentiment", "score", "aspects", "summary"], "additionalProperties": False},
        ["the review 'Great battery, but the screen scratches easily.'",
         "the review 'Slow delivery and the box was damaged; the blender works fine.'"]),
    "address_book": ({"type": "object", "properties": {"contacts": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": S, "phone": {"type": "string", "pattern": "^\\+[0-9]{6,14}$"},
                                         "street": S, "city": S, "country": S},
        "required": ["name", "phone", "street", "city", "country"], "additionalProperties": False}}},
        "required": ["contacts"], "additionalProperties": False},
        ["two friends who live in Lyon and Madrid", "a plumber and an electrician in Toronto"]),
}


class GrammarClock:
    """Seconds spent inside the grammar (llguidance calls and mask unpacking), accumulated around GrammarState's
    methods while the run is going."""

    METHODS = ("allowed", "accept", "legal_prefix", "forced")

    def __init__(self) -> None:
        self.seconds = 0.0
        cls = grammar_module.GrammarState
        for name in self.METHODS:
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def prompt_ids(llm: LLM, schema_name: str, subject: str, schema: dict) -> list[int]:
    text = (f"Write a JSON object for {subject}. Use this JSON schema ({schema_name}): "
            f"{json.dumps(schema, separators=(',', ':'))}. Reply with the JSON only.")
    return llm.chat_prompt([{"role": "user", "content": text}])


def run(llm: LLM, ids: list[int], params: SamplingParams, clock: GrammarClock) -> dict:
    before = clock.seconds
    (out,) = llm.generate([ids], params)
    o = out.outputs[0]
    spec = o.metrics.spec
    # decode time (after the first token): the prompt is the same for every config, and a prefix-cache hit would
    # otherwise hand the later configs a free prefill
    seconds = o.metrics.total_s - (o.metrics.ttft_s or 0.0)
    return {"tokens": len(o.token_ids) - 1, "seconds": seconds, "grammar_s": clock.seconds - before, "text": o.text,
            "token_ids": o.token_ids, "finish": o.finish_reason, "drafted": spec.draft_tokens,
            "accepted": spec.accepted_tokens, "forced": spec.forced_tokens, "passes": spec.rounds}


def configs(schema: dict, tokens: int) -> dict[str, SamplingParams]:
    constraint = {"json": schema}
    return {"plain": SamplingParams(max_tokens=tokens, temperature=0.0, speculative=False),
            "constrained": SamplingParams(max_tokens=tokens, temperature=0.0, speculative=False,
                                          structured_outputs=constraint),
            "constrained+spec": SamplingParams(max_tokens=tokens, temperature=0.0, structured_outputs=constraint),
            "spec": SamplingParams(max_tokens=tokens, temperature=0.0)}


def bench_setup(target: str, tokens: int, per_schema: int, clock: GrammarClock, bandwidth: float) -> dict:
    t0 = time.perf_counter()
    model = target.partition("+")[0]
    llm = LLM(model, **SETUPS[target])
    load_s = time.perf_counter() - t0
    engines = {c: LLM(model, **SETUPS[target]) if target in OWN_ENGINE_PER_CONFIG and c != "plain" else llm
               for c in CONFIGS}
    for engine in set(engines.values()):
        engine.generate([engine.chat_prompt([{"role": "user", "content": "hi"}])],
                        SamplingParams(max_tokens=4, temperature=0.0))
    compiler = compiler_for(llm.tokenizer)
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputs.of({"json_object": True}))  # builds the vocabulary's llguidance tokenizer
    tokenizer_s = time.perf_counter() - t0
    compile_ms = {}
    for name, (schema, _) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputs.of({"json": schema}))
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
    rows, checks = [], defaultdict(int)
    for name, (schema, subjects) in SCHEMAS.items():
        for subject in subjects[:per_schema]:
            ids = prompt_ids(llm, name, subject, schema)
            results = {config: run(engines[config], ids, params, clock)
                       for config, params in configs(schema, tokens).items()}
            for config in ("constrained", "constrained+spec"):
                r = results[config]
                try:
                    jsonschema_rs.validate(schema, json.loads(r["text"]))
                    checks[f"{config} valid"] += 1
                except (ValueError, jsonschema_rs.ValidationError):
                    print(f"  {name}: {config} output does not validate ({r['finish']}): {r['text'][:120]!r}")
            checks["constrained+spec == constrained"] += results["constrained+spec"]["token_ids"] == \
                results["constrained"]["token_ids"]
            for config, r in results.items():
                rows.append({"schema": name, "config": config, **{k: v for k, v in r.items()
                                                                  if k not in ("text", "token_ids")}})
            print(f"  {name}: " + ", ".join(f"{c} {r['tokens'] / r['seconds']:.1f} tok/s"
                                           for c, r in results.items()), flush=True)
    prompts = len(rows) // 4
    summary = []
    for config in CONFIGS:
        rs = [r for r in rows if r["config"] == config]
        tokens_sum, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        summary.append({"model": target, "config": config, "prompts": len(rs), "tokens": tokens_sum,
                        "tok_s": tokens_sum / seconds, "grammar_ms_per_token": sum(r["grammar_s"] for r in rs)
                        / tokens_sum * 1e3, "acceptance": sum(r["accepted"] for r in rs) /
                        max(1, sum(r["drafted"] for r in rs)), "forced_tokens": sum(r["forced"] for r in rs),
                        "tokens_per_pass": tokens_sum / sum(r["passes"] for r in rs)})
    by = {s["config"]: s for s in summary}
    plain_step_ms = 1e3 / by["plain"]["tok_s"]
    for s in summary:
        s["speedup_vs_constrained"] = s["tok_s"] / by["constrained"]["tok_s"]
        s["grammar_share_of_plain_step"] = s["grammar_ms_per_token"] / plain_step_ms
    weights = weight_bytes_per_token(llm.loaded.model)
    return {"model": target, "setup": SETUPS[target], "load_s": load_s, "llguidance_tokenizer_s": tokenizer_s,
            "compile_ms": compile_ms, "checks": dict(checks), "prompts": prompts, "summary": summary,
            "plain_step_ms": plain_step_ms, "weight_bytes_per_token": weights,
            "bandwidth_limit_tok_s": bandwidth * 1e9 / weights, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SETUPS), help="setups: " + ", ".join(SETUPS))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts-per-schema", type=int, default=2)
    ap.add_argument("--name", default="structured")
    args = ap.parse_args()
    info, bandwidth = machine(), memory_bandwidth_gbs()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {bandwidth:.1f} GB/s read", flush=True)
    clock = GrammarClock()
    results = []
    for target in args.models.split(","):
        print(f"{target} ({SETUPS[target]}):", flush=True)
        results.append(bench_setup(target, args.tokens, args.prompts_per_schema, clock, bandwidth))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(table([s for r in results for s in r["summary"]],
                ["model", "config", "prompts", "tokens", "tok_s", "speedup_vs_constrained", "grammar_ms_per_token",
                 "grammar_share_of_plain_step", "acceptance", "forced_tokens", "tokens_per_pass"]))
    for r in results:
        plain = next(s for s in r["summary"] if s["config"] == "plain")
        print(f"{r['model']}: plain {plain['tok_s']:.1f} tok/s = {plain['tok_s'] / r['bandwidth_limit_tok_s']:.0%} "
              f"of the bandwidth limit ({r['bandwidth_limit_tok_s']:.1f} tok/s); checks {r['checks']} of "
              f"{r['prompts']}; llguidance tokenizer {r['llguidance_tokenizer_s']:.2f} s; schema compile "
              f"{min(r['compile_ms'].values()):.1f}-{max(r['compile_ms'].values()):.1f} ms")
    print(f"peak RSS {peak_rss:.0f} MiB (the setups loaded in turn)")
    path = save(args.name, {"machine": info, "bandwidth_gbs": bandwidth, "args": vars(args), "peak_rss_mib": peak_rss,
                            "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
