"""What `clover quantize` is asked to do: its options and the error for settings it cannot follow."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from clover_lite.errors import CloverError
from clover_lite.quant.rtn import QuantSpec

METHODS = ("gptq", "rtn", "nf4")


class QuantizationError(CloverError):
    """Quantization cannot go on (non-finite weights or activations, impossible settings)."""


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "gptq"  # gptq | rtn | nf4 (bitsandbytes NF4, no calibration: the baseline)
    group_size: int | None = 128  # -1: per-channel; None: the largest of GROUP_SIZES that fits
    sym: bool = True
    act_order: bool = True
    static_groups: bool = True
    damp_percent: float = 0.01
    checkpoint_format: str = "gptq"  # gptq (v1) | gptq_v2
    quantize_lm_head: bool = False
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    calib: str | None = None  # text / JSONL file; None: the standard library's sources
    calibration: str = "diffusion"  # diffusion | clean
    moe_calibration: str = "all"  # all: every token through every expert for statistics | routed
    min_expert_samples: int = 16
    block_size: int | None = None  # calibration block size (default: the model's)
    batch_size: int = 8  # calibration samples per forward
    expert_chunk: int = 16  # experts quantized together (bounds the temporaries)
    device: str = "cpu"
    nf4_blocksize: int = 64

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.group_size, self.sym, self.checkpoint_format)

    def fingerprint(self) -> str:
        """What must match for a resumed run to produce the same output (device and batch do not change it
        in principle, but a resumed run must reproduce the same bytes, so they count)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
