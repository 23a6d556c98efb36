"""clover-lite: a lean runtime for block-diffusion MoE language models.

    import clover_lite
    engine = clover_lite.load("path/to/model")          # or load() for the bundled model
    out = engine.generate("Hello", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_forward)
    print(clover_lite.plan("path/to/model", "int4", 8192, "rtx4090").message())   # will it fit?
"""

from typing import TYPE_CHECKING

from clover_lite.errors import (
    CheckpointError,
    CloverError,
    ConfigError,
    GenerationError,
    NonFiniteError,
    TokenizerError,
)

# The rest is imported when first used (PEP 562), so that `import clover_lite` and the `clover` command's
# first instant do not import torch: a Ctrl-C in that second or two ends with "Aborted!", not a traceback
# (clover_lite/cli/launch.py), and `clover_lite.errors` stays cheap to import.
_LAZY = {
    "load": "clover_lite.runtime.engine",
    "Engine": "clover_lite.runtime.engine",
    "plan": "clover_lite.planning.planner",
    "MemoryPlan": "clover_lite.planning.planner",
    "EngineBusyError": "clover_lite.runtime.exclusive",
    **dict.fromkeys(["BlockEvent", "DoneEvent", "Generation", "GenerationConfig", "GenerationStats", "StepEvent"],
                    "clover_lite.runtime.generation"),
}

if TYPE_CHECKING:
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


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'clover_lite' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "load", "Engine", "GenerationConfig", "Generation", "GenerationStats", "StepEvent", "BlockEvent", "DoneEvent",
    "plan", "MemoryPlan", "CloverError", "ConfigError", "CheckpointError", "TokenizerError", "GenerationError",
    "NonFiniteError", "EngineBusyError", "__version__",
]
