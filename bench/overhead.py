"""Where the time of one engine step goes: weight-reading matmuls, attention, sampling, drafting, scheduling,
detokenizing and Python glue, for decode steps at batch 1 and 8, plain and speculative.

Usage: python bench/overhead.py [--models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b] [--batches 1,8]
         [--modes plain,spec] [--steps 48] [--weights auto] [--out overhead]
Each model loads with default settings (``weights``: what ``LLM(name)`` runs unless --weights is given).
``spec``: the 1.5B with the 0.5B as its draft model; the smaller models with n-gram prompt lookup.
Prompts: the first --batches HumanEval prompts in the chat template. The requests are prefilled and decode a
few tokens first; then --steps decode steps are measured with the methods below wrapped by timers that
count exclusive time (a category nested in another is taken out of the outer one; everything inside the
drafter counts as drafting, its model's matmuls included):

* layer kernels: the decoder layers' C call (``FusedLayer``) or, where a layer takes the torch path, its modules;
* lm_head: ``Transformer.logits``;
* attention: the attention kernel alone, timed apart on the same shapes (query rows, context lengths, heads)
  and taken out of the layer kernels; "matmuls" is the rest of the layer kernels (norms and rotary included);
* model glue: ``Transformer.forward`` and ``DecoderLayer.forward`` around the kernels (embedding, per-layer
  dispatch, final norm);
* KV & metadata: block reservation and the attention metadata of the batch;
* sampling: logits processing, argmax/sampling and verification (``LLMEngine._commit`` less the commit);
* commit & detokenize: appending tokens, stop checks, detokenizing, stream chunks;
* scheduling: the scheduler and the speculation controller;
* glue: the rest of ``LLMEngine.step``.

"fixed" is the step less its matmuls, attention and drafting: what a step costs beyond reading the target's weights
and cache and running the drafter. JSON goes to bench/results/<out>.json.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, save, table  # noqa: E402

from quickdraft import LLM, SamplingParams  # noqa: E402
from quickdraft.engine import engine as engine_module  # noqa: E402
from quickdraft.engine.scheduler import Scheduler  # noqa: E402
from quickdraft.engine.sequence import Sequence  # noqa: E402
from quickdraft.kv import attention as attention_module  # noqa: E402
from quickdraft.kv.blocks import SequenceKV  # noqa: E402
from quickdraft.kv.pool import KVPool  # noqa: E402
from quickdraft.models import fused, native, transformer  # noqa: E402
from quickdraft.speculative import drafters  # noqa: E402
from quickdraft.speculative.controller import SpeculationController  # noqa: E402

CATEGORIES = ("layer kernels", "lm_head", "model glue", "KV & metadata", "sampling", "commit & detokenize",
              "scheduling", "drafting", "glue")


class StepTimer:
    """Exclusive time per category: a category entered inside another pauses the outer one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [category, start of the running stretch]
        self.enabled = False

    def enter(self, category: str) -> None:
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.seconds[outer[0]] += now - outer[1]
            if outer[0] == "drafting":  # everything the drafter runs is drafting
                category = "drafting"
        self._stack.append([category, now])

    def leave(self) -> None:
        now = time.perf_counter()
        category, start = self._stack.pop()
        self.seconds[category] += now - start
        if self._stack:
            self._stack[-1][1] = now

    def wrap(self, owner: object, name: str, category: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            self.enter(category)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, name, timed)


def instrument(timer: StepTimer) -> None:
    for owner, name, category in (
            (engine_module.LLMEngine, "step", "glue"),
            (fused.FusedLayer, "__call__", "layer kernels"),
            (transformer.SelfAttention, "forward", "layer kernels"),
            (transformer.MLP, "forward", "layer kernels"),
            (transformer.RMSNorm, "forward", "layer kernels"),
            (transformer.Transformer, "logits", "lm_head"),
            (transformer.Transformer, "forward", "model glue"),
            (transformer.DecoderLayer, "forward", "model glue"),
            (attention_module.AttentionBatch, "__init__", "KV & metadata"),
            (SequenceKV, "reserve", "KV & metadata"),
            (SequenceKV, "make_writable", "KV & metadata"),
            (engine_module.LLMEngine, "_commit", "sampling"),
            (Sequence, "append", "commit & detokenize"),
            (Sequence, "take_chunk", "commit & detokenize"),
            (Scheduler, "schedule", "scheduling"),
            (SpeculationController, "choose", "scheduling"),
            (drafters.Drafter, "propose", "drafting"),
            (drafters.NgramDrafter, "propose", "drafting"),
            (drafters.ModelDrafter, "propose", "drafting")):
        timer.wrap(owner, name, category)
    if hasattr(fused, "FusedStack"):  # a step's layers in one call (absent from builds before it, for --before runs)
        timer.wrap(fused.FusedStack, "__call__", "layer kernels")


class AttentionShapes:
    """The single-token attention calls of the target's measured steps: (context lengths, groups) per step."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self.enabled = False
        self.pool = None  # the target's KV pool: a draft model's batches are not recorded
        original = attention_module.AttentionBatch.__init__
        shapes = self

        def record(batch, *args, **kwargs):
            original(batch, *args, **kwargs)
            if shapes.enabled and batch.native and batch.pool is shapes.pool:
                shapes.calls.append((batch.items.lengths.clone(), batch.items.group_first.clone()))

        attention_module.AttentionBatch.__init__ = record


def attention_seconds(llm: LLM, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The attention kernel alone, once per layer, over caches of the recorded context lengths and groups."""
    if not calls or not native.available():
        return 0.0
    cfg = llm.model.config
    dtype, act = llm.target.pool.dtype, llm.target.dtype
    layers = cfg.num_layers
    total = 0.0
    for lengths, group_first in calls:
        rows, groups = lengths.numel(), group_first.numel() - 1
        width = int(lengths.max())
        k = torch.randn(groups * width, cfg.num_kv_heads, cfg.head_dim).to(act)
        pool = KVPool(1, cfg.num_kv_heads, cfg.head_dim, -(-groups * width // 16), 16, dtype, "cpu")
        pool.write(0, torch.arange(groups * width), k, torch.randn_like(k))
        group_of_item = torch.repeat_interleave(torch.arange(groups), group_first.diff())
        slots = (group_of_item[:, None] * width + torch.arange(width)).contiguous()
        items = native.AttnItems(torch.arange(rows), slots, lengths, group_first)
        q = torch.randn(rows, cfg.num_heads, cfg.head_dim).to(act)
        out = torch.empty_like(q)
        native.attend(q, pool.layer(0), items, out, q.shape[-1] ** -0.5, 0)  # warm
        t0 = time.perf_counter()
        for _ in range(layers):
            native.attend(q, pool.layer(0), items, out, q.shape[-1] ** -0.5, 0)
        total += time.perf_counter() - t0
    return total


def measure(llm: LLM, timer: StepTimer, shapes: AttentionShapes, batch: int, steps: int) -> dict:
    engine = llm.engine
    texts = humaneval_prompts(batch)
    params = SamplingParams(max_tokens=steps * 10 + 64, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    ids = [engine.add_request(llm.chat_prompt([{"role": "user", "content": t}]), params) for t in texts]
    seqs = [engine.sequences(rid)[0] for rid in ids]
    while any(len(s.output_ids) < 4 for s in seqs):  # prefill and a few decode steps, not measured
        engine.step()
    before = sum(len(s.output_ids) for s in seqs)
    timer.seconds.clear()
    shapes.calls.clear()
    shapes.pool = llm.target.pool
    timer.enabled = shapes.enabled = True
    threads = []
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
        threads.append(torch.get_num_threads())
    wall = time.perf_counter() - t0
    timer.enabled = shapes.enabled = False
    tokens = sum(len(s.output_ids) for s in seqs) - before
    for rid in ids:
        engine.abort(rid)
        engine.release(rid)
    split = dict(timer.seconds)
    attention = min(attention_seconds(llm, shapes.calls), split.get("layer kernels", 0.0))
    split["attention"] = attention
    split["matmuls"] = split.pop("layer kernels", 0.0) - attention
    split["matmuls"] += split.pop("lm_head", 0.0)
    ms = {k: 1000 * v / steps for k, v in split.items()}
    step_ms = 1000 * wall / steps
    return {"threads": min(threads), "step_ms": step_ms, "tokens_per_step": tokens / steps, "ms_per_token": 1000 * wall / tokens,
            "fixed_ms": step_ms - ms["matmuls"] - ms["attention"] - ms.get("drafting", 0.0),
            **{f"{k}_ms": v for k, v in ms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model of the 1.5B in spec mode")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default="plain,spec")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--weights", default=None, help="weights= for every model (default: LLM's default)")
    ap.add_argument("--out", default="overhead")
    args = ap.parse_args()
    timer, shapes = StepTimer(), AttentionShapes()
    instrument(timer)
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            kwargs = {} if args.weights is None else {"weights": args.weights}
            if mode == "spec":
                kwargs.update({"draft": args.draft} if name.endswith("1.5b") else {"speculative": "ngram"})
            llm = LLM(name, **kwargs)
            llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"model": name, "weights": llm.weights, "mode": mode, "batch": batch,
                       **measure(llm, timer, shapes, batch, args.steps)}
                rows.append(row)
                print(f"{name} {mode} batch {batch}: {row['step_ms']:.2f} ms/step, fixed {row['fixed_ms']:.2f} ms",
                      flush=True)
            del llm
            gc.collect()
    columns = ["model", "weights", "mode", "batch", "threads", "step_ms", "tokens_per_step", "ms_per_token", "fixed_ms",
               "matmuls_ms", "attention_ms", *(f"{c}_ms" for c in CATEGORIES[2:])]
    for r in rows:
        for c in columns:
            r.setdefault(c, 0.0)
    print()
    print(table(rows, columns))
    path = save(args.out, {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
