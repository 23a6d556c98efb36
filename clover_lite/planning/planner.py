"""Memory planner: what a model needs on a device, before anything is allocated.

`plan(config, quant, context_len, device)` counts, from the config alone:

- weights, by format: which tensors stay 16-bit (embeddings, norms, router gates, GDN's small b/a
  projections, conv1d, decay parameters, the shared-expert gate, lm_head unless quantized) and which are
  INT4 GPTQ (qweight K/8 x N int32, qzeros G x N/8 int32, scales G x N fp16, g_idx K int32 per linear,
  G = K / group_size) or NF4 (packed codes numel/2 bytes, one fp32 absmax per block), exactly as
  `clover_lite.models.quantized` allocates them;
- the committed KV cache: full-attention layers only, 2 x kv_heads x head_dim x dtype bytes x layers per
  token (GDN layers keep no per-token state);
- GDN state: per GDN layer, v_heads x k_dim x v_dim fp32 recurrent state plus the conv tail
  conv_dim x (kernel - 1) in the model dtype;
- activation workspace: an *estimate* (see `workspace_formula`) for one denoising step of a block and for
  one prefill chunk, whichever is larger;
- the logits buffer: block x vocab fp32 (a step scores the block's masked positions only);
- the CUDA context: CUDA_CONTEXT_BYTES, a documented constant (what the driver and the CUDA/cuBLAS
  runtime take before the first tensor; measured values are 300-600 MiB depending on card and versions).

Known cards (`KNOWN_GPUS`) are counted at their memory capacity minus a reserve (see `GPU`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig, config_from_dict, load_config

GiB = 1 << 30
MiB = 1 << 20

# What the CUDA driver, runtime and cuBLAS workspaces take on a GPU before the model's first tensor.
CUDA_CONTEXT_BYTES = 512 * MiB
# The runtime's prompt prefill runs in chunks of this many tokens (CachedRunner's default).
PREFILL_CHUNK = 2048
# The context `load()` checks a model against (a generation asks for more only if the prompt is long).
LOAD_CHECK_CONTEXT = 4096
# What a GPU keeps that a model cannot use: a desktop on GeForce cards, the driver's own allocations,
# allocator fragmentation. Taken off every known card's capacity.
GPU_RESERVE_BYTES = 1 * GiB
# What a plan against a CUDA device's free memory leaves unused (the CUDA context is already outside what
# the driver reports free): the caching allocator's rounding and fragmentation, cuBLAS's and Triton's
# workspaces, the CUDA graph's pool. Without it the context `load()` picks would fill the card to the byte.
CUDA_FREE_HEADROOM_BYTES = 512 * MiB


class MemoryPlanError(CloverError):
    """The model does not fit the device (raised by `load` and `clover bench` before allocating)."""


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

FLOAT_KINDS = {"bf16": 2, "fp16": 2, "fp32": 4}
_DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# ---- named configs -----------------------------------------------------------------------------
def clover_35b_a3b_config() -> dict[str, Any]:
    """config.json of the Clover-35B-A3B class: the Qwen3.5-35B-A3B text backbone (shared DESIGN.md section 1)
    plus block diffusion (block 32, a mask token). For planning and random-weight benchmarks: the mask and
    EOS ids are placeholders in Qwen3.5's special-token range; a real checkpoint's config.json says which."""
    n = 40
    return {
        "model_type": "clover_moe",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": n,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "eos_token_id": 248046,
        "pad_token_id": 248044,
        "mask_token_id": 248319,
        "block_size": 32,
        "dtype": "bfloat16",
    }


def _tiny() -> dict[str, Any]:
    from clover_lite.checkpoint.tiny import tiny_config

    return tiny_config()


NAMED_CONFIGS = {"tiny": _tiny, "clover-35b-a3b": clover_35b_a3b_config}


def named_config(name: str) -> ModelConfig:
    if name not in NAMED_CONFIGS:
        raise CloverError(f"unknown config '{name}'; known: {', '.join(NAMED_CONFIGS)}")
    return config_from_dict(NAMED_CONFIGS[name](), source=name)


# ---- quantization schemes ----------------------------------------------------------------------
@dataclass(frozen=True)
class QuantScheme:
    kind: str  # bf16 | fp16 | fp32 | int4 | nf4
    group_size: int = 128  # int4: input channels per group, -1 per-channel
    lm_head: bool = False  # int4 / nf4: lm_head quantized too
    blocksize: int = 64  # nf4

    @property
    def quantized(self) -> bool:
        return self.kind in ("int4", "nf4")

    def label(self) -> str:
        if self.kind == "int4":
            g = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
            return f"INT4 GPTQ {g}, lm_head {'INT4' if self.lm_head else '16-bit'}"
        if self.kind == "nf4":
            return f"NF4 block {self.blocksize}, lm_head {'NF4' if self.lm_head else '16-bit'}"
        return self.kind

    def replace(self, **kw) -> QuantScheme:
        return QuantScheme(**{**self.__dict__, **kw})


def parse_quant(quant: str | dict | QuantScheme | None) -> QuantScheme:
    """"bf16" / "fp16" / "fp32" / "int4" (GPTQ, group 128, lm_head 16-bit) / "int4-g32" / "nf4", or a
    checkpoint's quantize_config dict (GPTQ keys group_size / lm_head, or ours for NF4)."""
    if isinstance(quant, QuantScheme):
        return quant
    if quant is None:
        return QuantScheme("bf16")
    if isinstance(quant, dict):
        method = quant.get("quant_method", "gptq")
        if method == "nf4":
            return QuantScheme("nf4", lm_head=bool(quant.get("lm_head", False)),
                               blocksize=int(quant.get("blocksize", 64)))
        if method != "gptq" or int(quant.get("bits", 4)) != 4:
            raise CloverError(f"quantization {method} {quant.get('bits')}-bit is not supported (GPTQ INT4 or NF4)")
        return QuantScheme("int4", group_size=int(quant.get("group_size", 128)),
                           lm_head=bool(quant.get("lm_head", False)))
    q = str(quant).lower().strip()
    if q in _DTYPE_NAMES:
        return QuantScheme(_DTYPE_NAMES[q])
    if q in ("int4", "gptq", "w4a16"):
        return QuantScheme("int4")
    if q.startswith("int4-g") and q[6:].lstrip("-").isdigit():
        return QuantScheme("int4", group_size=int(q[6:]))
    if q == "nf4":
        return QuantScheme("nf4")
    raise CloverError(f"unknown quantization '{quant}'; use bf16, fp16, fp32, int4 (GPTQ g128), int4-gG or nf4")


def _dtype_name(dtype: str | torch.dtype | None, scheme: QuantScheme) -> str:
    if dtype is None:
        return scheme.kind if scheme.kind in FLOAT_KINDS else "bf16"
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES:
            raise CloverError(f"dtype {dtype} is not supported (bf16, fp16, fp32)")
        return _TORCH_DTYPES[dtype]
    if str(dtype).lower() not in _DTYPE_NAMES:
        raise CloverError(f"unknown dtype '{dtype}'; use bf16, fp16 or fp32")
    return _DTYPE_NAMES[str(dtype).lower()]


# ---- weights -----------------------------------------------------------------------------------
def _groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else max(1, math.ceil(k / group_size))


def _linear(k: int, n: int, scheme: QuantScheme, d: int, quantized: bool, bias: bool = False,
            stack: int = 1) -> dict[str, int]:
    """Bytes of a linear y = x W^T, W [n, k] (times `stack` for stacked experts), by tensor kind."""
    out: dict[str, int] = {}
    if not quantized or not scheme.quantized:
        out["16-bit" if d == 2 else "float"] = stack * k * n * d
    elif scheme.kind == "int4":
        g = _groups(k, scheme.group_size)
        out["qweight"] = stack * (k // 8) * n * 4
        out["qzeros"] = stack * g * (n // 8) * 4
        out["scales"] = stack * g * n * 2
        out["g_idx"] = stack * k * 4
    else:  # nf4
        out["nf4 codes"] = stack * k * n // 2
        out["nf4 absmax"] = stack * (k * n // scheme.blocksize) * 4
    if bias:
        out["16-bit" if d == 2 else "float"] = out.get("16-bit" if d == 2 else "float", 0) + stack * n * d
    return out


def _add(into: dict[str, int], more: dict[str, int], times: int = 1) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v * times


def weight_bytes(config: ModelConfig, scheme: QuantScheme, dtype: str) -> dict[str, dict[str, int]]:
    """Bytes of every weight by category and tensor kind ('16-bit'/'float', 'qweight', 'scales', ...),
    as the runtime allocates them for this config and format."""
    c = config
    d = FLOAT_KINDS[dtype]
    fl = "16-bit" if d == 2 else "float"
    H = c.hidden_size
    cats: dict[str, dict[str, int]] = {}

    def cat(name: str) -> dict[str, int]:
        return cats.setdefault(name, {})

    _add(cat("embeddings"), {fl: c.vocab_size * H * d})
    if not c.tie_word_embeddings:
        _add(cat("lm_head"), _linear(H, c.vocab_size, scheme, d, quantized=scheme.lm_head))
    small = cat("norms, routers, GDN b/a/conv/decay")
    _add(small, {fl: H * d})  # final norm
    for i, kind in enumerate(c.layer_types):
        _add(small, {fl: 2 * H * d})  # input / post-attention norms
        if kind == "full_attention":
            nh, kv, hd, b = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias
            a = cat("attention (q/k/v/o)")
            _add(a, _linear(H, 2 * nh * hd, scheme, d, True, b))
            _add(a, _linear(H, kv * hd, scheme, d, True, b), 2)
            _add(a, _linear(nh * hd, H, scheme, d, True, b))
            _add(small, {fl: 2 * hd * d})  # q_norm, k_norm
        else:
            g = cat("GDN (in_proj_qkv/z, out_proj)")
            hv = c.linear_num_value_heads
            _add(g, _linear(H, c.gdn_conv_dim, scheme, d, True))
            _add(g, _linear(H, c.gdn_value_dim, scheme, d, True))
            _add(g, _linear(c.gdn_value_dim, H, scheme, d, True))
            # in_proj_b / in_proj_a, conv1d, dt_bias, A_log, gated norm
            _add(small, {fl: (2 * H * hv + c.gdn_conv_dim * c.linear_conv_kernel_dim + 2 * hv
                              + c.linear_value_head_dim) * d})
        if c.mlp_types[i] == "moe":
            E, inter = c.num_experts, c.moe_intermediate_size
            ex = cat("routed experts")
            _add(ex, _linear(H, inter, scheme, d, True, stack=E), 2)  # gate, up
            _add(ex, _linear(inter, H, scheme, d, True, stack=E))  # down
            _add(small, {fl: E * H * d})  # router
            if c.shared_expert_intermediate_size:
                s, si = cat("shared experts / dense MLP"), c.shared_expert_intermediate_size
                _add(s, _linear(H, si, scheme, d, True), 2)
                _add(s, _linear(si, H, scheme, d, True))
                _add(small, {fl: H * d})  # shared_expert_gate
        else:
            s, inter = cat("shared experts / dense MLP"), c.intermediate_size
            _add(s, _linear(H, inter, scheme, d, True), 2)
            _add(s, _linear(inter, H, scheme, d, True))
    return cats


# ---- caches and workspace ----------------------------------------------------------------------
def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """2 (K and V) x kv_heads x head_dim x dtype bytes x full-attention layers."""
    c = config
    return 2 * c.num_key_value_heads * c.head_dim * FLOAT_KINDS[dtype] * len(c.attention_layers)


def gdn_state_bytes(config: ModelConfig, dtype: str) -> int:
    """Per GDN layer: v_heads x k_dim x v_dim fp32 recurrent state + conv tail conv_dim x (kernel-1)."""
    c = config
    per = (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
           + c.gdn_conv_dim * (c.linear_conv_kernel_dim - 1) * FLOAT_KINDS[dtype])
    return per * len(c.gdn_layers)


WORKSPACE_FORMULA = (
    "an estimate, the larger of one denoising step (T = block) and one prefill\n"
    "chunk (T = chunk), S = context, d = dtype bytes:\n"
    "  4*T*H*d (residual stream) + the largest layer transient of\n"
    "    attention  T*(3*nh + 2*kv)*hd*d + 2*T*nh*S*d (scores, probabilities)\n"
    "               + 2*nh*S*hd*d (K and V expanded to the q heads)\n"
    "    GDN        T*(2*conv + v_dim)*d + 2*T*hv*(2*dk + dv)*4 + 2*hv*dk*dv*4\n"
    "    MoE        2*T*E*4 + 2*T*k*H*d + T*k*2*I*d + T*2*Is*d\n"
    "  + the largest quantized linear dequantized to d (PyTorch reference matmul)\n"
    "  + 2*T*V*4 (sampling temporaries; steps only)\n"
    "With the Triton kernels (CUDA) a step's attention keeps no scores or K/V copy and\n"
    "INT4 weights are never dequantized."
)


def workspace_bytes(config: ModelConfig, scheme: QuantScheme, dtype: str, tokens: int, context: int,
                    step: bool, backend: str = "torch") -> int:
    """The estimate of WORKSPACE_FORMULA for `tokens` positions run against `context` keys. backend
    "triton": a step's attention is the flash-decoding kernel (no scores, no K/V copy) and INT4 linears are
    never dequantized."""
    c = config
    d = FLOAT_KINDS[dtype]
    T, S, H = tokens, max(context, tokens), c.hidden_size
    fused_attention = backend == "triton" and step and T <= 64
    layer = 0
    if c.attention_layers:
        nh, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        scores = 0 if fused_attention else 2 * T * nh * S * d + 2 * nh * S * hd * d
        layer = max(layer, T * (3 * nh + 2 * kv) * hd * d + scores)
    if c.gdn_layers:
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        layer = max(layer, T * (2 * c.gdn_conv_dim + c.gdn_value_dim) * d + 2 * T * hv * (2 * dk + dv) * 4
                    + 2 * hv * dk * dv * 4)
    if "moe" in c.mlp_types:
        k, inter, si = c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size
        layer = max(layer, 2 * T * c.num_experts * 4 + 2 * T * k * H * d + T * k * 2 * inter * d + T * 2 * si * d)
    if "dense" in c.mlp_types:
        layer = max(layer, 3 * T * c.intermediate_size * d)
    dequant = 0
    if scheme.kind == "nf4" or (scheme.kind == "int4" and backend != "triton"):
        shapes = []
        if c.attention_layers:
            shapes.append(H * 2 * c.num_attention_heads * c.head_dim)
        if c.gdn_layers:
            shapes.append(H * c.gdn_conv_dim)
        if "moe" in c.mlp_types:
            shapes.append(H * max(c.moe_intermediate_size, c.shared_expert_intermediate_size))
        if "dense" in c.mlp_types:
            shapes.append(H * c.intermediate_size)
        if scheme.lm_head and not c.tie_word_embeddings:
            shapes.append(H * c.vocab_size)
        dequant = max(shapes) * d
    sampling = 2 * T * c.vocab_size * 4 if step else 0
    return 4 * T * H * d + layer + dequant + sampling


# ---- devices -----------------------------------------------------------------------------------
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
    dev = torch.device(device)
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


# ---- the plan ----------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    """Binary units, as GPU memory is counted: '21.34 GiB', '168.0 MiB', '3.5 KiB'."""
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}" if unit == "GiB" else f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


_gb = fmt_bytes


@dataclass
class MemoryPlan:
    model: str
    config: ModelConfig = field(repr=False)
    scheme: QuantScheme
    dtype: str
    context_len: int
    block_size: int
    prefill_chunk: int
    weights: dict[str, dict[str, int]]
    kv_per_token: int
    gdn_state: int
    step_workspace: int
    prefill_workspace: int
    logits: int
    cuda_context: int
    target: Target | None = None
    backend: str = "torch"

    # ---- totals ----------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        return sum(sum(v.values()) for v in self.weights.values())

    @property
    def kv_cache(self) -> int:
        return self.kv_per_token * self.context_len

    @property
    def workspace(self) -> int:
        return max(self.step_workspace, self.prefill_workspace)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_cache + self.gdn_state + self.workspace + self.logits + self.cuda_context

    def fits(self, capacity: int | None = None) -> bool:
        cap = capacity if capacity is not None else (self.target.capacity if self.target else None)
        if cap is None:
            raise ValueError("no device to compare with: pass a capacity or plan for a device")
        return self.total <= cap

    def fits_on(self) -> dict[str, bool]:
        """Known card -> fits (with the CUDA context, whatever this plan's device is)."""
        gpu_total = self.total - self.cuda_context + CUDA_CONTEXT_BYTES
        return {k: gpu_total <= g.usable for k, g in KNOWN_GPUS.items()}

    def max_context(self, capacity: int) -> int:
        """The longest context that fits `capacity` (0 if not even the weights fit). The workspace grows
        with the context too, so this searches."""
        lo, hi = 0, max(self.config.max_position_embeddings, self.context_len)
        if self.with_context(0).total > capacity:
            return 0
        if self.with_context(hi).total <= capacity:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.with_context(mid).total <= capacity else (lo, mid)
        return lo

    def with_context(self, context_len: int) -> MemoryPlan:
        return plan(self.config, self.scheme, context_len, None, block_size=self.block_size, dtype=self.dtype,
                    prefill_chunk=self.prefill_chunk, backend=self.backend, _target=self.target, _name=self.model)

    # ---- advice ----------------------------------------------------------------------------------
    def suggestions(self, capacity: int | None = None) -> list[str]:
        """What to change so that the model fits `capacity` (this plan's device by default)."""
        cap = capacity if capacity is not None else (self.target.capacity if self.target else None)
        if cap is None or self.total <= cap:
            return []
        out = []
        fixed = self.with_context(0)
        if fixed.total > cap:
            out.append(f"the weights alone need {_gb(self.weight_bytes)}: no context length fits {_gb(cap)}")
        else:
            n = self.max_context(cap)
            out.append(f"shorten the context to {n} tokens (or fewer): needs {_gb(self.with_context(n).total)}")
        if self.scheme.kind in FLOAT_KINDS:
            q = self._variant(QuantScheme("int4"), "bf16" if self.dtype == "fp32" else self.dtype)
            fits = "fits" if q.total <= cap else "still does not fit"
            out.append(f"use INT4 weights (clover quantize SRC OUT): {_gb(q.total)} at {self.context_len} tokens, "
                       f"{fits}")
        if self.scheme.quantized and not self.scheme.lm_head and not self.config.tie_word_embeddings:
            q = self._variant(self.scheme.replace(lm_head=True), self.dtype)
            if q.total < self.total:
                out.append(f"quantize lm_head too (clover quantize --quantize-lm-head): saves "
                           f"{_gb(self.total - q.total)}, {'fits' if q.total <= cap else 'still does not fit'}")
        if self.dtype == "fp32":
            q = self._variant(self.scheme if self.scheme.quantized else QuantScheme("bf16"), "bf16")
            out.append(f"run in bf16 (--dtype bfloat16): {_gb(q.total)}")
        bigger = [g.name for k, g in KNOWN_GPUS.items() if self.fits_on()[k] and g.usable > cap]
        if bigger and self.target is not None and not self.target.gpu and self.target.name.startswith("cpu"):
            out.append(f"on a GPU it fits: {', '.join(bigger)}")
        elif bigger:
            out.append(f"a card with more memory: {', '.join(bigger)}")
        return out

    def _variant(self, scheme: QuantScheme, dtype: str) -> MemoryPlan:
        return plan(self.config, scheme, self.context_len, None, block_size=self.block_size, dtype=dtype,
                    prefill_chunk=self.prefill_chunk, backend=self.backend, _target=self.target, _name=self.model)

    # ---- output ----------------------------------------------------------------------------------
    def rows(self) -> list[tuple[str, int, str]]:
        """(component, bytes, how it is counted) for a table."""
        c = self.config
        d = FLOAT_KINDS[self.dtype]
        rows = []
        for name, kinds in self.weights.items():
            detail = ", ".join(f"{k} {_gb(v)}" for k, v in kinds.items() if v)
            rows.append((f"weights: {name}", sum(kinds.values()), detail))
        rows.append(("KV cache", self.kv_cache,
                     f"{self.kv_per_token} B/token = 2 x {c.num_key_value_heads} kv heads x {c.head_dim} x {d} B x "
                     f"{len(c.attention_layers)} attention layers, x {self.context_len} tokens"))
        if c.gdn_layers:
            rows.append(("GDN state", self.gdn_state,
                         f"{len(c.gdn_layers)} layers x ({c.linear_num_value_heads} x {c.linear_key_head_dim} x "
                         f"{c.linear_value_head_dim} fp32 + conv tail {c.gdn_conv_dim} x "
                         f"{c.linear_conv_kernel_dim - 1} x {d} B)"))
        rows.append(("activation workspace (estimate)", self.workspace,
                     f"max(step of {self.block_size} tokens {_gb(self.step_workspace)}, prefill chunk of "
                     f"{self.prefill_chunk} tokens {_gb(self.prefill_workspace)}), {self.backend} kernels"))
        rows.append(("logits buffer", self.logits, f"{self.block_size} x {c.vocab_size} x 4 B (fp32)"))
        if self.cuda_context:
            rows.append(("CUDA context", self.cuda_context, "constant CUDA_CONTEXT_BYTES (driver, runtime, cuBLAS)"))
        return rows

    def verdict(self) -> str:
        if self.target is None:
            return ""
        ok = self.total <= self.target.capacity
        return (f"{'fits' if ok else 'does NOT fit'}: needs {_gb(self.total)}, {self.target.name} has "
                f"{_gb(self.target.capacity)}")

    def message(self) -> str:
        """One paragraph for an error or a report: need, have, what to change."""
        head = f"{self.model} ({self.scheme.label()}, {self.dtype}) at {self.context_len} tokens of context"
        lines = [f"{head}: {self.verdict() or 'needs ' + _gb(self.total)}"]
        parts = [("weights", self.weight_bytes), ("KV cache", self.kv_cache), ("GDN state", self.gdn_state),
                 ("workspace (estimate)", self.workspace), ("logits", self.logits),
                 ("CUDA context", self.cuda_context)]
        lines.append("  = " + " + ".join(f"{name} {_gb(b)}" for name, b in parts if b))
        for s in self.suggestions():
            lines.append(f"  - {s}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "quant": self.scheme.label(), "dtype": self.dtype, "backend": self.backend,
            "context_len": self.context_len, "block_size": self.block_size, "prefill_chunk": self.prefill_chunk,
            "weights": self.weights, "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_per_token,
            "kv_cache_bytes": self.kv_cache, "gdn_state_bytes": self.gdn_state,
            "workspace_bytes": self.workspace, "workspace_step_bytes": self.step_workspace,
            "workspace_prefill_bytes": self.prefill_workspace, "workspace_formula": WORKSPACE_FORMULA,
            "logits_bytes": self.logits, "cuda_context_bytes": self.cuda_context, "total_bytes": self.total,
            "device": None if self.target is None else self.target.name,
            "capacity_bytes": None if self.target is None else self.target.capacity,
            "fits": None if self.target is None else self.fits(),
            "fits_on": self.fits_on(), "suggestions": self.suggestions(),
        }


def _config_of(config: ModelConfig | dict | str | os.PathLike) -> tuple[ModelConfig, str, dict | None]:
    """(config, display name, the checkpoint's quantize_config or None)."""
    if isinstance(config, ModelConfig):
        return config, config.model_type, None
    if isinstance(config, dict):
        return config_from_dict(config, "config"), str(config.get("model_type", "model")), None
    if isinstance(config, str) and config in NAMED_CONFIGS:
        return named_config(config), config, None
    p = Path(config)
    if not p.exists():
        raise CloverError(f"{p}: no such model directory or config (named configs: {', '.join(NAMED_CONFIGS)})")
    from clover_lite.checkpoint.load import read_quant_config

    qc = read_quant_config(p) if p.is_dir() else None
    return load_config(p), p.name, qc


def plan(
    config: ModelConfig | dict | str | os.PathLike,
    quant: str | dict | QuantScheme | None = None,
    context_len: int = 8192,
    device: str | torch.device | None = None,
    *,
    block_size: int | None = None,
    dtype: str | torch.dtype | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    backend: str | None = None,
    quantize_lm_head: bool | None = None,
    _target: Target | None = None,
    _name: str | None = None,
) -> MemoryPlan:
    """The memory a model needs, from its config alone (nothing is allocated).

    config: a ModelConfig, a config.json dict, a model directory (its quantize_config is used when `quant`
    is None) or a named config ("tiny", "clover-35b-a3b"). quant: "bf16" / "fp16" / "fp32" / "int4" (GPTQ
    group 128, lm_head 16-bit) / "int4-gG" / "nf4", or a quantize_config dict. device: a known card
    (KNOWN_GPUS), "cpu" (available RAM), a CUDA device (its free memory now) or None (no comparison).
    dtype: the runtime dtype of float tensors (default: the quant's, bf16 for INT4/NF4). backend: "torch"
    (PyTorch reference) or "triton" (the kernels); default: what `load` picks for the device (Triton on a GPU).
    quantize_lm_head: INT4 / NF4 with lm_head quantized too (default: as the quant says; 16-bit for "int4").
    """
    cfg, name, ckpt_quant = _config_of(config)
    scheme = parse_quant(quant if quant is not None else ckpt_quant)
    if quantize_lm_head is not None and scheme.quantized:
        scheme = scheme.replace(lm_head=quantize_lm_head)
    dt = _dtype_name(dtype, scheme)
    if context_len < 0:
        raise CloverError(f"context length must be >= 0, got {context_len}")
    block = block_size or cfg.block_size or 4
    target = _target if _target is not None else resolve_target(device)
    gpu = target.gpu if target is not None else True
    chunk = min(prefill_chunk, max(context_len, block))
    if backend is None:
        backend = _default_backend(device, gpu)
    if backend not in ("torch", "triton"):
        raise CloverError(f"backend must be 'torch' or 'triton', got '{backend}'")
    return MemoryPlan(
        model=_name or name,
        config=cfg,
        scheme=scheme,
        dtype=dt,
        context_len=context_len,
        block_size=block,
        prefill_chunk=chunk,
        weights=weight_bytes(cfg, scheme, dt),
        kv_per_token=kv_bytes_per_token(cfg, dt),
        gdn_state=gdn_state_bytes(cfg, dt),
        step_workspace=workspace_bytes(cfg, scheme, dt, block, context_len, step=True, backend=backend),
        prefill_workspace=workspace_bytes(cfg, scheme, dt, chunk, context_len, step=False, backend=backend),
        logits=block * cfg.vocab_size * 4,
        cuda_context=CUDA_CONTEXT_BYTES if gpu else 0,
        target=target,
        backend=backend,
    )


def _default_backend(device, gpu: bool) -> str:
    """The kernels `load` would choose: kernels.dispatch.select for a real device, Triton for a GPU card."""
    from clover_lite.kernels import dispatch

    real = isinstance(device, torch.device) or (
        isinstance(device, str) and device.lower().split(":")[0] in ("cpu", "cuda"))
    if real:
        try:
            return dispatch.select(device)
        except (RuntimeError, ValueError):
            return "torch"
    return "triton" if gpu else "torch"


def meta_model(config: ModelConfig | str, quant: str | dict | QuantScheme | None = None,
               dtype: str | torch.dtype | None = None):
    """The Denoiser exactly as `load` builds it for this config and format, on the meta device (nothing
    allocated): quantized modules swapped in through the loader's own `install_quantized_modules`, from a
    synthetic list of the tensors a GPTQ / NF4 checkpoint of this model holds. For `clover bench` (random
    weights) and for checking the planner."""
    from clover_lite.checkpoint.load import TensorInfo, install_quantized_modules
    from clover_lite.models.denoiser import Denoiser
    from clover_lite.models.moe import SparseMoE
    from clover_lite.quant.pipeline import layer_targets

    cfg = named_config(config) if isinstance(config, str) else config
    scheme = parse_quant(quant)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[_dtype_name(dtype, scheme)]
    with torch.device("meta"):
        model = Denoiser(cfg)
    model = model.to(dtype=dt)
    if not scheme.quantized:
        return model
    marker = "nf4_weight" if scheme.kind == "nf4" else "qweight"
    canon: dict[str, TensorInfo] = {}

    def add(path: str, k: int, n: int) -> None:
        g = _groups(k, scheme.group_size)
        for suffix, shape in ((marker, (k // 8, n)), ("scales", (g, n))):
            canon[f"{path}.{suffix}"] = TensorInfo(f"{path}.{suffix}", Path("<random>"), shape, "I32")

    for i, layer in enumerate(model.layers):
        for name, _, _ in layer_targets(layer):
            lin = layer.get_submodule(name)
            add(f"layers.{i}.{name}", lin.in_features, lin.out_features)
        if isinstance(layer.mlp, SparseMoE):
            H, inter = cfg.hidden_size, cfg.moe_intermediate_size
            for part, (k, n) in (("gate_proj", (H, inter)), ("up_proj", (H, inter)), ("down_proj", (inter, H))):
                add(f"layers.{i}.mlp.experts.0.{part}", k, n)
    if scheme.lm_head and not cfg.tie_word_embeddings:
        add("lm_head", cfg.hidden_size, cfg.vocab_size)
    qc = ({"quant_method": "nf4", "blocksize": scheme.blocksize} if scheme.kind == "nf4"
          else {"quant_method": "gptq", "bits": 4, "group_size": scheme.group_size, "checkpoint_format": "gptq"})
    with torch.device("meta"):  # the quantized modules' buffers are created on the meta device too
        install_quantized_modules(model, canon, qc)
    for module in model.modules():  # as build_model: quantized modules' float parameters in the model dtype
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != dt:
                setattr(module, name, torch.nn.Parameter(p.to(dt), requires_grad=False))
    return model


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of a model (meta tensors count their would-be size)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def check_load(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               context: int | None = None) -> MemoryPlan | None:
    """Called by `load` before allocating: raise MemoryPlanError when the model will not fit.

    CUDA: the plan at `context` tokens (the engine's, when the caller fixed it; else LOAD_CHECK_CONTEXT)
    against the device's free memory. CPU: only refuse when the
    weights alone exceed the available RAM (swap and overcommit make anything less a guess)."""
    from clover_lite.checkpoint.load import read_quant_config

    if device.type not in ("cpu", "cuda"):
        return None
    qc = read_quant_config(path)
    context = context or min(config.max_position_embeddings, LOAD_CHECK_CONTEXT)
    p = plan(config, qc, context, device, dtype=dtype, _name=path.name)
    if device.type == "cuda":
        if not p.fits():
            raise MemoryPlanError(f"{path}: not loading, it would run out of GPU memory.\n{p.message()}")
    elif p.target.capacity and p.weight_bytes > p.target.capacity:
        raise MemoryPlanError(
            f"{path}: not loading, the weights ({_gb(p.weight_bytes)}) exceed the available RAM "
            f"({_gb(p.target.capacity)}).\n{p.message()}"
        )
    return p


__all__ = [
    "plan", "MemoryPlan", "QuantScheme", "parse_quant", "KNOWN_GPUS", "GPU", "CUDA_CONTEXT_BYTES",
    "GPU_RESERVE_BYTES", "CUDA_FREE_HEADROOM_BYTES", "PREFILL_CHUNK", "WORKSPACE_FORMULA", "NAMED_CONFIGS",
    "named_config", "clover_35b_a3b_config", "MemoryPlanError", "check_load", "weight_bytes", "kv_bytes_per_token",
    "gdn_state_bytes", "workspace_bytes", "fmt_bytes", "meta_model", "model_bytes", "available_ram",
    "normalize_gpu_name",
]
