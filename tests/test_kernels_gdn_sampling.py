"""The GDN block kernel and the fused sampler, in Triton's interpreter (or on the GPU with --device cuda),
against their references."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels.gdn import gdn_chunked  # noqa: E402
from clover_lite.kernels.sampling import choose_fused  # noqa: E402
from clover_lite.models.gdn import gated_delta_rule_chunked, gated_delta_rule_recurrent  # noqa: E402
from clover_lite.runtime.sampling import choose, filter_logits  # noqa: E402

from .devices import assert_near, assert_same, on_gpu, rel_err, to  # noqa: E402

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(5)


def gdn_close(actual, expected):
    """Exact dots in the interpreter: 2e-5. On a GPU the kernel's products run on tensor cores in tf32
    (configs.GDN_DOT_PRECISION): 2e-3 of the largest value, as the GPU check measured it (1.7e-3 at Clover's
    heads) and test_gdn_kernel_with_tf32_dots_stays_close_over_thousands_of_tokens bounds it."""
    assert_near(actual, expected, 2e-3, atol=2e-5, rtol=2e-5)


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
def test_gdn_kernel_equals_the_recurrence(device, b, L, HK, HV, K, V, block_t):
    q, k, v, g, beta, s0 = _gdn_inputs(b, L, HK, HV, K, V)
    s0_dev = to(device, s0)
    out, state = gdn_chunked(*to(device, (q, k, v, g, beta)), s0_dev, write_state=True, block_t=block_t)
    ref_out, ref_state = gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)))
    gdn_close(out.double().cpu(), ref_out)
    gdn_close(state.double().cpu(), ref_state)
    assert torch.equal(s0_dev.cpu(), s0)  # the committed state is an input, never written


def test_gdn_step_leaves_state_bitwise_and_commits_compose(device):
    q, k, v, g, beta, s0 = to(device, _gdn_inputs(1, 24, 2, 4, 16, 16))
    frozen = s0.clone()
    step_out, none = gdn_chunked(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], s0, write_state=False)
    assert none is None and torch.equal(s0, frozen)
    # step then commit of the same block: same outputs, and the commit's state continues the recurrence
    out1, s1 = gdn_chunked(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], s0, write_state=True)
    assert_same(out1, step_out)
    out2, s2 = gdn_chunked(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:], s1, write_state=True)
    whole_out, whole_state = gdn_chunked(q, k, v, g, beta, s0, write_state=True, block_t=16)
    ref_out, ref_state = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    gdn_close(torch.cat([out1, out2], 1), ref_out)
    gdn_close(s2, ref_state)
    gdn_close(whole_state, ref_state)
    gdn_close(whole_out, ref_out)


def _round_to_tf32(a: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest value with a 10-bit mantissa (ties away from zero), what tensor cores read."""
    bits = a.astype(np.float32).view(np.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(np.float32)


def test_gdn_kernel_with_tf32_dots_stays_close_over_thousands_of_tokens(device, monkeypatch):
    """On a GPU the kernel's products run on tensor cores in tf32 (configs.GDN_DOT_PRECISION); the
    interpreter computes them exactly. With every tf32 dot operand rounded as the tensor cores round it
    (in the interpreter: a stand-in for the tensor cores; on a GPU: the tensor cores), the kernel stays within
    2e-3 of the float64 recurrence over 2048 tokens of slow decay: the chunked form does not accumulate the
    rounding into the state."""
    rounded = []
    if not on_gpu():
        from triton.runtime import interpreter

        dot = interpreter.InterpreterBuilder.create_dot

        def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            if str(input_precision).upper().endswith("TF32") and a.data.dtype == np.float32:
                rounded.append(a.data.shape)
                a = interpreter.TensorHandle(_round_to_tf32(a.data), a.dtype)
                b = interpreter.TensorHandle(_round_to_tf32(b.data), b.dtype)
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    q, k, v, g, beta, s0 = _gdn_inputs(1, 2048, 1, 1, 64, 32, decay=0.3)
    out, state = gdn_chunked(*to(device, (q, k, v, g, beta, s0 * 0.1)), write_state=True)
    ref_out, ref_state = gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta, s0 * 0.1)))
    assert rounded or on_gpu(), "the kernel's dots did not run in tf32"
    out_err = ((out.double().cpu() - ref_out).norm() / ref_out.norm()).item()
    state_err = ((state.double().cpu() - ref_state).norm() / ref_state.norm()).item()
    assert out_err < 2e-3 and state_err < 2e-3, (out_err, state_err)  # rounded, yet close
    assert on_gpu() or out_err > 1e-5, out_err  # the stand-in did round


# The GPU check's shapes: Clover's GDN (16 k, 32 v heads of 128), a step and blocks up to 300 tokens; small
# ones in the interpreter. fp32 inputs (the layer's, from gdn_prepare), against the float64 recurrence.
@pytest.mark.parametrize("L", [1, 32, 64, 300] if on_gpu() else [4, 33])
def test_gdn_kernel_at_the_models_heads(device, L, report_err):
    b, hk, hv, dk = (1, 16, 32, 128) if on_gpu() else (1, 2, 4, 16)
    gen = torch.Generator().manual_seed(L)
    q, k = (torch.randn(b, L, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, L, hv, dk, generator=gen)
    g = -torch.rand(b, L, hv, generator=gen) * 2
    beta = torch.rand(b, L, hv, generator=gen)
    s0 = torch.randn(b, hv, dk, dk, generator=gen)
    s0_dev = s0.to(device)  # the copy the kernel gets must be the one checked for writes
    out, state = gdn_chunked(*to(device, (q, k, v, g, beta)), s0_dev, write_state=True)
    ro, rs = gated_delta_rule_recurrent(*(t.double() for t in (q, k, v, g, beta, s0)))
    err = report_err("GDN block kernel", max(rel_err(out, ro), rel_err(state, rs)))
    assert err < (2e-3 if on_gpu() else 1e-4)  # tf32 on a GPU
    assert torch.equal(s0_dev.cpu(), s0)


@pytest.mark.interpret_only("argument checks before any launch, the same on every device")
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
def test_fused_sampler_matches_reference_greedy(device, confidence, block_v):
    logits = torch.randn(6, 1000, generator=GEN) * 3
    logits[2, 10] = 50.0  # a confident row
    logits[3, 999] = logits[3].max() + 1  # the best token in the last (ragged) chunk
    logits = logits.to(device)
    ref_tok, ref_conf = choose(logits, confidence=confidence, banned_token_id=10)
    tok, conf = choose_fused(logits, confidence=confidence, banned_token_id=10, block_v=block_v)
    assert torch.equal(tok, ref_tok) and 10 not in tok.tolist()
    # rtol 1e-4 on a GPU, whose exp and log are approximate (the GPU check's bound)
    torch.testing.assert_close(conf, ref_conf, atol=1e-5, rtol=1e-4 if on_gpu() else 1e-5)


def test_fused_sampler_is_seeded_and_follows_the_softmax(device):
    # One program per row in the interpreter (~50 ms each): a few hundred draws, a loose but telling bound.
    # A CPU generator on every device: the same seed reaches the kernel, so the same draws (a generator on
    # the logits' device: test_fused_sampler_at_the_models_vocabulary).
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * 11], device=device)

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    a, pa = choose_fused(row.repeat(300, 1), temperature=1.0, generator=seeded(1))
    b, _ = choose_fused(row.repeat(50, 1), temperature=1.0, generator=seeded(1))
    c, _ = choose_fused(row.repeat(50, 1), temperature=1.0, generator=seeded(2))
    assert torch.equal(a[:50], b) and not torch.equal(b, c)  # the seed fixes the stream, row by row
    p = torch.softmax(row[0], -1)
    freq = torch.bincount(a, minlength=16).double() / len(a)
    torch.testing.assert_close(freq[:5], p[:5].double(), atol=0.09, rtol=0)  # ~3 sigma at 300 draws
    torch.testing.assert_close(pa, p[a], atol=1e-5, rtol=1e-5)  # the confidence is the chosen token's probability
    hot, _ = choose_fused(row.repeat(30, 1), temperature=0.05, generator=seeded(0))
    assert (hot == 0).all()  # a low temperature is almost greedy


def test_fused_sampler_top_k_top_p(device):
    logits = (torch.randn(3, 500, generator=GEN) * 2).to(device)
    for kw in (dict(top_k=5), dict(top_p=0.3), dict(top_k=20, top_p=0.5)):
        gen = torch.Generator(device=device).manual_seed(4)  # torch.multinomial's, on the logits' device
        tok, conf = choose_fused(logits, temperature=0.8, generator=gen, **kw)
        ref_allowed = torch.isfinite(filter_logits(logits / 0.8, kw.get("top_k", 0), kw.get("top_p", 1.0)))
        assert ref_allowed.gather(1, tok[:, None]).all(), kw  # only tokens the reference would allow
        assert (conf > 0).all() and (conf <= 1).all()


# The GPU check's vocabulary: Qwen3.5's 248,320 tokens (chunks of 4096 there), 32 masked rows; 1000 in the
# interpreter (a program per row holds the whole row).
def test_fused_sampler_at_the_models_vocabulary(device):
    """Greedy tokens and every confidence equal the reference's, and a seeded generator on the device reproduces
    the sampled tokens."""
    V = 248320 if on_gpu() else 1000
    logits = (torch.randn(32, V, generator=torch.Generator().manual_seed(7)) * 4).to(device)
    for conf in ("prob", "margin", "entropy"):
        a, ca = choose(logits, confidence=conf, banned_token_id=5)
        b, cb = choose_fused(logits, confidence=conf, banned_token_id=5)
        assert torch.equal(a, b), conf
        torch.testing.assert_close(cb, ca, atol=1e-5, rtol=1e-4, msg=conf)
    g1, g2 = (torch.Generator(device=device).manual_seed(1) for _ in range(2))
    assert torch.equal(choose_fused(logits, 1.0, generator=g1)[0], choose_fused(logits, 1.0, generator=g2)[0])
