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
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig, config_from_dict, load_config
from clover_lite.planning.devices import CUDA_CONTEXT_BYTES, Target, fmt_bytes, resolve_target
from clover_lite.planning.memory import (
    DTYPE_NAMES,
    QuantScheme,
    dtype_name,
    gdn_state_bytes,
    group_count,
    kv_bytes_per_token,
    parse_quant,
    weight_bytes,
    workspace_bytes,
)
from clover_lite.planning.memory_plan import PREFILL_CHUNK, MemoryPlan, _default_backend
from clover_lite.planning.named_configs import NAMED_CONFIGS, named_config

# The context `load()` checks a model against (a generation asks for more only if the prompt is long).
LOAD_CHECK_CONTEXT = 4096


class MemoryPlanError(CloverError):
    """The model does not fit the device (raised by `load` and `clover bench` before allocating)."""


_gb = fmt_bytes


@dataclass
class BlockPlan(MemoryPlan):
    """The plan of a block denoiser (the Denoiser's config), re-planned by `plan`."""

    def _replan(self, scheme: QuantScheme, context_len: int, dtype: str) -> MemoryPlan:
        return plan(self.config, scheme, context_len, None, block_size=self.block_size, dtype=dtype,
                    prefill_chunk=self.prefill_chunk, backend=self.backend, _target=self.target, _name=self.model)


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
        from clover_lite.planning.named_configs import DIFFUSION_GEMMA_CONFIGS

        names = ", ".join([*NAMED_CONFIGS, *DIFFUSION_GEMMA_CONFIGS])
        raise CloverError(f"{p}: no such model directory or config (named configs: {names})")
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
    A DiffusionGemma config, named config or checkpoint gets its own plan (planning/diffusion_gemma.py: the
    canvas instead of a block, a prefix cache whose sliding layers keep their window; `block_size` and
    `quantize_lm_head` do not apply).
    """
    from clover_lite.planning.diffusion_gemma import diffusion_gemma_of, plan_diffusion_gemma

    dg = diffusion_gemma_of(config)
    if dg is not None:
        return plan_diffusion_gemma(dg[0], quant if quant is not None else dg[2], context_len, device, dtype=dtype,
                                    prefill_chunk=prefill_chunk, backend=backend, _target=_target,
                                    _name=_name or dg[1])
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
    return BlockPlan(
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
    from clover_lite.quant.checks import layer_targets

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
    smaller = "a smaller --context" + ("" if p.scheme.quantized else " or an INT4 model")
    return (f"this needs about {_gb(p.total)} of the {_gb(cap)} of RAM available now: the machine may swap, "
            f"or the process be killed; close other programs, or use {smaller}")


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
