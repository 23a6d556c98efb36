"""Model definitions: the typed config and the block-diffusion denoiser built from it."""

from .config import SUPPORTED_MODEL_TYPES, ModelConfig, config_from_dict, load_config
from .denoiser import Denoiser, block_causal_mask

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "Denoiser", "block_causal_mask", "config_from_dict", "load_config"]
