"""The host's share of a decode step: milliseconds per target pass spent outside the model's forward (scheduling,
drafting, the step's decisions, the commit), plain and with n-gram drafting, at a few batch sizes.

On a GPU the host's work between two steps does not overlap the device's, so at batch 1 it adds to every token.
This measures it where it is the same code: a one-layer model, tiny enough that its forward costs little, on the
static step run eagerly and with the step's decisions made as a GPU makes them (``CPU_GREEDY_ON_HOST`` off), so the
time outside the forward is the host's own. Random weights; a prompt that repeats itself, so n-gram drafts hit.

Usage: python bench/step_host.py [--tokens 256] [--batches 1,8,32] [--repeats 3] [--name step_host]
Prints a table and writes bench/results/<name>.json (the best of ``--repeats`` runs per row).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save, table  # noqa: E402
import cuda_decode  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
import quickdraft.engine.verify_step as verify_step  # noqa: E402

SHAPE = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0)


def host_ms(llm: LLM, batch: int, tokens: int, repeats: int) -> tuple[float, float, int]:
    """(best ms per pass outside the forward, ms per pass in it, passes) over ``repeats`` answers of ``tokens``."""
    runner = llm.loaded.engine.target
    forward = runner.forward
    spent = [0.0, 0]

    def timed(items):
        out = forward(items)
        spent[0] += runner.last_forward_s
        spent[1] += 1
        return out

    runner.forward = timed
    prompts = cuda_decode.prompts_for(SHAPE["vocab_size"], batch, repeat=True)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    best = None
    for _ in range(repeats):
        spent[:] = [0.0, 0]
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        outside = (time.perf_counter() - t0 - spent[0]) / spent[1]
        if best is None or outside < best[0]:
            best = (outside, spent[0] / spent[1], spent[1])
    runner.forward = forward
    return 1000 * best[0], 1000 * best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="step_host")
    args = ap.parse_args()
    torch.set_num_threads(1)
    verify_step.CPU_GREEDY_ON_HOST = False  # decide as on a GPU
    batches = [int(b) for b in args.batches.split(",")]
    cuda_decode.SHAPES["step-host"] = SHAPE
    rows = []
    with tempfile.TemporaryDirectory() as root:
        _, directory = cuda_decode.build_shape("step-host", "cpu", Path(root))
        for mode, options in (("plain", {}), ("n-gram", {"speculative": "ngram"})):
            llm = LLM(str(directory), device="cpu", dtype="float32", static_step="eager", max_num_seqs=max(batches),
                      max_model_len=2048, max_speculative_tokens=4, kv_cache_memory="256MiB", **options)
            for batch in batches:
                outside, inside, passes = host_ms(llm, batch, args.tokens, args.repeats)
                rows.append(dict(mode=mode, batch=batch, passes=passes, host_ms_per_pass=outside,
                                 host_ms_per_seq=outside / batch, forward_ms=inside))
                print(table(rows[-1:], list(rows[-1])))
    info = machine()
    print(f"\n{info['cpu']}, one thread; ms per target pass outside the forward (the host's own work)\n"
          + table(rows, ["mode", "batch", "passes", "host_ms_per_pass", "host_ms_per_seq", "forward_ms"]))
    print(f"wrote {save(args.name, {'machine': info, 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
