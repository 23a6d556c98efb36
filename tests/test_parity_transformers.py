"""Parity with implementations nobody here wrote: transformers' Qwen3.5-MoE and Qwen3-Next on tiny random
configs. With block_size=1 the block-causal mask is the causal mask, so logits must match."""

import pytest
import torch

from clover_lite.checkpoint.load import load_model
from clover_lite.models import load_config

from . import hf_models
from .seed import SEED

pytest.importorskip("transformers")


def _compare(hf_model, path, lengths=(1, 3, 17, 70), tol=2e-5, tie=False):
    config = load_config(path)
    ours, report = load_model(path, config)
    gen = torch.Generator().manual_seed(SEED + sum(lengths))
    for T in lengths:
        ids = torch.randint(0, config.vocab_size, (2, T), generator=gen)
        with torch.no_grad():
            ref = hf_model(input_ids=ids).logits.float()
            out = ours(ids, block_size=1)
        assert out.shape == ref.shape
        err = (out - ref).abs().max().item()
        assert err < tol * max(1.0, ref.abs().max().item()), f"T={T}: max abs diff {err}"
    return ours, report


def test_qwen3_5_moe_text_matches_transformers(tmp_path):
    hf = hf_models.qwen3_5_moe_causal(tmp_path, seed=1)
    _compare(hf, tmp_path)


def test_qwen3_5_moe_tied_embeddings(tmp_path):
    hf = hf_models.qwen3_5_moe_causal(tmp_path, seed=2, tie_word_embeddings=True)
    ours, _ = _compare(hf, tmp_path, lengths=(5, 33))
    assert ours.lm_head is None


def test_qwen3_5_moe_multimodal_checkpoint_text_path(tmp_path):
    """The multimodal wrapper stores the text model under model.language_model.* next to a vision tower,
    which is skipped with a note."""
    hf = hf_models.qwen3_5_moe_multimodal(tmp_path, seed=3)
    _, report = _compare(hf, tmp_path, lengths=(4, 29))
    assert report.skipped and all("visual" in n for n in report.skipped)
    assert any("vision" in note for note in report.notes)


def test_qwen3_next_matches_transformers(tmp_path):
    """Qwen3-Next interleaves q/k/v/z per key head in one projection and mixes dense and MoE layers."""
    hf = hf_models.qwen3_next_causal(tmp_path, seed=4)
    config = load_config(tmp_path)
    assert config.mlp_types == ("moe", "dense", "moe", "moe")
    _compare(hf, tmp_path)


def test_gdn_ratio_one_and_long_prompt(tmp_path):
    """Equal qk and v head counts, and a prompt longer than the 64-token GDN chunk several times over."""
    hf = hf_models.qwen3_5_moe_causal(tmp_path, seed=5, linear_num_value_heads=2)
    _compare(hf, tmp_path, lengths=(200,))
