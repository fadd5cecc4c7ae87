"""weights='auto', the default, runs a GGUF at the file's own precision: the rule (Q4 -> int4, Q5/Q6/Q8 -> int8,
float -> float weights), where it reads the tensor types, what `quickdraft models` and the load line say, and on the
real SmolLM2 Q4_1 GGUF that the default int4 model computes the math of the file's float32-dequantized weights
within a stated logit bound (figures and command in docs/MEASUREMENTS.md, "Default weights")."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from quickdraft import LLM, SamplingParams, cli
from quickdraft.errors import InvalidParameterError
from quickdraft.kv import ForwardItem, SequenceKV
from quickdraft.loading import load_checkpoint
from quickdraft.loading.gguf import hf_tensor_types
from quickdraft.loading import weight_cache
from quickdraft.loading.gguf_metadata import tensor_types
from quickdraft.loading.quant_convert import LAYER_LINEARS
from quickdraft.loading.quantize import file_defaults, load_model, resolve_weights
from quickdraft.loading.weight_choice import auto_format, planned_kernels
from quickdraft.models.quant import Int4Linear, Int8Linear

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
# prompts whose first GREEDY_TOKENS greedy tokens were identical to float32's in every set-up measured
GREEDY_PROMPTS = ["1, 2, 3, 4, 5, 6,", "January, February, March, April,", "A, B, C, D, E, F,",
                  "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]
GREEDY_TOKENS = 16


def layers(types: list[str], num_layers: int = 4, **others: str) -> dict[str, str]:
    """Tensor types of a checkpoint whose decoder layers store their linears in ``types`` (one per linear, cycled),
    plus ``others`` by HF name."""
    out = {f"model.layers.{i}.{name}.weight": types[(i * len(LAYER_LINEARS) + j) % len(types)]
           for i in range(num_layers) for j, name in enumerate(LAYER_LINEARS)}
    out.update({f"model.layers.{i}.input_layernorm.weight": "F32" for i in range(num_layers)})
    return {**out, **others}


def test_auto_rule_follows_the_layer_types():
    q4_k_m = layers(["Q4_K"] * 5 + ["Q6_K"] * 2, **{"model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K"})
    assert auto_format(q4_k_m) == "int4"  # mostly Q4_K: int4, its Q6_K layers on int8
    assert planned_kernels(q4_k_m, "int8") == {"int4": 20, "int8": 9}
    assert auto_format(layers(["Q4_0", "Q8_0"])) == auto_format(layers(["Q4_1"])) == "int4"
    assert auto_format(layers(["Q8_0"])) == "int8"
    assert auto_format(layers(["Q5_0", "Q6_K", "Q8_0", "Q5_K", "Q5_1", "F16"])) == "int8"
    assert planned_kernels(layers(["Q8_0"]), "int8") == {"int8": 29}
    for floats in (["F16"], ["BF16"], ["F32"], ["F16", "F32"]):
        assert auto_format(layers(floats, **{"model.embed_tokens.weight": "Q8_0"})) is None  # only layers count
    assert planned_kernels(layers(["F16"]), "int8") is None
    assert auto_format(None) is None  # an HF directory: no GGUF types
    assert auto_format({"model.embed_tokens.weight": "Q4_0", "lm_head.weight": "Q4_0"}) is None


def test_resolve_weights_auto_and_explicit_formats():
    q4, q8 = layers(["Q4_K"]), layers(["Q8_0"])
    assert resolve_weights("auto", "cpu", q4) == "int4" and resolve_weights("auto", "cpu", q8) == "int8"
    assert resolve_weights("auto", "cpu", layers(["F16"])) is None and resolve_weights("auto", "cpu") is None
    assert resolve_weights("auto", "cuda:0", q4) is None  # off CPU: float weights, as before
    for fmt in ("int4", "int8", "bfloat16", "float32"):
        assert resolve_weights(fmt, "cpu", q8) == fmt  # an explicit format is taken as it is
    for bad in (None, "Q4_K", "float16", "fp32"):
        with pytest.raises(InvalidParameterError, match="weights must be one of auto, int4, int8, bfloat16, float32"):
            resolve_weights(bad, "cpu", q4)


@pytest.mark.parametrize("qtype,expected,kernels", [(QT.Q4_K, "int4", "int4 x14, int8 x1"),
                                                    (QT.Q4_0, "int4", "int4 x14, int8 x1"),
                                                    (QT.Q8_0, "int8", "int8 x15"), (QT.Q6_K, "int8", "int8 x15"),
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
    assert file_defaults(path) == (qtype.name, kernels)
    if expected is not None:
        model = load_model(ckpt, expected)
        ran = {k: sum(v.values()) for k, v in model.quant_info["kernels"].items()}
        assert ran == planned_kernels(ckpt.tensor_types, "int8")


def test_hf_directory_keeps_float_weights(tiny_dir):
    llm = LLM(str(tiny_dir(arch="llama")), dtype="float32", kv_cache_memory="4MiB")
    assert llm.weights == "float32"
    assert llm.weights_summary == "weights: float32 kernels for 15 tensors (safetensors)"


# ----------------------------------------------------------------------------- the real SmolLM2 Q4_1 GGUF


@pytest.fixture(scope="module")
def pair(smollm2) -> tuple[LLM, LLM]:
    """(LLM('smollm2-135m') with its defaults, the same with float32 weights dequantized from the file)."""
    return (LLM("smollm2-135m", kv_cache_memory="64MiB"),
            LLM("smollm2-135m", weights="float32", kv_cache_memory="64MiB"))


def test_smollm2_runs_int4_kernels_by_default(pair, smollm2):
    llm, ref = pair
    assert llm.weights == "int4" and ref.weights == "float32"
    layers_run = [m for m in llm.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert sum(isinstance(m, Int4Linear) for m in layers_run) == 7 * llm.model.config.num_layers == 210
    assert llm.model.quant_info["exact_gguf_int4"] == 210  # the file's own Q4_1 blocks, not requantized
    assert llm.model.quant_info["kernels"] == {"int4": {"Q4_1": 210}, "int8": {"Q8_0 lm_head": 1}}
    assert llm.weights_summary == "weights: int4 kernels for 210 tensors (Q4_1), int8 for 1 (Q8_0 lm_head)"
    assert file_defaults(smollm2) == ("Q4_1", "int4 x210, int8 x1")  # what `quickdraft models` shows
    assert ref.weights_summary == "weights: float32 kernels for 211 tensors (210 Q4_1, Q8_0 lm_head; dequantized)"


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
    assert " Q4_1 " in row and "int4 x210, int8 x1" in row
