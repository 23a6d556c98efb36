"""What the INT4 launchers choose for the device they run on: its architecture and SM count, the table's
config (split-K trimmed to fill the GPU, or autotuned with CLOVER_AUTOTUNE=1) and the dtype to compute in.
"""

from __future__ import annotations

import functools

import torch

from clover_lite.kernels import configs
from clover_lite.kernels.host import cdiv, interpreting


def device_arch(device: torch.device) -> str | None:
    if device.type != "cuda" or interpreting():
        return None
    return configs.arch_of(torch.cuda.get_device_capability(device))


def gemm_config_for(device: torch.device, m: int) -> configs.GemmConfig:
    arch = device_arch(device)
    return configs.INTERPRET_GEMM if arch is None else configs.gemm_config(arch, m)


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fill_split(cfg: configs.GemmConfig, m: int, n: int, device: torch.device) -> configs.GemmConfig:
    """The table's split-K trimmed to what fills this GPU for an [m, n] output (configs.split_to_fill)."""
    if device_arch(device) is None:
        return cfg
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return configs.split_to_fill(cfg, tiles, sm_count(device.index or 0))


# (device index, M bucket, N, K, fused, g_idx) -> the fastest config measured on this GPU.
_TUNED: dict[tuple, configs.GemmConfig] = {}


def autotune(key: tuple, candidates: list[configs.GemmConfig], run, measure=None) -> configs.GemmConfig:
    """Time `run(config)` for each candidate once per key and keep the fastest; a candidate that fails to
    compile or run (e.g. out of shared memory on this part) is skipped. `measure` defaults to Triton's
    do_bench (milliseconds)."""
    if key in _TUNED:
        return _TUNED[key]
    if measure is None:
        from triton.testing import do_bench

        measure = lambda fn: do_bench(fn, warmup=5, rep=20)  # noqa: E731
    best, best_t = candidates[0], float("inf")
    for cfg in candidates:
        try:
            t = measure(lambda cfg=cfg: run(cfg))
        except Exception:  # noqa: BLE001 - an unusable config is simply not chosen
            continue
        if t < best_t:
            best, best_t = cfg, t
    _TUNED[key] = best
    return best


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    # The interpreter gets bf16 arithmetic wrong (DESIGN section 5): compute in fp32 there.
    return torch.float32 if x.dtype == torch.bfloat16 and interpreting() else x.dtype


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without Tensor.to's call when it already is (host time of an eager launch)."""
    return t if t.dtype == dtype else t.to(dtype)
