import dataclasses
import math

import pytest

from quickdraft.errors import InvalidParameterError, QuickdraftError
from quickdraft.sampling.params import SamplingParams

NAN, INF = float("nan"), float("inf")

INVALID = [
    ("n", 0), ("n", 129), ("n", -1), ("n", 1.0), ("n", True), ("n", "2"), ("n", None),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5), ("max_tokens", 16.0), ("max_tokens", True),
    ("max_tokens", "16"), ("max_tokens", None),
    ("temperature", -0.5), ("temperature", -1e-9), ("temperature", NAN), ("temperature", INF),
    ("temperature", True), ("temperature", "1"), ("temperature", None),
    # a logit divided by these could leave float32's range (1e-30 and 1e38 once made every request of a step fail)
    ("temperature", 1e-30), ("temperature", 1e-7), ("temperature", 100.5), ("temperature", 1e38),
    ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.0001), ("top_p", NAN), ("top_p", False), ("top_p", None),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"), ("top_k", None),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", NAN), ("min_p", INF), ("min_p", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 10 ** 30), ("min_tokens", 1.5), ("min_tokens", True),
    ("min_tokens", "3"), ("min_tokens", None),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", NAN),
    ("repetition_penalty", INF), ("repetition_penalty", True), ("repetition_penalty", 1e-300),
    ("repetition_penalty", 9.9e-4), ("repetition_penalty", 1e38),
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("presence_penalty", NAN),
    ("presence_penalty", -INF), ("presence_penalty", True),
    ("frequency_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", NAN),
    ("frequency_penalty", "0.1"),
    ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101}), ("logit_bias", {1: NAN}), ("logit_bias", {1: INF}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"abc": 1.0}), ("logit_bias", {"-3": 1.0}),
    ("logit_bias", {"1.5": 1.0}), ("logit_bias", {1.0: 1.0}), ("logit_bias", {True: 1.0}),
    ("logit_bias", {1: "x"}), ("logit_bias", [(1, 1.0)]), ("logit_bias", "1:2"), ("logit_bias", {1: 1e30}),
    ("logit_bias", {i: 1.0 for i in range(1025)}),
    ("seed", 1.0), ("seed", "42"), ("seed", True),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [1]), ("stop", ["s"] * 17), ("stop", 5),
    ("stop", {"a"}), ("stop", "x" * 1025), ("stop", ["ok", "\ud800"]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("stop_token_ids", "12"), ("stop_token_ids", list(range(1025))),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("include_stop_str_in_output", 0), ("skip_special_tokens", "true"),
    ("stop_strings_after_token", -1), ("stop_strings_after_token", 1.5), ("stop_strings_after_token", "7"),
    ("priority", 1.5), ("priority", True), ("priority", None),
    ("deadline_s", 0), ("deadline_s", -1.0), ("deadline_s", NAN), ("deadline_s", INF), ("deadline_s", True),
    ("deadline_s", "5"),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert field in msg
    assert "must be" in msg and "got" in msg
    assert isinstance(info.value, (QuickdraftError, ValueError))


def test_message_format_example():
    with pytest.raises(InvalidParameterError,
                       match=r"^temperature must be 0 \(greedy\) or a number in \[1e-06, 100\], got -0.5$"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(InvalidParameterError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


VALID = [
    ("n", 1), ("n", 128), ("max_tokens", 1), ("max_tokens", 10**6),
    ("temperature", 0), ("temperature", 0.0), ("temperature", 1e-6), ("temperature", 5), ("temperature", 100),
    ("top_p", 1e-6), ("top_p", 1), ("top_k", 0), ("top_k", -1), ("top_k", 1), ("top_k", 10**6),
    ("min_p", 0), ("min_p", 1), ("repetition_penalty", 1e-3), ("repetition_penalty", 1e3),
    ("presence_penalty", -2), ("presence_penalty", 2), ("frequency_penalty", -2.0), ("frequency_penalty", 2.0),
    ("logit_bias", {}), ("logit_bias", {0: -100, 5: 100}), ("seed", 0), ("seed", -1), ("seed", 2**70),
    ("stop", "x"), ("stop", ["a"] * 16), ("stop", []), ("stop_token_ids", []), ("stop_token_ids", [0, 7]),
    ("stop", "x" * 1024), ("stop_token_ids", list(range(1024))), ("logit_bias", {i: 1.0 for i in range(1024)}),
    ("logprobs", 0), ("logprobs", 20), ("priority", -3), ("deadline_s", 0.001), ("deadline_s", 30),
    ("ignore_eos", True), ("include_stop_str_in_output", True), ("skip_special_tokens", False),
    ("stop_strings_after_token", 0), ("stop_strings_after_token", None),
]


@pytest.mark.parametrize("field,value", VALID, ids=[f"{f}={v!r}"[:40] for f, v in VALID])
def test_valid_edge_values_pass(field, value):
    SamplingParams(**{field: value})


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.logit_bias is None and p.seed is None and p.logprobs is None and p.deadline_s is None
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert p.priority == 0
    assert not p.greedy and not p.has_penalties and not p.has_truncation


def test_normalisation():
    p = SamplingParams(stop="END", logit_bias={"123": 5, 7: -1}, stop_token_ids=(3, 4), temperature=1)
    assert p.stop == ["END"]
    assert p.logit_bias == {123: 5.0, 7: -1.0}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert p.stop_token_ids == [3, 4]
    assert type(p.temperature) is float
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    # dataclasses.replace re-validates the normalised values
    q = dataclasses.replace(p, top_p=0.5)
    assert q.logit_bias == p.logit_bias and q.stop == ["END"]
    with pytest.raises(InvalidParameterError, match="top_p"):
        dataclasses.replace(p, top_p=0)


def test_greedy_and_flags():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(top_k=5).has_truncation and not SamplingParams(top_k=-1).has_truncation
    assert SamplingParams(min_p=0.1).has_truncation and SamplingParams(top_p=0.9).has_truncation


def test_validate_after_mutation():
    p = SamplingParams()
    p.temperature = -1
    with pytest.raises(InvalidParameterError, match="temperature"):
        p.validate()


def test_check_vocab():
    p = SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[0, 4])
    p.check_vocab(10)
    with pytest.raises(InvalidParameterError, match=r"logit_bias key must be a token id in \[0, 9\), got 9"):
        p.check_vocab(9)
    p = SamplingParams(stop_token_ids=[0, 4])
    with pytest.raises(InvalidParameterError, match="stop_token_ids"):
        p.check_vocab(4)
    SamplingParams().check_vocab(1)


def test_stop_count_message():
    with pytest.raises(InvalidParameterError, match="stop must be a list of at most 16 non-empty strings of at most "
                                                    "1024 characters, got"):
        SamplingParams(stop=["x"] * 17)


def test_numpy_scalars_accepted():
    np = pytest.importorskip("numpy")
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), logit_bias={np.int64(3): np.float64(1)})
    assert p.max_tokens == 5 and type(p.max_tokens) is int
    assert math.isclose(p.temperature, 0.5) and p.logit_bias == {3: 1.0}
