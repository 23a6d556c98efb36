"""Probes: a GPTQ checkpoint whose quantize_config omits checkpoint_format is v1 (stored zero = zero - 1); a
quantized linear's bias takes the model dtype (bfloat16 load runs)."""

import numpy as np
import torch
from safetensors.torch import load_file

import clover_lite

from .test_quant_loader import fake_gptq, write_twins


def _gptq_dir(tiny_dir, tmp_path, qc, bias=False):
    rng = np.random.default_rng(0)
    src = load_file(tiny_dir / "model.safetensors")
    quant, floats = {}, {}
    for name, w in src.items():
        if name.startswith("model.layers.") and name.endswith(".self_attn.o_proj.weight"):
            tensors, deq = fake_gptq(w, 32, "gptq", False, False, rng)
            base = name[: -len(".weight")]
            quant.update({f"{base}.{k}": v for k, v in tensors.items()})
            floats[name] = deq
            if bias:
                quant[f"{base}.bias"] = torch.randn(w.shape[0])
        else:
            quant[name] = floats[name] = w
    return write_twins(tiny_dir, tmp_path, quant, floats, qc)


def test_checkpoint_format_defaults_to_v1(tiny_dir, tmp_path):
    qdir, fdir = _gptq_dir(tiny_dir, tmp_path, {"bits": 4, "group_size": 32, "quant_method": "gptq"})
    q, f = clover_lite.load(qdir, device="cpu"), clover_lite.load(fdir, device="cpu")
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(q.model(ids, block_size=4), f.model(ids, block_size=4), atol=2e-4, rtol=2e-4)


def test_quantized_bias_follows_the_model_dtype(tiny_dir, tmp_path):
    qdir, _ = _gptq_dir(tiny_dir, tmp_path, {"bits": 4, "group_size": 32, "quant_method": "gptq"}, bias=True)
    q = clover_lite.load(qdir, device="cpu", dtype=torch.bfloat16)
    lin = q.model.layers[3].self_attn.o_proj
    assert type(lin).__name__ == "QuantLinear" and lin.bias is not None and lin.bias.dtype == torch.bfloat16
    with torch.no_grad():
        q.model(torch.randint(0, 256, (1, 9)), block_size=4)
