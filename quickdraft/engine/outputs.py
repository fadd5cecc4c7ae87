"""What the engine hands back to callers: vLLM-shaped request outputs and stream chunks."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Speculative decoding counters for one request (or summed over many)."""

    rounds: int = 0  # target forward passes that produced tokens
    draft_tokens: int = 0  # tokens proposed by the drafter
    accepted_tokens: int = 0  # proposed tokens the target accepted
    drafting_rounds: int = 0  # rounds in which at least one token was proposed
    generated_tokens: int = 0
    run_ahead_rounds: int = 0  # drafting rounds whose proposal began with tokens drafted ahead (run-ahead)
    run_ahead_tokens: int = 0  # proposed tokens that were drafted ahead, during the previous target pass
    forced_tokens: int = 0  # tokens the request's grammar forced, verified beside the drafts (structured outputs)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per drafting round (vLLM's mean acceptance length minus the bonus)."""
        return self.accepted_tokens / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    def add(self, other: "SpecMetrics") -> None:
        # every field by name (twice a sequence a step: a loop over the names through getattr cost several times this)
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.drafting_rounds += other.drafting_rounds
        self.generated_tokens += other.generated_tokens
        self.run_ahead_rounds += other.run_ahead_rounds
        self.run_ahead_tokens += other.run_ahead_tokens
        self.forced_tokens += other.forced_tokens

    def usage(self) -> dict[str, float]:
        """The request's figures as the server's ``usage.speculative`` names them; ``target_passes`` counts the
        target forwards that produced its tokens (a prompt read in several chunks counts once)."""
        return {"drafted_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4), "target_passes": self.rounds,
                "forced_tokens": self.forced_tokens}

    def as_dict(self) -> dict[str, float]:
        return {
            "rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 4),
            "run_ahead_rounds": self.run_ahead_rounds, "run_ahead_tokens": self.run_ahead_tokens,
            "forced_tokens": self.forced_tokens,
        }


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None  # time from arrival to the first generated token
    total_s: float = 0.0
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    cached_tokens: int | None = None  # prompt tokens found in the KV cache when first admitted (prefix, session)

    @property
    def speculative(self) -> dict[str, float]:
        """Drafted and accepted tokens, acceptance rate and target passes of this sample (``SpecMetrics.usage``)."""
        return self.spec.usage()

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token (prefill excluded), as llama.cpp and vLLM report it."""
        decode_s = self.total_s - (self.ttft_s or 0.0)
        return (self.generated_tokens - 1) / decode_s if self.generated_tokens > 1 and decode_s > 0 else 0.0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[dict] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None  # with finish_reason "error": what went wrong


@dataclass
class RequestOutput:
    """All samples of one request. ``.text`` etc. read the first sample, as most callers ask for n=1."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # SamplingParams.prompt_logprobs: per prompt token its logprob and the top ones there (None for the first)
    prompt_logprobs: list[dict | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics


@dataclass
class StreamChunk:
    """New text and tokens of one sample since the previous chunk."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    from_draft: list[bool]  # per token: was it proposed by the drafter and accepted?
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    metrics: RequestMetrics | None = None  # set on the final chunk
    error: str | None = None  # with finish_reason "error" (the request failed alone): what went wrong
    stop_string: str | None = None  # with finish_reason "stop": the stop string that ended it (None: EOS, a stop id)
    # ``text`` cut by the token that wrote each piece: (characters, the token came from an accepted draft)
    spans: list[tuple[int, bool]] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None  # on the first chunk of sample 0 (Sequence.prompt_logprobs_out)
