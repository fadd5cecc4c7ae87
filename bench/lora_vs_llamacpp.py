"""A LoRA adapter on quickdraft and on llama.cpp (llama-cpp-python, built natively): the same tokens, and what the
adapter costs each engine per token.

The adapter: a random PEFT LoRA (rank ``--rank``, every projection of every layer: q, k, v, o, gate, up, down) made
with peft on transformers' float32 model of the GGUF, written as the GGUF LoRA llama.cpp's ``convert_lora_to_gguf.py``
writes (``quickdraft.loading.lora.write_gguf_lora``). With ``--converter PATH`` (llama.cpp's own script, in its
checkout or llama-cpp-python's sdist) the script converts the PEFT directory itself too and reports the largest
difference between its tensors and quickdraft's writer's. Both engines then run the same GGUF LoRA file.

Work: the first ``--prompts`` public HumanEval prompts, encoded once by quickdraft's tokenizer and given to both
engines as ids; ``--tokens`` greedy tokens each, one request at a time (batch 1), with and without the adapter
alternately (which goes first swapping each of ``--rounds`` rounds), so that a drift of the machine's speed reaches
both alike.
Reported per engine: decode tokens/s (after the first token) without and with the adapter, the adapter's cost, and
the fraction of the bandwidth limit (the measured read bandwidth over the bytes a step reads: the file's tensors in
their own types, plus the adapter's); how many leading tokens the engines agree on, per prompt, with and without the
adapter (the same file on different kernels: they part where their roundings break a near-tie, with or without an
adapter alike); and quickdraft's aggregate tokens/s for ``--batch`` requests (each prompt's first 16 tokens), all on
the base, and half of them on the adapter beside the other half. Each engine runs in a process of its own (its
peak RSS is its own).

Usage: python bench/lora_vs_llamacpp.py [--model smollm2-135m] [--rank 16] [--prompts 6] [--tokens 64] [--batch 8]
         [--rounds 2] [--threads 2] [--converter llama.cpp/convert_lora_to_gguf.py] [--out lora_vs_llamacpp]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gguf_step_bytes, humaneval_prompts, machine, memory_bandwidth_gbs, save, table  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: Path, rank: int, out: Path, converter: str | None) -> dict:
    """The PEFT adapter and its GGUF LoRA under ``out``; with ``converter``, llama.cpp's conversion compared."""
    import peft
    import torch
    import transformers

    from quickdraft import LLM
    from quickdraft.loading.lora import read_gguf_lora, read_peft, write_gguf_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES,
                                                         init_lora_weights=False))
    with torch.no_grad():  # a smaller term than peft's random one: the text changes, and stays text
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    adapted.save_pretrained(out / "peft")
    cfg = LLM(str(path), kv_cache_memory="16MiB").model.config
    gguf_lora = write_gguf_lora(read_peft(out / "peft", cfg), out / "lora.gguf", cfg)
    report = {"adapter_bytes": gguf_lora.stat().st_size, "gguf_lora": str(gguf_lora)}
    if converter:
        model.config.architectures = [type(adapted.unload()).__name__]  # (a config read from a GGUF has none)
        model.config.save_pretrained(out / "base")  # the converter reads the base's config.json alone
        config = json.loads((out / "base" / "config.json").read_text())
        config.pop("quantization_config", None)  # (transformers records the GGUF it read the weights from)
        (out / "base" / "config.json").write_text(json.dumps(config))
        done = subprocess.run([sys.executable, converter, "--base", str(out / "base"), "--outtype", "f32",
                               "--outfile", str(out / "converted.gguf"), str(out / "peft")], capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{converter} failed:\n{done.stderr[-2000:]}")
        mine, theirs = read_gguf_lora(gguf_lora, cfg), read_gguf_lora(out / "converted.gguf", cfg)
        assert mine.keys() == theirs.keys(), "the converter adapted other modules"
        report["converter_max_abs_diff"] = max((x - y).abs().max().item()
                                               for k in mine for x, y in zip(mine[k][:2], theirs[k][:2]))
        report["converter_scales_equal"] = all(mine[k][2] == theirs[k][2] for k in mine)
    return report


def child_quickdraft(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from quickdraft import LLM, SamplingParams
    llm = LLM(args.model, threads=args.threads, lora_adapters={"a": args.lora})
    params = {key: SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, lora=name)
              for key, name in (("base", None), ("lora", "a"))}
    llm.generate([prompts[0][:8]], params["lora"])  # warm-up: kernels, caches
    out: dict = {"weights": llm.weights_summary}
    tokens: dict[str, list] = {"base": [], "lora": []}
    spent = {"base": [0, 0.0], "lora": [0, 0.0]}
    for round_ in range(args.rounds):  # base and adapter alternate prompt by prompt: drift reaches both alike
        for ids in prompts:
            for key in ("base", "lora") if round_ % 2 == 0 else ("lora", "base"):
                llm.reset_prefix_cache()
                r = llm.generate([ids], params[key])[0]
                spent[key][0] += r.metrics.generated_tokens - 1
                spent[key][1] += r.metrics.total_s - r.metrics.ttft_s
                if round_ == 0:
                    tokens[key].append(r.outputs[0].token_ids)
    for key in ("base", "lora"):
        out[key] = {"tokens": tokens[key], "tok_s": spent[key][0] / spent[key][1]}
    batch = [ids[:16] for ids in (prompts * args.batch)[:args.batch]]  # short prompts: the decode steps' rate
    for key, names in (("batch_base", ["base"] * args.batch), ("batch_mixed", ["base", "lora"] * (args.batch // 2))):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(batch, [params[n] for n in names])
        out[key] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    return out


def child_llamacpp(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from llama_cpp import Llama
    engines = {key: Llama(args.model, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                          lora_path=lora) for key, lora in (("base", None), ("lora", args.lora))}
    tokens: dict[str, list] = {"base": [], "lora": []}
    spent = {"base": [0, 0.0], "lora": [0, 0.0]}

    def run(key: str, ids: list[int]) -> tuple[list[int], float]:
        llm = engines[key]
        llm.reset()
        got, first = [], 0.0
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(tok)
            first = first or time.perf_counter()
            if len(got) >= args.tokens:
                break
        return got, time.perf_counter() - first

    for key in engines:
        run(key, prompts[0][:8])  # warm-up
    for round_ in range(args.rounds):
        for ids in prompts:
            for key in ("base", "lora") if round_ % 2 == 0 else ("lora", "base"):
                got, decode_s = run(key, ids)
                spent[key][0] += len(got) - 1
                spent[key][1] += decode_s
                if round_ == 0:
                    tokens[key].append(got)
    return {key: {"tokens": tokens[key], "tok_s": spent[key][0] / spent[key][1]} for key in engines}


def run_child(engine: str, args: argparse.Namespace, prompts_file: Path) -> dict:
    command = [sys.executable, __file__, "--child", engine, "--model", args.model, "--lora", args.lora,
               "--prompts-file", str(prompts_file), "--tokens", str(args.tokens), "--threads", str(args.threads),
               "--batch", str(args.batch), "--rounds", str(args.rounds)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--converter", default=None)
    parser.add_argument("--out", default="lora_vs_llamacpp")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lora", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prompts = json.loads(Path(args.prompts_file).read_text())
        result = (child_quickdraft if args.child == "quickdraft" else child_llamacpp)(args, prompts)
        status = Path("/proc/self/status").read_text()  # VmHWM: this process's own peak (ru_maxrss keeps the parent's)
        result["peak_rss_mib"] = int(status.split("VmHWM:")[1].split()[0]) / 1024
        print(json.dumps(result))
        return

    from quickdraft import LLM
    from quickdraft.loading import resolve_model
    path = resolve_model(args.model)
    args.model = str(path)
    tokenizer = LLM(args.model, kv_cache_memory="16MiB").tokenizer
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = make_adapter(path, args.rank, Path(tmp), args.converter)
        args.lora = adapter["gguf_lora"]
        (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
        results = {engine: run_child(engine, args, Path(tmp) / "prompts.json") for engine in ("quickdraft", "llamacpp")}
    bandwidth = memory_bandwidth_gbs()
    step_bytes = gguf_step_bytes(path)
    llamacpp = results["llamacpp"]
    rows = []
    for engine, r in results.items():
        for key in ("base", "lora"):
            read = step_bytes + (adapter["adapter_bytes"] if key == "lora" else 0)
            rows.append({"engine": engine, "adapter": key == "lora", "decode_tok_s": round(r[key]["tok_s"], 1),
                         "limit_fraction": round(r[key]["tok_s"] * read / (bandwidth * 1e9), 3),
                         "peak_rss_mib": round(r["peak_rss_mib"])})
    agreement = {key: [leading_agreement(a, b) for a, b in zip(results["quickdraft"][key]["tokens"],
                                                                llamacpp[key]["tokens"])] for key in ("base", "lora")}
    q = results["quickdraft"]
    changed = sum(a != b for a, b in zip(q["base"]["tokens"], q["lora"]["tokens"]))
    print(table(rows, ["engine", "adapter", "decode_tok_s", "limit_fraction", "peak_rss_mib"]))
    for engine in ("quickdraft", "llamacpp"):
        r = results[engine]
        print(f"{engine}: the adapter costs {1 - r['lora']['tok_s'] / r['base']['tok_s']:.1%} of decode tokens/s")
    print(f"leading tokens both engines agree on (of {args.tokens}), base: {agreement['base']}, "
          f"adapter: {agreement['lora']}; the adapter changed {changed} of {len(prompts)} quickdraft outputs")
    print(f"quickdraft, batch of {args.batch}: {q['batch_base']:.1f} tok/s all base, {q['batch_mixed']:.1f} tok/s half "
          f"on the adapter")
    if "converter_max_abs_diff" in adapter:
        print(f"llama.cpp's converter vs write_gguf_lora: largest tensor difference "
              f"{adapter['converter_max_abs_diff']:g}, scales equal: {adapter['converter_scales_equal']}")
    save(args.out, {"machine": machine(), "bandwidth_gbs": bandwidth, "step_bytes": step_bytes, "adapter": adapter,
                    "rows": rows, "agreement": agreement, "changed_by_adapter": changed,
                    "quickdraft": {k: v for k, v in q.items() if k.startswith("batch") or k == "weights"},
                    "settings": {k: getattr(args, k) for k in ("model", "rank", "prompts", "tokens", "batch",
                                                               "threads", "rounds")}})


if __name__ == "__main__":
    main()
