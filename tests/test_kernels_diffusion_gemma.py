"""DiffusionGemma on the Triton kernels (the interpreter, or the GPU with --device cuda): its INT4 linears,
GELU experts and norms against the reference path. What the next GPU session checks before
configs.VERIFIED may turn DiffusionGemma's kernels on by default (docs/ARCHITECTURE.md sections 7.4 and 11)."""

import pytest
import torch

pytest.importorskip("triton")

from clover_lite.checkpoint.diffusion_gemma_weights import load_diffusion_gemma  # noqa: E402
from clover_lite.checkpoint.tiny_diffusion_gemma import write_tiny_diffusion_gemma  # noqa: E402
from clover_lite.kernels.forwards import install  # noqa: E402
from clover_lite.models.quantized import gptq_experts  # noqa: E402
from clover_lite.quant.diffusion_gemma import quantize_diffusion_gemma  # noqa: E402
from clover_lite.quant.gptq import gptq_quantize  # noqa: E402
from clover_lite.quant.pipeline import QuantizeOptions  # noqa: E402
from clover_lite.quant.rtn import QuantSpec  # noqa: E402
from clover_lite.runtime.diffusion_gemma_loop import DiffusionGemmaSettings, generate  # noqa: E402

from .devices import on_gpu, rel_err  # noqa: E402
from .seed import SEED as RUN_SEED

pytestmark = pytest.mark.gpu
SEED = RUN_SEED % 10_000  # this run's seed (tests/seed.py): CLOVER_TEST_SEED repeats it


def test_triton_kernels_give_the_reference_tokens(tmp_path, device, report_err):
    """Loaded with the Triton kernels, an INT4 DiffusionGemma denoises like its reference path: INT4 GEMMs for
    the linears, the fused MoE with GELU experts, the RMSNorm kernel. In the interpreter the seeded generation's
    tokens are equal; on a GPU (tf32 and another summation order) the first step's logits agree to 5e-3 of
    their largest value, and the tokens are reported."""
    src = write_tiny_diffusion_gemma(tmp_path / "src", seed=SEED + 2, num_hidden_layers=2, canvas_length=8,
                                     layer_types=["sliding_attention", "full_attention"], num_experts=4)
    quantize_diffusion_gemma(src, tmp_path / "q", QuantizeOptions(group_size=32, nsamples=4, seqlen=32, method="rtn"))
    ref, _ = load_diffusion_gemma(tmp_path / "q", device=device, kernels="torch")
    tri, _ = load_diffusion_gemma(tmp_path / "q", device=device, kernels="triton")
    layer = tri.decoder.layers[1]
    for m in (layer.self_attn.q_proj, layer.experts, layer.input_layernorm):
        assert "forward" in vars(m), type(m).__name__  # a kernel bound on the instance; the class stays reference
    prompt = torch.randint(0, 256, (9,)).tolist()  # > 4 rows: the GEMM paths, as a 256-position canvas takes
    ids, canvas = torch.tensor([prompt], device=device), torch.randint(0, 256, (1, 8)).to(device)
    with torch.no_grad():
        cr, ct = ref.new_cache(), tri.new_cache()
        ref.encode(ids, cr)
        tri.encode(ids, ct)
        want, got = ref.denoise(canvas, cr), tri.denoise(canvas, ct)
    err = report_err("diffusion_gemma int4 model logits", rel_err(got, want))
    assert err < (5e-3 if on_gpu() else 1e-4), err
    if on_gpu():
        return
    settings = DiffusionGemmaSettings(max_new_tokens=8, max_denoising_steps=2, stability_threshold=None,
                                      eos_token_ids=())
    want = generate(ref, prompt, settings, generator=torch.Generator().manual_seed(SEED))
    got = generate(tri, prompt, settings, generator=torch.Generator().manual_seed(SEED))
    assert got.tokens == want.tokens, SEED


@pytest.mark.parametrize("tokens", [3, 40])  # a program per (token, expert) pair, and the tiled GEMM
def test_fused_moe_with_gelu_matches_reference(device, report_err, tokens):
    """The GELU experts' kernel path on its own, with act-order weights (gate, up and the down input gathered
    in each expert's row order), against QuantExperts' reference."""
    E, H, inter, k = 4, 64, 32, 2
    gen = torch.Generator().manual_seed(SEED)
    ex = gptq_experts(E, H, inter, H // 32, inter // 16, activation="gelu_pytorch_tanh")
    shapes = {"gate_proj": (inter, H, 32), "up_proj": (inter, H, 32), "down_proj": (H, inter, 16)}
    for part, (n, kk, g) in shapes.items():
        x = torch.randn(64, kk, generator=gen) * torch.rand(kk, generator=gen)  # uneven columns: a real act-order
        qw = gptq_quantize(torch.randn(E, n, kk, generator=gen) * 0.1, 2 * x.t() @ x / 64, QuantSpec(g),
                           act_order=True, static_groups=False)  # groups in act order: g_idx not k // G
        for e in range(E):
            for key, v in qw[e].pack().items():
                getattr(getattr(ex, part), key)[e].copy_(v)
    ex = ex.to(device)
    x = torch.randn(tokens, H, generator=gen).to(device)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(device)
    w = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(device)
    want = ex(x, w, ids)
    install(ex)
    assert ex.gate_proj.k_perm is not None  # rows regrouped: the gathered-input path
    err = report_err("fused_moe gelu experts", rel_err(ex(x, w, ids), want))
    assert err < (5e-3 if on_gpu() else 1e-5), err
