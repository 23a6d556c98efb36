"""Model definitions: the typed config and the block-diffusion denoiser built from it."""

from clover_lite.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, config_from_dict, load_config
from clover_lite.models.denoiser import Denoiser, block_causal_mask

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "Denoiser", "block_causal_mask", "config_from_dict", "load_config"]
