"""GPTQ checkpoints written by other tools: tensors packed here by an independent numpy packer in every
variant (v1/v2, sym/asym, act-order g_idx or none, config in quantize_config.json or config.json); the
loaded model must equal a float model holding the same weights dequantized in float64."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import clover_lite
from clover_lite.errors import CheckpointError


def np_pack_rows(v: np.ndarray) -> np.ndarray:
    out = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
    for j in range(8):
        out |= (v[j::8].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return out.view(np.int32)


def write_twins(src, tmp_path, quant: dict, floats: dict, quantize_config: dict):
    """`src` copied twice: with the GPTQ tensors `quant` (and quantize_config.json), and with `floats`, the same
    weights dequantized; the two must load to the same model."""
    qdir, fdir = tmp_path / "q", tmp_path / "f"
    for d, tensors in ((qdir, quant), (fdir, floats)):
        shutil.copytree(src, d)
        save_file(tensors, d / "model.safetensors")
    (qdir / "quantize_config.json").write_text(json.dumps(quantize_config))
    return qdir, fdir


def fake_gptq(w: torch.Tensor, group: int, fmt: str, sym: bool, act_order: bool, rng: np.random.Generator):
    """Quantize w [N, K] the simple way and pack it as a GPTQ tool would; returns (tensors, dequantized w)."""
    N, K = w.shape
    G = K // group
    g_idx = rng.permutation(np.arange(K) // group) if act_order else np.arange(K) // group
    wn = w.double().numpy()
    scales = np.zeros((G, N))
    zeros = np.zeros((G, N), dtype=np.int64)
    for g in range(G):
        cols = wn[:, g_idx == g]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if sym:
            hi = np.maximum(-lo, hi)
            lo = -hi
        scales[g] = np.float16((hi - lo) / 15 + 1e-8)
        zeros[g] = 8 if sym else np.clip(np.round(-lo / scales[g]), 1, 15)
    scales = scales.astype(np.float16).astype(np.float64)
    q = np.clip(np.round(wn.T / scales[g_idx]) + zeros[g_idx], 0, 15).astype(np.int64)  # [K, N]
    deq = ((q - zeros[g_idx]) * scales[g_idx]).T  # [N, K]
    stored = zeros - (1 if fmt == "gptq" else 0)
    tensors = {
        "qweight": torch.from_numpy(np_pack_rows(q)),
        "qzeros": torch.from_numpy(np_pack_rows(stored.T).T.copy()),
        "scales": torch.from_numpy(scales.astype(np.float16)),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }
    return tensors, torch.from_numpy(deq).float().contiguous()


@pytest.mark.parametrize(
    "fmt,sym,act_order,g_idx_saved,in_config",
    [("gptq", True, False, True, False), ("gptq", False, True, True, True),
     ("gptq_v2", False, True, True, False), ("gptq_v2", True, False, False, True)],
)
def test_foreign_gptq_checkpoint(tiny_dir, tmp_path, fmt, sym, act_order, g_idx_saved, in_config):
    rng = np.random.default_rng(abs(hash((fmt, sym, act_order))) % 2**32)
    src = load_file(tiny_dir / "model.safetensors")
    quant, floats = {}, {}
    targets = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".in_proj_qkv.weight",
               ".in_proj_z.weight", ".out_proj.weight", "_proj.weight")
    for name, w in src.items():
        quantizable = name.endswith(targets) and ".mlp.gate." not in name and "shared_expert_gate" not in name
        if quantizable and name.startswith("model.layers."):
            tensors, deq = fake_gptq(w, 32, fmt, sym, act_order, rng)
            base = name[: -len(".weight")]
            for k, v in tensors.items():
                if k != "g_idx" or g_idx_saved:
                    quant[f"{base}.{k}"] = v
            floats[name] = deq
        else:
            quant[name] = w
            floats[name] = w
    qdir, fdir = tmp_path / "gptq", tmp_path / "float"
    for d, tensors in ((qdir, quant), (fdir, floats)):
        shutil.copytree(tiny_dir, d)
        save_file(tensors, d / "model.safetensors")
    qc = {"bits": 4, "group_size": 32, "sym": sym, "desc_act": act_order, "checkpoint_format": fmt,
          "quant_method": "gptq"}
    if in_config:
        cfg = json.loads((qdir / "config.json").read_text())
        (qdir / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    else:
        (qdir / "quantize_config.json").write_text(json.dumps(qc))
    q = clover_lite.load(qdir, device="cpu")
    f = clover_lite.load(fdir, device="cpu")
    assert type(q.model.layers[0].mlp.experts).__name__ == "QuantExperts"
    ids = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(q.model(ids, block_size=4), f.model(ids, block_size=4), atol=2e-4, rtol=2e-4)
    assert q.generate([1, 2, 3], max_new_tokens=6).token_ids == f.generate([1, 2, 3], max_new_tokens=6).token_ids


def test_quantized_checkpoint_errors(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "quantize_config.json").write_text(json.dumps({"bits": 3, "quant_method": "gptq"}))
    with pytest.raises(CheckpointError, match="3-bit"):
        clover_lite.load(d)
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4, "quant_method": "awq"}))
    with pytest.raises(CheckpointError, match="awq"):
        clover_lite.load(d)
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4, "checkpoint_format": "marlin"}))
    with pytest.raises(CheckpointError, match="marlin"):
        clover_lite.load(d)
    # A qweight stored as float is a broken file, named as such.
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32}))
    t = load_file(d / "model.safetensors")
    w = t.pop("model.layers.3.self_attn.o_proj.weight")
    t["model.layers.3.self_attn.o_proj.qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0])
    t["model.layers.3.self_attn.o_proj.qzeros"] = torch.zeros(w.shape[1] // 32, w.shape[0] // 8, dtype=torch.int32)
    t["model.layers.3.self_attn.o_proj.scales"] = torch.zeros(w.shape[1] // 32, w.shape[0], dtype=torch.float16)
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="o_proj.qweight.*integer"):
        clover_lite.load(d)
