"""The GDN block kernel and the fused sampler, in Triton's interpreter, against their references."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels.gdn import gdn_chunked  # noqa: E402
from clover_lite.kernels.sampling import choose_fused  # noqa: E402
from clover_lite.models.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent  # noqa: E402
from clover_lite.runtime.sampling import choose, filter_logits  # noqa: E402

GEN = torch.Generator().manual_seed(5)


def _gdn_inputs(b, L, HK, HV, K, V, decay=3.0):
    q = torch.randn(b, L, HK, K, generator=GEN)
    k = torch.randn(b, L, HK, K, generator=GEN)
    v = torch.randn(b, L, HV, V, generator=GEN)
    g = -torch.rand(b, L, HV, generator=GEN) * decay
    beta = torch.rand(b, L, HV, generator=GEN)
    s0 = torch.randn(b, HV, K, V, generator=GEN)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("b,L,HK,HV,K,V,block_t", [(1, 1, 2, 4, 16, 16, None), (2, 7, 1, 2, 32, 24, None),
                                                   (1, 32, 2, 2, 16, 40, None), (1, 100, 1, 2, 32, 16, None),
                                                   (1, 100, 1, 2, 32, 16, 64)])
def test_gdn_kernel_equals_the_recurrence(b, L, HK, HV, K, V, block_t):
    q, k, v, g, beta, s0 = _gdn_inputs(b, L, HK, HV, K, V)
    before = s0.clone()
    out, state = gdn_chunked(q, k, v, g, beta, s0, write_state=True, block_t=block_t)
    ref_out, ref_state = gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state.double(), ref_state, atol=2e-5, rtol=2e-5)
    assert torch.equal(s0, before)  # the committed state is an input, never written


def test_gdn_step_leaves_state_bitwise_and_commits_compose():
    q, k, v, g, beta, s0 = _gdn_inputs(1, 24, 2, 4, 16, 16)
    frozen = s0.clone()
    step_out, none = gdn_chunked(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], s0, write_state=False)
    assert none is None and torch.equal(s0, frozen)
    # step then commit of the same block: same outputs, and the commit's state continues the recurrence
    out1, s1 = gdn_chunked(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], s0, write_state=True)
    assert torch.equal(out1, step_out)
    out2, s2 = gdn_chunked(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:], s1, write_state=True)
    whole_out, whole_state = gdn_chunked(q, k, v, g, beta, s0, write_state=True, block_t=16)
    ref_out, ref_state = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    torch.testing.assert_close(torch.cat([out1, out2], 1), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s2, ref_state, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(whole_state, ref_state, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(whole_out, ref_out, atol=2e-5, rtol=2e-5)


def _round_to_tf32(a: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest value with a 10-bit mantissa (ties away from zero), what tensor cores read."""
    bits = a.astype(np.float32).view(np.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(np.float32)


def test_gdn_kernel_with_tf32_dots_stays_close_over_thousands_of_tokens(monkeypatch):
    """On a GPU the kernel's products run on tensor cores in tf32 (configs.GDN_DOT_PRECISION); the
    interpreter computes them exactly. With every tf32 dot operand rounded as the tensor cores round it,
    the kernel stays within 2e-3 of the float64 recurrence over 2048 tokens of slow decay: the chunked form
    does not accumulate the rounding into the state."""
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot
    rounded = []

    def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if str(input_precision).upper().endswith("TF32") and a.data.dtype == np.float32:
            rounded.append(a.data.shape)
            a = interpreter.TensorHandle(_round_to_tf32(a.data), a.dtype)
            b = interpreter.TensorHandle(_round_to_tf32(b.data), b.dtype)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    q, k, v, g, beta, s0 = _gdn_inputs(1, 2048, 1, 1, 64, 32, decay=0.3)
    out, state = gdn_chunked(q, k, v, g, beta, s0 * 0.1, write_state=True)
    ref_out, ref_state = gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta, s0 * 0.1)))
    assert rounded, "the kernel's dots did not run in tf32"
    out_err = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    state_err = ((state.double() - ref_state).norm() / ref_state.norm()).item()
    assert 1e-5 < out_err < 2e-3 and state_err < 2e-3, (out_err, state_err)  # rounded, yet close


def test_gdn_kernel_errors():
    q, k, v, g, beta, s0 = _gdn_inputs(1, 4, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="fp32"):
        gdn_chunked(q, k, v, g, beta, s0.half(), True)
    with pytest.raises(ValueError, match="state must be"):
        gdn_chunked(q, k, v, g, beta, s0[:, :2], True)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn_chunked(q[:, :, :1].expand(1, 4, 3, 16), k[:, :, :1].expand(1, 4, 3, 16), v, g, beta, s0, True)


@pytest.mark.parametrize("confidence", ["prob", "margin", "entropy"])
@pytest.mark.parametrize("block_v", [64, 1024])
def test_fused_sampler_matches_reference_greedy(confidence, block_v):
    logits = torch.randn(6, 1000, generator=GEN) * 3
    logits[2, 10] = 50.0  # a confident row
    logits[3, 999] = logits[3].max() + 1  # the best token in the last (ragged) chunk
    ref_tok, ref_conf = choose(logits, confidence=confidence, banned_token_id=10)
    tok, conf = choose_fused(logits, confidence=confidence, banned_token_id=10, block_v=block_v)
    assert torch.equal(tok, ref_tok) and 10 not in tok.tolist()
    torch.testing.assert_close(conf, ref_conf, atol=1e-5, rtol=1e-5)


def test_fused_sampler_is_seeded_and_follows_the_softmax():
    # One program per row in the interpreter (~50 ms each): a few hundred draws, a loose but telling bound.
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * 11])
    a, pa = choose_fused(row.repeat(300, 1), temperature=1.0, generator=torch.Generator().manual_seed(1))
    b, _ = choose_fused(row.repeat(50, 1), temperature=1.0, generator=torch.Generator().manual_seed(1))
    c, _ = choose_fused(row.repeat(50, 1), temperature=1.0, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a[:50], b) and not torch.equal(b, c)  # the seed fixes the stream, row by row
    p = torch.softmax(row[0], -1)
    freq = torch.bincount(a, minlength=16).double() / len(a)
    torch.testing.assert_close(freq[:5], p[:5].double(), atol=0.09, rtol=0)  # ~3 sigma at 300 draws
    torch.testing.assert_close(pa, p[a], atol=1e-5, rtol=1e-5)  # the confidence is the chosen token's probability
    hot, _ = choose_fused(row.repeat(30, 1), temperature=0.05, generator=torch.Generator().manual_seed(0))
    assert (hot == 0).all()  # a low temperature is almost greedy


def test_fused_sampler_top_k_top_p():
    logits = torch.randn(3, 500, generator=GEN) * 2
    for kw in (dict(top_k=5), dict(top_p=0.3), dict(top_k=20, top_p=0.5)):
        gen = torch.Generator().manual_seed(4)
        tok, conf = choose_fused(logits, temperature=0.8, generator=gen, **kw)
        ref_allowed = torch.isfinite(filter_logits(logits / 0.8, kw.get("top_k", 0), kw.get("top_p", 1.0)))
        assert ref_allowed.gather(1, tok[:, None]).all(), kw  # only tokens the reference would allow
        assert (conf > 0).all() and (conf <= 1).all()
