"""Sessions: KV kept between turns, snapshots that resume exactly (in another process), crash-safe saves,
clear errors for snapshots that cannot be resumed, chat turns that recompute only what changed."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from quickdraft import LLM, SamplingParams, SessionError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True, frequency_penalty=0.4)
CUTS = (1, 4, 9)


@pytest.fixture(scope="module")
def paths(tiny_dir):
    target = tiny_dir(arch="qwen2", vocab_size=64, layers=3)
    return {"target": target, "draft": tiny_dir(arch="llama", vocab_size=64, seed=4)}


def build(paths, kind: str, **kw) -> LLM:
    spec = {"draft": {"draft": str(paths["draft"])}, "ngram": {"speculative": "ngram"}, "plain": {}}[kind]
    return LLM(str(paths["target"]), dtype="float32", kv_cache_memory="16MiB", **spec, **kw)


@pytest.fixture(scope="module")
def llms(paths):
    return {kind: build(paths, kind) for kind in ("draft", "ngram", "plain")}


def used(llm: LLM) -> tuple[int, ...]:
    runners = [llm.target] + ([llm.drafter.runner] if hasattr(llm.drafter, "runner") else [])
    return tuple(r.allocator.num_used for r in runners)


def interrupt(llm: LLM, prompt, params: SamplingParams, cut: int, path: Path) -> list[int]:
    """Stream a turn, stop after at least ``cut`` tokens, save; returns the tokens received."""
    with llm.session() as s:
        got = []
        stream = s.stream(prompt, params)
        for chunk in stream:
            got += chunk.token_ids
            if len(got) >= cut:
                break
        stream.close()
        assert s.interrupted is not None and s.num_cached == s.num_tokens - 1
        s.save(path)
    return got


RESUME_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from quickdraft import LLM, SamplingParams
    jobs = json.loads(sys.argv[1])
    llms = {}
    for job in jobs:
        key = json.dumps(job["llm"], sort_keys=True)
        if key not in llms:
            llms[key] = LLM(**job["llm"])
        s = llms[key].load_session(job["path"])
        out = s.generate(None, SamplingParams(**job["params"]))
        s.close()
        print(json.dumps(out.token_ids))
""")


def run_in_new_process(jobs: list[dict]) -> list[list[int]]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, json.dumps(jobs)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]


def test_interrupted_turns_resume_exactly_in_a_new_process(paths, llms, tmp_path):
    cases, jobs = [], []
    for kind in ("draft", "ngram"):
        llm = llms[kind]
        llm_args = {"model": str(paths["target"]), "dtype": "float32", "kv_cache_memory": "16MiB",
                    **({"draft": str(paths["draft"])} if kind == "draft" else {"speculative": "ngram"})}
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            with llm.session() as s:
                reference = s.generate(PROMPT, params).token_ids
            assert len(reference) == params.max_tokens
            for cut in CUTS:
                path = tmp_path / f"{kind}-{name}-{cut}.qds"
                before = interrupt(llm, PROMPT, params, cut, path)
                assert before == reference[:len(before)]
                cases.append((kind, name, cut, before, reference))
                jobs.append({"llm": llm_args, "path": str(path), "params": dataclasses.asdict(params)})
        assert used(llm) == (0,) * len(used(llm))  # closed sessions gave every block back
    resumed = run_in_new_process(jobs)
    assert len(resumed) == len(cases)
    for (kind, name, cut, before, reference), after in zip(cases, resumed):
        assert before + after == reference, (kind, name, cut)


def test_resume_continues_stop_strings_penalties_and_text(llms, tmp_path):
    """One token per step (no drafter), a stop string spanning the cut: the uninterrupted text is the streamed
    text before the cut plus the resumed text, and the run still stops at the stop string."""
    llm = llms["plain"]
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    full = llm.generate([PROMPT], base)[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    for cut in range(4, 20):  # a stop string made of the end of token cut-1 and the start of token cut
        at = len(" ".join(pieces[:cut]))
        stop = full.text[at - 2:at + 3]
        if full.text.find(stop) == at - 2:
            break
    params = dataclasses.replace(base, stop=[stop])
    with llm.session() as s:
        expected = s.generate(PROMPT, params)
    assert expected.finish_reason == "stop" and len(expected.token_ids) == cut + 1
    with llm.session() as s:
        stream, streamed, tokens = s.stream(PROMPT, params), "", []
        for chunk in stream:
            streamed += chunk.text
            tokens += chunk.token_ids
            if len(tokens) == cut:
                break
        stream.close()
        s.save(tmp_path / "stop.qds")
    with llm.load_session(tmp_path / "stop.qds") as s:
        rest = s.generate(None, params)
        assert rest.finish_reason == "stop"
        assert tokens + rest.token_ids == expected.token_ids
        assert streamed + rest.text == expected.text
        # completed: the next turn is a new one, counting max_tokens afresh
        assert s.interrupted is None and s.turns == 1
        assert s.generate(None, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)).token_ids


def test_resume_recomputes_only_the_pending_token(paths, tmp_path):
    llm = build(paths, "draft", num_speculative_tokens=2)  # a fixed k, so the draft surely runs
    with llm.session() as s:
        first = s.generate(PROMPT, GREEDY)
        s.save(tmp_path / "done.qds")
        history = list(s.history)
    assert history == PROMPT + first.token_ids
    calls = {"target": [], "draft": []}
    for runner, name in ((llm.target, "target"), (llm.drafter.runner, "draft")):
        original = runner.forward
        runner.forward = lambda items, _f=original, _n=name: calls[_n].append([len(i.tokens) for i in items]) or _f(items)
    try:
        with llm.load_session(tmp_path / "done.qds") as s:
            draft_cached = s.kv["draft:draft"].num_cached  # the draft lags when a round accepted everything
            assert s.num_cached == len(history) - 1 and 0 < draft_cached <= len(history) - 1
            out = s.generate(None, SamplingParams(max_tokens=1, temperature=0.0))
            assert calls == {"target": [[1]], "draft": []}
        with llm.load_session(tmp_path / "done.qds") as s:
            calls["target"].clear()
            s.generate(None, SamplingParams(max_tokens=2, temperature=0.0))
            # the draft feeds only what its cache has not seen; the target the pending token (+ one draft)
            assert calls["draft"][0] == [len(history) - draft_cached] and calls["target"][0] == [2]
    finally:
        del llm.target.forward, llm.drafter.runner.forward
    assert out.token_ids == llm.generate([history], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids


def test_save_killed_at_random_points_leaves_a_whole_snapshot(llms, tmp_path):
    llm = llms["plain"]
    a, b = llm.session(), llm.session()
    a.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    b.generate(PROMPT[:5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    path = tmp_path / "s.qds"
    a.save(path)
    states = {tuple(a.history): a, tuple(b.history): b}
    rng, seen, kills = random.Random(0), set(), 0
    while kills < 24 or (len(seen) < 2 and kills < 80):
        kills += 1
        pid = os.fork()
        if pid == 0:  # the writer: save the two states alternately until killed
            try:
                torch.set_num_threads(1)  # libgomp's thread pool does not survive fork(): stay serial
                while True:
                    b.save(path)
                    a.save(path)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.1))  # one save takes ~10-30 ms here (two fsyncs)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with llm.load_session(path) as s:
            original = states[tuple(s.history)]
            seen.add(tuple(s.history))
            assert s.num_cached == original.num_cached
            k, v = llm.target.gather(s.kv["target"])
            k0, v0 = llm.target.gather(original.kv["target"])
            assert torch.equal(k, k0) and torch.equal(v, v0)
    assert len(seen) == 2  # the kills landed in both halves of the loop
    leftovers = list(tmp_path.glob("s.qds.*.tmp"))  # killed mid-write; never read as the snapshot
    assert leftovers  # some kills did land in the middle of a save
    for f in leftovers:
        try:
            llm.load_session(f).close()  # a whole one is a valid snapshot, a partial one a clear error
        except SessionError:
            pass
    a.close()
    b.close()
    assert used(llm) == (0,)


def test_bad_snapshots_raise_clear_errors_and_change_nothing(paths, llms, tmp_path, tiny_dir, monkeypatch):
    llm = llms["draft"]
    good = tmp_path / "good.qds"
    interrupt(llm, PROMPT, SAMPLED, 5, good)
    data = good.read_bytes()
    keep = llm.session()
    keep.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0))  # some blocks in use

    def broken(name: str, content: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(content)
        return p

    header_end = 8 + int.from_bytes(data[:8], "little")
    cases = [
        (tmp_path / "missing.qds", "no session snapshot at"),
        (broken("empty.qds", b""), "not a quickdraft session snapshot"),
        (broken("garbage.qds", random.Random(1).randbytes(4096)), "not a quickdraft session snapshot"),
        (broken("text.qds", b"hello world\n" * 50), "not a quickdraft session snapshot"),
        (broken("cut-header.qds", data[:header_end - 10]), "truncated"),
        (broken("cut-data.qds", data[:len(data) - 7]), "truncated"),
        (broken("extra.qds", data + b"\0"), "corrupt"),
    ]
    for pos in (header_end + 3, (header_end + len(data)) // 2, len(data) - 1, header_end - 40, 12):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        cases.append((broken(f"flip{pos}.qds", bytes(flipped)), "corrupt|not a quickdraft"))
    monkeypatch.setattr("quickdraft.session.FORMAT_VERSION", 99)
    interrupt(llm, PROMPT, SAMPLED, 2, tmp_path / "v99.qds")
    monkeypatch.undo()
    cases.append((tmp_path / "v99.qds", "format version 99; this quickdraft reads version 1"))
    before = used(llm)
    for path, message in cases:
        with pytest.raises(SessionError, match=message):
            llm.load_session(path)
        assert used(llm) == before, path
    # other models or options: each refused with what differs, before any block is taken
    other_target = tiny_dir(arch="qwen2", vocab_size=64, layers=3, seed=9)
    other_draft = tiny_dir(arch="llama", vocab_size=64, seed=5)
    mismatches = [
        (LLM(str(other_target), dtype="float32", draft=str(paths["draft"]), kv_cache_memory="16MiB"),
         "target model fingerprint"),
        (LLM(str(paths["target"]), dtype="float32", draft=str(other_draft), kv_cache_memory="16MiB"),
         "draft model fingerprint"),
        (llms["ngram"], "speculation=draft; this LLM has speculation=ngram"),
        (llms["plain"], "speculation=draft; this LLM has speculation=off"),
        (LLM(str(paths["target"]), dtype="bfloat16", draft=str(paths["draft"]), kv_cache_memory="16MiB"),
         "weight format float32; this LLM has bfloat16"),
    ]
    for other, message in mismatches:
        was = used(other)
        with pytest.raises(SessionError, match=message) as err:
            other.load_session(good)
        assert "same model files" in str(err.value)
        assert used(other) == was
    # a copied model directory is the same model: its snapshot resumes
    copy = tmp_path / "copy"
    shutil.copytree(paths["target"], copy)
    time.sleep(0.01)
    os.utime(copy / "model.safetensors")
    twin = LLM(str(copy), dtype="float32", draft=str(paths["draft"]), kv_cache_memory="16MiB")
    with twin.load_session(good) as s:
        assert s.interrupted is not None
    # the LLM is still usable and the session it holds is intact
    assert llm.generate([PROMPT], GREEDY)[0].token_ids
    assert keep.generate([3, 4], SamplingParams(max_tokens=3, temperature=0.0)).token_ids
    keep.close()
    assert used(llm) == (0, 0)


def test_chat_turns_match_llm_chat_and_recompute_only_new_tokens(smollm2, tmp_path):
    llm = LLM(str(smollm2), dtype="float32", kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    user1 = {"role": "user", "content": "What is the capital of France?"}
    user2 = {"role": "user", "content": "And of Italy?"}
    forwards = []
    original = llm.target.forward
    llm.target.forward = lambda items: forwards.append(sum(len(i.tokens) for i in items)) or original(items)
    try:
        with llm.session() as s:
            r1 = s.chat(user1, params)
            history1 = list(s.history)
            forwards.clear()
            r2 = s.chat(user2, params)
            conversation = [user1, {"role": "assistant", "content": r1.text}, user2]
            prompt2 = llm.chat_prompt(conversation)
            common = next((i for i, (x, y) in enumerate(zip(history1, prompt2)) if x != y), len(history1))
            assert forwards[0] == len(prompt2) - min(common, len(history1) - 1) < len(prompt2) // 2
            assert s.messages == conversation + [{"role": "assistant", "content": r2.text}]
            s.save(tmp_path / "chat.qds")
            history2 = list(s.history)
    finally:
        del llm.target.forward
    assert r1.text == llm.chat([user1], params)[0].text
    assert r2.text == llm.chat(conversation, params)[0].text
    with llm.load_session(tmp_path / "chat.qds") as s:
        assert s.messages[-1]["content"] == r2.text and s.history == history2 and s.turns == 2


def test_truncating_into_cached_blocks_keeps_the_prefix_cache_correct(paths):
    """A chat turn whose rendering shares only 3 tokens with the history rewrites the KV from there on, inside a
    block that was published to the prefix cache: that block must leave the cache, or a later request with the
    old prefix would be served the new keys/values."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = build(paths, "plain", block_size=4)
    with llm.session() as s:
        s.generate([1, 5, 6, 9, 9, 9, 10, 11, 12, 13, 14, 15], params)
        old = list(s.history)
        s.chat({"role": "user", "content": "t5 t6 t7"}, params)  # the word-level ChatML is [1, 5, 6, 1, 1]
        assert s.history[:5] == [1, 5, 6, 1, 1] and s.num_cached == len(s.history) - 1
        probe = dataclasses.replace(params, logprobs=0)  # logprobs show any change in the keys/values used
        reused = llm.generate([old], probe)[0].outputs[0].logprobs
    assert reused == build(paths, "plain", block_size=4).generate([old], probe)[0].outputs[0].logprobs


def test_cli_chat_saves_and_restores(paths, tmp_path, monkeypatch, capsys):
    import io

    from quickdraft.cli import main
    session = tmp_path / "cli.qds"
    args = ["chat", str(paths["target"]), "--dtype", "float32", "--session", str(session), "--max-tokens", "4",
            "--kv-cache-memory", "16MiB"]
    monkeypatch.setattr("sys.stdin", io.StringIO("t5 t6 t7\nt8 t9\n"))
    assert main(args) == 0
    first = capsys.readouterr()
    assert session.exists() and "2 turns" in first.err
    monkeypatch.setattr("sys.stdin", io.StringIO("t10\n"))
    assert main(args) == 0
    second = capsys.readouterr()
    assert "restored 2 turns" in second.err
