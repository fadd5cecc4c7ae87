"""A GGUF's token embedding read from the file's own blocks a row at a time (models/block_embedding.py): its rows are
the bits of the whole dequantized table, a model's logits are those of the float table, and no converted-weight cache
entry holds the table."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors import safe_open

from quickdraft.loading import load_checkpoint, quantize
from quickdraft.loading.quantize import load_model
from quickdraft.models.block_embedding import BlockEmbedding

from fixtures_loading import TINY, write_tiny_gguf
from test_loading import _logits

EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_are_the_tables_bits_and_no_entry_holds_the_table(tmp_path, monkeypatch, qtype, dtype):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", qtype, tied=True)
    ckpt = load_checkpoint(path, dtype)
    embedding = load_model(ckpt, "gguf").model.embed_tokens
    assert isinstance(embedding, BlockEmbedding)
    ids = torch.tensor([3, 0, 3, TINY["vocab"] - 1, 7, 3])
    rows = embedding(ids)
    assert rows.dtype == dtype and torch.equal(rows, ckpt.tensors[EMBED][ids])
    with pytest.raises(IndexError, match=r"token ids must be in 0\.\.319"):
        embedding(torch.tensor([1, TINY["vocab"]]))
    with pytest.raises(IndexError, match=r"token ids must be in 0\.\.319"):
        embedding(torch.tensor([-1]))
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, TINY["hidden"])
    (entry,) = (tmp_path / "cache" / "quantized").glob("*.safetensors")
    with safe_open(entry, "pt") as f:
        assert EMBED not in f.keys() and "model.norm.weight" in f.keys()
    again = load_model(load_checkpoint(path, dtype), "gguf").model.embed_tokens  # from the entry written
    assert isinstance(again, BlockEmbedding) and torch.equal(again(ids), rows)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("weights", ["gguf", "int4"])
def test_logits_equal_the_float_tables(tmp_path, monkeypatch, tied, weights):
    """Every prompt position's logits of the model reading rows from the blocks are those of the model holding the
    float table; a float head that is the table itself keeps it (no reader there)."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2", QT.Q6_K, tied=tied)
    ids = [5, 9, 3, 200, 7, 5, 9, 3, 11, 300]
    out = {}
    for reader in (True, False):
        monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / f"cache-{reader}"))
        if not reader:
            monkeypatch.setattr(quantize, "block_embedding", lambda *args: None)
        model = load_model(load_checkpoint(path, torch.bfloat16), weights)
        assert isinstance(model.model.embed_tokens, BlockEmbedding) == reader
        out[reader] = _logits(model, ids)
    assert torch.equal(out[True], out[False])
    monkeypatch.undo()
    model = load_model(load_checkpoint(path), weights, lm_head=False, use_cache=False)  # a float head
    assert isinstance(model.model.embed_tokens, BlockEmbedding) != tied
    assert (model.lm_head.weight is getattr(model.model.embed_tokens, "weight", None)) == tied


def test_a_table_of_the_wrong_size_is_refused_at_load():
    """A damaged header (or cached record of it) whose byte count does not match the rows fails when the reader is
    made, naming the sizes, not in the middle of an engine step."""
    import numpy as np

    from quickdraft.errors import ModelLoadError
    from quickdraft.loading.gguf import rows_reader

    with pytest.raises(ModelLoadError, match=r"a Q8_0 tensor of 4 x 64 needs 272 bytes, the file holds 270"):
        rows_reader(np.zeros(270, np.uint8), int(QT.Q8_0), (4, 64), torch.float32)
