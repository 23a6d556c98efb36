"""The MoE routing kernels (router top-k, sort of the pairs by expert, combine) in the Triton interpreter (or
on the GPU with --device cuda), against float64 torch and a plain Python stable sort."""

import pytest
import torch

from clover_lite.kernels import moe_route
from clover_lite.kernels.moe_route import combine, sort_pairs, sort_pairs_reference, topk_softmax

from .devices import on_gpu, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T, E, k, normalize, dtype", [
    (1, 8, 2, True, torch.float32), (5, 20, 3, False, torch.float16), (33, 256, 8, True, torch.float32),
    (3, 100, 1, True, torch.bfloat16),
])
def test_topk_softmax_matches_float64(device, T, E, k, normalize, dtype):
    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g).to(device, torch.float16 if dtype == torch.float16 else torch.float32)
    weights, ids = topk_softmax(logits, k, normalize, dtype)
    probs = torch.softmax(logits.double(), -1)
    ref_w, ref_ids = torch.topk(probs, k)
    if normalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == dtype
    assert torch.equal(ids, ref_ids)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(weights.double(), ref_w, rtol=tol, atol=tol)


def test_topk_ties_go_to_the_lower_expert(device):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]], device=device)
    weights, ids = topk_softmax(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3))


def _python_sort(ids, weights):
    """The pairs' stable order by expert, worked element by element."""
    e, w = ids.reshape(-1).tolist(), weights.reshape(-1).tolist()
    k = ids.shape[1]
    order = sorted(range(len(e)), key=lambda i: (e[i], i))
    position = [0] * len(e)
    for p, i in enumerate(order):
        position[i] = p
    sorted_e = [e[i] for i in order]
    rank = [sum(1 for q in range(p) if sorted_e[q] == sorted_e[p]) for p in range(len(e))]
    count = [sorted_e.count(x) for x in sorted_e]
    return dict(expert=sorted_e, token=[i // k for i in order], scale=[w[i] for i in order], position=position,
                rank=rank, count=count)


@pytest.mark.parametrize("T, k, E, skew", [(1, 1, 4, False), (7, 3, 16, False), (40, 8, 256, False),
                                           (19, 4, 8, True), (0, 2, 8, False)])
def test_sort_pairs_matches_a_python_stable_sort(device, T, k, E, skew):
    """Ragged pair counts (more than one program at 320 pairs), experts with no pair, one expert holding most."""
    g = torch.Generator().manual_seed(T * 31 + k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()
    if skew:
        ids[:, 0] = 5  # every token's first choice is expert 5
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).to(torch.float16)
    want = _python_sort(ids, weights.float())
    ids, weights = ids.to(device), weights.to(device)
    for got in (sort_pairs(ids, weights, E), sort_pairs_reference(ids, weights, E), sort_pairs(ids.int(), weights, E)):
        for field, values in want.items():
            t = getattr(got, field)
            assert t.dtype == (torch.float32 if field == "scale" else torch.int32), field
            assert t.tolist() == values, field


def test_sort_pairs_past_the_kernel_limit_takes_torch(device, monkeypatch):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (9, 2), generator=g).to(device)
    weights = torch.rand(9, 2, generator=g).to(device)
    kernel = sort_pairs(ids, weights, 6)
    monkeypatch.setattr(moe_route, "SORT_KERNEL_MAX_PAIRS", 4)
    monkeypatch.setattr(moe_route, "_sort_pairs_kernel", None)  # would fail if launched
    fallback = sort_pairs(ids, weights, 6)
    for field in ("expert", "token", "scale", "position", "rank", "count"):
        assert torch.equal(getattr(kernel, field), getattr(fallback, field)), field


@pytest.mark.parametrize("splits, T, k, N, dtype", [(1, 3, 2, 40, torch.float32), (4, 6, 3, 1100, torch.float16),
                                                    (2, 1, 8, 7, torch.bfloat16)])
def test_combine_sums_splits_and_pairs_in_float64(device, splits, T, k, N, dtype):
    g = torch.Generator().manual_seed(splits * 100 + N)
    R = T * k + 5  # rows the pairs do not use are never read
    y = torch.randn(splits, R, N, generator=g)
    rows = torch.randperm(R, generator=g)[: T * k].to(torch.int32)
    out = combine(y.to(device), rows.to(device), k, dtype).cpu()
    ref = y.double().sum(0)[rows.long()].view(T, k, N).sum(1)
    assert out.dtype == dtype and out.shape == (T, N)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # The decoder's residual, added in the same kernel (in its own dtype, summed in fp32).
    residual = torch.randn(T, N, generator=g).to(dtype)
    out = combine(y.to(device), rows.to(device), k, dtype, residual=residual.to(device)).cpu()
    ref = ref + residual.double()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_router_kernel_in_the_moe_layer_matches_torch(device):
    """SparseMoE on the kernel path (router and shared-expert gate in one matmul, the top-k kernel, the gate
    applied with the experts' sum) against its torch path, including the return_routing path."""
    from clover_lite.checkpoint.tiny import tiny_config
    from clover_lite.kernels import dispatch
    from clover_lite.models.config import config_from_dict
    from clover_lite.models.moe import SparseMoE

    cfg = config_from_dict(tiny_config())
    assert cfg.shared_expert_intermediate_size
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.to(device)
    x = torch.randn(2, 5, cfg.hidden_size).to(device)
    ref = moe(x)
    dispatch.apply(moe, "triton")
    assert moe._gate_rows.shape == (cfg.num_experts + 1, cfg.hidden_size)
    assert moe.gate.weight.data_ptr() == moe._gate_rows.data_ptr()  # the modules view the joined weight
    # On a GPU the joined router matmul may take another cuBLAS kernel than the two it replaces: fp32 rounding.
    torch.testing.assert_close(moe(x), ref, rtol=1e-4 if on_gpu() else 1e-5, atol=1e-5 if on_gpu() else 1e-6)
    # Training's path keeps the probabilities: the reference routing, which through the views computes
    # exactly what it did before the kernels were installed.
    out, probs, ids = moe(x, return_routing=True)
    assert probs.shape == (10, cfg.num_experts) and ids.shape == (10, cfg.num_experts_per_tok)
    assert torch.equal(out, ref)


@pytest.mark.interpret_only("the GPU's tiles in the interpreter; on a GPU every test here runs them")
def test_gpu_tiles_under_the_interpreter(monkeypatch):
    """The launchers' GPU tiles (a token per program) run under the interpreter too, with the same results."""
    g = torch.Generator().manual_seed(5)
    logits, y = torch.randn(5, 20, generator=g), torch.randn(2, 15, 1100, generator=g)
    rows = torch.randperm(15, generator=g)[:15].to(torch.int32)
    ids = torch.randint(0, 9, (50, 3), generator=g)  # 150 pairs: 3 programs of 64 pairs, 5 steps of 32
    big = topk_softmax(logits, 3, True, torch.float32), combine(y, rows, 3, torch.float32), sort_pairs(ids, ids, 9)
    monkeypatch.setattr(moe_route, "interpreting", lambda: False)
    small = topk_softmax(logits, 3, True, torch.float32), combine(y, rows, 3, torch.float32), sort_pairs(ids, ids, 9)
    assert torch.equal(big[0][1], small[0][1])
    torch.testing.assert_close(big[0][0], small[0][0])
    torch.testing.assert_close(big[1], small[1])
    for field, values in _python_sort(ids, ids.float()).items():
        assert getattr(small[2], field).tolist() == values, field


@pytest.mark.interpret_only("argument checks before any launch, the same on every device")
def test_bad_arguments():
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        topk_softmax(torch.zeros(8), 2, True, torch.float32)
    with pytest.raises(ValueError, match="top-k"):
        topk_softmax(torch.zeros(2, 4), 5, True, torch.float32)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        sort_pairs(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2), 4)
    with pytest.raises(ValueError, match="multiple of top-k"):
        combine(torch.zeros(1, 4, 8), torch.zeros(5, dtype=torch.int32), 2, torch.float32)
    with pytest.raises(ValueError, match="residual must be"):
        combine(torch.zeros(1, 4, 8), torch.zeros(4, dtype=torch.int32), 2, torch.float32, residual=torch.zeros(2, 7))


# The GPU check's shapes: Clover's router (256 experts, top 8, hidden 2048) in the runtime's dtype (bf16: a
# GPU's alone) at a step's and a block's tokens; small ones in the interpreter.
@pytest.mark.parametrize("T", [1, 5, 32, 64] if on_gpu() else [3, 9])
def test_routing_at_the_models_shapes(device, T, report_err):
    """Router top-k against torch's (a bf16 tie at the k-th place may go either way: one token may differ),
    the sort of the pairs exactly as torch's sort, the combine against float64."""
    E, k, H = (256, 8, 2048) if on_gpu() else (16, 2, 64)
    dt = torch.bfloat16 if on_gpu() else torch.float32
    gen = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=gen).to(device, dt)
    w, ids = topk_softmax(logits, k, True, dt)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), k)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert int((~same).sum()) <= 1, "tokens chose other experts than torch.topk"
    if same.any():
        err = (w[same].float() - ref_w[same]).abs().max().item()
        assert report_err("MoE routing weights", err) < 1e-2
    pairs, ref = sort_pairs(ids, w, E), sort_pairs_reference(ids, w, E)
    for f in ("expert", "token", "scale", "position", "rank", "count"):
        assert torch.equal(getattr(pairs, f), getattr(ref, f)), f
    y = torch.randn(3, T * k, H, generator=gen).to(device)
    out = combine(y, pairs.position, k, dt)
    want = y.double().sum(0)[pairs.position.long()].view(T, k, H).sum(1)
    assert report_err("MoE combine", rel_err(out, want)) < 1e-2
