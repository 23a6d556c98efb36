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

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig, config_from_dict, load_config
from clover_lite.planning.devices import CUDA_CONTEXT_BYTES, KNOWN_GPUS, Target, fmt_bytes, resolve_target
from clover_lite.planning.memory import (
    DTYPE_NAMES,
    FLOAT_KINDS,
    WORKSPACE_FORMULA,
    QuantScheme,
    dtype_name,
    gdn_state_bytes,
    group_count,
    kv_bytes_per_token,
    parse_quant,
    weight_bytes,
    workspace_bytes,
)
from clover_lite.planning.named_configs import NAMED_CONFIGS, named_config

# The runtime's prompt prefill runs in chunks of this many tokens (CachedRunner's default).
PREFILL_CHUNK = 2048
# The context `load()` checks a model against (a generation asks for more only if the prompt is long).
LOAD_CHECK_CONTEXT = 4096


class MemoryPlanError(CloverError):
    """The model does not fit the device (raised by `load` and `clover bench` before allocating)."""


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
    cfg = load_config(p)
    # A 16-bit checkpoint's scheme is the dtype its config.json declares (fp16 stays fp16, not bf16).
    return cfg, p.name, qc if qc is not None else DTYPE_NAMES.get(str(cfg.torch_dtype or "").replace("torch.", ""))


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
    dt = dtype_name(dtype, scheme)
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
    from clover_lite.checkpoint.files import TensorInfo
    from clover_lite.checkpoint.load import install_quantized_modules
    from clover_lite.models.denoiser import Denoiser
    from clover_lite.models.moe import SparseMoE
    from clover_lite.quant.pipeline import layer_targets

    cfg = named_config(config) if isinstance(config, str) else config
    scheme = parse_quant(quant)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name(dtype, scheme)]
    with torch.device("meta"):
        model = Denoiser(cfg)
    model = model.to(dtype=dt)
    if not scheme.quantized:
        return model
    marker = "nf4_weight" if scheme.kind == "nf4" else "qweight"
    canon: dict[str, TensorInfo] = {}

    def add(path: str, k: int, n: int) -> None:
        g = group_count(k, scheme.group_size)
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


RAM_WARN_FRACTION = 0.75  # above this share of the available RAM, other programs or a transient can tip it over


def ram_warning(p: MemoryPlan) -> str | None:
    """On a CPU: a warning when the plan takes most of the RAM available now, else None."""
    cap = p.target.capacity if p.target is not None and not p.target.gpu else 0
    if not cap or p.total <= RAM_WARN_FRACTION * cap:
        return None
    return (f"this needs about {_gb(p.total)} of the {_gb(cap)} of RAM available now: the machine may swap, "
            "or the process be killed; close other programs, or use a smaller --context or an INT4 model")


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


__all__ = ["plan", "MemoryPlan", "MemoryPlanError", "check_load", "ram_warning", "meta_model", "model_bytes",
           "PREFILL_CHUNK", "LOAD_CHECK_CONTEXT"]
