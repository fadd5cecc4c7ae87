"""Per-request sampling parameters (vLLM / OpenAI field names), validated up front.

Every field is checked in ``__post_init__`` before any model work happens; a bad
value raises :class:`quickdraft.errors.InvalidParameterError` whose message names
the parameter, the allowed range and the value that was given.
"""
from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quickdraft.errors import InvalidParameterError, require_unicode
from quickdraft.models.lora import check_choice
from quickdraft.sampling.structured import StructuredOutputs

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # every step searches the recent text for each stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties
# Temperature and repetition penalty divide (or multiply) logits: outside these ranges a logit could leave float32's
# range, and nothing is ever clamped silently, so the request is refused instead.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 1e3
MAX_DRAFT_TOKENS = 32  # the engine's own most (num_speculative_tokens)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # as many as the largest vocabularies hold (Gemma 3: 262,144)
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 40  # llama.cpp's own limit: each breaker's overlaps with every token are looked up once
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's defaults
# a float32 probability has at most about 150 bits of surprise; beyond 100, mirostat keeps every token anyway
MAX_MIROSTAT_TAU, MAX_MIROSTAT_ETA = 100.0, 10.0
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 64, 200  # each word is two token sequences matched against the output each row


def _fail(name: str, allowed: str, value: Any, *, raw: bool = False) -> InvalidParameterError:
    got = value if raw else reprlib.repr(value)  # bounded: a client's value may be megabytes
    return InvalidParameterError(f"{name} must be {allowed}, got {got}")


def _as_int(name: str, value: Any, allowed: str) -> int:
    """An int (numpy ints too); bools, floats and strings are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, allowed, value)
    return int(value)


def _as_float(name: str, value: Any, allowed: str) -> float:
    """A finite real number (ints accepted); bools, strings, NaN and inf are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, allowed, value)
    try:
        out = float(value)
    except OverflowError:  # an int of hundreds of digits
        raise _fail(name, allowed, value) from None
    if not math.isfinite(out):
        raise _fail(name, allowed, value)
    return out


def _check_strings(name: str, items: Any, most: int, chars: int, strip: bool = False) -> list[str]:
    """A list of at most ``most`` non-empty (``strip``: not blank) strings of at most ``chars`` characters."""
    allowed = f"a list of at most {most} non-empty strings of at most {chars} characters"
    if isinstance(items, str) or not isinstance(items, (list, tuple)) or len(items) > most:
        raise _fail(name, allowed, items)
    for item in items:
        if not isinstance(item, str) or not (item.strip() if strip else item) or len(item) > chars:
            raise _fail(name, allowed, item)
        require_unicode(name, item)
    return list(items)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "a bool (true or false)", value)
    return value


@dataclass
class SamplingParams:
    """How to sample one request. Defaults match vLLM.

    ``top_k`` of 0 or -1 disables top-k. ``temperature`` 0 means greedy.
    After construction ``stop`` and ``stop_token_ids`` are always lists (possibly
    empty) and ``logit_bias`` (if given) has int keys and float values.
    The dataclass is mutable; call :meth:`validate` again after changing a field.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: the logprob of each prompt token after the first, and the top ones at its position (raw logits)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # stop strings are looked for only in the text after this token, up to the next special token: the bodies of
    # harmony's messages (after <|message|>), never its markup (the server sets it for gpt-oss). None: everywhere
    stop_strings_after_token: int | None = None
    priority: int = 0
    deadline_s: float | None = None
    # per request: False decodes it without drafts; {"max_draft_tokens": n} caps each round's draft (0..32); True
    # (default) lets the engine's controller choose. The output is the same either way: only the speed changes.
    speculative: bool | dict[str, int] = True
    # what the output must match (a JSON schema, any JSON object, a regex, a choice, a grammar), as vLLM's field:
    # a dict such as {"json": schema} or a StructuredOutputs; the engine compiles it once per distinct constraint
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None
    # as vLLM's: no end of sequence (EOS unless ignore_eos, stop_token_ids) can be sampled, nor a stop string end the
    # output, before this many tokens
    min_tokens: int = 0
    # as vLLM's: only these ids may be sampled (None: any); words the output never spells (bad_words.py)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # llama.cpp's samplers (its names and defaults; each off by default). Locally typical sampling keeps the tokens
    # whose surprise is nearest the entropy, up to typical_p of the mass; top_n_sigma keeps the logits within n
    # standard deviations of the largest (<= 0: off).
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    # XTC: with probability xtc_probability a step removes every token of probability >= xtc_threshold but the
    # least likely of them (where at least two are); the target distribution is that mixture, so speculation stays exact
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    # DRY: a token that would extend a repeat of dry_allowed_length or more tokens of the context (prompt and
    # output, the last dry_penalty_last_n: -1 all, 0 off) loses dry_multiplier * dry_base^(length - allowed) of its
    # logit; a repeat never reaches back across a sequence breaker
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    # Mirostat (llama.cpp's, sampling/mirostat.py): version 1 or 2 steers each token's surprise (-log2 p) towards
    # mirostat_tau, moving its bound by mirostat_eta a step, in place of top-k, top-p, min-p, typical_p, top_n_sigma
    # and XTC (ignored while it runs, as llama.cpp ignores them); 0: off
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # the temperature after the samplers that cut the vocabulary (they read it untempered), as llama-server's chain
    temperature_last: bool = False
    # None: vLLM's penalties; else llama.cpp's, over the last this many tokens of prompt and output (-1 all, 0 off)
    repeat_last_n: int | None = None
    # the LoRA adapter it runs, by its name in EngineOptions.lora_adapters, or {name: scale} of several; None: none
    lora: str | dict[str, float] | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check and normalise every field; raises InvalidParameterError."""
        n = _as_int("n", self.n, f"an int in [1, {MAX_N}]")
        if not 1 <= n <= MAX_N:
            raise _fail("n", f"an int in [1, {MAX_N}]", self.n)
        self.n = n

        mt = _as_int("max_tokens", self.max_tokens, "an int >= 1")
        if mt < 1:
            raise _fail("max_tokens", "an int >= 1", self.max_tokens)
        self.max_tokens = mt

        allowed = f"an int in [0, max_tokens] (max_tokens is {mt})"
        mn = _as_int("min_tokens", self.min_tokens, allowed)
        if not 0 <= mn <= mt:
            raise _fail("min_tokens", allowed, self.min_tokens)
        self.min_tokens = mn

        allowed = f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
        t = _as_float("temperature", self.temperature, allowed)
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise _fail("temperature", allowed, self.temperature)
        self.temperature = t

        tp = _as_float("top_p", self.top_p, "a number in (0, 1]")
        if not 0 < tp <= 1:
            raise _fail("top_p", "in (0, 1]", self.top_p)
        self.top_p = tp

        tk = _as_int("top_k", self.top_k, "an int >= 1, or 0 or -1 to disable")
        if tk < -1:
            raise _fail("top_k", ">= 1, or 0 or -1 to disable", self.top_k)
        self.top_k = tk

        mp = _as_float("min_p", self.min_p, "a number in [0, 1]")
        if not 0 <= mp <= 1:
            raise _fail("min_p", "in [0, 1]", self.min_p)
        self.min_p = mp

        allowed = f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 disables)"
        rp = _as_float("repetition_penalty", self.repetition_penalty, allowed)
        if not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise _fail("repetition_penalty", allowed, self.repetition_penalty)
        self.repetition_penalty = rp

        for name in ("presence_penalty", "frequency_penalty"):
            allowed = f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]"
            v = _as_float(name, getattr(self, name), "a number " + allowed)
            if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise _fail(name, allowed, getattr(self, name))
            setattr(self, name, v)

        self.logit_bias = self._check_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._check_token_ids("allowed_token_ids", self.allowed_token_ids,
                                                       MAX_ALLOWED_TOKEN_IDS, empty=False)
        self._check_llama_samplers()

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed, "an int or None")

        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _as_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        if self.stop_strings_after_token is not None:
            after = _as_int("stop_strings_after_token", self.stop_strings_after_token, "a token id or None")
            if after < 0:
                raise _fail("stop_strings_after_token", "a token id (>= 0) or None", self.stop_strings_after_token)
            self.stop_strings_after_token = after

        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                allowed = f"an int in [0, {MAX_LOGPROBS}] or None"
                lp = _as_int(name, getattr(self, name), allowed)
                if not 0 <= lp <= MAX_LOGPROBS:
                    raise _fail(name, allowed, getattr(self, name))
                setattr(self, name, lp)

        self.priority = _as_int("priority", self.priority, "an int")
        self.lora = check_choice(self.lora)

        self.speculative = self._check_speculative(self.speculative)

        self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        if self.structured_outputs is not None and self.allowed_token_ids is not None:
            raise InvalidParameterError("allowed_token_ids cannot be combined with structured outputs (a constraint, "
                                        "response_format or a forced tool call): the grammar may need a token outside "
                                        "them")

        if self.deadline_s is not None:
            d = _as_float("deadline_s", self.deadline_s, "a finite number of seconds > 0 or None")
            if d <= 0:
                raise _fail("deadline_s", "> 0 seconds or None", self.deadline_s)
            self.deadline_s = d

    @staticmethod
    def _check_speculative(value: Any) -> bool | dict[str, int]:
        allowed = f'true, false or {{"max_draft_tokens": an int in [0, {MAX_DRAFT_TOKENS}]}}'
        if isinstance(value, bool):
            return value
        if not isinstance(value, Mapping) or set(value) != {"max_draft_tokens"}:
            raise _fail("speculative", allowed, value)
        cap = value["max_draft_tokens"]
        if isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or not 0 <= cap <= MAX_DRAFT_TOKENS:
            raise _fail("speculative.max_draft_tokens", f"an int in [0, {MAX_DRAFT_TOKENS}]", cap)
        return {"max_draft_tokens": int(cap)}

    @staticmethod
    def _check_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise _fail("logit_bias", "a dict mapping token ids to biases in [-100, 100]", bias)
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise _fail("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries", f"{len(bias)} entries", raw=True)
        out: dict[int, float] = {}
        for key, value in bias.items():
            if isinstance(key, str):
                text = key.strip()
                if not text.isdigit() or not text.isascii():
                    raise _fail("logit_bias key", "a token id (an int >= 0, or a string of digits)", key)
                tok = int(text)
            else:
                tok = _as_int("logit_bias key", key, "a token id (an int >= 0, or a string of digits)")
            if tok < 0:
                raise _fail("logit_bias key", "a token id >= 0", key)
            allowed = f"in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
            v = _as_float(f"logit_bias value for token {tok}", value, "a number " + allowed)
            if not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise _fail(f"logit_bias value for token {tok}", allowed, value)
            out[tok] = v
        return out

    @staticmethod
    def _check_stop(stop: Any) -> list[str]:
        items = [] if stop is None else [stop] if isinstance(stop, str) else stop
        return _check_strings("stop", items, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)

    @staticmethod
    def _check_stop_token_ids(ids: Any) -> list[int]:
        return SamplingParams._check_token_ids("stop_token_ids", ids, MAX_STOP_TOKEN_IDS) or []

    @staticmethod
    def _check_token_ids(name: str, ids: Any, most: int, empty: bool = True) -> list[int] | None:
        if ids is None:
            return None
        allowed = f"a list of {'' if empty else 'at least one and '}at most {most} token ids (ints >= 0)"
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise _fail(name, allowed, ids)
        if len(ids) > most or not (empty or ids):
            raise _fail(name, allowed, f"{len(ids)} ids", raw=True)
        if all(type(t) is int for t in ids) and (not ids or min(ids) >= 0):  # the common case, without a loop here
            return list(ids)
        out = []
        for t in ids:
            v = _as_int(f"{name} entry", t, "a token id (an int >= 0)")
            if v < 0:
                raise _fail(f"{name} entry", "a token id >= 0", t)
            out.append(v)
        return out

    def _check_llama_samplers(self) -> None:
        def check(name: str, allowed: str, ok, integral: bool = False) -> None:
            given = getattr(self, name)
            v = _as_int(name, given, "an int " + allowed) if integral else _as_float(name, given, "a number " + allowed)
            if not ok(v):
                raise _fail(name, allowed, given)
            setattr(self, name, v)

        check("typical_p", "in (0, 1] (1 disables)", lambda v: 0 < v <= 1)
        check("top_n_sigma", "> 0 (standard deviations), or <= 0 to disable", lambda v: True)
        check("xtc_probability", "in [0, 1] (0 disables)", lambda v: 0 <= v <= 1)
        check("xtc_threshold", "in [0, 1] (above 0.5 nothing is ever removed)", lambda v: 0 <= v <= 1)
        check("dry_multiplier", ">= 0 (0 disables)", lambda v: v >= 0)
        check("dry_base", ">= 1", lambda v: v >= 1)
        check("dry_allowed_length", ">= 1", lambda v: v >= 1, integral=True)
        check("dry_penalty_last_n", ">= -1 (-1: the whole context, 0 disables)", lambda v: v >= -1, integral=True)
        check("mirostat", "0 (off), 1 or 2 (the version)", lambda v: v in (0, 1, 2), integral=True)
        check("mirostat_tau", f"in [0, {MAX_MIROSTAT_TAU:g}] (bits of surprise)", lambda v: 0 <= v <= MAX_MIROSTAT_TAU)
        check("mirostat_eta", f"in [0, {MAX_MIROSTAT_ETA:g}]", lambda v: 0 <= v <= MAX_MIROSTAT_ETA)
        self.temperature_last = _as_bool("temperature_last", self.temperature_last)
        if self.repeat_last_n is not None:
            check("repeat_last_n", ">= -1 (-1: the whole context, 0 disables), or None", lambda v: v >= -1,
                  integral=True)
        breakers = DRY_SEQUENCE_BREAKERS if self.dry_sequence_breakers is None else self.dry_sequence_breakers
        self.dry_sequence_breakers = _check_strings("dry_sequence_breakers", breakers, MAX_DRY_BREAKERS,
                                                    MAX_DRY_BREAKER_CHARS)
        if self.bad_words is not None:  # (a word of spaces alone spells nothing)
            self.bad_words = _check_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS, strip=True)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a logit_bias key, stop_token_id or allowed_token_id is outside [0, vocab_size)."""
        for tok in self.logit_bias or {}:
            if not 0 <= tok < vocab_size:
                raise _fail("logit_bias key", f"a token id in [0, {vocab_size})", tok)
        for name in ("stop_token_ids", "allowed_token_ids"):
            for tok in getattr(self, name) or []:
                if not 0 <= tok < vocab_size:
                    raise _fail(f"{name} entry", f"a token id in [0, {vocab_size})", tok)

    # -------------------------------------------------------------- properties
    @property
    def greedy(self) -> bool:
        """Temperature 0: take the argmax (after bias and penalties)."""
        return self.temperature == 0.0

    @property
    def max_draft_tokens(self) -> int | None:
        """The most tokens a round may draft for this request (0: none), None: as the engine chooses."""
        if isinstance(self.speculative, dict):
            return self.speculative["max_draft_tokens"]
        return None if self.speculative else 0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def has_truncation(self) -> bool:
        """A sampler after the temperature would change the distribution: top-k, top-p, min-p, typical_p,
        top_n_sigma or XTC (none runs under mirostat)."""
        return not self.mirostat and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or self.typical_p < 1.0
                or self.top_n_sigma > 0 or (self.xtc_probability > 0 and self.xtc_threshold <= 0.5))

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0
