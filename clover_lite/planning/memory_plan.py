"""`MemoryPlan`: what a model needs on a device, its totals, the advice when it does not fit, and its output.

The planners fill it (planning/planner.py for the block denoisers, planning/diffusion_gemma.py for
DiffusionGemma, docs/ARCHITECTURE.md sections 6 and 11); each subclass re-plans its own model in another
format or context (`_replan`), so the advice works the same for both. Kept apart from planner.py so that the
DiffusionGemma planner can build on it while `planner.plan` dispatches to it, without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from clover_lite.models.config import ModelConfig
from clover_lite.planning.devices import CUDA_CONTEXT_BYTES, KNOWN_GPUS, Target, fmt_bytes
from clover_lite.planning.memory import FLOAT_KINDS, WORKSPACE_FORMULA, QuantScheme

# The runtime's prompt prefill runs in chunks of this many tokens (CachedRunner's default).
PREFILL_CHUNK = 2048

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
    lm_head_quantizable = True  # a class constant: `clover quantize --quantize-lm-head` applies

    @property
    def step_label(self) -> str:
        """What one denoising step runs over, for titles."""
        return f"block {self.block_size}"

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
        return self._replan(self.scheme, context_len, self.dtype)

    def _replan(self, scheme: QuantScheme, context_len: int, dtype: str) -> MemoryPlan:
        """The same model planned again in another format, dtype or context, by the planner that made this plan
        (planner.BlockPlan, diffusion_gemma.DiffusionGemmaPlan)."""
        raise NotImplementedError

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
        if self.scheme.quantized and not self.scheme.lm_head and not self.config.tie_word_embeddings \
                and self.lm_head_quantizable:
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
        return self._replan(scheme, self.context_len, dtype)

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


def _default_backend(device, gpu: bool, verified: bool = True) -> str:
    """The kernels `load` would choose: kernels.dispatch.select for a real device, Triton for a GPU card
    (`verified`: as dispatch.select's, False where the model's kernel path has not run on a GPU yet)."""
    from clover_lite.kernels import dispatch

    real = isinstance(device, torch.device) or (
        isinstance(device, str) and device.lower().split(":")[0] in ("cpu", "cuda"))
    if real:
        try:
            return dispatch.select(device, verified=verified)
        except (RuntimeError, ValueError):
            return "torch"
    return "triton" if gpu and verified else "torch"
