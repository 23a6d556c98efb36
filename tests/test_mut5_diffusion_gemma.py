"""Mutation round 5: DiffusionGemma settings and the request's context check, against hand-worked cases."""

import json

import pytest

from clover_lite.checkpoint.diffusion_gemma_weights import load_diffusion_gemma
from clover_lite.checkpoint.tiny_diffusion_gemma import special_id, write_tiny_diffusion_gemma
from clover_lite.errors import GenerationError
from clover_lite.runtime.diffusion_gemma_loop import DiffusionGemmaSettings, generate, settings_from_generation_config


def test_equal_t_min_and_t_max_are_refused():
    """The temperature schedule must fall: t_min == t_max is refused like t_min > t_max (need t_min < t_max)."""
    with pytest.raises(GenerationError, match="need 0 <= t_min < t_max"):
        DiffusionGemmaSettings(t_min=0.5, t_max=0.5).checked()
    with pytest.raises(GenerationError, match="need 0 <= t_min < t_max"):
        DiffusionGemmaSettings(t_min=0.6, t_max=0.5).checked()
    assert DiffusionGemmaSettings(t_min=0.0, t_max=1e-3).checked().t_max == 1e-3


@pytest.mark.parametrize("bound", [0.25, 2.0])
def test_sampler_config_entropy_bound_is_read_from_generation_config(tmp_path, bound):
    """generation_config.json's sampler_config.entropy_bound is the sampler's bound (not the 0.1 default);
    a sampler_config without one takes the default."""
    raw = {"max_denoising_steps": 5,
           "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": bound}}
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    s = settings_from_generation_config(tmp_path)
    assert s.entropy_bound == bound and s.sampler == "entropy_bound" and s.max_denoising_steps == 5
    raw["sampler_config"] = {"_cls_name": "EntropyBoundSamplerConfig"}
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    assert settings_from_generation_config(tmp_path).entropy_bound == 0.1


@pytest.fixture(scope="module")
def ctx64(tmp_path_factory):
    path = write_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny", seed=2, max_position_embeddings=64)
    return load_diffusion_gemma(path)[0]


def test_context_check_counts_whole_canvases(ctx64):
    """max_new_tokens is rounded up to whole canvases of 8 before the context check (64 positions): a prompt of
    57 plus 1 new token needs one canvas, 57 + 8 = 65 > 64, refused before any step; a prompt of 56 fits
    exactly (56 + 8 = 64) and generates one canvas."""
    bos = special_id("<bos>")
    with pytest.raises(GenerationError, match="needs 65 positions, over the context of 64"):
        generate(ctx64, [bos] + [104] * 56, max_new_tokens=1, max_denoising_steps=2)
    with pytest.raises(GenerationError, match="2 canvas\\(es\\) of 8 needs 67 positions"):
        generate(ctx64, [bos] + [104] * 50, max_new_tokens=9, max_denoising_steps=2)
    result = generate(ctx64, [bos] + [104] * 55, max_new_tokens=1, max_denoising_steps=2, stability_threshold=None)
    assert result.canvases == 1 and result.steps == 2 and result.encoded_tokens == 56
