"""The bytes a model needs, from its config alone: weights by format, the committed caches, the workspace."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from clover_lite.errors import CloverError
from clover_lite.models.config import ModelConfig

FLOAT_KINDS = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPE_NAMES = {
    "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
    if q in DTYPE_NAMES:
        return QuantScheme(DTYPE_NAMES[q])
    if q in ("int4", "gptq", "w4a16"):
        return QuantScheme("int4")
    if q.startswith("int4-g") and q[6:].lstrip("-").isdigit():
        g = int(q[6:])
        if g < 1 and g != -1:
            raise CloverError(f"'{quant}': the group size must be positive (e.g. int4-g128), or -1 for one group per "
                              "channel (int4-g-1)")
        return QuantScheme("int4", group_size=g)
    if q == "nf4":
        return QuantScheme("nf4")
    raise CloverError(f"unknown quantization '{quant}'; use bf16, fp16, fp32, int4 (GPTQ g128), int4-gG or nf4")


def dtype_name(dtype: str | torch.dtype | None, scheme: QuantScheme) -> str:
    if dtype is None:
        return scheme.kind if scheme.kind in FLOAT_KINDS else "bf16"
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES:
            raise CloverError(f"dtype {dtype} is not supported (bf16, fp16, fp32)")
        return _TORCH_DTYPES[dtype]
    if str(dtype).lower() not in DTYPE_NAMES:
        raise CloverError(f"unknown dtype '{dtype}'; use bf16, fp16 or fp32")
    return DTYPE_NAMES[str(dtype).lower()]


# ---- weights -----------------------------------------------------------------------------------
def group_count(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else max(1, math.ceil(k / group_size))


def _linear(k: int, n: int, scheme: QuantScheme, d: int, quantized: bool, bias: bool = False,
            stack: int = 1) -> dict[str, int]:
    """Bytes of a linear y = x W^T, W [n, k] (times `stack` for stacked experts), by tensor kind."""
    out: dict[str, int] = {}
    if not quantized or not scheme.quantized:
        out["16-bit" if d == 2 else "float"] = stack * k * n * d
    elif scheme.kind == "int4":
        g = group_count(k, scheme.group_size)
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
            # q_proj is twice as wide with the output gate; a fused query_key_value (LLaDA2) is held as the
            # three projections it is split into: the same bytes.
            _add(a, _linear(H, (2 if c.attention_output_gate else 1) * nh * hd, scheme, d, True, b))
            _add(a, _linear(H, kv * hd, scheme, d, True, b), 2)
            _add(a, _linear(nh * hd, H, scheme, d, True, c.attention_output_bias))
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
            if c.router_expert_bias:
                _add(small, {fl: E * d})  # the grouped router's expert bias (LLaDA2)
            if c.shared_expert_intermediate_size:
                s, si = cat("shared experts / dense MLP"), c.shared_expert_intermediate_size
                _add(s, _linear(H, si, scheme, d, True), 2)
                _add(s, _linear(si, H, scheme, d, True))
                if c.shared_expert_gate:
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
            shapes.append(H * (2 if c.attention_output_gate else 1) * c.num_attention_heads * c.head_dim)
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
