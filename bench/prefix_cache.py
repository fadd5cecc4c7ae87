"""Time to the first token with the prefix cache: a cached prefix that may end at any block below
``attention.EXACT_POSITIONS`` (the default) against the rule before it, a prefix cut back to a 64-token cell
(``EXACT_POSITIONS = 0``), alternating in one process.

Two cases a chat server meets all the time, each from the first ``--prompts`` public HumanEval prompts in the
target's chat template: a fresh conversation (its system prompt, the template's own, cached by an earlier one), and
a follow-up that holds the conversation's first answer (``--answer-tokens`` greedy tokens) and a new question. The
time is a one-token ``generate`` (the prompt's forward and one decision), the first request of each round excluded.

Usage: python bench/prefix_cache.py [--model qwen2.5-coder-1.5b] [--prompts 6] [--answer-tokens 48] [--repeats 2]
         [--out prefix_cache]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, save, table  # noqa: E402

import quickdraft.kv.attention as attention  # noqa: E402
from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402

RULES = {"cell (before)": 0, "any block below EXACT_POSITIONS": attention.EXACT_POSITIONS}
FOLLOW_UP = "Now add type hints to the function and show it again."


def one_round(llm: LLM, code: list[str], answer_tokens: int) -> dict[str, list[float]]:
    """Seconds to the first token of each fresh conversation and of each follow-up, from an empty prefix cache."""
    first = SamplingParams(max_tokens=1, temperature=0)
    llm.reset_prefix_cache()
    llm.generate([llm.chat_prompt([{"role": "user", "content": "hi"}])], first)  # the template's system prompt
    out: dict[str, list[float]] = {"fresh conversation": [], "follow-up": []}
    for prompt in code:
        messages = [{"role": "user", "content": prompt}]
        ids = llm.chat_prompt(messages)
        t0 = time.perf_counter()
        llm.generate([ids], first)
        out["fresh conversation"].append(time.perf_counter() - t0)
        answer = llm.generate([ids], SamplingParams(max_tokens=answer_tokens, temperature=0))[0].text
        ids = llm.chat_prompt(messages + [{"role": "assistant", "content": answer},
                                          {"role": "user", "content": FOLLOW_UP}])
        t0 = time.perf_counter()
        llm.generate([ids], first)
        out["follow-up"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="prefix_cache")
    args = ap.parse_args()
    llm = LLM(str(resolve_model(args.model)))
    code = humaneval_prompts(args.prompts)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for rule, bound in RULES.items():
                attention.EXACT_POSITIONS = bound
                for case, seconds in one_round(llm, code, args.answer_tokens).items():
                    times.setdefault((rule, case), []).extend(seconds)
    finally:
        attention.EXACT_POSITIONS = RULES["any block below EXACT_POSITIONS"]
    rows = []
    for (rule, case), seconds in times.items():
        before = statistics.mean(times["cell (before)", case])
        rows.append({"case": case, "rule": rule, "requests": len(seconds), "first_token_ms": 1000 * statistics.mean(seconds),
                     "median_ms": 1000 * statistics.median(seconds), "vs_before": statistics.mean(seconds) / before})
    rows.sort(key=lambda r: r["case"])
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores; {args.model}, {args.prompts} HumanEval prompts x {args.repeats}")
    print(table(rows, ["case", "rule", "requests", "first_token_ms", "median_ms", "vs_before"]))
    print(f"wrote {save(args.out, {'machine': info, 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
