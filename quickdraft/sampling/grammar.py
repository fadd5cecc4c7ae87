"""Grammar constraints as token masks: compiled once per (tokenizer, constraint), one matcher state per sequence.

llguidance does the work (chosen over xgrammar by measurement, see docs/MEASUREMENTS.md "Structured outputs": it
compiles a schema several times faster, which every new schema pays on the request path, bounds every compile and
mask step by fuel, and installs without pulling triton and transformers). A ``GrammarState`` follows one sequence: its matcher holds the committed
tokens plus a few speculative ones (``_ahead``), and ``allowed`` moves that cursor to whatever prefix a row is
conditioned on, so the draft's q rows, the target's p rows and plain sampling all see the same masks. Rolling back
a rejected draft is moving the cursor back.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from quickdraft.errors import InvalidParameterError
from quickdraft.sampling.structured import StructuredOutputs
from quickdraft.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 64
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)  # bit i of an int32 word


class _TokenizerAdapter:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the specials, and an encoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else \
            (tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0)
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [b if b is not None else b"" for b in tokenizer.token_bytes()]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")  # forced bytes may end mid-character: checked after
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; the llguidance tokenizer is built on first use (it reads the whole
    vocabulary) and compiled matchers are kept by constraint, so a schema compiles once per process."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles off the engine thread

    def _ll(self):
        import llguidance

        if self._ll_tokenizer is None:
            spelled = sum(b is not None for b in self.tokenizer.token_bytes())
            if spelled < self.tokenizer.vocab_size // 2:
                raise InvalidParameterError(
                    f"structured_outputs needs the bytes each token writes, and this model's tokenizer says them for "
                    f"only {spelled} of {self.tokenizer.vocab_size} tokens (its decoder is neither byte-level BPE "
                    f"nor SentencePiece)")
            wrapper = llguidance.TokenizerWrapper(_TokenizerAdapter(self.tokenizer))
            self._ll_tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.tokenizer.vocab_size,
                                                        eos_token=list(self.tokenizer.eos_token_ids) or None)
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> "GrammarState":
        """A fresh state at the grammar's start; raises InvalidParameterError naming what the compiler rejected."""
        import llguidance

        key = spec.cache_key()
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is None:
                try:
                    grammar = spec.grammar_text()
                except (ValueError, TypeError, RuntimeError) as exc:  # e.g. a number JSON cannot hold
                    raise InvalidParameterError(f"{spec.source} was rejected by the grammar compiler: "
                                                f"{_first_lines(str(exc))}") from None
                matcher = llguidance.LLMatcher(self._ll(), grammar, log_level=0)
                self._check_start(matcher, spec)
                self._compiled[key] = matcher
                if len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return GrammarState(matcher.deep_copy(), self.tokenizer.vocab_size, frozenset(self.tokenizer.eos_token_ids))

    def _check_start(self, matcher, spec: StructuredOutputs) -> None:
        """Refuse what the compiler rejected, and a constraint nothing can start: unsatisfiable (a schema that
        refers only to itself, an empty character class) or past the compiler's limits at its first step."""
        vocab = self.tokenizer.vocab_size
        try:
            GrammarState(matcher.deep_copy(), vocab).allowed((), 0, 1, vocab)
        except GrammarViolation as exc:
            raise InvalidParameterError(f"{spec.source} was rejected by the grammar compiler: {exc}") from None


_COMPILERS: "weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler]" = weakref.WeakKeyDictionary()


def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """The one compiler of a tokenizer (its llguidance tokenizer reads the whole vocabulary: built once)."""
    compiler = _COMPILERS.get(tokenizer)
    if compiler is None:
        compiler = _COMPILERS.setdefault(tokenizer, GrammarCompiler(tokenizer))
    return compiler


def _first_lines(message: str, lines: int = 4) -> str:
    return "\n".join(message.strip().splitlines()[:lines])[:1000]


class GrammarViolation(RuntimeError):
    """A committed token the grammar does not allow (the sampler never picks one: this is a bug, not bad input)."""


class GrammarState:
    """One sequence's position in its grammar. The matcher has consumed the committed tokens and then ``_ahead``
    (speculative tokens: a draft being built or verified); every query first moves it to the prefix it is about."""

    def __init__(self, matcher, vocab_size: int, stop_ids: frozenset[int] = frozenset()) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._stop_ids = stop_ids  # end-of-turn tokens, which a grammar may also name as text (harmony's <|call|>)
        self._stop_outside = False  # the last of _ahead is such a token, taken without entering the matcher
        self._ended = False  # such a token was committed: the output is over (even one that ignores its end)
        self._ahead: list[int] = []
        self._words = (vocab_size + 31) // 32

    def fork(self) -> "GrammarState":
        other = GrammarState(self._matcher.deep_copy(), self.vocab_size, self._stop_ids)
        other._ahead, other._stop_outside, other._ended = list(self._ahead), self._stop_outside, self._ended
        return other

    def _seek(self, prefix: Sequence[int]) -> int:
        """Move to committed + ``prefix``; returns how many of ``prefix`` the grammar allows (the cursor stops at
        the first illegal token, never entering the matcher's error state)."""
        ahead = self._ahead
        same = 0
        while same < len(ahead) and same < len(prefix) and ahead[same] == prefix[same]:
            same += 1
        if same < len(ahead):
            dropped = len(ahead) - same - self._stop_outside  # that one never entered the matcher
            self._stop_outside = False
            if dropped:
                self._matcher.rollback(dropped)
            del ahead[same:]
        if same < len(prefix) and not self._stop_outside:
            rest = [int(t) for t in prefix[same:]]
            taken = self._matcher.try_consume_tokens(rest)
            ahead.extend(rest[:taken])
            if taken < len(rest) and rest[taken] in self._stop_ids and self._names(rest[taken]):
                ahead.append(rest[taken])  # the output ends here, on a token the grammar writes itself
                self._stop_outside = True
        return len(ahead)

    def _names(self, token: int) -> bool:
        """Whether the grammar writes this stop token as text here (harmony's <|call|>): its mask allows it, but
        ``try_consume_tokens`` takes a stop token only where the grammar may end. The output ends on it, so it is
        checked on a copy and never enters the matcher."""
        probe = self._matcher.deep_copy()
        return bool(probe.consume_token(token)) and not probe.is_error()

    def allowed(self, drafted: Sequence[int], offset: int, rows: int, width: int) -> Tensor:
        """[rows, width] bool: row i's allowed ids after committed + drafted[:offset + i] (none after an illegal
        draft)."""
        words = torch.zeros(rows, self._words, dtype=torch.int32)
        for i in range(rows):
            want = offset + i
            if self._seek(drafted[:want]) == want:  # after an illegal draft the row stays empty (p = 0 there)
                row = words[i]
                if not self._matcher.is_error():
                    self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                if self._matcher.is_error():  # rejected by the compiler, or past its limits mid-way
                    raise GrammarViolation(f"the request's grammar failed here: "
                                           f"{_first_lines(self._matcher.get_error())}")
                if not bool(row.any()):  # a dead end: sampling from nothing would pick garbage
                    raise GrammarViolation("no output can satisfy it here: the grammar allows no token of this "
                                           "tokenizer (nothing it can write continues the text, and the end is not "
                                           "allowed yet)")
        bits = (words.unsqueeze(-1) & _BITS) != 0  # [rows, words, 32]
        mask = bits.reshape(rows, -1)[:, :width]
        if mask.shape[1] < width:
            mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=False)
        return mask

    def legal_prefix(self, drafted: Sequence[int]) -> int:
        """How many leading drafted tokens the grammar allows (n-gram and suffix drafts are not masked)."""
        return self._seek(drafted)

    def forced(self, drafted: Sequence[int], limit: int) -> list[int]:
        """The tokens the grammar forces after committed + ``drafted`` (llguidance's fast-forward tokens: the
        forced bytes in their canonical tokenization), at most ``limit``."""
        if limit <= 0 or self._seek(drafted) != len(drafted) or self._matcher.is_stopped():
            return []
        tokens = [t for t in self._matcher.compute_ff_tokens()[:limit] if 0 <= t < self.vocab_size]
        taken = self._seek(list(drafted) + tokens) - len(drafted)
        return tokens[:taken]

    def accept(self, tokens: Sequence[int]) -> None:
        """Commit tokens: the cursor's speculative tokens become history where they agree."""
        tokens = [int(t) for t in tokens]
        if self._seek(tokens) != len(tokens):
            raise GrammarViolation(f"token {tokens[len(self._ahead)]} is not allowed by the request's grammar "
                                   f"here: {_first_lines(self._matcher.get_error() or 'no error recorded', 2)}")
        self._ended = self._ended or self._stop_outside  # a stop token ends the output, where a grammar names it too
        self._ahead, self._stop_outside = [], False

    @property
    def finished(self) -> bool:
        """The committed text is complete and nothing but the end of the sequence may follow."""
        self._seek([])
        return self._ended or self._matcher.is_stopped()

    def reset(self) -> None:
        self._seek([])
        self._matcher.reset()
        self._ended = False
