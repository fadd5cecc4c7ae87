"""The scale-out pieces that need no Ray instance: the prefix-aware policy, block hashes as the KV cache computes
them, and merging replicas' metrics."""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from quickdraft.errors import InvalidParameterError  # noqa: E402
from quickdraft.kv.blocks import BlockAllocator, SequenceKV  # noqa: E402
from quickdraft.serving.ray import ReplicaOptions  # noqa: E402
from quickdraft.serving.metrics import merge_expositions, parse_metrics  # noqa: E402
from quickdraft.serving.ray.prefix import answer_text, block_hashes  # noqa: E402
from quickdraft.serving.ray.router import Balancer, PrefixAffinity, Route  # noqa: E402


def chain(n: int, start: int = 0) -> list[bytes]:
    return block_hashes(list(range(start, start + 16 * n + 1)), 16)


def test_block_hashes_are_the_prefix_cache_keys():
    ids = list(range(1000, 1000 + 16 * 3 + 5))
    alloc = BlockAllocator(8)
    kv = SequenceKV()
    kv.reserve(len(ids), alloc, 16)
    kv.num_cached = len(ids)
    kv.publish(ids, alloc, 16)
    assert block_hashes(ids, 16) == kv.hashes[:3]
    assert block_hashes(ids[:16], 16) == []  # match_prefix always leaves one token to compute


def test_a_conversation_prefers_the_replica_holding_its_prefix():
    affinity = PrefixAffinity()
    first = Route(chain(4))
    assert affinity.preferred(first) is None  # nothing cached anywhere yet
    affinity.routed("a", first.hashes)
    second_turn = Route(chain(7))  # the first turn's 4 blocks, then the reply and the next question
    assert second_turn.hashes[:4] == first.hashes and affinity.preferred(second_turn) == "a"
    affinity.routed("b", chain(6))  # the conversation with its answer went on at "b": the deepest owner wins
    assert affinity.preferred(second_turn) == "b"
    assert affinity.preferred(Route(chain(3, start=5000))) is None
    # a prefix under half the prompt (a shared system prompt) does not pull a new conversation
    shared_start = Route(chain(1) + block_hashes(list(range(16)) + list(range(900, 900 + 16 * 3 + 1)), 16)[1:])
    assert shared_start.hashes[0] == chain(1)[0] and affinity.preferred(shared_start) is None


def test_the_balancer_takes_the_preferred_replica_within_the_load_bound():
    balancer = Balancer(max_imbalance=4)
    assert balancer.choose(["a", "b"], {"a": 2, "b": 0}, "a") == "a"
    assert balancer.choose(["a", "b"], {"a": 9, "b": 0}, "a") == "b"  # too busy: the least loaded
    assert balancer.choose(["a", "b"], {}, "gone") in ("a", "b")  # a dead replica is no candidate
    assert [balancer.choose(["a", "b"], {}, None) for _ in range(4)] == ["b", "a", "b", "a"]  # idle: alternate
    assert balancer.choose(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}, None) == "b"


def test_sessions_stick_to_their_replica():
    affinity = PrefixAffinity()
    affinity.routed("c", [], session="user-7")
    assert affinity.preferred(Route(chain(3, 50), session="user-7")) == "c"


def test_round_robin_ignores_preferences():
    balancer = Balancer(policy="round_robin")
    assert [balancer.choose(["a", "b"], {}, "a") for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="policy must be one of"):
        Balancer(policy="random")
    with pytest.raises(InvalidParameterError, match="routing must be one of"):
        ReplicaOptions(policy="random")


def test_the_tables_are_bounded():
    affinity = PrefixAffinity(max_hashes=10, max_sessions=2)
    for i in range(5):
        affinity.routed("a", chain(4, start=100 * i), session=f"s{i}")
    assert len(affinity._owner) == 10 and len(affinity._sessions) == 2


def test_answers_are_read_back_from_whole_and_streamed_responses():
    whole = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}}]}'
    assert answer_text("/v1/chat/completions", whole, events=False) == "Paris."
    stream = (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
              b'data: {"choices": [{"index": 0, "delta": {"content": "Par"}}]}\n\n'
              b'data: {"choices": [{"index": 0, "delta": {"content": "is."}}]}\n\ndata: [DONE]\n\n')
    assert answer_text("/v1/chat/completions", stream, events=True) == "Paris."
    assert answer_text("/v1/completions", b'{"choices": [{"text": " 42"}]}', events=False) == " 42"
    assert answer_text("/v1/chat/completions", b"not json", events=False) is None


def test_merged_metrics_label_every_sample_with_its_replica():
    a = ("# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
         "vllm:num_requests_waiting 3\n# HELP q_total Requests.\n# TYPE q_total counter\n"
         'q_total{status="ok"} 5\n')
    b = a.replace(" 3\n", " 1\n").replace("} 5", "} 7")
    text = merge_expositions({"r1": a, "r2": b})
    m = parse_metrics(text)
    assert m['vllm:num_requests_waiting{replica="r1"}'] == 3 and m['vllm:num_requests_waiting{replica="r2"}'] == 1
    assert m['q_total{replica="r2",status="ok"}'] == 7
    assert text.count("# TYPE vllm:num_requests_waiting gauge") == 1
    lines = text.splitlines()
    assert lines.index("# TYPE q_total counter") < lines.index('q_total{replica="r1",status="ok"} 5')


def test_agent_apis_hash_the_prompt_the_chat_route_renders(smollm2):
    """A conversation sent as Responses items or Anthropic messages is routed by the prompt the replica renders for
    the same conversation on chat completions, so all three APIs share one replica's prefix cache."""
    from quickdraft.engine.build import tokenizer_for
    from quickdraft.loading.load import load_checkpoint
    from quickdraft.serving.ray.prefix import prompt_ids

    tokenizer = tokenizer_for(load_checkpoint(smollm2))
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]}
    responses = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "Name a colour."}]}
    messages = {"model": "m", "max_tokens": 5, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}
    expected = prompt_ids(tokenizer, "/v1/chat/completions", chat)
    assert len(expected) > 20
    assert prompt_ids(tokenizer, "/v1/responses", responses) == expected
    assert prompt_ids(tokenizer, "/v1/messages", messages) == expected
