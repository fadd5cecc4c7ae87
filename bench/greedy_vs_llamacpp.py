"""Greedy text of quickdraft and llama.cpp on the same GGUF file and the same prompt token ids: where do they part?

Usage: python bench/greedy_vs_llamacpp.py [--model gemma3-270m] [--weights float32,auto] [--tokens 64]
                                          [--humaneval 2] [--spec-bench 3] [--out greedy_vs_llamacpp]
Prompts: the first --humaneval public HumanEval prompts and the first public Spec-Bench prompt of the first
--spec-bench categories, as plain text (a base model has no chat template), encoded once by quickdraft's tokenizer
(with the file's BOS) and given to both engines as ids. For each prompt and weight format: the number of leading
tokens both engines agree on, and the top-2 logit margin of quickdraft's own choice at the first difference (a
small margin: the two engines' roundings broke a near-tie; llama.cpp multiplies with its weights' blocks and
8-bit-quantized activations, quickdraft with float32 or its int4/int8 kernels). Unless --no-transformers,
transformers' float32 model of the same file gives a third opinion: how many leading tokens quickdraft shares with
it, and it with llama.cpp.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, save, spec_bench_prompts, table  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.loading import resolve_model  # noqa: E402


def llamacpp_greedy(path: Path, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    from llama_cpp import Llama
    llm = Llama(str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    outs = []
    for ids in prompts:
        llm.reset()
        out = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if len(out) >= tokens:
                break
        outs.append(out)
    del llm
    gc.collect()
    return outs


def transformers_greedy(path: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' float32 model of the same file (it dequantizes the GGUF itself): a third opinion."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    del hf
    gc.collect()
    return outs


def leading(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def margin_at(llm: LLM, ids: list[int], generated: list[int], at: int) -> float:
    """Top-1 minus top-2 log-probability of quickdraft's prediction at generated position ``at``."""
    out = llm.generate([ids + generated[:at]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0].outputs[0]
    top = out.logprobs[0]["top"]
    return top[0][1] - top[1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--weights", default="float32,auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--spec-bench", type=int, default=3, help="categories of Spec-Bench, one prompt each")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-transformers", dest="transformers", action="store_false",
                    help="skip transformers' float32 model of the file (a third opinion)")
    ap.add_argument("--out", default="greedy_vs_llamacpp")
    args = ap.parse_args()
    texts = [("humaneval", t) for t in humaneval_prompts(args.humaneval)]
    texts += spec_bench_prompts(1)[:args.spec_bench]
    rows = []
    reference = hf = None
    for weights in args.weights.split(","):
        llm = LLM(args.model, weights=weights, kv_cache_memory="256MiB")
        ids = [llm.tokenizer.encode(t, add_special_tokens=True) for _, t in texts]
        if reference is None:
            reference = llamacpp_greedy(resolve_model(args.model), ids, args.tokens, args.threads)
            hf = transformers_greedy(resolve_model(args.model), ids, args.tokens) if args.transformers else None
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for i, ((cat, _), p, theirs) in enumerate(zip(texts, ids, reference)):
            ours = llm.generate([p], params)[0].token_ids
            same = leading(ours, theirs)
            parted = same < min(len(ours), len(theirs))
            rows.append({"weights": llm.weights, "category": cat, "prompt_tokens": len(p), "same_leading": same,
                         "of": min(len(ours), len(theirs)),
                         "same_as_transformers": None if hf is None else leading(ours, hf[i]),
                         "transformers_same_as_llamacpp": None if hf is None else leading(hf[i], theirs),
                         "margin_at_parting": margin_at(llm, p, ours, same) if parted else None,
                         "ours": llm.tokenizer.decode(ours[:same + 4]), "llama.cpp": llm.tokenizer.decode(theirs[:same + 4])})
        del llm
        gc.collect()
    print(table(rows, ["weights", "category", "prompt_tokens", "same_leading", "of", "margin_at_parting",
                       "same_as_transformers", "transformers_same_as_llamacpp"]))
    info = machine()
    path = save(args.out, {"machine": info, "model": args.model, "tokens": args.tokens, "results": rows})
    print(f"machine: {info['cpu']}; wrote {path}")


if __name__ == "__main__":
    main()
