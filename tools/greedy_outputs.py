"""Greedy token ids of the benchmark prompts for several model/drafter setups, written as JSON.

A refactor must not change what quickdraft generates: run this on the old and the new code (the old one from a
``git worktree`` with ``PYTHONPATH`` pointing at it) and compare the two files with ``--compare``.

    PYTHONPATH=/tmp/old python tools/greedy_outputs.py --out /tmp/before.json
    python tools/greedy_outputs.py --out /tmp/after.json --compare /tmp/before.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT / "bench"))

from common import humaneval_prompts, spec_bench_prompts  # noqa: E402

SETUPS = {  # explicit weight formats: the defaults change between versions, the setups compared must not
    "smollm2-135m/bfloat16": ("smollm2-135m", {"weights": "bfloat16"}),
    "smollm2-135m/int4": ("smollm2-135m", {"weights": "int4"}),
    "smollm2-135m/int4+ngram": ("smollm2-135m", {"weights": "int4", "speculative": "ngram"}),
    "smollm2-135m/bfloat16+self": ("smollm2-135m", {"weights": "bfloat16", "speculative": "self"}),
    "smollm2-135m/int4+self": ("smollm2-135m", {"weights": "int4", "speculative": "self"}),
    "qwen2.5-coder-0.5b/int4": ("qwen2.5-coder-0.5b", {"weights": "int4"}),
    "qwen2.5-coder-1.5b/bfloat16": ("qwen2.5-coder-1.5b", {"weights": "bfloat16"}),
    "qwen2.5-coder-1.5b/int4": ("qwen2.5-coder-1.5b", {"weights": "int4"}),
    "qwen2.5-coder-1.5b/int4+draft": ("qwen2.5-coder-1.5b", {"weights": "int4", "draft": "qwen2.5-coder-0.5b"}),
    "qwen2.5-coder-1.5b/bfloat16+draft": ("qwen2.5-coder-1.5b", {"weights": "bfloat16", "draft": "qwen2.5-coder-0.5b"}),
    "qwen2.5-coder-1.5b/int4+ngram": ("qwen2.5-coder-1.5b", {"weights": "int4", "speculative": "ngram"}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None, help="an earlier output of this script: fail on any difference")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated names of SETUPS")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--humaneval", type=int, default=3)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--batch", type=int, default=0, help="prompts per generate call (default 0: all at once)")
    args = parser.parse_args()

    from quickdraft import LLM, SamplingParams

    prompts = humaneval_prompts(args.humaneval) + [text[:3000] for _, text in spec_bench_prompts(args.per_category)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    results = {}
    for name in args.setups.split(","):
        model, kwargs = SETUPS[name]
        llm = LLM(model, kv_cache_memory="512MiB", max_model_len=4096, **kwargs)
        size = args.batch or len(prompts)
        results[name] = [out.token_ids for i in range(0, len(prompts), size)
                         for out in llm.generate(prompts[i:i + size], params)]
        print(f"{name}: {len(prompts)} prompts, {sum(map(len, results[name]))} tokens", flush=True)
        del llm
    Path(args.out).write_text(json.dumps({"prompts": len(prompts), "tokens": args.tokens, "outputs": results}))
    if args.compare is None:
        return 0
    before = json.loads(Path(args.compare).read_text())["outputs"]
    differ = [name for name in results if before.get(name) != results[name]]
    for name in results:
        same = sum(a == b for a, b in zip(before.get(name, []), results[name]))
        print(f"{name}: {same}/{len(results[name])} outputs identical to {args.compare}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
