"""Soak test: `quickdraft serve` under well-formed load mixed with clients that vanish and hostile bodies.

A server that is fast only when every client behaves is not ready for the open network. This starts one
`quickdraft serve` subprocess on 127.0.0.1 and runs, against it:

1. reference: each distinct well-formed request alone (one at a time, non-streaming): its greedy text;
2. clean: the well-formed requests of the plan, concurrency ``--concurrency``, nothing else;
3. mixed: the whole plan, concurrency ``--concurrency``: ``--disconnect-rate`` of the requests are clients that
   leave at a random moment (a stream closed after a random number of chunks, or a non-streaming request
   cancelled by a short client timeout), ``--hostile-rate`` are hostile bodies (malformed JSON, wrong types,
   NaN/1e38/1e-300 sampling values, logit_bias 1e30, lone surrogates, a million stop_token_ids, a 1 MB stop
   string, 2,000 prompts in one request, a 20 MB body, ...), the rest are the same well-formed requests.

It reports well-formed requests lost (no 200, or an error) and changed (greedy text differs from the reference:
greedy decoding and exact speculation must not depend on what else runs), hostile requests answered 2xx / 4xx /
5xx / closed without an answer / no answer within ``--hang-timeout``, the KV blocks still in use once the server
is idle, tracebacks in the server log, and the p50/p99 latency of the well-formed requests in the mixed run beside
the clean run's. The prefix cache is reset before the clean and the mixed run, so both compute every prompt.

Prompts: the first turn of Spec-Bench public records (``spec_bench.public.jsonl``), ``--prompts`` distinct ones
taken round-robin over its six tasks as bench/serve.py does; well-formed requests cycle through them and alternate
/v1/completions and /v1/chat/completions, streaming or not at random (``--seed``). Greedy (temperature 0),
``--max-tokens`` each. Every request has a time bound, every loop a count bound, and the server is stopped on any
exit. The exit status is 1 when a well-formed request was lost or changed, a hostile one got a 5xx or no answer,
KV blocks stayed in use, or the server died.

    python bench/soak.py                                               # 300 requests, concurrency 32
    python bench/soak.py --requests 40 --concurrency 8 --out /tmp/soak.json  # smoke run
    python bench/soak.py --server-args "--max-waiting-requests 64"      # extra `quickdraft serve` flags
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402
from serve import DATA, load_sample, machine_info, pct  # noqa: E402
from server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "soak"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """One request of the plan; ``kind`` is "ok" (well-formed), "disconnect" or "hostile"."""

    index: int
    kind: str
    endpoint: str = COMPLETIONS
    prompt: int = 0
    stream: bool = False
    leave_after_chunks: int | None = None  # disconnect, streaming: content chunks read before closing
    leave_after_s: float | None = None  # disconnect, non-streaming: client timeout
    hostile: str | None = None


@dataclass
class Result:
    index: int
    kind: str
    outcome: str  # ok | error | left | finished (a disconnect client answered first) | 2xx | 4xx | 5xx | closed | hang
    status: int | None = None
    latency_s: float | None = None
    text: str | None = field(default=None, repr=False)
    error: str | None = None
    hostile: str | None = None


def well_formed_body(item: Item, prompts: list[str], max_tokens: int) -> dict:
    body: dict = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0.0, "stream": item.stream}
    if item.endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompts[item.prompt]}]
    else:
        body["prompt"] = prompts[item.prompt]
    return body


def _raw(text: str) -> tuple[str, bytes]:
    return COMPLETIONS, text.encode()


def _json(body: dict, path: str = COMPLETIONS) -> tuple[str, bytes]:
    return path, json.dumps(body).encode()


def hostile_bodies(max_tokens: int) -> dict[str, Callable[[], tuple[str, bytes]]]:
    """Name -> (path, body bytes); built when sent, so the large ones do not sit in memory. Raw text where JSON
    must carry what ``json.dumps`` would refuse or escape (NaN, Infinity, lone surrogates, invalid UTF-8)."""
    mt = max_tokens
    return {
        "malformed_json": lambda: _raw('{"prompt": "Hello", "max_tokens": '),
        "not_an_object": lambda: _raw('[1, 2, 3]'),
        "empty_body": lambda: _raw(""),
        "wrong_types": lambda: _json({"prompt": 5, "max_tokens": "8", "temperature": "hot", "stream": "yes"}),
        "chat_wrong_types": lambda: _json({"messages": "hello", "n": 1.5}, CHAT),
        "temperature_nan": lambda: _raw(f'{{"prompt": "Hello", "max_tokens": {mt}, "temperature": NaN}}'),
        "top_p_infinity": lambda: _raw(f'{{"prompt": "Hello", "max_tokens": {mt}, "top_p": Infinity}}'),
        "temperature_1e38": lambda: _json({"prompt": "Hello", "max_tokens": mt, "temperature": 1e38}),
        "top_p_1e-300": lambda: _json({"prompt": "Hello", "max_tokens": mt, "temperature": 0.7, "top_p": 1e-300}),
        "min_p_1e-300": lambda: _json({"prompt": "Hello", "max_tokens": mt, "temperature": 0.7, "min_p": 1e-300}),
        "logit_bias_1e30": lambda: _json({"prompt": "Hello", "max_tokens": mt, "logit_bias": {"42": 1e30}}),
        "logit_bias_nan": lambda: _raw(f'{{"prompt": "Hello", "max_tokens": {mt}, "logit_bias": {{"42": NaN}}}}'),
        "lone_surrogate_prompt": lambda: _raw(f'{{"prompt": "\\ud800 x", "max_tokens": {mt}}}'),
        "lone_surrogate_chat": lambda: (CHAT, f'{{"messages": [{{"role": "user", "content": "a\\udfff"}}], '
                                              f'"max_tokens": {mt}}}'.encode()),
        "lone_surrogate_stop": lambda: _raw(f'{{"prompt": "Hello", "max_tokens": {mt}, "stop": ["\\ud800"]}}'),
        "invalid_utf8": lambda: (COMPLETIONS, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}'),
        "deep_nesting": lambda: _raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "million_stop_token_ids": lambda: _json({"prompt": "Hello", "max_tokens": mt, "stop_token_ids": [2] * 10**6}),
        "megabyte_stop_string": lambda: _json({"prompt": "Hello", "max_tokens": mt, "stop": "x" * 2**20}),
        "2000_prompts": lambda: _json({"prompt": ["Hello"] * 2000, "max_tokens": mt}),
        "20MB_body": lambda: _json({"prompt": "a " * (10 * 2**20), "max_tokens": mt}),
        "huge_ints": lambda: _json({"prompt": "Hello", "max_tokens": 10**30, "n": 10**30, "seed": 10**30}),
        "negative_max_tokens": lambda: _json({"prompt": "Hello", "max_tokens": -1}),
    }


def make_plan(args: argparse.Namespace, kinds: list[str]) -> list[Item]:
    """The mixed run's requests: kinds drawn at random; hostile bodies dealt from a shuffled deck, so every kind
    is sent before any repeats."""
    rng = random.Random(args.seed)
    deck: list[str] = []
    plan = []
    for i in range(args.requests):
        r = rng.random()
        item = Item(i, "ok", endpoint=rng.choice([COMPLETIONS, CHAT]), prompt=i % args.prompts,
                    stream=rng.random() < 0.5)
        if r < args.hostile_rate:
            if not deck:
                deck = rng.sample(kinds, len(kinds))
            item.kind, item.hostile = "hostile", deck.pop()
        elif r < args.hostile_rate + args.disconnect_rate:
            item.kind = "disconnect"
            if item.stream:
                item.leave_after_chunks = rng.randrange(0, max(1, args.max_tokens // 2))
            else:
                item.leave_after_s = rng.uniform(0.05, 2.0)
        plan.append(item)
    return plan


# ---- the server ----------------------------------------------------------------------------------------------
def start_server(args: argparse.Namespace, log_path: Path) -> ServerProcess:
    serve_args = [args.model, "--served-model-name", SERVED_NAME, "--log-level", "warning",
                  "--kv-cache-memory", args.kv_cache_memory, *shlex.split(args.server_args)]
    if args.speculative != "none":
        serve_args += ["--speculative", args.speculative]
    if args.dtype:
        serve_args += ["--dtype", args.dtype]
    return ServerProcess(serve_args, log_path)


# ---- clients -------------------------------------------------------------------------------------------------
def _text_of(event: dict, endpoint: str) -> str:
    out = []
    for choice in event.get("choices", []):
        if endpoint == CHAT:
            out.append((choice.get("delta") or choice.get("message") or {}).get("content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


async def well_formed(client: httpx.AsyncClient, item: Item, prompts: list[str], args: argparse.Namespace) -> Result:
    """A request that must succeed (kind "ok"), or one that leaves early (kind "disconnect")."""
    body = well_formed_body(item, prompts, args.max_tokens)
    leaving = item.kind == "disconnect"
    t0 = time.perf_counter()
    res = Result(item.index, item.kind, "error")
    try:
        if not item.stream:
            timeout = httpx.Timeout(args.request_timeout, read=item.leave_after_s) if leaving else None
            r = await client.post(item.endpoint, json=body, **({"timeout": timeout} if timeout else {}))
            res.status = r.status_code
            if r.status_code == 200:
                res.text, res.outcome = _text_of(r.json(), item.endpoint), "finished" if leaving else "ok"
            else:
                res.error = r.text[:300]
        else:
            async with client.stream("POST", item.endpoint, json=body) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.error = (await r.aread()).decode(errors="replace")[:300]
                else:
                    chunks, text = 0, []
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            res.text, res.outcome = "".join(text), "finished" if leaving else "ok"
                            break
                        event = json.loads(line[6:])
                        if "error" in event:
                            res.error = json.dumps(event["error"])[:300]
                            break
                        text.append(_text_of(event, item.endpoint))
                        chunks += 1
                        if leaving and chunks > item.leave_after_chunks:
                            res.outcome = "left"  # leaving the block closes the connection mid-stream
                            break
                    else:
                        res.error = "the stream ended without [DONE]"
    except httpx.TimeoutException as exc:
        if leaving:
            res.outcome = "left"
        else:
            res.error = f"no answer within the client timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.latency_s = time.perf_counter() - t0
    return res


async def hostile(client: httpx.AsyncClient, item: Item, bodies: dict, args: argparse.Namespace) -> Result:
    """A hostile body: the answer should be a 4xx (a 2xx where the value is odd but legal), never a 5xx or none."""
    path, content = bodies[item.hostile]()
    t0 = time.perf_counter()
    res = Result(item.index, item.kind, "closed", hostile=item.hostile)
    try:
        r = await client.post(path, content=content, headers={"content-type": "application/json"},
                              timeout=httpx.Timeout(args.hang_timeout))
        res.status = r.status_code
        res.outcome = f"{r.status_code // 100}xx"
        if r.status_code >= 300:
            res.error = r.text[:300]
    except httpx.TimeoutException:
        res.outcome = "hang"
    except httpx.HTTPError as exc:  # the server closed the connection without an answer
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.latency_s = time.perf_counter() - t0
    return res


async def run_plan(url: str, items: list[Item], prompts: list[str], args: argparse.Namespace,
                   concurrency: int) -> tuple[list[Result], float]:
    """Send ``items`` at ``concurrency``; anything unfinished when ``--run-timeout`` passes is cancelled and
    reported as an error, so the run always ends."""
    gate = asyncio.Semaphore(concurrency)
    bodies = hostile_bodies(args.max_tokens)
    # no keep-alive: a client that leaves closes its own connection, as a real one would
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.request_timeout, pool=None)

    async def one(client: httpx.AsyncClient, item: Item) -> Result:
        # the client timeouts bound each read; this bounds the whole exchange (a trickling stream included)
        bound = args.hang_timeout if item.kind == "hostile" else args.request_timeout
        async with gate:
            t0 = time.perf_counter()
            try:
                if item.kind == "hostile":
                    return await asyncio.wait_for(hostile(client, item, bodies, args), bound)
                return await asyncio.wait_for(well_formed(client, item, prompts, args), bound)
            except asyncio.TimeoutError:
                return Result(item.index, item.kind, "hang" if item.kind == "hostile" else "error",
                              latency_s=time.perf_counter() - t0, error=f"not finished within {bound:.0f}s",
                              hostile=item.hostile)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(client, item)) for item in items]
        done, pending = await asyncio.wait(tasks, timeout=args.run_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    results = []
    for item, t in zip(items, tasks):
        if t in done and t.exception() is None:
            results.append(t.result())
        else:
            why = "cancelled at --run-timeout" if t in pending else f"client bug: {t.exception()!r}"
            results.append(Result(item.index, item.kind, "hang" if item.kind == "hostile" else "error",
                                  error=why, hostile=item.hostile))
    return results, wall


# ---- report --------------------------------------------------------------------------------------------------
def latency_summary(results: list[Result]) -> dict:
    lat = [r.latency_s for r in results if r.outcome == "ok"]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {"requests": len(lat), "latency_ms_p50": ms(pct(lat, 50)), "latency_ms_p99": ms(pct(lat, 99)),
            "latency_ms_max": ms(max(lat) if lat else None)}


def server_errors(log: str) -> list[str]:
    """Tracebacks and error lines the server logged (each cut short): a 5xx's cause, or an error a client
    never saw."""
    found = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("Traceback", "ERROR:", "CRITICAL:")) or " ERROR " in line or " CRITICAL " in line:
            found.append("\n".join(lines[i:i + 40])[:3000])
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--speculative", default="ngram", choices=["ngram", "self", "none"])
    p.add_argument("--dtype", default=None, help="the server's --dtype (default: its own)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--server-args", default="", help="extra `quickdraft serve` flags, one shell-quoted string")
    p.add_argument("--requests", type=int, default=300, help="requests in the mixed run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--disconnect-rate", type=float, default=0.2)
    p.add_argument("--hostile-rate", type=float, default=0.1)
    p.add_argument("--prompts", type=int, default=48, help="distinct Spec-Bench prompts the requests cycle through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600, help="seconds a well-formed request may take")
    p.add_argument("--hang-timeout", type=float, default=120, help="seconds without an answer that count as a hang")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds each of the three runs may take")
    p.add_argument("--idle-timeout", type=float, default=60, help="seconds to wait for the server to go idle")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = p.parse_args(argv)
    if not (0 <= args.disconnect_rate and 0 <= args.hostile_rate and args.disconnect_rate + args.hostile_rate <= 1):
        p.error("--disconnect-rate and --hostile-rate must be >= 0 and add up to at most 1")
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.prompts < 1:
        p.error("--requests, --concurrency, --max-tokens and --prompts must be >= 1")

    sample = load_sample(args.data, args.prompts)
    prompts = [s["prompt"] for s in sample]
    kinds = list(hostile_bodies(args.max_tokens))
    plan = make_plan(args, kinds)
    ok_items = [it for it in plan if it.kind == "ok"]
    ref_keys = sorted({(it.endpoint, it.prompt) for it in ok_items})
    print(f"plan: {len(ok_items)} well-formed, {sum(it.kind == 'disconnect' for it in plan)} disconnecting, "
          f"{sum(it.kind == 'hostile' for it in plan)} hostile; {len(ref_keys)} distinct well-formed requests",
          file=sys.stderr)

    logs = Path(tempfile.mkdtemp(prefix="quickdraft-soak-"))
    server = start_server(args, logs / "server.log")
    report: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "server_cmd": " ".join(server.cmd[2:]), "machine": machine_info(),
                    "sample": {"file": args.data.name, "question_ids": [s["question_id"] for s in sample]}}
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.startup_timeout)
        print(f"server ready in {time.perf_counter() - t0:.0f}s ({server.url}); log: {server.log_path}",
              file=sys.stderr)

        # 1. reference: each distinct well-formed request alone
        ref_items = [Item(-1 - i, "ok", endpoint=e, prompt=pr) for i, (e, pr) in enumerate(ref_keys)]
        refs, wall = asyncio.run(run_plan(server.url, ref_items, prompts, args, concurrency=1))
        reference = {(it.endpoint, it.prompt): r.text for it, r in zip(ref_items, refs) if r.outcome == "ok"}
        failed = [asdict(r) for r in refs if r.outcome != "ok"]
        print(f"reference: {len(reference)}/{len(ref_items)} answered in {wall:.0f}s", file=sys.stderr)
        if failed:
            print(f"reference requests failed: {failed[:3]}", file=sys.stderr)

        # 2. clean: the well-formed requests only
        server.reset_prefix_cache()
        clean, clean_wall = asyncio.run(run_plan(server.url, ok_items, prompts, args, args.concurrency))
        print(f"clean run: {len(clean)} requests in {clean_wall:.0f}s", file=sys.stderr)

        # 3. mixed: the whole plan
        server.reset_prefix_cache()
        before, _ = server.wait_idle(args.idle_timeout)
        mixed, mixed_wall = asyncio.run(run_plan(server.url, plan, prompts, args, args.concurrency))
        print(f"mixed run: {len(mixed)} requests in {mixed_wall:.0f}s", file=sys.stderr)
        after, idle_wait = server.wait_idle(args.idle_timeout)
        try:
            health = httpx.get(f"{server.url}/health", timeout=10).status_code
        except httpx.HTTPError as exc:
            health = f"{type(exc).__name__}"
        alive = server.proc.poll() is None
    finally:
        server.stop()
    log_errors = server_errors(server.log_text())

    # ---- tally ----
    def compare(results: list[Result]) -> dict:
        ok = [r for r in results if r.kind == "ok"]
        items = {it.index: it for it in plan}
        lost = [r for r in ok if r.outcome != "ok"]
        changed = [r for r in ok if r.outcome == "ok" and
                   (key := (items[r.index].endpoint, items[r.index].prompt)) in reference and r.text != reference[key]]
        no_ref = [r for r in ok if (items[r.index].endpoint, items[r.index].prompt) not in reference]
        return {"sent": len(ok), "lost": len(lost), "changed": len(changed), "without_reference": len(no_ref),
                "lost_detail": [asdict(r) for r in lost[:20]],
                "changed_detail": [{"index": r.index, **dict(zip(("endpoint", "prompt"), (
                    items[r.index].endpoint, items[r.index].prompt))), "text": r.text,
                    "reference": reference[(items[r.index].endpoint, items[r.index].prompt)]} for r in changed[:10]]}

    disc = [r for r in mixed if r.kind == "disconnect"]
    hos = [r for r in mixed if r.kind == "hostile"]
    by_kind: dict[str, dict] = {}
    for r in hos:
        row = by_kind.setdefault(r.hostile, {"hostile body": r.hostile, "sent": 0, "statuses": [], "max_s": 0.0})
        row["sent"] += 1
        row["statuses"].append(str(r.status) if r.status is not None else r.outcome)
        row["max_s"] = max(row["max_s"], r.latency_s or 0.0)
        if r.error and len(row.setdefault("answers", [])) < 3:
            row["answers"].append(r.error[:200])
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    report["results"] = {
        "reference": {"requests": len(ref_items), "answered": len(reference), "failed": failed},
        "clean": {"wall_s": round(clean_wall, 2), **compare(clean), **latency_summary(clean)},
        "mixed": {"wall_s": round(mixed_wall, 2), "well_formed": {**compare(mixed), **latency_summary(mixed)},
                  "disconnect": {"sent": len(disc), **{o: sum(r.outcome == o for r in disc)
                                                       for o in ("left", "finished", "error")},
                                 "errors": [asdict(r) for r in disc if r.outcome == "error"][:10]},
                  "hostile": {"sent": len(hos), **{o: sum(r.outcome == o for r in hos)
                                                   for o in ("2xx", "4xx", "5xx", "closed", "hang")},
                              "by_body": sorted(by_kind.values(), key=lambda r: r["hostile body"])},
                  "requests": [{k: v for k, v in asdict(r).items() if k != "text" and v is not None} for r in mixed]},
        "after": {"kv_blocks_used": after.get("quickdraft_kv_blocks_used"),
                  "draft_kv_blocks_used": after.get("quickdraft_draft_kv_blocks_used"),
                  "requests_running": after.get("quickdraft_num_requests_running"),
                  "requests_waiting": after.get("quickdraft_num_requests_waiting"),
                  "seconds_to_idle": round(idle_wait, 2), "health": health, "process_alive": alive,
                  "server_requests": {s: delta(f'quickdraft_requests_total{{status="{s}"}}')
                                      for s in ("ok", "error", "aborted")},
                  "server_log_errors": len(log_errors), "server_log_error_excerpts": log_errors[:5]},
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.out}")
    res = report["results"]
    bad = (res["mixed"]["well_formed"]["lost"] + res["mixed"]["well_formed"]["changed"] + res["mixed"]["hostile"]["5xx"]
           + res["mixed"]["hostile"]["hang"] + (res["after"]["kv_blocks_used"] or 0) + (not alive))
    return 1 if bad else 0


def _int(v: float | None) -> int | None:
    return None if v is None else int(v)


def print_report(report: dict) -> None:
    res, cfg = report["results"], report["config"]
    mixed, clean, after = res["mixed"], res["clean"], res["after"]
    wf, d, h = mixed["well_formed"], mixed["disconnect"], mixed["hostile"]
    print(f"\nsoak: {cfg['model']} (speculative: {cfg['speculative']}), {cfg['requests']} requests at concurrency "
          f"{cfg['concurrency']}, max_tokens {cfg['max_tokens']}, seed {cfg['seed']}")
    rows = [
        {"": "well-formed (mixed run)", "sent": wf["sent"],
         "result": f"lost {wf['lost']}, changed vs alone {wf['changed']}"},
        {"": "well-formed (clean run)", "sent": clean["sent"],
         "result": f"lost {clean['lost']}, changed vs alone {clean['changed']}"},
        {"": "disconnecting clients", "sent": d["sent"],
         "result": f"left early {d['left']}, answered first {d['finished']}, errors {d['error']}"},
        {"": "hostile bodies", "sent": h["sent"],
         "result": f"2xx {h['2xx']}, 4xx {h['4xx']}, 5xx {h['5xx']}, closed {h['closed']}, hang {h['hang']}"},
        {"": "after the mixed run", "sent": None,
         "result": f"KV blocks in use {_int(after['kv_blocks_used'])} (idle after {after['seconds_to_idle']}s), "
                   f"health {after['health']}, server log errors {after['server_log_errors']}"},
    ]
    print(table(rows, ["", "sent", "result"]))
    print()
    print(table([{"run": "clean", **{k: clean[k] for k in ("requests", "latency_ms_p50", "latency_ms_p99",
                                                           "latency_ms_max")}, "wall_s": clean["wall_s"]},
                 {"run": "mixed", **{k: wf[k] for k in ("requests", "latency_ms_p50", "latency_ms_p99",
                                                        "latency_ms_max")}, "wall_s": mixed["wall_s"]}],
                ["run", "requests", "latency_ms_p50", "latency_ms_p99", "latency_ms_max", "wall_s"]))
    print("latency: well-formed requests answered in full, request sent to last byte")
    if h["by_body"]:
        print()
        print(table([{**r, "statuses": " ".join(r["statuses"]), "max_s": r["max_s"]} for r in h["by_body"]],
                    ["hostile body", "sent", "statuses", "max_s"]))


if __name__ == "__main__":
    sys.exit(main())
