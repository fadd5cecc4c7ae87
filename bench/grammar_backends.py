"""llguidance vs xgrammar on quickdraft's tokenizers: what chose the constraint library (sampling/grammar.py).

Usage: python bench/grammar_backends.py [--models smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m] [--name grammar_backends]

xgrammar is not a quickdraft dependency (it pulls triton and transformers): install it for this script with
``pip install --no-deps xgrammar apache-tvm-ffi``. For each model's tokenizer: the time to build each library's
tokenizer object (once per process), to compile a realistic JSON schema, and per token of a valid 75-token JSON
document to compute the mask and commit the token (both single-threaded calls, as the engine makes them).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402

from quickdraft.engine.build import tokenizer_for  # noqa: E402
from quickdraft.loading.load import load_checkpoint  # noqa: E402
from quickdraft.loading.registry import resolve_model  # noqa: E402
from quickdraft.sampling.grammar import _TokenizerAdapter  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"]},
    "status": {"enum": ["active", "inactive", "banned"]}},
    "required": ["name", "age", "email", "tags", "address", "status"], "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"],
                  "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
                  "status": "active"})


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def llguidance_row(tok, ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt
    ll_tok, tok_s = timed(lambda: llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenizerAdapter(tok)),
                                                         n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": True})
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(ll_tok, grammar))
    mask = llt.allocate_token_bitmask(1, tok.vocab_size)
    t0 = time.perf_counter()
    for t in ids:
        llt.fill_next_token_bitmask(matcher, mask)
        assert matcher.consume_token(t), matcher.get_error()
    return {"library": "llguidance", "tokenizer_s": tok_s, "compile_ms": compile_s * 1e3,
            "mask_us_per_token": (time.perf_counter() - t0) / len(ids) * 1e6}


def xgrammar_row(tok, ids: list[int]) -> dict:
    import xgrammar
    adapter = _TokenizerAdapter(tok)
    compiler, tok_s = timed(lambda: xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(
        adapter.tokens, vocab_type=xgrammar.VocabType.RAW, vocab_size=tok.vocab_size,
        stop_token_ids=list(tok.eos_token_ids)), max_threads=1))
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, tok.vocab_size)
    t0 = time.perf_counter()
    for t in ids:
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(t)
    return {"library": "xgrammar", "tokenizer_s": tok_s, "compile_ms": compile_s * 1e3,
            "mask_us_per_token": (time.perf_counter() - t0) / len(ids) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m")
    ap.add_argument("--name", default="grammar_backends")
    args = ap.parse_args()
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        sys.exit("xgrammar is not installed: pip install --no-deps xgrammar apache-tvm-ffi (see this script's docstring)")
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores")
    rows = []
    for name in args.models.split(","):
        tok = tokenizer_for(load_checkpoint(resolve_model(name)))
        ids = tok.encode(DOC, add_special_tokens=False)
        for row in (llguidance_row(tok, ids), xgrammar_row(tok, ids)):
            rows.append({"model": name, "vocab": tok.vocab_size, **row})
    print(table(rows, ["model", "vocab", "library", "tokenizer_s", "compile_ms", "mask_us_per_token"]))
    print(f"wrote {save(args.name, {'machine': info, 'schema': SCHEMA, 'document': DOC, 'rows': rows})}")


if __name__ == "__main__":
    main()
