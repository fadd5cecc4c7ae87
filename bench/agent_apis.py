"""An agent loop over each API a client speaks: chat completions, OpenAI Responses, Anthropic Messages; suffix
decoding against plain on repeated rounds, through real servers on 127.0.0.1 and the real clients.

Usage: python bench/agent_apis.py [--target qwen2.5-coder-0.5b] [--tasks 2] [--tokens 128]
         [--apis chat,responses,messages] [--out agent_apis]

Each API gets two servers of the same model in this process, plain and suffix decoding (``--speculative
suffix``), so its suffix and prefix caches hold its own earlier rounds only (the weights are one memory-mapped file,
shared). The workload is bench/agentic.py's edit-resend and multi-turn tasks (an agent resending code with small
changes, public HumanEval prompts) in one fixed order, greedy; each request goes through every API and mode one
after the other, so the machine's drift over minutes touches all alike. A task's later rounds are where suffix
decoding finds its earlier answers. Every API sees the same conversations (the assistant turns are the first API's
plain answers), and every answer is checked against that one. Tokens/s is the whole request (prefill included) over
new tokens.
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentic import workload  # noqa: E402
from common import machine, save, table  # noqa: E402

import anthropic  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

from quickdraft import LLM  # noqa: E402
from quickdraft.serving import create_app  # noqa: E402


class Server:
    """uvicorn serving one LLM on a free port of 127.0.0.1, from a thread of this process."""

    def __init__(self, llm: LLM) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(llm, "model"), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def ask(api: str, url: str, history: list[dict], tokens: int) -> tuple[str, int, dict]:
    """(answer, tokens generated, usage.speculative) of one greedy request through ``api``."""
    if api == "chat":
        r = openai.OpenAI(base_url=f"{url}/v1", api_key="-").chat.completions.create(
            model="model", messages=history, max_tokens=tokens, temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens, r.usage.model_extra["speculative"]
    if api == "responses":
        r = openai.OpenAI(base_url=f"{url}/v1", api_key="-").responses.create(
            model="model", input=history, max_output_tokens=tokens, temperature=0)
        return r.output_text, r.usage.output_tokens, r.usage.model_extra["speculative"]
    m = anthropic.Anthropic(base_url=url, api_key="-").messages.create(
        model="model", messages=history, max_tokens=tokens, extra_body={"temperature": 0})
    text = "".join(b.text for b in m.content if b.type == "text")
    return text, m.usage.output_tokens, m.usage.model_extra["speculative"]


def run(apis: list[str], target: str, tasks: int, tokens: int) -> list[dict]:
    """The workload, each request sent through every API to its own plain and suffix servers in turn."""
    servers = {(api, mode): Server(LLM(target, max_model_len=4096, kv_cache_memory="256MiB", **options))
               for api in apis for mode, options in (("plain", {}), ("suffix", {"speculative": "suffix"}))}
    rows, history = [], []
    try:
        for (api, _), server in servers.items():  # warm-up: the weights' pages and the kernels
            ask(api, server.url, [{"role": "user", "content": "hi"}], 4)
        requests = [r for r in workload(tasks) if r["kind"] != "tool-call"]
        for index, request in enumerate(requests):
            history = (history if request.get("follows") else []) + request["messages"]
            answers = {}
            for (api, mode), server in servers.items():
                t0 = time.perf_counter()
                answers[api, mode], generated, spec = ask(api, server.url, history, tokens)
                rows.append({"api": api, "request": index, "kind": request["kind"], "round": request["round"],
                             "mode": mode, "seconds": time.perf_counter() - t0, "tokens": generated,
                             "passes": spec["target_passes"], "accepted": spec["accepted_tokens"]})
            reference = answers[apis[0], "plain"]
            for row in rows[-len(servers):]:
                row["identical"] = answers[row["api"], row["mode"]] == reference
            history = history + [{"role": "assistant", "content": reference}]
            print(f"  #{index:<2} {request['kind']:<11} round {request['round']}  tok/s: " + "  ".join(
                f"{r['api']} {r['mode']} {r['tokens'] / r['seconds']:5.1f}" for r in rows[-len(servers):]), flush=True)
    finally:
        for server in servers.values():
            server.close()
    return rows


def summarise(rows: list[dict], apis: list[str]) -> list[dict]:
    out = []
    for api in apis:
        for phase, keep in (("first rounds", lambda r: r["round"] == 1), ("repeated rounds", lambda r: r["round"] > 1)):
            chosen = [r for r in rows if r["api"] == api and keep(r)]
            speed = {mode: sum(r["tokens"] for r in chosen if r["mode"] == mode) /
                     sum(r["seconds"] for r in chosen if r["mode"] == mode) for mode in ("plain", "suffix")}
            suffix = [r for r in chosen if r["mode"] == "suffix"]
            out.append({"api": api, "phase": phase, "requests": len(chosen) // 2, "plain_tok_s": speed["plain"],
                        "suffix_tok_s": speed["suffix"], "speedup": speed["suffix"] / speed["plain"],
                        "suffix_tokens_per_pass": sum(r["tokens"] for r in suffix) / sum(r["passes"] for r in suffix),
                        "identical": all(r["identical"] for r in chosen)})
    chat = {r["phase"]: r["speedup"] for r in out if r["api"] == "chat"}
    for row in out:
        if row["phase"] in chat:
            row["speedup_vs_chat"] = row["speedup"] / chat[row["phase"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--apis", default="chat,responses,messages")
    ap.add_argument("--out", default="agent_apis")
    args = ap.parse_args()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; target {args.target}, greedy, {args.tokens} new tokens")
    apis = args.apis.split(",")
    rows = run(apis, args.target, args.tasks, args.tokens)
    summary = summarise(rows, apis)
    print(table(summary, ["api", "phase", "requests", "plain_tok_s", "suffix_tok_s", "speedup", "speedup_vs_chat",
                          "suffix_tokens_per_pass", "identical"]))
    print(f"wrote {save(args.out, {'machine': info, 'args': vars(args), 'summary': summary, 'rows': rows})}")


if __name__ == "__main__":
    main()
