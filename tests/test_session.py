"""Sessions: KV kept between turns, snapshots that resume exactly (in another process), crash-safe saves,
clear errors for snapshots that cannot be resumed, chat turns that recompute only what changed."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as safetensors_load, save as safetensors_save

from quickdraft import LLM, SamplingParams, SessionError
from quickdraft import session as session_module
from quickdraft import snapshot as snapshot_module

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True, frequency_penalty=0.4)
# mirostat's state is not in the tokens: a resumed turn needs it from the snapshot
MIROSTAT = SamplingParams(max_tokens=24, temperature=1.0, seed=12, ignore_eos=True, mirostat=2, mirostat_tau=2.5,
                          mirostat_eta=0.5)
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
    runners = [llm.target] + ([llm.drafter.runner] if llm.drafter is not None and llm.drafter.runner else [])
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
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED), ("mirostat", MIROSTAT)):
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
            restored, saved = llm.target.gather(s.kv["target"]), llm.target.gather(original.kv["target"])
            assert all(torch.equal(restored[name], saved[name]) for name in ("k", "v"))
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
    user2 = {"role": "user", "content": "And the capital of Italy?"}
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


# ---- hostile snapshots: malformed records under a correct checksum, the size cap, the file mode -------------------
def read_snapshot(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(json.loads(data[8:8 + n])["__metadata__"]["session"]), safetensors_load(data)


def write_snapshot(path: Path, record: dict | str, tensors: dict[str, torch.Tensor]) -> Path:
    """A snapshot holding this record (or raw JSON text) and these tensors, under the checksum they should have: what
    a hostile writer makes, so only checking the values can refuse it."""
    text = record if isinstance(record, str) else json.dumps(record)
    meta = {"format": session_module.FORMAT, "session": text, "checksum": snapshot_module.checksum(text, tensors)}
    path.write_bytes(safetensors_save(tensors, metadata=meta))
    return path


RAW = "\0raw\0"  # a value replaced by raw JSON text after dumping


def _at(record: dict, where: str) -> tuple[dict | list, str | int]:
    *parents, last = where.split(".")
    for key in parents:
        record = record[int(key)] if isinstance(record, list) else record[key]
    return record, int(last) if isinstance(record, list) else last


def setting(where: str, value) -> callable:
    def mutate(record: dict, tensors: dict) -> None:
        parent, key = _at(record, where)
        parent[key] = value(record) if callable(value) else value
    return mutate


def deleting(where: str) -> callable:
    def mutate(record: dict, tensors: dict) -> None:
        parent, key = _at(record, where)
        del parent[key]
    return mutate


def raw(where: str, text: str) -> callable:
    def mutate(record: dict, tensors: dict) -> str:
        setting(where, RAW)(record, tensors)
        return json.dumps(record).replace(json.dumps(RAW), text)
    return mutate


def tensor(name: str, value) -> callable:
    def mutate(record: dict, tensors: dict) -> None:
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value(tensors[name]) if callable(value) else value
    return mutate


def _poisoned(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


MALFORMED = {  # name: (rewrite of the valid snapshot's record / tensors, what the SessionError says)
    # the record as a whole
    "record a list": (lambda r, t: "[1, 2]", r"corrupt \(the session record is a list \(\[1, 2\]\), not an object"),
    "record with NaN": (raw("turns", "NaN"), r"unreadable session record: ValueError: NaN is not a JSON number"),
    "record with -Infinity": (raw("spec.accepted", "-Infinity"), r"-Infinity is not a JSON number"),
    "record nested 100000 deep": (raw("messages", "[" * 100_000 + "]" * 100_000), r"unreadable session record: "
                                                                                   r"RecursionError"),
    "integer of 5000 digits": (raw("turns", "9" * 5000), r"unreadable session record: ValueError: Exceeds the limit"),
    "version a string": (setting("version", "1"), r"its format version is a string \(\"1\"\), not an integer"),
    "version true": (setting("version", True), r"its format version is a boolean \(true\), not an integer"),
    "history missing": (deleting("history"), r"inconsistent: the session record lacks history"),
    "identity missing": (deleting("identity"), r"the session record lacks identity"),
    "field added": (setting("evil", 1), r"the session record has unexpected evil \(it holds cached, format, history"),
    "format other": (setting("format", "other"), r"its record's format is a string \(\"other\"\), expected "
                                                 r"'quickdraft-session'"),
    # identity
    "identity a list": (setting("identity", [1]), r"does not record the models it was made with"),
    "identity.target a list": (setting("identity.target", [1]), r"made with target model fingerprint None \(None, "),
    "identity.kv 1000 chars": (setting("identity.kv", "x" * 1000), r"KV cache layout x{100}\.\.\.; this LLM has"),
    # history
    "history an object": (setting("history", {"0": 5}), r"history is an object \(\{\"0\": 5\}\); it must be a list"),
    "history a string": (setting("history", "t5 t6"), r"history is a string \(\"t5 t6\"\); it must be a list"),
    "token a string": (setting("history.0", "5"), r"history\[0\] is a string \(\"5\"\): token ids are integers in "
                                                  r"\[0, 64\), this model's vocabulary"),
    "token negative": (setting("history.3", -1), r"history\[3\] is an integer \(-1\): token ids are integers"),
    "token a float": (setting("history.0", 5.0), r"history\[0\] is a number \(5.0\)"),
    "token true": (setting("history.0", True), r"history\[0\] is a boolean \(true\)"),
    "token = vocabulary size": (setting("history.1", 64), r"history\[1\] is an integer \(64\): token ids are integers "
                                                          r"in \[0, 64\)"),
    "token 2^80": (setting("history.1", 1 << 80), r"history\[1\] is an integer \(1208925819614629174706176\)"),
    "history past the context": (setting("history", lambda r: [5] * 512),
                                 r"holds 512 tokens but this LLM's context window is 512; build the LLM with a larger"),
    # cached
    "cached a list": (setting("cached", [3]), r"cached is a list \(\[3\]\); it must be an object \{cache: tokens"),
    "cached negative": (setting("cached.target", -1), r"cached\['target'\] is an integer \(-1\); it must be an "
                                                      r"integer in \[0, \d+\]"),
    "cached = history": (setting("cached.target", lambda r: len(r["history"])), r"cached\['target'\] is an integer "
                                                                                r"\(\d+\); it must be an integer in"),
    "cached a string": (setting("cached.target", "3"), r"cached\['target'\] is a string \(\"3\"\)"),
    "cached a float": (setting("cached.target", 3.0), r"cached\['target'\] is a number \(3.0\)"),
    "cache missing": (deleting("cached.draft:draft"), r"caches for \['target'\], this LLM has \['draft:draft', "
                                                      r"'target'\]"),
    "cache added": (setting("cached.draft:self", 0), r"caches for \['draft:draft', 'draft:self', 'target'\]"),
    "cached one less than stored": (setting("cached.target", lambda r: r["cached"]["target"] - 1),
                                    r"target keys are \(\(3, (\d+), 2, 16\), 'torch.float32'\), expected "
                                    r"\(3, \d+, 2, 16\) torch.float32"),
    # turns, spec
    "turns negative": (setting("turns", -1), r"turns is an integer \(-1\); it must be an integer in "
                                             r"\[0, 9223372036854775807\]"),
    "turns 2^63": (setting("turns", 1 << 63), r"turns is an integer \(9223372036854775808\)"),
    "turns a string": (setting("turns", "2"), r"turns is a string"),
    "spec a list": (setting("spec", []), r"spec is a list \(\[\]\); it must be an object with accepted, rejected"),
    "spec field added": (setting("spec.evil", 1), r"spec has unexpected evil \(it holds accepted, rejected"),
    "spec negative": (setting("spec.accepted", -1.0), r"spec.accepted is a number \(-1.0\); it must be a number in "
                                                      r"\[0, 1e\+09\]"),
    "spec 1e400": (raw("spec.rejected", "1e400"), r"spec.rejected is a number \(inf\); it must be a number in"),
    "spec 1e300": (setting("spec.rejected", 1e300), r"spec.rejected is a number \(1e\+300\); it must be a number in"),
    "spec 10^400": (setting("spec.rejected", 10**400), r"spec.rejected is an integer \(1000.*; it must be a number in"),
    "spec zero sum": (lambda r, t: r["spec"].update(accepted=0, rejected=0.0),
                      r"spec.accepted \+ spec.rejected is 0; the acceptance rate .* needs a positive sum"),
    "spec count a float": (setting("spec.rounds_off", 1.5), r"spec.rounds_off is a number \(1.5\); it must be an "
                                                            r"integer in \[0, "),
    # the interrupted turn
    "interrupted a list": (setting("interrupted", []), r"interrupted is a list \(\[\]\); it must be null or an "
                                                       r"object with chat, delivered_chars, params, start"),
    "interrupted start missing": (deleting("interrupted.start"), r"interrupted lacks start"),
    "interrupted field added": (setting("interrupted.evil", 1), r"interrupted has unexpected evil"),
    "start 0": (setting("interrupted.start", 0), r"interrupted.start is an integer \(0\); it must be an integer in "
                                                 r"\[1, \d+\]"),
    "start past the history": (setting("interrupted.start", lambda r: len(r["history"]) + 1),
                               r"interrupted.start is an integer \(\d+\); it must be an integer in \[1, \d+\]"),
    "start a string": (setting("interrupted.start", "3"), r"interrupted.start is a string"),
    "chat a string": (setting("interrupted.chat", "yes"), r"interrupted.chat is a string \(\"yes\"\); it must be "
                                                          r"true or false"),
    "delivered_chars negative": (setting("interrupted.delivered_chars", -5), r"interrupted.delivered_chars is an "
                                                                             r"integer \(-5\)"),
    "mirostat_mu 1e300": (setting("interrupted.mirostat_mu", 1e300), r"interrupted.mirostat_mu is 1e\+300; it must be "
                                                                     r"a number in \[-1e\+30, 1e\+30\]"),
    "mirostat_mu 10^400": (setting("interrupted.mirostat_mu", 10**400), r"interrupted.mirostat_mu is 1000"),
    "mirostat_mu a string": (setting("interrupted.mirostat_mu", "6"), r"interrupted.mirostat_mu is '6'; it must be"),
    "params a string": (setting("interrupted.params", "greedy"), r"interrupted.params is a string \(\"greedy\"\); it "
                                                                 r"must be an object of sampling parameters"),
    "params unknown name": (setting("interrupted.params.evil", 1), r"interrupted.params are invalid \(.*unexpected "
                                                                   r"keyword argument 'evil'\)"),
    "temperature negative": (setting("interrupted.params.temperature", -1.0),
                             r"interrupted.params are invalid \(temperature must be"),
    "temperature 1e400": (raw("interrupted.params.temperature", "1e400"), r"interrupted.params are invalid "
                                                                          r"\(temperature must be"),
    "max_tokens a string": (setting("interrupted.params.max_tokens", "24"), r"invalid \(max_tokens must be an int"),
    "n 2": (setting("interrupted.params.n", 2), r"interrupted.params has n=2; a session turn has n=1"),
    "stop token outside the vocabulary": (setting("interrupted.params.stop_token_ids", [64]),
                                          r"invalid \(stop_token_ids entry must be a token id in \[0, 64\)"),
    "logit bias outside the vocabulary": (setting("interrupted.params.logit_bias", {"1000": 1.0}),
                                          r"invalid \(logit_bias key must be a token id in \[0, 64\)"),
    # messages
    "messages an object": (setting("messages", {}), r"messages is an object \(\{\}\); it must be a list of chat"),
    "message a string": (setting("messages", ["hi"]), r"messages\[0\] is a string \(\"hi\"\); a chat message is an "
                                                      r"object \{role, content\}"),
    "message without a role": (setting("messages", [{"content": "t5"}]), r"messages\[0\] has no role"),
    "role null": (setting("messages", [{"role": None, "content": "t5"}]), r"messages\[0\].role is null; it must be "
                                                                          r"a string"),
    "role a number": (setting("messages", [{"role": 1, "content": "t5"}]), r"messages\[0\].role is an integer"),
    "content a list": (setting("messages", [{"role": "user", "content": ["t5"]}]), r"messages\[0\].content is a list"),
    "content a lone surrogate": (raw("messages", '[{"role": "user", "content": "t5 \\ud800"}]'),
                                 r"messages\[0\].content is not valid Unicode \(a lone surrogate at character 3\)"),
    # tensors
    "generator missing": (tensor("generator", None), r"the generator state is None, expected \(5056,\) "
                                                     r"torch.uint8"),
    "generator float32": (tensor("generator", lambda g: g.float()), r"the generator state is \(\(5056,\), "
                                                                     r"'torch.float32'\)"),
    "generator cut": (tensor("generator", lambda g: g[:100].clone()), r"the generator state is \(\(100,\), "),
    "generator garbage": (tensor("generator", lambda g: torch.full_like(g, 255)), r"the generator state is invalid "
                                                                                  r"\(Invalid mt19937 state\)"),
    "values missing": (tensor("kv.target.v", None), r"tensors \['generator', 'kv.draft:draft.k', 'kv.draft:draft.v', "
                                                    r"'kv.target.k'\], expected \['generator', .*'kv.target.v'\]"),
    "tensor added": (tensor("evil", torch.zeros(1)), r"tensors \['evil', 'generator', .*\], expected \['generator'"),
    "keys one token short": (tensor("kv.target.k", lambda k: k[:, :-1].clone()),
                             r"target keys are \(\(3, \d+, 2, 16\), 'torch.float32'\), expected"),
    "keys float64": (tensor("kv.target.k", lambda k: k.double()), r"'torch.float64'\), expected \(3, \d+, 2, 16\) "
                                                                  r"torch.float32"),
    "keys NaN": (tensor("kv.target.k", lambda k: _poisoned(k, float("nan"))), r"target keys hold NaN or "
                                                                              r"infinite numbers"),
    "draft values inf": (tensor("kv.draft:draft.v", lambda v: _poisoned(v, float("inf"))),
                         r"draft:draft values hold NaN or infinite numbers"),
}


@pytest.fixture(scope="module")
def valid_snapshot(llms, tmp_path_factory) -> bytes:
    """An interrupted turn of the draft-model LLM: both caches hold keys/values."""
    path = tmp_path_factory.mktemp("snapshot") / "valid.qds"
    interrupt(llms["draft"], PROMPT, SAMPLED, 5, path)
    return path.read_bytes()


def test_the_rewritten_valid_snapshot_resumes(llms, valid_snapshot, tmp_path):
    """The rewriter the malformed cases use makes loadable snapshots, so each case fails for its one change."""
    record, tensors = read_snapshot(valid_snapshot)
    assert record["interrupted"] is not None and record["cached"]["draft:draft"] > 0 and record["turns"] == 0
    record["messages"] = [{"role": "user", "content": "t5 t6"}]
    llm = llms["draft"]
    with llm.load_session(write_snapshot(tmp_path / "same.qds", record, tensors)) as s:
        assert s.history == record["history"] and s.messages == record["messages"] and s.interrupted is not None
    assert used(llm) == (0, 0)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_snapshot_under_a_valid_checksum_is_refused(llms, valid_snapshot, tmp_path, case):
    mutate, message = MALFORMED[case]
    record, tensors = read_snapshot(valid_snapshot)
    rewritten = mutate(record, tensors)
    path = write_snapshot(tmp_path / "bad.qds", record if rewritten is None else rewritten, tensors)
    llm = llms["draft"]
    before = used(llm)
    with pytest.raises(SessionError, match=message) as err:
        llm.load_session(path)
    assert type(err.value) is SessionError and str(path) in str(err.value)
    assert used(llm) == before


def test_a_snapshot_larger_than_the_cap_is_refused_unread(llms, tmp_path, monkeypatch):
    llm = llms["plain"]
    path = tmp_path / "s.qds"
    with llm.session() as s:
        s.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        s.save(path)
    size = path.stat().st_size
    # the cap: a 100 MiB header, the generator state and a full context window of keys and values per cache
    runner = llm.target
    kv_bytes = 2 * runner.num_layers * llm.max_model_len * runner.pool.k[0, 0].numel() * runner.pool.k.element_size()
    cap = session_module.max_snapshot_bytes(llm)
    assert cap == 8 + (100 << 20) + 5056 + kv_bytes and size < cap
    monkeypatch.setattr(session_module, "max_snapshot_bytes", lambda _: size - 1)
    monkeypatch.setattr(snapshot_module, "open", lambda *a: pytest.fail("read a file over the cap"), raising=False)
    before = used(llm)
    with pytest.raises(SessionError, match=rf"{path} is {size:,} bytes, more than the {size - 1:,} a snapshot of this "
                                           rf"LLM can hold"):
        llm.load_session(path)
    with pytest.raises(SessionError, match=rf"{tmp_path} is not a regular file"):
        llm.load_session(tmp_path)
    assert used(llm) == before
    monkeypatch.undo()
    monkeypatch.setattr(session_module, "max_snapshot_bytes", lambda _: size)
    llm.load_session(path).close()


def test_a_snapshot_is_readable_by_its_owner_only(llms, tmp_path):
    path = tmp_path / "s.qds"
    path.write_bytes(b"an older file, readable by all")
    os.chmod(path, 0o644)
    with llms["plain"].session() as s:
        s.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        s.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # caches written by the same function keep their mode
    from quickdraft.loading.tensor_file import write_atomic
    cache = write_atomic(tmp_path / "cache.safetensors", {"x": torch.zeros(2)}, {}, "test cache")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o644


def test_fields_added_to_the_config_keep_a_models_fingerprint(smollm2):
    """A saved session names its model by a fingerprint that hashes the parsed config: a field added to ModelConfig
    since (``ADDED_FIELDS``) counts only where it differs from its default, so SmolLM2's fingerprint is the one its
    sessions were saved under before those fields existed (computed then), and a model that uses one differs."""
    from quickdraft.loading import load_checkpoint
    from quickdraft.loading.checkpoint import content_fingerprint

    ckpt = load_checkpoint(smollm2)
    assert ckpt.content_fingerprint() == "0f947d6b81139236ebbe815e38241e59"
    assert content_fingerprint(smollm2, dataclasses.replace(ckpt.config, residual_multiplier=0.5)) != \
        ckpt.content_fingerprint()
