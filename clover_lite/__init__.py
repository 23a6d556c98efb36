"""clover-lite: a lean runtime for block-diffusion MoE language models.

    import clover_lite
    engine = clover_lite.load("path/to/model")          # or load() for the bundled model
    out = engine.generate("Hello", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_forward)
    print(clover_lite.plan("path/to/model", "int4", 8192, "rtx4090").message())   # will it fit?
"""

from clover_lite.errors import (
    CheckpointError,
    CloverError,
    ConfigError,
    GenerationError,
    NonFiniteError,
    TokenizerError,
)
from clover_lite.planning.planner import MemoryPlan, plan
from clover_lite.runtime.engine import Engine, load
from clover_lite.runtime.exclusive import EngineBusyError
from clover_lite.runtime.generation import (
    BlockEvent,
    DoneEvent,
    Generation,
    GenerationConfig,
    GenerationStats,
    StepEvent,
)

__version__ = "0.1.0"

__all__ = [
    "load", "Engine", "GenerationConfig", "Generation", "GenerationStats", "StepEvent", "BlockEvent", "DoneEvent",
    "plan", "MemoryPlan", "CloverError", "ConfigError", "CheckpointError", "TokenizerError", "GenerationError",
    "NonFiniteError", "EngineBusyError", "__version__",
]
