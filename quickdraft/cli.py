"""Command line: ``quickdraft models | generate | chat | serve``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from quickdraft.errors import InvalidParameterError, QuickdraftError
from quickdraft.paths import cache_root
from quickdraft.serving.lora_args import add_lora_arguments, lora_setup

GREEN, RESET = "\033[32m", "\033[0m"

# the other samplers, each as SamplingParams names it (a llama.cpp user's --repeat-penalty is --repetition-penalty)
LLAMA_SAMPLER_ARGS = {"min_p": float, "repetition_penalty": float, "typical_p": float, "top_n_sigma": float,
                      "xtc_probability": float, "xtc_threshold": float, "dry_multiplier": float, "dry_base": float,
                      "dry_allowed_length": int, "dry_penalty_last_n": int, "dry_sequence_breakers": str,
                      "mirostat": int, "mirostat_tau": float, "mirostat_eta": float}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, max_tokens_help: str | None = None) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    for name, kind in LLAMA_SAMPLER_ARGS.items():  # llama.cpp's samplers, off unless given
        repeated = name == "dry_sequence_breakers"  # as llama.cpp's --dry-sequence-breaker, once a string
        parser.add_argument("--" + name.replace("_", "-").removesuffix("s" if repeated else ""), dest=name,
                            type=kind, action="append" if repeated else "store")
    parser.add_argument("--max-draft-tokens", type=int, default=None,
                        help="cap each round's draft for these requests (0: no speculation); the output is the same")
    parser.add_argument("--json-schema", default=None, metavar="FILE",
                        help="the output is JSON following the JSON schema in FILE (structured outputs)")


def _json_schema(path: str | None) -> dict | None:
    """The --json-schema file's constraint; a file that cannot be read or parsed is named in the error."""
    if path is None:
        return None
    try:
        return {"json": json.loads(Path(path).read_text(encoding="utf-8"))}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidParameterError(f"--json-schema {path}: not a readable JSON file ({exc})") from None


def request_params(args: argparse.Namespace):
    """The sampling parameters the sampling arguments ask for."""
    from quickdraft.sampling import SamplingParams
    cap = args.max_draft_tokens
    given = {k: getattr(args, k) for k in LLAMA_SAMPLER_ARGS if getattr(args, k) is not None}
    if args.temperature == 0 and any(given.get(k) for k in ("min_p", "typical_p", "top_n_sigma", "xtc_probability",
                                                            "mirostat")):  # (mirostat 0 is off)
        raise InvalidParameterError("--min-p, --typical-p, --top-n-sigma, --xtc-* and --mirostat choose among sampled "
                                    "tokens: give --temperature > 0 (the CLI decodes greedily by default)")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, **given, lora=lora_setup(args).default_choice(),
                          speculative=True if cap is None else {"max_draft_tokens": cap},
                          structured_outputs=_json_schema(args.json_schema))


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_lora_arguments(p)
    p.add_argument("model", help="packaged model name (see `quickdraft models`), GGUF file or HF directory")
    p.add_argument("--draft", help="draft model for speculative decoding (same tokenizer as MODEL)")
    p.add_argument("--speculative", choices=["ngram", "self", "suffix"],
                   help="draft-free speculation; suffix (suffix decoding) also takes a --draft model for what it has "
                        "no match for")
    p.add_argument("--suffix-scope", default=None, choices=["request", "global"],
                   help="--speculative suffix: match the request's own tokens only, or also earlier requests' outputs "
                        "(default; faster on repeated work, and the speed-up is observable across clients)")
    p.add_argument("--suffix-cache-tokens", type=int, default=None,
                   help="--speculative suffix: tokens of earlier outputs kept (least recently used go first)")
    p.add_argument("--k", default="auto", help="tokens drafted per round: an int, or 'auto' (adaptive, default)")
    p.add_argument("--run-ahead", action="store_true",
                   help="with --draft or --speculative self: draft the next round in a background thread while "
                        "the target verifies the current one")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "int4", "int8", "bfloat16", "float32"],
                   help="the linear layers' format (default auto: on CPU a quantized GGUF runs each tensor in its own "
                        "type, read at the file's size ('gguf'); a float GGUF or an HF directory float weights in "
                        "--dtype); int4/int8: requantized; bfloat16/float32: float weights dequantized from the file")
    p.add_argument("--draft-weights", default="auto", choices=["auto", "gguf", "int4", "int8", "bfloat16", "float32"],
                   help="the --draft model's weight format (default auto: int4 on CPU; a draft's precision changes "
                        "acceptance, never the output)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--kv-cache-memory", default="auto",
                   help="cap of each model's KV cache, e.g. 2GiB (default auto: what --max-num-seqs full contexts need, "
                        "within half the free memory); it fills as sequences need it")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int8"],
                   help="KV cache format (default auto: the model's dtype; int8: a float32 scale per 32 values, 0.56x "
                        "the bytes of bfloat16 to store and read, slightly less exact)")
    p.add_argument("--max-memory", default=None,
                   help="refuse, before loading, a configuration whose weights, KV caps and runtime exceed this, e.g. 4GiB")
    p.add_argument("--threads", default="auto", type=_int_or("auto", "auto"),
                   help="CPU threads per step (default auto: the cores other processes leave free, re-read as it runs)")
    p.add_argument("--static-step", default="auto", choices=["auto", "graphs", "eager", "off"],
                   help="how decode steps and verify passes run (default auto: CUDA graphs on a GPU, captured at load; "
                        "eager: the same static step without graphs; off: the dynamic path)")
    p.add_argument("--launch-ahead", default="auto", choices=["auto", "on", "off"],
                   help="queue the next decode step before reading this one's tokens (default auto: where CUDA graphs "
                        "run; on: also with --static-step eager)")
    p.add_argument("--gpu-linears", default="cublas", choices=["cublas", "triton"],
                   help="what a GPU's bfloat16 decoder-layer linears run on (default cublas; triton: quickdraft's "
                        "Triton kernel, a row's result alike whatever the rows beside it)")


def _int_or(word: str, means: object) -> Callable[[str], int | object]:
    """An argparse type: an int, or ``word`` (given back as ``means``)."""
    def parse(value: str) -> int | object:
        if value == word:
            return means
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int or {word!r}, got {value!r}") from None
    return parse


def llm_options(args: argparse.Namespace, **extra) -> dict:
    """``LLM``'s keyword arguments from the model arguments (what every replica of a scaled-out server gets)."""
    k = args.k if args.k == "auto" else int(args.k)
    return dict(draft=args.draft, speculative=args.speculative, num_speculative_tokens=k, dtype=args.dtype,
                weights=args.weights, draft_weights=args.draft_weights, device=args.device,
                max_model_len=args.max_model_len, run_ahead=args.run_ahead, threads=args.threads, **extra,
                lora_adapters=lora_setup(args).adapters or None,
                **{name: getattr(args, name) for name in ("kv_cache_memory", "kv_cache_dtype", "max_memory",
                   "suffix_scope", "suffix_cache_tokens", "static_step", "launch_ahead", "gpu_linears")})


def llm_from_args(args: argparse.Namespace, announce: bool = True, **extra):
    """The LLM the model arguments ask for; ``announce`` prints which kernels it runs to stderr (``serve`` logs
    the same line instead)."""
    from quickdraft.llm import LLM
    llm = LLM(args.model, **llm_options(args, **extra))
    if announce:
        draft = f"; draft: {llm.draft_weights}" if llm.draft_weights is not None else ""
        draft += f" ({llm.loaded.draft_pairing})" if llm.loaded.draft_pairing else ""
        print(f"[{args.model}: {llm.weights_summary}{draft}; {llm.memory_summary}]", file=sys.stderr, flush=True)
    return llm


def cmd_models(args: argparse.Namespace) -> int:
    from quickdraft.loading import list_models
    from quickdraft.loading.quantize import file_defaults
    models = list_models()
    print(f"{'name':<22} {'installed':<10} {'size':>10}  {'file layers':<20} {'default kernels':<36} "
          f"{'read/token':>10}  path / how to install")
    for m in models:
        where = str(m.path) if m.installed else f"`{m.install_hint}` in a quickdraft checkout"
        size = f"{m.size_bytes / 1e6:>8.0f}MB" if m.size_bytes else f"{'?':>10}"
        stored, kernels, step = file_defaults(m.path)
        read = f"{step / 1e6:>8.0f}MB" if step else f"{'?':>10}"
        print(f"{m.name:<22} {'yes' if m.installed else 'no':<10} {size}  {stored:<20} {kernels:<36} {read}  {where}")
    missing = [m for m in models if not m.installed]
    if missing:
        print("\nanywhere else, install with pip:")
        for m in missing:
            print(f"  {m.name}: {m.pip_command}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from quickdraft.loading import cache_budget
    limit = cache_budget.limit_bytes()  # a bad bound is refused before anything is removed
    if args.clear:
        count, freed = cache_budget.clear()
        print(f"removed {count} converted-weight files ({freed / 1e9:.2f} GB) from {cache_root()}")
    print(f"{cache_root()}: {', '.join(cache_budget.BUDGETED)} kept under "
          f"{'no bound' if limit is None else f'{limit / 1e9:g} GB'} (${cache_budget.LIMIT_ENV})")
    for folder, (files, size) in cache_budget.usage().items():
        print(f"  {folder:<12} {files:>6} files {size / 1e9:>9.2f} GB")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    params = request_params(args)
    llm = llm_from_args(args)
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    colour = args.show_drafts and sys.stdout.isatty()
    start = time.perf_counter()
    final = None
    for chunk in llm.stream(prompt, params):
        if colour and any(chunk.from_draft):
            pieces = [(llm.tokenizer.decode([t]), d) for t, d in zip(chunk.token_ids, chunk.from_draft)]
            text = "".join(f"{GREEN}{s}{RESET}" if d else s for s, d in pieces)
            sys.stdout.write(text if "".join(s for s, _ in pieces) == chunk.text else chunk.text)
        else:
            sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finished:
            final = chunk
    sys.stdout.write("\n")
    m = final.metrics
    line = (f"[{m.generated_tokens} tokens, {m.tokens_per_s:.1f} tok/s, ttft {m.ttft_s * 1000:.0f} ms, "
            f"total {time.perf_counter() - start:.2f}s, finish={final.finish_reason}")
    if llm.drafter is not None:
        s = m.spec
        line += (f", {llm.drafter.name}: acceptance {s.acceptance_rate:.0%}, mean accepted {s.mean_accepted_length:.2f}"
                 f", {s.tokens_per_pass:.2f} tokens/target pass")
        if args.run_ahead and s.drafting_rounds:
            line += f", {s.run_ahead_rounds / s.drafting_rounds:.0%} of rounds from run-ahead"
        plain_step_s = llm.engine.cost.target(1)  # measured one-token target pass
        if plain_step_s > 0 and m.tokens_per_s > 0:
            line += f", speed-up ~{m.tokens_per_s * plain_step_s:.2f}x vs plain decoding"
    print(line + "]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat: user lines from stdin, replies streamed to stdout, the session saved after every turn."""
    params = request_params(args)
    llm = llm_from_args(args)
    path = Path(args.session) if args.session else None
    if path is not None and path.exists():
        session = llm.load_session(path)
        note = "; the last reply was interrupted: an empty line continues it" if session.interrupted else ""
        print(f"restored {session.turns} turns, {session.num_tokens} tokens from {path}{note}", file=sys.stderr)
    else:
        session = llm.session()
    interactive = sys.stdin.isatty()
    with session:
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:  # EOF / Ctrl-D
                break
            text = line.rstrip("\n")
            if not text.strip() and session.interrupted is None:
                continue
            stream = session.stream(None, params) if not text.strip() else \
                session.chat_stream({"role": "user", "content": text}, params)
            try:
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:  # the reply stays interrupted (and saved); an empty line continues it
                print("\n[interrupted]", end="", file=sys.stderr)
            except QuickdraftError as exc:
                print(f"error: {exc}", file=sys.stderr)
            finally:
                stream.close()
            sys.stdout.write("\n")
            sys.stdout.flush()
            if path is not None:
                session.save(path)
        saved = f", saved to {path}" if path is not None else ""
        print(f"{session.turns} turns, {session.num_tokens} tokens{saved}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from quickdraft.serving import create_app
    from quickdraft.serving.guard import ServerLimits
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = ServerLimits.with_env_key(
            args.api_key, max_body_bytes=args.max_request_body_bytes, max_waiting_requests=args.max_waiting_requests,
            request_timeout_s=args.request_timeout or None, max_prompts_per_request=args.max_prompts_per_request,
            max_stored_responses=args.max_stored_responses)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = dict(policy=args.policy, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  prefill_tokens_while_decoding=args.prefill_tokens_while_decoding, preemption=args.preemption)
    name = args.served_model_name or args.model
    if args.replicas is not None or args.ray_address is not None:
        return _serve_replicas(args, engine, name, limits)
    llm = llm_from_args(args, announce=False, **engine)
    app = create_app(llm, name, limits=limits, web=args.web, lora_scales=lora_setup(args).scales)
    spec = f", {llm.drafter.name} speculation" if llm.drafter is not None else ""
    page = f"; chat page: http://{args.host}:{args.port}/" if args.web else ""
    print(f"serving {name} ({llm.max_model_len} tokens of context{spec}) on http://{args.host}:{args.port}/v1{page}",
          file=sys.stderr, flush=True)
    # on SIGTERM uvicorn stops accepting, lets in-flight requests finish for --shutdown-timeout seconds, then
    # cancels them (their engine requests are aborted) and the app's shutdown stops the engine thread
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def _serve_replicas(args: argparse.Namespace, engine: dict, name: str, limits) -> int:
    """``serve --replicas N``: the same server as N engine replicas on Ray Serve (docs/DEPLOY.md)."""
    try:
        from quickdraft.serving.ray.cluster import serve_replicas
        from quickdraft.serving.ray.app import ReplicaOptions
    except ImportError as exc:
        print(f"error: --replicas needs Ray Serve ({exc}); install it with: pip install 'quickdraft[ray]'",
              file=sys.stderr)
        return 2
    options = llm_options(args, **engine)
    if lora_setup(args).scales:
        print("error: --lora and --lora-scaled are not passed to Ray replicas; use --lora-modules", file=sys.stderr)
        return 2
    if args.threads == "auto":  # each replica gets its CPUs' worth of threads
        options.pop("threads")
    try:
        replicas = ReplicaOptions(num_replicas=1 if args.replicas is None else args.replicas,
                                  num_cpus=args.num_cpus_per_replica,
                                  num_gpus=args.num_gpus_per_replica, min_replicas=args.min_replicas,
                                  max_replicas=args.max_replicas, policy=args.routing,
                                  target_ongoing_requests=max(1, args.max_num_seqs // 2), web=args.web)
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve_replicas(args.model, options, name, limits, replicas, args.host, args.port, args.ray_address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quickdraft", description="LLM inference with exact speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list packaged models and whether each is installed").set_defaults(fn=cmd_models)
    k = sub.add_parser("cache", help="the cache's folders and sizes; --clear removes the converted weights")
    k.add_argument("--clear", action="store_true", help="remove every converted-weight file (rebuilt when next used)")
    k.set_defaults(fn=cmd_cache)
    g = sub.add_parser("generate", help="stream a completion to stdout, stats to stderr")
    add_model_args(g)
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(g, max_tokens=128)
    g.add_argument("--show-drafts", action="store_true", help="colour accepted draft tokens (terminal only)")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat on stdin/stdout; --session FILE keeps it across runs")
    add_model_args(c)
    c.add_argument("--session", default=None, metavar="FILE",
                   help="session snapshot: loaded first if it exists, saved after every turn")
    add_sampling_args(c, max_tokens=256, max_tokens_help="tokens per reply at most")
    c.set_defaults(fn=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--policy", default="fcfs", choices=["fcfs", "sjf", "priority", "deadline"],
                   help="scheduling policy (priority and deadline read the request's priority / deadline_s)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences batched together at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step at most")
    s.add_argument("--prefill-tokens-while-decoding", type=_int_or("none", None), default=128,
                   help="prompt tokens per step while other requests stream (default 128; 'none': up to "
                        "--max-num-batched-tokens): smaller keeps their tokens coming while a long prompt is read, "
                        "larger reads the prompt sooner")
    s.add_argument("--preemption", default="recompute", choices=["recompute", "swap"],
                   help="when KV blocks run out: drop and recompute (default) or keep the KV in host memory")
    s.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: MODEL)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(default: $QUICKDRAFT_API_KEY if set, else no key)")
    s.add_argument("--max-request-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="while this many requests wait to start, new ones get 429 with Retry-After")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may run before it is aborted (0: no limit)")
    s.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one /v1/completions request may carry")
    s.add_argument("--no-web", dest="web", action="store_false", help="do not serve the chat page at /")
    s.add_argument("--max-stored-responses", type=int, default=1024,
                   help="/v1/responses kept in memory for previous_response_id (the oldest evicted first)")
    s.add_argument("--replicas", type=int, default=None,
                   help="serve from N engine replicas on Ray Serve behind one endpoint (pip install quickdraft[ray])")
    s.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local instance)")
    s.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    s.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    s.add_argument("--min-replicas", type=int, default=None, help="autoscale on requests in flight, from ...")
    s.add_argument("--max-replicas", type=int, default=None, help="... to this many replicas")
    s.add_argument("--routing", default="prefix", choices=["prefix", "round_robin", "power_of_two"],
                   help="replicas: prefix-aware (cache affinity, bounded by load), round-robin, or Ray Serve's "
                        "default (power of two choices)")
    s.add_argument("--shutdown-timeout", type=int, default=10,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    s.set_defaults(fn=cmd_serve)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except QuickdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`quickdraft models | head`): stop quietly, as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the closed pipe


if __name__ == "__main__":
    sys.exit(main())
