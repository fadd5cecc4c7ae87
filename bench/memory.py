"""Where every megabyte goes: resident memory of one process that loads a model and generates 32 greedy tokens.

Each configuration runs in its own child process, which reports its resident memory (RSS) after ``import``, after
loading, after the first request and at peak (``ru_maxrss``), and splits the final RSS into weights (by module kind,
counting only the pages actually resident, so a memory-mapped embedding counts the rows read), the KV cache
(reserved and resident), the runtime (what the process held after import) and the rest. llama.cpp
(llama-cpp-python, n_ctx 4096) loads the same GGUF in a separate process; the pair's llama.cpp figure is the two
models alone, summed.

    python bench/memory.py                                  # SmolLM2, the 0.5B, the 1.5B, Gemma 3 270M, the pair
    python bench/memory.py --configs smollm2-135m --no-llamacpp
    python bench/memory.py --cold --no-llamacpp              # a first run: converting into an empty cache
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2 ** 20
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
CONFIGS = {
    "smollm2-135m": {"model": "smollm2-135m"},
    "qwen2.5-coder-0.5b": {"model": "qwen2.5-coder-0.5b"},
    "qwen2.5-coder-1.5b": {"model": "qwen2.5-coder-1.5b"},
    "gemma3-270m": {"model": "gemma3-270m"},
    "pair": {"model": PAIR[0], "draft": PAIR[1]},
}
PROMPT = "Write a Python function that checks whether a number is prime."
TOKENS = 32


def rss_mib() -> float:
    """Current resident set size (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_PAGE = mmap.PAGESIZE


def resident_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) mapped into this process's page table (/proc/self/pagemap's present bit): what
    RSS counts, for anonymous and file-backed pages alike (a file page in the page cache but never touched by this
    process does not count)."""
    if nbytes <= 0:
        return 0
    first, last = ptr // _PAGE, (ptr + nbytes - 1) // _PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = memoryview(f.read((last - first + 1) * 8)).cast("Q")
    return min(nbytes, sum(1 for e in entries if e >> 63) * _PAGE)


def tensor_usage(modules) -> dict[str, dict[str, float]]:
    """MiB held by the modules' parameters and buffers, by the kind of module that owns them: reserved and resident.
    A tensor shared by several modules (a tied head, one weight behind two runners) counts once."""
    seen: set[int] = set()
    out: dict[str, dict[str, float]] = {}
    for root in modules:
        for mod in root.modules():
            for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                if t.device.type != "cpu" or t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                kind = type(mod).__name__
                row = out.setdefault(kind, {"reserved": 0.0, "resident": 0.0})
                row["reserved"] += storage.nbytes() / MiB
                row["resident"] += resident_bytes(storage.data_ptr(), storage.nbytes()) / MiB
    return out


def child_quickdraft(config: dict) -> dict:
    t0 = time.perf_counter()
    import quickdraft  # noqa: F401
    from quickdraft import LLM, SamplingParams

    after_import = rss_mib()
    t1 = time.perf_counter()
    llm = LLM(config["model"], draft=config.get("draft"), **config.get("options", {}))
    load_s = time.perf_counter() - t1
    after_load = rss_mib()
    llm.generate(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0.0))
    after_request = rss_mib()
    runners = [llm.target] + ([llm.drafter.runner] if llm.drafter is not None and llm.drafter.runner else [])
    models = [r.model for r in runners] + [r.long_model for r in runners if r.long_model is not None]
    weights = tensor_usage(models)
    kv = {"reserved": 0.0, "resident": 0.0}
    for r in runners:
        for t in (r.pool.k, r.pool.v):
            kv["reserved"] += t.untyped_storage().nbytes() / MiB
            kv["resident"] += resident_bytes(t.data_ptr(), t.untyped_storage().nbytes()) / MiB
    weights_resident = sum(w["resident"] for w in weights.values())
    return {"after_import": after_import, "after_load": after_load, "after_request": after_request,
            "peak": peak_mib(), "load_s": load_s, "import_s": t1 - t0, "weights": weights,
            "weights_resident": weights_resident, "kv": kv, "summary": llm.memory_summary
            if hasattr(llm, "memory_summary") else llm.weights_summary,
            "rest": after_request - after_import - weights_resident - kv["resident"]}


def child_llamacpp(config: dict) -> dict:
    import llama_cpp  # noqa: F401
    from llama_cpp import Llama

    from quickdraft.loading.registry import resolve_model

    after_import = rss_mib()
    t1 = time.perf_counter()
    llm = Llama(str(resolve_model(config["model"])), n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
    load_s = time.perf_counter() - t1
    after_load = rss_mib()
    ids = llm.tokenize(PROMPT.encode())
    for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0)):
        if i + 1 >= TOKENS:
            break
    return {"after_import": after_import, "after_load": after_load, "after_request": rss_mib(), "peak": peak_mib(),
            "load_s": load_s}


def run_child(engine: str, config: dict, cold: bool = False) -> dict:
    """One measurement in a fresh process; ``cold``: with an empty weight cache (the assembled model files linked in),
    so the run converts the model as a first run does."""
    cmd = [sys.executable, __file__, "--child", engine, json.dumps(config)]
    env = dict(os.environ)
    if cold:
        from quickdraft.paths import cache_root

        tmp = tempfile.mkdtemp(prefix="quickdraft-cold-")
        os.symlink(cache_root() / "models", Path(tmp) / "models")
        env["QUICKDRAFT_CACHE_DIR"] = tmp
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        if cold:
            shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--options", default="{}", help="JSON of LLM options for every quickdraft run")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--cold", action="store_true", help="start every quickdraft run from an empty weight cache")
    ap.add_argument("--out", default="memory")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        engine, config = args.child[0], json.loads(args.child[1])
        result = child_quickdraft(config) if engine == "quickdraft" else child_llamacpp(config)
        print(json.dumps(result))
        return
    from common import machine, save, table

    options = json.loads(args.options)
    rows, llamacpp_peak = [], {}
    for name in args.configs.split(","):
        config = {**CONFIGS[name], "options": options}
        q = run_child("quickdraft", config, args.cold)
        row = {"config": name, "import": q["after_import"], "load": q["after_load"], "request": q["after_request"],
               "peak": q["peak"], "weights": q["weights_resident"], "kv_reserved": q["kv"]["reserved"],
               "kv_resident": q["kv"]["resident"], "rest": q["rest"], "load_s": q["load_s"], "detail": q}
        if not args.no_llamacpp:
            models = PAIR if name == "pair" else (CONFIGS[name]["model"],)
            for m in models:
                if m not in llamacpp_peak:
                    llamacpp_peak[m] = run_child("llamacpp", {"model": m})
            row["llamacpp_peak"] = sum(llamacpp_peak[m]["peak"] for m in models)
            row["ratio"] = row["peak"] / row["llamacpp_peak"]
        rows.append(row)
        print(f"{name}: peak {row['peak']:.0f} MiB; {q['summary']}", flush=True)
    columns = ["config", "import", "load", "request", "peak", "weights", "kv_reserved", "kv_resident", "rest",
               "load_s", "llamacpp_peak", "ratio"]
    print(table(rows, columns))
    for row in rows:
        print(f"{row['config']} weights by module (MiB resident / reserved): " + ", ".join(
            f"{k} {v['resident']:.0f}/{v['reserved']:.0f}" for k, v in row["detail"]["weights"].items()))
    path = save(args.out, {"machine": machine(), "options": options, "cold": args.cold, "tokens": TOKENS, "rows": rows,
                           "llamacpp": llamacpp_peak})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
