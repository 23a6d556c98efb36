"""The SDPA call behind prefill and the reference attention: both ways of handing it GQA keys (native, and
expanded to the query heads as CUDA needs under a mask) equal a float64 reference on a ragged mask."""

import pytest
import torch

from clover_lite.models.attention import attend


def reference(q, k, v, mask, scale):
    """Query head h reads key/value head h // (heads / kv_heads), in float64."""
    r = q.shape[1] // k.shape[1]
    heads = torch.arange(q.shape[1]) // r
    s = torch.einsum("bhld,bhsd->bhls", q.double(), k.double()[:, heads]) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhls,bhsd->bhld", s.softmax(-1), v.double()[:, heads])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("expand_kv", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_matches_float64(heads, kv_heads, expand_kv, masked):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, L, past, d = 2, 7, 13, 16  # ragged: 7 new positions in blocks of 3 after 13 committed ones
    S = past + L
    q = torch.randn(b, heads, L, d, generator=g)
    k, v = (torch.randn(b, kv_heads, S, d, generator=g) for _ in range(2))
    mask = None
    if masked:  # committed keys visible; blocks of 3 bidirectional inside, causal across
        block = torch.arange(L) // 3
        mask = torch.cat([torch.ones(L, past, dtype=torch.bool), block[None, :] <= block[:, None]], dim=1)
    out = attend(q, k, v, mask, d**-0.5, expand_kv=expand_kv)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, d**-0.5), atol=1e-5, rtol=1e-5)
