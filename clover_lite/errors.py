"""The errors clover-lite raises for bad input. Each message names the problem and the fix."""


class CloverError(Exception):
    """Base class for every error clover-lite raises on purpose."""


class ConfigError(CloverError, ValueError):
    """config.json is missing, malformed, of an unknown model type or lacks a required key."""


class CheckpointError(CloverError, ValueError):
    """A weight file is missing, truncated, or holds missing, unexpected or mis-shaped tensors."""


class TokenizerError(CloverError, ValueError):
    """No usable tokenizer files, or a chat template that cannot be rendered."""


class GenerationError(CloverError, ValueError):
    """A generation request that cannot be served (bad setting, prompt over the context, ...)."""


class NonFiniteError(GenerationError):
    """A denoising step's logits held NaN or Inf. `module` names the first module whose output went
    non-finite when the step was re-run with hooks (None when no module could be named)."""

    def __init__(self, message: str, module: str | None = None):
        super().__init__(message)
        self.module = module
