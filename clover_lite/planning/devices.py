"""The devices a plan is made for: the known cards, this machine's RAM, a CUDA device's free memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from clover_lite.errors import CloverError

GiB = 1 << 30
MiB = 1 << 20

# What the CUDA driver, runtime and cuBLAS workspaces take on a GPU before the model's first tensor.
CUDA_CONTEXT_BYTES = 512 * MiB
# What a GPU keeps that a model cannot use: a desktop on GeForce cards, the driver's own allocations,
# allocator fragmentation. Taken off every known card's capacity.
GPU_RESERVE_BYTES = 1 * GiB
# What a plan against a CUDA device's free memory leaves unused (the CUDA context is already outside what
# the driver reports free): the caching allocator's rounding and fragmentation, cuBLAS's and Triton's
# workspaces, the CUDA graph's pool. Without it the context `load()` picks would fill the card to the byte.
CUDA_FREE_HEADROOM_BYTES = 512 * MiB


@dataclass(frozen=True)
class GPU:
    """A known card. `capacity` is the memory the driver reports (marketing 'GB' are GiB of GDDR on
    GeForce cards; for HBM parts see the notes); usable = capacity - GPU_RESERVE_BYTES."""

    key: str
    name: str
    capacity: int
    bandwidth_gbs: float
    note: str = ""

    @property
    def usable(self) -> int:
        return self.capacity - GPU_RESERVE_BYTES


KNOWN_GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        GPU("rtx4080", "RTX 4080", 16 * GiB, 717, "16 GB GDDR6X"),
        GPU("rtx3090", "RTX 3090", 24 * GiB, 936, "24 GB GDDR6X"),
        GPU("rtx4090", "RTX 4090", 24 * GiB, 1008, "24 GB GDDR6X"),
        GPU("rtx5090", "RTX 5090", 32 * GiB, 1792, "32 GB GDDR7 (16 x 2 GB modules)"),
        # nvidia-smi reports 143771 MiB for an H200 SXM (141 GB HBM3e).
        GPU("h200", "H200", 143771 * MiB, 4800, "141 GB HBM3e; driver reports 143771 MiB"),
        # 288 GB HBM3e per GPU; counted as decimal GB (268 GiB) since the driver-reported total is not
        # verified here, which errs on the safe side.
        GPU("gb300", "GB300", 288 * 10**9, 8000, "288 GB HBM3e, counted as 288e9 bytes"),
    )
}


def fmt_bytes(n: float) -> str:
    """Binary units, as GPU memory is counted: '21.34 GiB', '168.0 MiB', '3.5 KiB'."""
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}" if unit == "GiB" else f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def normalize_gpu_name(name: str) -> str | None:
    """'RTX 4090' / 'rtx-4090' / 'NVIDIA GeForce RTX 4090' / '4090' -> 'rtx4090'; None if unknown."""
    key = str(name).lower()
    for junk in ("nvidia", "geforce", " ", "-", "_"):
        key = key.replace(junk, "")
    if key in KNOWN_GPUS:
        return key
    if "rtx" + key in KNOWN_GPUS:
        return "rtx" + key
    for k in KNOWN_GPUS:  # torch.cuda.get_device_name: 'NVIDIA H200', 'NVIDIA GB300', ...
        if key.startswith(k):
            return k
    return None


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else total RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cuda_free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device for this process: what the driver reports free now plus what
    PyTorch's caching allocator holds unused (free to this process's tensors, not to the driver: a second
    model loaded in one process, as `clover quantize --eval` does, may use it)."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached), int(total)


@dataclass
class Target:
    name: str  # what the user sees: 'RTX 4090', 'cpu (available RAM)', 'cuda:0 (free)'
    capacity: int  # bytes the model may use
    gpu: bool  # counts the CUDA context


def resolve_target(device: str | torch.device | None) -> Target | None:
    if device is None:
        return None
    if isinstance(device, str) and device.lower() != "cpu" and not device.lower().startswith("cuda"):
        key = normalize_gpu_name(device)
        if key is None:
            raise CloverError(f"unknown GPU '{device}'; known: {', '.join(KNOWN_GPUS)} (or cpu, cuda, cuda:N)")
        g = KNOWN_GPUS[key]
        return Target(g.name, g.usable, True)
    dev = torch.device(device.lower() if isinstance(device, str) else device)  # "CPU", "CUDA:0" as above
    if dev.type == "cpu":
        return Target("cpu (available RAM)", available_ram(), False)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CloverError(f"device '{device}' asked for but CUDA is not available here")
        free, _ = cuda_free_memory(dev)
        # mem_get_info has already created the CUDA context: what is free excludes it.
        return Target(f"{dev} (free now, less {fmt_bytes(CUDA_FREE_HEADROOM_BYTES)} headroom)",
                      max(0, free - CUDA_FREE_HEADROOM_BYTES), False)
    raise CloverError(f"cannot plan for device type '{dev.type}'")
