"""weights='auto', the default, runs a GGUF at the file's own precision: the rule (a quantized GGUF -> 'gguf', each
tensor in its own type; without the kernel Q4 -> int4, Q5/Q6/Q8 -> int8; float -> float weights), where it reads the
tensor types, what `quickdraft models` and the load line say, and on the real SmolLM2 Q4_1 GGUF that the default
model computes the math of the file's float32-dequantized weights within a stated logit bound (figures and command
in docs/MEASUREMENTS.md, "Default weights")."""
from __future__ import annotations

import math

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from quickdraft import LLM, SamplingParams, cli
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.loading import load_checkpoint
from quickdraft.loading.gguf import hf_tensor_types
from quickdraft.loading import weight_cache
from quickdraft.loading.ggml_types import BY_NAME, ggml_type
from quickdraft.loading.gguf_metadata import tensor_shapes, tensor_types
from quickdraft.loading.quant_convert import LAYER_LINEARS
from quickdraft.loading.quantize import file_defaults, load_model, resolve_weights
from quickdraft.loading.weight_choice import auto_format, planned_kernels
from quickdraft.models import qmatmul, step_weight_bytes

try:
    from fixtures_loading import cache_dir, write_tiny_gguf  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.fixtures_loading import cache_dir, write_tiny_gguf  # noqa: F401

# SmolLM2 default (int4 kernels, int8 lm_head) against float32 weights dequantized from the same file, at the
# positions that predict NEW_TOKENS greedy float32 tokens of PROMPTS: bounds with a margin over the figures measured
# in every kernel / activation set-up of docs/MEASUREMENTS.md ("Default weights")
MAX_LOGIT_DIFF = 3.0
MEAN_LOGIT_DIFF = 0.4
MIN_TOP1_AGREEMENT = 0.9
# where greedy tokens part, the float32 model rated the default's token this close to its own top one
MAX_GAP_AT_DIVERGENCE = 1.0
NEW_TOKENS = 32
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The capital of France is",
           "Write a haiku about the sea.",
           "Once upon a time, in a small village by the mountains,",
           "import numpy as np\n\ndef normalize(x):\n",
           "Question: What is 12 times 7?\nAnswer:",
           "The quick brown fox jumps over the lazy",
           "Monday, Tuesday, Wednesday,",
           "def add(a, b):\n    return"]
# prompts whose first GREEDY_TOKENS greedy tokens were identical to float32's in every set-up measured (the months
# left the list when the head became the file's own Q8_0: float32 itself rates its two candidates 0.016 apart there)
GREEDY_PROMPTS = ["1, 2, 3, 4, 5, 6,", "10, 20, 30, 40,", "A, B, C, D, E, F,",
                  "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
GREEDY_TOKENS = 16


def layers(types: list[str], num_layers: int = 4, **others: str) -> dict[str, str]:
    """Tensor types of a checkpoint whose decoder layers store their linears in ``types`` (one per linear, cycled),
    plus ``others`` by HF name."""
    out = {f"model.layers.{i}.{name}.weight": types[(i * len(LAYER_LINEARS) + j) % len(types)]
           for i in range(num_layers) for j, name in enumerate(LAYER_LINEARS)}
    out.update({f"model.layers.{i}.input_layernorm.weight": "F32" for i in range(num_layers)})
    return {**out, **others}


needs_kernel = pytest.mark.skipif(not qmatmul.available(), reason="the qmatmul kernel is not built on this CPU")


@needs_kernel
def test_auto_rule_follows_the_layer_types():
    q4_k_m = layers(["Q4_K"] * 5 + ["Q6_K"] * 2, **{"model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K"})
    assert auto_format(q4_k_m) == "gguf"  # every tensor in its own type, the head in the file's Q6_K
    assert planned_kernels(q4_k_m, "int8") == {"Q4_K": 20, "Q6_K": 9}
    for types in (["Q4_0", "Q8_0"], ["Q4_1"], ["Q8_0"], ["Q5_0", "Q6_K", "Q8_0", "Q5_K", "Q5_1", "F16"],
                  ["IQ4_NL", "IQ4_XS"], ["Q1_0"], ["Q2_0"]):
        assert auto_format(layers(types)) == "gguf", types
    # a float tensor among quantized ones runs int8; a tied head (typed as the embedding, as hf_tensor_types
    # records it) runs in the embedding's type
    tied = {"model.embed_tokens.weight": "Q8_0", "lm_head.weight": "Q8_0"}
    assert planned_kernels(layers(["Q5_0", "F16"], **tied), "int8") == {"Q5_0": 14, "int8": 14, "Q8_0": 1}
    for floats in (["F16"], ["BF16"], ["F32"], ["F16", "F32"]):
        assert auto_format(layers(floats, **{"model.embed_tokens.weight": "Q8_0"})) is None  # only layers count
    assert planned_kernels(layers(["F16"]), "int8") is None
    assert auto_format(None) is None  # an HF directory: no GGUF types
    assert auto_format({"model.embed_tokens.weight": "Q4_0", "lm_head.weight": "Q4_0"}) is None


def test_auto_rule_without_the_kernel(monkeypatch):
    """Where the kernel cannot be built, torch's kernels run: Q4 files int4 (wider layers int8), others int8."""
    monkeypatch.setattr(qmatmul, "available", lambda: False)
    q4_k_m = layers(["Q4_K"] * 5 + ["Q6_K"] * 2, **{"model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K"})
    assert auto_format(q4_k_m) == "int4"  # mostly Q4_K: int4, its Q6_K layers on int8
    assert planned_kernels(q4_k_m, "int8") == {"int4": 20, "int8": 9}
    assert auto_format(layers(["Q4_0", "Q8_0"])) == auto_format(layers(["Q4_1"])) == "int4"
    assert auto_format(layers(["Q5_0", "Q6_K", "Q8_0", "Q5_K", "Q5_1", "F16"])) == "int8"
    assert planned_kernels(layers(["Q8_0"]), "int8") == {"int8": 29}
    with pytest.raises(InvalidParameterError, match="weights='gguf' runs the file's own quantization"):
        resolve_weights("gguf", "cpu", q4_k_m)


@needs_kernel
def test_resolve_weights_auto_and_explicit_formats():
    q4, q8 = layers(["Q4_K"]), layers(["Q8_0"])
    assert resolve_weights("auto", "cpu", q4) == resolve_weights("auto", "cpu", q8) == "gguf"
    assert resolve_weights("auto", "cpu", layers(["F16"])) is None and resolve_weights("auto", "cpu") is None
    assert resolve_weights("auto", "cuda:0", q4) is None  # off CPU: float weights, as before
    for fmt in ("gguf", "int4", "int8", "bfloat16", "float32"):
        assert resolve_weights(fmt, "cpu", q8) == fmt  # an explicit format is taken as it is
    with pytest.raises(InvalidParameterError, match="weights='gguf' runs the file's own quantization"):
        resolve_weights("gguf", "cuda:0", q4)
    for bad in (None, "Q4_K", "float16", "fp32"):
        with pytest.raises(InvalidParameterError,
                           match="weights must be one of auto, gguf, int4, int8, bfloat16, float32"):
            resolve_weights(bad, "cpu", q4)


@needs_kernel
@pytest.mark.parametrize("qtype,expected,kernels", [(QT.Q4_K, "gguf", "Q4_K x15"), (QT.Q4_0, "gguf", "Q4_0 x15"),
                                                    (QT.Q8_0, "gguf", "Q8_0 x15"), (QT.Q6_K, "gguf", "Q6_K x15"),
                                                    (QT.F16, None, "float")])
def test_auto_rule_on_gguf_files(tmp_path, cache_dir, qtype, expected, kernels):
    """A tiny GGUF's types come with its checkpoint (and from the weight cache); its header alone says the same,
    and quantizing it runs the kernels the header promised."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", qtype)
    ckpt = load_checkpoint(path)
    assert ckpt.tensor_types["model.layers.1.mlp.down_proj.weight"] == qtype.name
    assert ckpt.tensor_types["model.layers.1.input_layernorm.weight"] == "F32"
    assert ckpt.tensor_types == hf_tensor_types(tensor_types(path))
    assert weight_cache.index_path(ckpt.fingerprint).is_file()
    assert load_checkpoint(path).tensor_types == ckpt.tensor_types  # from the header record (a weight-cache hit)
    assert resolve_weights("auto", "cpu", ckpt.tensor_types) == expected
    stored, planned, step = file_defaults(path)
    assert (stored, planned) == (qtype.name, kernels)
    if expected is not None:
        model = load_model(ckpt, expected)
        ran = {k: sum(v.values()) for k, v in model.quant_info["kernels"].items()}
        assert ran == planned_kernels(ckpt.tensor_types, "int8")
        assert step == step_weight_bytes(model)  # the header's plan is what the model reads (norms in float32)


def test_hf_directory_keeps_float_weights(tiny_dir):
    llm = LLM(str(tiny_dir(arch="llama")), dtype="float32", kv_cache_memory="4MiB")
    assert llm.weights == "float32"
    assert llm.weights_summary.startswith("weights: float32 kernels for 15 tensors (safetensors); ")
    assert llm.weights_summary.endswith(f"; {step_weight_bytes(llm.model) / 1e9:.3g} GB read per token")


# ----------------------------------------------------------------------------- the real SmolLM2 Q4_1 GGUF


@pytest.fixture(scope="module")
def pair(smollm2) -> tuple[LLM, LLM]:
    """(LLM('smollm2-135m') with its defaults, the same with float32 weights dequantized from the file)."""
    return (LLM("smollm2-135m", kv_cache_memory="64MiB"),
            LLM("smollm2-135m", weights="float32", kv_cache_memory="64MiB"))


@needs_kernel
def test_smollm2_runs_its_own_types_by_default(pair, smollm2):
    llm, ref = pair
    assert llm.weights == "gguf" and ref.weights == "float32"
    assert llm.model.quant_info["exact_from_file"] == 211  # the file's own Q4_1 and Q8_0 blocks, not requantized
    assert llm.model.quant_info["kernels"] == {"Q4_1": {"Q4_1": 210}, "Q8_0": {"Q8_0 lm_head": 1}}
    step = step_weight_bytes(llm.model)
    assert llm.weights_summary == (f"weights: Q4_1 kernels for 210 tensors (Q4_1), Q8_0 for 1 (Q8_0 lm_head); "
                                   f"{step / 1e9:.3g} GB read per token")
    assert file_defaults(smollm2)[:2] == ("Q4_1", "Q4_1 x210, Q8_0 x1")  # what `quickdraft models` shows
    # a decode step reads the file's bytes: every tensor, the embedding table as the tied head (norms in the model's
    # dtype, the header's plan counts them as float32)
    file_bytes = sum(math.prod(shape) // ggml_type(BY_NAME[t]).block * ggml_type(BY_NAME[t]).type_size
                     for t, shape in tensor_shapes(smollm2).values())
    assert abs(step / file_bytes - 1) < 0.03 and abs(file_defaults(smollm2)[2] / file_bytes - 1) < 0.03
    assert ref.weights_summary.startswith(
        "weights: float32 kernels for 211 tensors (210 Q4_1, Q8_0 lm_head; dequantized); ")


def _logits(llm: LLM, ids: list[int], rows: int) -> torch.Tensor:
    kv = SequenceKV()
    (logits,) = llm.target.forward([ForwardItem(kv, ids, rows)])
    llm.target.free(kv)
    return logits


def test_smollm2_default_computes_the_dequantized_files_math(pair):
    """Logits within the bound at every position that predicts a float32 greedy token, and greedy tokens that
    part from the float32 ones only where the float32 model itself was near-tied."""
    llm, ref = pair
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ref_ids = [o.token_ids for o in ref.generate(PROMPTS, params)]
    got_ids = [o.token_ids for o in llm.generate(PROMPTS, params)]
    worst, total, count, agree = 0.0, 0.0, 0, 0
    for prompt, r, got in zip(PROMPTS, ref_ids, got_ids):
        ids = llm.tokenizer.encode(prompt) + r[:-1]
        with torch.inference_mode():
            ours, theirs = _logits(llm, ids, len(r)), _logits(ref, ids, len(r))
        diff = (ours - theirs).abs()
        worst, total, count = max(worst, diff.max().item()), total + diff.sum().item(), count + diff.numel()
        agree += (ours.argmax(-1) == theirs.argmax(-1)).sum().item()
        first = next((i for i, (a, b) in enumerate(zip(got, r)) if a != b), None)
        if first is not None:
            gap = (theirs[first, r[first]] - theirs[first, got[first]]).item()
            assert gap <= MAX_GAP_AT_DIVERGENCE, (prompt, first, gap)
    assert worst <= MAX_LOGIT_DIFF, worst
    assert total / count <= MEAN_LOGIT_DIFF, total / count
    assert agree / (len(PROMPTS) * NEW_TOKENS) >= MIN_TOP1_AGREEMENT, agree


def test_smollm2_default_greedy_tokens_equal_float32(pair):
    llm, ref = pair
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(GREEDY_PROMPTS, params)]
    assert ours == [o.token_ids for o in ref.generate(GREEDY_PROMPTS, params)]


def test_models_lists_file_quantization_and_default_kernels(smollm2, capsys):
    assert cli.main(["models"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert "file layers" in header and "default kernels" in header
    [row] = [line for line in rows if line.startswith("smollm2-135m")]
    assert " Q4_1 " in row and "Q4_1 x210, Q8_0 x1" in row and "read/token" in header
    assert f"{file_defaults(smollm2)[2] / 1e6:>8.0f}MB" in row
