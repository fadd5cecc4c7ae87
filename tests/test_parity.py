"""Our model equals HF transformers loading the same files: logits and greedy continuations."""
from __future__ import annotations

import pytest
import torch
import transformers

from quickdraft import LLM, SamplingParams
from quickdraft.kv import ForwardItem, SequenceKV


def our_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    kv = SequenceKV()
    (logits,) = llm.target.forward([ForwardItem(kv, ids, len(ids))])
    llm.target.free(kv)
    return logits


def check_parity(llm: LLM, hf_model, vocab_size: int) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab_size, (64,), generator=g).tolist()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (our_logits(llm, ids) - ref).abs().max().item()
    assert diff < 1e-3, f"max abs logit diff {diff}"
    with torch.no_grad():
        hf_out = hf_model.generate(torch.tensor([ids[:16]]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, 16:].tolist()
    ours = llm.generate([ids[:16]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    assert ours == hf_out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_hf_checkpoint_matches_transformers(tiny_dir, arch, tie):
    path = tiny_dir(arch=arch, tie=tie, vocab_size=96)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="16MiB")  # LLM's default pool is 1 GiB, zeroed up front
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert llm.model.config.attention_bias == (arch == "qwen2")
    assert llm.model.config.num_kv_heads < llm.model.config.num_heads  # GQA
    check_parity(llm, hf, 96)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2, smollm2_transformers):
    # smollm2_transformers: from_pretrained(dir, gguf_file=name, dtype=float32), loaded once (conftest)
    # float32 weights dequantized from the file, as transformers loads them (the default runs the file's int4)
    llm = LLM(str(smollm2), weights="float32", kv_cache_memory="64MiB")
    check_parity(llm, smollm2_transformers, llm.model.config.vocab_size)
