"""The block-attention Triton kernels (flash-decoding over the committed cache plus the block's own keys), run by
Triton's interpreter on CPU (TRITON_INTERPRET=1, set in conftest; compiled on the GPU with --device cuda),
against `block_attention_reference` and an independent float64 computation on fresh random inputs. The cache
beyond cache_len is poisoned (NaN, inf, the dtype's largest value): the result must not change."""

import pytest
import torch

pytest.importorskip("triton")

from clover_lite.kernels import configs  # noqa: E402
from clover_lite.kernels.attention import (  # noqa: E402
    block_attention,
    block_attention_reference,
    choose_num_splits,
    split_plan,
)

from .devices import on_gpu, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(20261207)
CPU = torch.device("cpu")


def make_inputs(b, Hq, Hkv, L, D, cache_len, capacity, dtype, gate, poison=True, device=CPU):
    def rnd(*shape):
        return torch.randn(*shape, generator=GEN).to(device, dtype)

    q, kb, vb = rnd(b, Hq, L, D), rnd(b, Hkv, L, D), rnd(b, Hkv, L, D)
    kc, vc = rnd(b, Hkv, capacity, D), rnd(b, Hkv, capacity, D)
    if poison and capacity > cache_len:
        big = torch.finfo(dtype).max
        tail = torch.tensor([float("nan"), big, float("inf"), -big], dtype=dtype, device=device).repeat(capacity)
        tail = tail[: capacity - cache_len]
        kc[:, :, cache_len:] = tail[:, None]
        vc[:, :, cache_len:] = tail.flip(0)[:, None]
    g = rnd(b, L, Hq * D) * 2 if gate else None
    return dict(q=q, k_cache=kc, v_cache=vc, k_block=kb, v_block=vb, cache_len=cache_len, gate=g)


def float64_attention(q, k_cache, v_cache, k_block, v_block, cache_len, gate=None, scale=None):
    """Written independently of the module: per query head, its kv head h // (Hq / Hkv), float64."""
    b, Hq, L, D = q.shape
    Hkv = k_cache.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(b, L, Hq, D, dtype=torch.float64, device=q.device)
    for h in range(Hq):
        kvh = h // (Hq // Hkv)
        k = torch.cat([k_cache[:, kvh, :cache_len], k_block[:, kvh]], dim=1).double()  # [b, N, D]
        v = torch.cat([v_cache[:, kvh, :cache_len], v_block[:, kvh]], dim=1).double()
        s = torch.einsum("bld,bnd->bln", q[:, h].double(), k) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        out[:, :, h] = torch.einsum("bln,bnd->bld", p / p.sum(-1, keepdim=True), v)
    out = out.reshape(b, L, Hq * D)
    return out if gate is None else out * torch.sigmoid(gate.double())


def tol(dtype):
    return {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
# b, Hq, Hkv, L, D, cache_len, capacity, dtype, gate, num_splits
CASES = {
    "empty-cache-no-storage": (1, 2, 2, 4, 128, 0, 0, F32, False, None),  # GQA 1, cache_len 0, capacity 0
    "empty-cache-poisoned": (1, 8, 1, 4, 256, 0, 40, F16, True, None),  # every cache slot is garbage
    "cache-1-block-1": (1, 8, 2, 1, 128, 1, 16, F16, True, None),  # GQA 4, L 1 (15 padded rows)
    "ragged-batch2-gqa8": (2, 8, 1, 17, 256, 300, 333, F16, True, None),  # 300: a non-multiple of 256 keys
    "ragged-fp32-block-32": (1, 4, 1, 32, 256, 77, 90, F32, False, None),
    "clover-heads": (1, 16, 2, 32, 256, 64, 100, F16, True, None),  # 16 q / 2 kv heads, head_dim 256
    "gqa1-fp32-batch2": (2, 2, 2, 4, 128, 257, 300, F32, True, 2),
    "long-2500": (1, 4, 1, 17, 128, 2500, 2600, F16, True, 2),  # a few thousand keys, two splits
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_block_attention_matches_references(device, case):
    b, Hq, Hkv, L, D, cache_len, cap, dtype, gate, splits = CASES[case]
    args = make_inputs(b, Hq, Hkv, L, D, cache_len, cap, dtype, gate, device=device)
    y = block_attention(**args, num_splits=splits)
    assert y.shape == (b, L, Hq * D) and y.dtype == dtype
    assert torch.isfinite(y).all()
    ref = block_attention_reference(**args)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(y, ref, **tol(dtype))
    f64 = float64_attention(**args)
    torch.testing.assert_close(y.double(), f64, **tol(dtype))
    torch.testing.assert_close(ref.double(), f64, **tol(dtype))  # the reference itself is right


def test_bf16_is_computed_in_fp32_under_the_interpreter_and_scale_is_honoured(device):
    """bf16 inputs: computed in fp32 under the interpreter (its bf16 arithmetic is wrong), in bf16 on a GPU."""
    args = make_inputs(1, 4, 2, 5, 128, 40, 48, torch.bfloat16, True, device=device)
    y = block_attention(**args, scale=0.2)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), float64_attention(**args, scale=0.2), **tol(torch.bfloat16))


@pytest.mark.parametrize("D", [64, 96])
def test_other_head_dims_and_strided_inputs(device, D):
    # Layouts as GatedAttention produces them: q a transposed view, the cache a slice of a wider buffer.
    b, Hq, Hkv, L, cache_len = 1, 4, 2, 6, 50
    args = make_inputs(b, Hq, Hkv, L, D, cache_len, 64, F32, True, device=device)
    args["q"] = args["q"].transpose(1, 2).contiguous().transpose(1, 2)  # [b, Hq, L, D] with L-major strides
    wide = torch.randn(b, Hkv, 64, 2 * D, generator=GEN).to(device)
    wide[..., :D] = args["k_cache"]
    args["k_cache"] = wide[..., :D]  # row stride 2*D
    assert not args["q"].is_contiguous() and not args["k_cache"].is_contiguous()
    y = block_attention(**args)
    torch.testing.assert_close(y.double(), float64_attention(**args), **tol(F32))
    # ... and PyTorch's own GQA attention agrees (a third, unrelated implementation).
    k = torch.cat([args["k_cache"][:, :, :cache_len], args["k_block"]], 2)
    v = torch.cat([args["v_cache"][:, :, :cache_len], args["v_block"]], 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(args["q"], k, v, enable_gqa=True)
    sdpa = sdpa.transpose(1, 2).reshape(b, L, Hq * D) * torch.sigmoid(args["gate"])
    # On a GPU torch's own fp32 attention kernels are free to round otherwise: 1e-3 there.
    torch.testing.assert_close(y, sdpa, **(dict(atol=1e-3, rtol=1e-3) if on_gpu() else tol(F32)))


@pytest.mark.parametrize("splits", [1, 3])
def test_gate_read_in_place_from_the_query_projection(device, splits):
    # GatedAttention passes the gate half of q_proj's [b, L, Hq, 2D] output as it is: a strided 4-D view.
    b, Hq, Hkv, L, D = 2, 4, 2, 5, 64
    args = make_inputs(b, Hq, Hkv, L, D, 70, 80, F32, False, device=device)
    qg = torch.randn(b, L, Hq, 2 * D, generator=GEN).to(device) * 2
    args["gate"] = qg[..., D:]
    assert not args["gate"].is_contiguous()
    y = block_attention(**args, num_splits=splits)
    want = float64_attention(**{**args, "gate": args["gate"].reshape(b, L, Hq * D)})
    torch.testing.assert_close(y.double(), want, **tol(F32))
    torch.testing.assert_close(block_attention_reference(**args).double(), want, **tol(F32))


def test_split_kv_equals_single_split(device, monkeypatch):
    # 32-key steps over 200 keys: 7 steps, so 1, 3 and 7 splits all exist; 16-row merge tiles over 80 rows
    # (the interpreter's config; a GPU takes its table's, with fewer, longer steps).
    monkeypatch.setattr(configs, "INTERPRET_ATTENTION", configs.AttentionConfig(512, 32, 4, 1, 16))
    assert [split_plan(200, s, 32)[0] for s in (1, 3, 7, 50)] == [1, 3, 7, 7]
    args = make_inputs(2, 8, 2, 5, 64, 200, 230, F32, True, device=device)
    one = block_attention(**args, num_splits=1)
    for s in (3, 7, 50):
        torch.testing.assert_close(block_attention(**args, num_splits=s), one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block_attention(**args), one, atol=1e-5, rtol=1e-5)  # automatic choice
    torch.testing.assert_close(one.double(), float64_attention(**args), **tol(F32))


def test_row_tiles_and_block_steps_smaller_than_the_problem(device, monkeypatch):
    # GPU-like tiles: 16-row tiles over 4 heads x 17 positions = 68 rows (5 row tiles), 16-key steps, so the
    # block's own 17 keys take two steps; three splits (on a GPU, its table's tiles).
    monkeypatch.setattr(configs, "INTERPRET_ATTENTION", configs.AttentionConfig(16, 16, 4, 1, 16))
    args = make_inputs(1, 4, 1, 17, 64, 45, 50, F16, True, device=device)
    y = block_attention(**args, num_splits=3)
    torch.testing.assert_close(y.double(), float64_attention(**args), **tol(F16))
    torch.testing.assert_close(block_attention(**args, num_splits=1), y, atol=2e-3, rtol=2e-3)


@pytest.mark.interpret_only("the split count's arithmetic: no launch")
def test_choose_num_splits():
    per = configs.ATTENTION_MIN_KEYS_PER_SPLIT
    assert choose_num_splits(0, 2, 132, 64) == 1
    assert choose_num_splits(per, 2, 132, 64) == 1  # short caches: one split, no merge kernel
    assert choose_num_splits(32768, 2, 132, 64) == 32768 // per  # long: limited by keys per split
    assert choose_num_splits(32768, 64, 132, 64) == 5  # many programs already: limited by ~2 waves
    assert choose_num_splits(1 << 22, 1, 1000, 64) == configs.ATTENTION_MAX_SPLITS
    assert split_plan(0, 5, 64) == (1, 0) and split_plan(65, 5, 64) == (2, 64)


@pytest.mark.interpret_only("argument checks before any launch, the same on every device")
def test_bad_arguments_fail_before_launch(monkeypatch):
    args = make_inputs(1, 4, 2, 3, 64, 10, 16, F32, True, poison=False)

    def bad(match, **changes):
        with pytest.raises(ValueError, match=match):
            block_attention(**{**args, **changes})

    bad("q must be 4-D", q=args["q"][0])
    bad("fp16, bf16 or fp32", q=args["q"].double())
    bad("k_cache is torch.float16", k_cache=args["k_cache"].half())
    bad("block length", q=torch.randn(1, 4, 65, 64), k_block=torch.randn(1, 2, 65, 64),
        v_block=torch.randn(1, 2, 65, 64), gate=None)
    bad("head_dim must be a multiple of 16", q=torch.randn(1, 4, 3, 40), k_cache=torch.randn(1, 2, 16, 40),
        v_cache=torch.randn(1, 2, 16, 40), k_block=torch.randn(1, 2, 3, 40), v_block=torch.randn(1, 2, 3, 40),
        gate=None)
    bad("head_dim must be a multiple of 16", q=torch.randn(1, 4, 3, 512), k_cache=torch.randn(1, 2, 16, 512),
        v_cache=torch.randn(1, 2, 16, 512), k_block=torch.randn(1, 2, 3, 512), v_block=torch.randn(1, 2, 3, 512),
        gate=None)
    bad("multiple of the 3 kv heads", k_cache=torch.randn(1, 3, 16, 64), v_cache=torch.randn(1, 3, 16, 64),
        k_block=torch.randn(1, 3, 3, 64), v_block=torch.randn(1, 3, 3, 64))
    bad("k_cache must be", k_cache=torch.randn(2, 2, 16, 64), v_cache=torch.randn(2, 2, 16, 64))
    bad("v_cache has shape", v_cache=torch.randn(1, 2, 15, 64))
    bad("k_block must be", k_block=torch.randn(1, 2, 4, 64))
    bad("v_block must be", v_block=torch.randn(1, 2, 3, 32))
    bad(r"cache_len must be in 0..capacity \(16\)", cache_len=17)
    bad("cache_len must be in", cache_len=-1)
    bad("cache_len must be an int", cache_len=3.0)
    bad("scale must be", scale=float("nan"))
    bad("gate must be", gate=torch.randn(1, 3, 4 * 64 + 1))
    bad("gate is torch.float16", gate=args["gate"].half())
    bad("num_splits must be", num_splits=0)
    bad("different devices", q=args["q"].to("meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    bad("CUDA tensors")


@pytest.mark.interpret_only("the tables' arithmetic: no launch (the GPU run compiles the entries in use)")
def test_every_attention_config_fits_its_architecture():
    def pow2(x):
        return x & (x - 1) == 0

    assert set(configs.ATTENTION_TABLE) == set(configs.SMEM_LIMIT)
    for arch, table in configs.ATTENTION_TABLE.items():
        assert set(table) == set(configs.ATTENTION_HEAD_DIMS), arch
        for d, c in table.items():
            # every tl.dot dim: rows (block_m), keys (block_n; the block's own keys use min(block_n, >=16)),
            # and head_dim (a multiple of 16 by validation)
            assert min(c.block_m, c.block_n, c.merge_rows) >= 16 and pow2(c.block_m) and pow2(c.block_n), (arch, c)
            assert c.num_warps in (1, 2, 4, 8, 16) and c.num_stages >= 1
            assert c.smem_bytes(d) <= configs.SMEM_LIMIT[arch], (arch, d, c, c.smem_bytes(d))
            assert configs.attention_config(arch, d) == c  # 16-bit inputs: the table entry as written
            fp32 = configs.attention_config(arch, d, elem_bytes=4)  # fp32 inputs: shrunk until it fits
            assert min(fp32.block_m, fp32.block_n) >= 16 and fp32.smem_bytes(d, 4) <= configs.SMEM_LIMIT[arch]
        assert configs.attention_config(arch, 64) == table[128] and configs.attention_config(arch, 96) == table[128]
    c = configs.INTERPRET_ATTENTION
    assert min(c.block_m, c.block_n, c.merge_rows) >= 16 and pow2(c.block_m) and pow2(c.block_n)
    assert c.block_m >= 8 * 64  # under the interpreter one row tile holds 8 heads x 64 positions


def test_cache_length_read_from_device_memory(device):
    """The CUDA-graph form: the length is a device tensor and the number of splits fixed for the whole
    capacity (trailing splits empty for a short cache); results equal the int-length kernel."""
    from clover_lite.kernels.attention import block_attention

    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 4, 4, 32, generator=g).to(device)
    kc, vc = (torch.randn(1, 2, 300, 32, generator=g).to(device) for _ in range(2))
    kb, vb = (torch.randn(1, 2, 4, 32, generator=g).to(device) for _ in range(2))
    gate = torch.randn(1, 4, 128, generator=g).to(device)
    for n in (0, 1, 77, 300):
        want = block_attention(q, kc, vc, kb, vb, n, gate=gate)
        for splits in (1, 3, 8):
            got = block_attention(q, kc, vc, kb, vb, torch.tensor([n], dtype=torch.int32, device=device), gate=gate,
                                  num_splits=splits)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_splits"):
        block_attention(q, kc, vc, kb, vb, torch.tensor([3], device=device))


# The GPU check's shapes: Clover's heads (16 q, 2 kv heads of 256) over caches of 0 to 32K keys, a block of 4
# and of 32, in fp16 and bf16 (bf16 arithmetic: a GPU's alone); one small case in fp32 in the interpreter.
MODEL_ATTENTION = ([(16, 2, 256, n, L, dt) for n in (0, 1, 1000, 8191, 32768) for L in (4, 32) for dt in (F16, BF16)]
                   if on_gpu() else [(2, 2, 64, 40, 4, F32)])


@pytest.mark.parametrize("hq, hkv, d, n, L, dtype", MODEL_ATTENTION)
def test_attention_at_the_models_heads(device, hq, hkv, d, n, L, dtype, report_err):
    gen = torch.Generator().manual_seed(n + L)
    q = torch.randn(1, hq, L, d, generator=gen).to(device, dtype)
    kc, vc = (torch.randn(1, hkv, n + 7, d, generator=gen).to(device, dtype) for _ in range(2))
    kb, vb = (torch.randn(1, hkv, L, d, generator=gen).to(device, dtype) for _ in range(2))
    gate = torch.randn(1, L, hq * d, generator=gen).to(device, dtype)
    out = block_attention(q, kc, vc, kb, vb, n, gate=gate)
    ref = block_attention_reference(q, kc, vc, kb, vb, n, gate=gate)
    err = report_err(f"block attention, {str(dtype).removeprefix('torch.')}", rel_err(out, ref))
    assert err < (1e-4 if dtype == torch.float32 else 2e-2)
