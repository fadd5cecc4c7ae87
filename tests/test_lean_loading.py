"""Loading holds at most one float tensor beyond the model it builds, and converting in row chunks changes nothing."""
from __future__ import annotations

import weakref

import pytest
import torch
from gguf import GGMLQuantizationType as QT

import quickdraft.loading.dequant as dequant_module
import quickdraft.loading.gguf as gguf_module
import quickdraft.loading.quant_convert as quant_convert
from quickdraft.loading import load_checkpoint
from quickdraft.loading.checkpoint import LazyTensors
from quickdraft.loading.quantize import load_model
from quickdraft.models import qmatmul
from quickdraft.models.block_embedding import BlockEmbedding

from fixtures_loading import write_tiny_gguf


class FloatTracker:
    """Watches every float weight matrix loading makes: the float32 ones ``dequantize`` returns and the ones
    ``Checkpoint.tensors`` hands out in the model dtype. Each new one records how many earlier ones are still alive
    (a load that kept them would hold the model in float)."""

    def __init__(self, monkeypatch) -> None:
        self.alive: list[weakref.ref] = []
        self.most_alive = 0
        self.calls = 0
        dequantize, getitem = dequant_module.dequantize, LazyTensors.__getitem__
        monkeypatch.setattr(dequant_module, "dequantize", lambda *a, **k: self.watch(dequantize(*a, **k)))
        monkeypatch.setattr(gguf_module, "dequantize", lambda *a, **k: self.watch(dequantize(*a, **k)))
        monkeypatch.setattr(LazyTensors, "__getitem__", lambda lazy, name: self.watch(getitem(lazy, name)))

    def watch(self, out: torch.Tensor) -> torch.Tensor:
        if isinstance(out, torch.Tensor) and out.dim() == 2:  # (Checkpoint.blocks hands out raw bytes)
            self.alive = [r for r in self.alive if r() is not None and r() is not out]
            self.most_alive = max(self.most_alive, len(self.alive))
            self.calls += 1
            self.alive.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("qtype,fmt", [(QT.Q8_0, "int8"), (QT.Q8_0, "int4"), (QT.Q4_0, "int4"), (QT.Q6_K, "int8"),
                                       (QT.F16, "bfloat16")], ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "in-memory"])
def test_conversion_holds_one_float_tensor_at_a_time(tmp_path, monkeypatch, qtype, fmt, use_cache):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", qtype, tied=True)
    tracker = FloatTracker(monkeypatch)
    ckpt = load_checkpoint(path, dtype=torch.bfloat16)
    assert tracker.calls == 0  # loading a checkpoint reads its header only
    model = load_model(ckpt, fmt, use_cache=use_cache)
    if qtype == QT.Q4_0 and fmt == "int4":  # the blocks map exactly: no layer is dequantized at all
        assert tracker.calls <= 3, tracker.calls  # the embedding (and the tied head's int8 copy)
    else:
        assert tracker.calls >= 7 * ckpt.config.num_layers  # every layer was read from the file
    # a quantized model: the one matrix being converted (its embedding's rows are read from the file's blocks when
    # looked up, never a float table); a float one: the embedding and the seven matrices of the layer being packed
    # (q/k/v and gate/up are packed as one projection each)
    bound = 8 if fmt == "bfloat16" else 1
    assert tracker.most_alive <= bound, f"{tracker.most_alive} float matrices alive at once while loading"
    assert isinstance(model.model.embed_tokens, BlockEmbedding) == (fmt != "bfloat16")
    assert model.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.bfloat16


@pytest.mark.skipif(not qmatmul.available(), reason="row chunks apply to the qmatmul kernel's layout")
@pytest.mark.parametrize("qtype,fmt", [(QT.Q8_0, "int8"), (QT.Q4_0, "int4"), (QT.Q6_K, "int4")],
                         ids=lambda v: getattr(v, "name", v))
def test_row_chunked_conversion_is_identical(tmp_path, monkeypatch, qtype, fmt):
    """A vocabulary-wide head converted a few rows at a time gives the very same kernel tensors, and a dequantized
    embedding the very same values, as one pass over the whole matrix."""
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", qtype, tied=False)
    ckpt = load_checkpoint(path, dtype=torch.bfloat16)
    whole = load_model(ckpt, fmt, use_cache=False)
    embed = ckpt.tensors["model.embed_tokens.weight"]
    monkeypatch.setattr(quant_convert, "CHUNK_BYTES", 1)  # one row at a time
    monkeypatch.setattr(gguf_module, "ROW_CHUNK", 5)
    assert torch.equal(ckpt.tensors["model.embed_tokens.weight"], embed)
    for use_cache in (False, True):
        chunked = load_model(ckpt, fmt, use_cache=use_cache)
        for name, buf in whole.named_buffers():
            assert torch.equal(dict(chunked.named_buffers())[name], buf), name
