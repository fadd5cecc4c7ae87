"""Server metrics in the Prometheus text exposition format (0.0.4), written by hand (no client library).

Counters and histograms are fed by the engine thread and the HTTP handlers (one lock guards them); engine
gauges and counters (queue sizes, KV blocks and bytes, speculative totals) are read from ``AsyncEngine.stats()``, and
the process's memory, CPU time and file descriptors from /proc, when ``/metrics`` is scraped.
"""
from __future__ import annotations

import bisect
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer low ends because small models on a GPU answer in a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_STATUSES = ("ok", "error", "aborted")


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape(label_value: str) -> str:
    return label_value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Histogram:
    """Cumulative-bucket histogram; ``observe(v, count)`` records ``count`` observations of ``v``."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0 or not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.buckets, value)] += count
        self.sum += value * count
        self.count += count

    def render(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            lines.append(f'{name}_bucket{{le="{_fmt(float(bound))}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {_fmt(self.sum)}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    """Request counters and latency histograms of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = {status: 0 for status in REQUEST_STATUSES}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def count_request(self, status: str, n: int = 1) -> None:
        with self._lock:
            self.requests[status] += n

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, count: int = 1) -> None:
        with self._lock:
            self.itl.observe(seconds, count)

    def render(self, stats: Mapping[str, float]) -> str:
        """The whole exposition; ``stats`` is ``AsyncEngine.stats()``."""
        out: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")

        def single(name: str, kind: str, text: str, value: float) -> None:
            head(name, kind, text)
            out.append(f"{name} {_fmt(value)}")

        with self._lock:
            head("quickdraft_requests_total", "counter",
                 "Generation requests by outcome: ok (finished), error (rejected or failed), aborted (client left).")
            for status, n in self.requests.items():
                out.append(f'quickdraft_requests_total{{status="{_escape(status)}"}} {n}')
            head("quickdraft_time_to_first_token_seconds", "histogram",
                 "Time from a request's arrival to its first generated token.")
            out.extend(self.ttft.render("quickdraft_time_to_first_token_seconds"))
            head("quickdraft_inter_token_latency_seconds", "histogram",
                 "Time per generated token after the first (a step's gap is split over the tokens it produced).")
            out.extend(self.itl.render("quickdraft_inter_token_latency_seconds"))

        single("quickdraft_num_requests_running", "gauge", "Sequences being generated.",
               stats.get("num_requests_running", 0))
        single("quickdraft_num_requests_waiting", "gauge", "Sequences queued (new or preempted).",
               stats.get("num_requests_waiting", 0))
        # the same figures under vLLM's names, which gateways and autoscalers read (llm-d's inference scheduler,
        # the Gateway API Inference Extension, KServe)
        single("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               stats.get("num_requests_running", 0))
        single("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               stats.get("num_requests_waiting", 0))
        blocks = stats.get("kv_blocks_used", 0) + stats.get("kv_blocks_free", 0)
        single("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               stats.get("kv_blocks_used", 0) / blocks if blocks else 0.0)
        single("quickdraft_kv_blocks_used", "gauge", "Target-model KV cache blocks in use.",
               stats.get("kv_blocks_used", 0))
        single("quickdraft_kv_blocks_free", "gauge", "Target-model KV cache blocks free.",
               stats.get("kv_blocks_free", 0))
        if "draft_kv_blocks_used" in stats:
            single("quickdraft_draft_kv_blocks_used", "gauge", "Draft-model KV cache blocks in use.",
                   stats["draft_kv_blocks_used"])
        single("quickdraft_kv_cache_bytes_used", "gauge", "KV cache bytes held by sequences and cached prefixes, all models.",
               stats.get("kv_bytes_used", 0))
        single("quickdraft_kv_cache_bytes_resident", "gauge",
               "KV cache bytes in memory, all models (blocks handed out since memory was last given back).",
               stats.get("kv_bytes_resident", 0))
        single("quickdraft_kv_cache_bytes_cap", "gauge", "KV cache caps, all models (the caches grow up to them).",
               stats.get("kv_bytes_cap", 0))
        for name, kind, text, value in process_metrics():
            single(name, kind, text, value)
        single("quickdraft_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (a hit is used up to a 64-token prefill cell boundary; usage.prompt_tokens_details.cached_tokens counts what each request used).",
               stats.get("prefix_cache_hits", 0))
        single("quickdraft_num_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
               stats.get("num_preemptions", 0))
        single("quickdraft_spec_decode_num_drafts_total", "counter",
               "Speculative rounds in which the drafter proposed at least one token.",
               stats.get("spec_num_drafts", 0))
        single("quickdraft_spec_decode_num_draft_tokens_total", "counter", "Tokens proposed by the drafter.",
               stats.get("spec_num_draft_tokens", 0))
        single("quickdraft_spec_decode_num_accepted_tokens_total", "counter",
               "Proposed tokens accepted by the target model.", stats.get("spec_num_accepted_tokens", 0))
        single("quickdraft_spec_decode_num_rounds_total", "counter",
               "Target forward passes that produced tokens (drafting or not).", stats.get("spec_num_rounds", 0))
        return "\n".join(out) + "\n"


def process_metrics() -> list[tuple[str, str, str, float]]:
    """The process collector's samples, with the names and meanings of prometheus-client's ``ProcessCollector``
    (read from /proc/self; none where there is no /proc)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        fds = len(os.listdir("/proc/self/fd"))
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, StopIteration, ValueError):
        return []
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    return [
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", int(fields[21]) * page),
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", int(fields[20])),
        ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.",
         (int(fields[11]) + int(fields[12])) / ticks),
        ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
         boot + int(fields[19]) / ticks),
        ("process_open_fds", "gauge", "Number of open file descriptors.", fds),
    ]


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of an exposition as ``{'name{labels}': value}`` (tests and benches read it back)."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    return values


def merge_expositions(by_replica: Mapping[str, str], label: str = "replica") -> str:
    """One exposition from several processes' (a Ray Serve application's replicas): every sample gets
    ``label="<its replica>"``; each family's HELP and TYPE lines appear once, its samples from every replica after
    them."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in by_replica.items():
        family = ""
        tag = f'{label}="{_escape(replica)}"'
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                lines = heads.setdefault(family, [])
                if len(lines) < 2 and line not in lines:
                    lines.append(line)
                continue
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            base, brace, rest = name.partition("{")
            labelled = f"{base}{{{tag},{rest}" if brace else f"{base}{{{tag}}}"
            samples.setdefault(family or base, []).append(f"{labelled} {value}")
    out: list[str] = []
    for family in dict.fromkeys([*heads, *samples]):
        out.extend(heads.get(family, []))
        out.extend(samples.get(family, []))
    return "\n".join(out) + "\n"
