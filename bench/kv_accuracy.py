"""What an int8 KV cache costs in accuracy, beside the exact (bfloat16) cache, on the same model in one run.

- Agreement: greedy outputs of --tokens tokens for HumanEval prompts and Spec-Bench prompts (chat-templated), and
  for long contexts (held-out HumanEval text, as bench/long_context.py builds them): how many outputs are
  identical, and where the first differing token falls.
- Perplexity of held-out text (HumanEval problems from 20 on, and Spec-Bench prompts) read a chunk at a time through
  the decode path (every token attends on the attention kernel, as in a verify pass), so the cache holds the
  text's own keys and values at every position up to --ppl-tokens.

    python bench/kv_accuracy.py --model qwen2.5-coder-0.5b
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DATA, humaneval_prompts, machine, save, spec_bench_prompts, table  # noqa: E402
from long_context import context_ids  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.kv import ForwardItem, SequenceKV  # noqa: E402


def perplexity(llm: LLM, ids: list[int], chunk: int = 64) -> float:
    """exp(mean NLL) of ids[1:] given the tokens before, every logits row from the decode path."""
    runner, kv = llm.target, SequenceKV()
    nll, count = 0.0, 0
    try:
        for start in range(0, len(ids) - 1, chunk):
            tokens = ids[start:start + chunk]
            targets = torch.tensor(ids[start + 1:start + 1 + len(tokens)])
            logits = runner.forward([ForwardItem(kv, tokens, len(tokens))])[0][:len(targets)]
            nll -= float(torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets].sum())
            count += len(targets)
    finally:
        runner.free(kv)
    return math.exp(nll / count)


def spec_bench_text(llm: LLM, length: int) -> list[int]:
    rows = [json.loads(line) for line in (BENCH_DATA / "spec_bench.public.jsonl").read_text().splitlines()]
    ids: list[int] = []
    for row in rows:
        ids += llm.tokenizer.encode(" ".join(row["turns"]) + "\n\n", add_special_tokens=False)
        if len(ids) >= length:
            return ids[:length]
    return ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=10, help="HumanEval prompts and Spec-Bench prompts, each")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--contexts", default="2048,8192", help="long contexts whose continuations are compared")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--out", default="kv_accuracy")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    longest = max([*contexts, args.ppl_tokens]) + args.tokens + 64
    engines = {name: LLM(args.model, kv_cache_dtype=name, max_model_len=longest) for name in ("auto", "int8")}
    reference = engines["auto"]
    prompts = {"humaneval": [reference.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)],
               "spec_bench": [reference.chat_prompt([{"role": "user", "content": text}])
                              for _, text in spec_bench_prompts(max(1, args.prompts // 13 + 1))][:args.prompts],
               "long_context": [context_ids(reference, c) for c in contexts]}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outputs = {name: {set_name: [o.token_ids for o in llm.generate(ids, params)] for set_name, ids in prompts.items()}
               for name, llm in engines.items()}
    rows = []
    for set_name in prompts:
        pairs = list(zip(outputs["auto"][set_name], outputs["int8"][set_name]))
        firsts = [first_difference(a, b) for a, b in pairs]
        diverged = [f for f in firsts if f is not None]
        rows.append({"set": set_name, "prompts": len(pairs), "identical": sum(f is None for f in firsts),
                     "token_agreement": sum(sum(x == y for x, y in zip(a, b)) for a, b in pairs)
                     / sum(len(a) for a, _ in pairs),
                     "first_difference_median": sorted(diverged)[len(diverged) // 2] if diverged else None})
    texts = {"humaneval_held_out": context_ids(reference, args.ppl_tokens),
             "spec_bench": spec_bench_text(reference, args.ppl_tokens)}
    ppl = [{"text": name, "tokens": len(ids), **{f"ppl_{kv}": perplexity(llm, ids) for kv, llm in engines.items()}}
           for name, ids in texts.items()]
    for row in ppl:
        row["ppl_change_pct"] = 100 * (row["ppl_int8"] / row["ppl_auto"] - 1)
    print(f"{args.model}, {machine()['cpu']}, greedy {args.tokens} tokens, int8 KV cache against "
          f"{str(reference.target.pool.dtype).removeprefix('torch.')}")
    print(table(rows, list(rows[0])))
    print(table(ppl, list(ppl[0])))
    path = save(args.out, {"machine": machine(), "args": vars(args), "agreement": rows, "perplexity": ppl})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
