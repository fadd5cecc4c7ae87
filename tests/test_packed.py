"""PackedLinear: float weights in oneDNN's layout give row-independent results (the basis of bitwise-exact
speculation with float weights) and the same numbers as F.linear up to rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quickdraft.models.packed import MIN_ROWS, PackedLinear, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.float32, "cpu"), reason="oneDNN not available")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(8, 32), (96, 64), (576, 576), (1536, 960)])
def test_each_row_is_computed_on_its_own(dtype, out_features, in_features):
    if not packing_supported(dtype, "cpu"):
        pytest.skip(f"oneDNN has no {dtype} kernel on this CPU")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    layer = PackedLinear(weight, bias)
    x = torch.randn(70, in_features, generator=gen).to(dtype)
    full = layer(x)
    for rows in (1, 2, 3, MIN_ROWS, 9, 17, 64):  # a row's result never depends on how many rows share the call
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    singles = torch.cat([layer(x[i]) for i in range(8)]).view(8, -1)  # 1-D input, one row at a time
    assert torch.equal(singles, full[:8])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), F.linear(x.float(), weight.float(), bias.float()), atol=tol * in_features ** 0.5,
                               rtol=tol)


def test_three_dim_input_and_no_bias():
    weight = torch.randn(40, 24)
    layer = PackedLinear(weight)
    x = torch.randn(2, 3, 24)
    y = layer(x)
    assert y.shape == (2, 3, 40) and layer.bias is None
    torch.testing.assert_close(y, x @ weight.T, atol=1e-5, rtol=1e-5)


def test_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match="2-D float32/bfloat16"):
        PackedLinear(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32/bfloat16"):
        PackedLinear(torch.randn(4))
