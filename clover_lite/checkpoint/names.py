"""Hub tensor names -> the model's: prefixes of the wrappers, per-expert and fused expert tensors, GPTQ
parts, each family's own module names; each checkpoint tensor becomes assignments into the model's
parameters, checked for shape.

The model's names are Qwen's (`embed_tokens`, `self_attn.q_proj` ...). SDAR stores exactly those. LLaDA2
(BailingMoeV2) stores `word_embeddings`, `attention.query_key_value` (q, k, v fused along the output: all q
heads, then the k heads, then the v heads), `attention.dense`, `attention.query_layernorm` /
`key_layernorm`, `mlp.shared_experts`, and `mlp.gate.expert_bias`: `BAILING_NAMES` renames them and the fused
projection is split into q_proj / k_proj / v_proj (a 16-bit one by rows; a GPTQ-quantized one, as other
tools write it, by output columns; our own quantizer writes the three projections)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from clover_lite.models.config import ModelConfig
from clover_lite.models.denoiser import Denoiser

# Tensors of checkpoints that carry more than the text denoiser: multi-token-prediction heads and the
# vision tower of the multimodal Qwen3.5 wrapper. Skipped with a note.
SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


@dataclass(frozen=True)
class Assignment:
    """Where (part of) a source tensor goes: param[index] = transform(tensor)."""

    dest: str
    index: tuple | None
    units: tuple[tuple, ...]  # what this fills, for the missing-tensor check
    shape: tuple[int, ...]  # expected shape of the source tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|qweight|qzeros|scales|g_idx|bias|nf4_weight|nf4_absmax)$"
)
# GPTQ tensors of a quantized linear; g_idx may be absent (then groups are k // group_size).
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


# LLaDA2's module names inside a layer (and its embedding) -> ours; query_key_value is split, not renamed.
BAILING_NAMES = (
    ("attention.dense.", "self_attn.o_proj."),
    ("attention.query_layernorm.", "self_attn.q_norm."),
    ("attention.key_layernorm.", "self_attn.k_norm."),
    ("mlp.shared_experts.", "mlp.shared_expert."),
)
BAILING_QKV = "attention.query_key_value."
# What a fused query_key_value may carry: 16-bit weight and bias, or a GPTQ-quantized linear's tensors.
QKV_KINDS = ("weight", "bias", "qweight", "qzeros", "scales", "g_idx")


def model_name(canon: str, config: ModelConfig) -> str:
    """A canonical checkpoint name ('layers.3.attention.dense.weight') as the model names it
    ('layers.3.self_attn.o_proj.weight'): the family's renames; unchanged for Qwen-named checkpoints (and for
    LLaDA2's fused query_key_value, which NameMap splits)."""
    if config.family != "llada2":
        return canon
    if canon == "word_embeddings.weight":
        return "embed_tokens.weight"
    m = _LAYER.match(canon)
    if m:
        rest = m.group(2)
        for old, new in BAILING_NAMES:
            if rest.startswith(old):
                return f"layers.{m.group(1)}.{new}{rest[len(old):]}"
    return canon


def hub_layout(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors in the model's naming (`model.layers.N.self_attn.q_proj.weight`, checkpoint/save.py's
    checkpoint_tensors) as the family's Hub checkpoints name them: the inverse of model_name, with LLaDA2's
    q/k/v projections fused into query_key_value (16-bit tensors). Qwen-named families pass unchanged."""
    if config.family != "llada2":
        yield from tensors
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name == "model.embed_tokens.weight":
            yield "model.word_embeddings.weight", t
            continue
        m = _LAYER.match(name[len("model."):]) if name.startswith("model.") else None
        if not m:
            yield name, t
            continue
        i, rest = m.group(1), m.group(2)
        qkv = re.match(r"^self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$", rest)
        if qkv:
            parts = pending.setdefault(f"{i}.{qkv.group(2)}", {})
            parts[qkv.group(1)] = t
            if len(parts) == 3:
                fused = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
                yield f"model.layers.{i}.{BAILING_QKV}{qkv.group(2)}", fused
            continue
        for hub, ours in BAILING_NAMES:
            if rest.startswith(ours):
                rest = hub + rest[len(ours):]
                break
        yield f"model.layers.{i}.{rest}", t
    if any(len(p) != 3 for p in pending.values()):
        raise ValueError("hub_layout: q, k and v projections of a layer must all be given to fuse them")


def canonical_name(name: str) -> str | None:
    """Checkpoint name -> name inside the text model ('layers.3.mlp...'), or None to skip it."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name  # lm_head.weight


class NameMap:
    """Maps checkpoint tensors (by their Hub names and shapes) to the model's parameters for one config."""

    def __init__(self, model: Denoiser, config: ModelConfig):
        self.model = model
        self.c = config
        # Everything a checkpoint fills: parameters and the (integer) GPTQ buffers of quantized modules.
        self.params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        # Every unit that must be filled, per tensor: plain tensors are one unit; experts one per expert
        # (and part), so per-expert and fused checkpoints are checked the same way.
        self.units: dict[str, tuple[tuple, ...]] = {}
        for name, t in self.params.items():
            if name.endswith("experts.gate_up_proj"):
                parts = ("gate_proj", "up_proj")
                self.units[name] = tuple((name, e, p) for e in range(config.num_experts) for p in parts)
            elif name.endswith("experts.down_proj"):
                self.units[name] = tuple((name, e, "down_proj") for e in range(config.num_experts))
            elif ".experts." in name:  # stacked quantized experts: [E, ...]
                self.units[name] = tuple((name, e) for e in range(t.shape[0]))
            else:
                self.units[name] = ((name,),)

    def checkpoint_name(self, unit: tuple) -> str:
        """The per-expert / plain checkpoint name a unit would come from, for error messages."""
        name = unit[0]
        if len(unit) == 3:  # float experts
            base = name.rsplit(".", 2)[0]  # layers.N.mlp
            return f"model.{base}.experts.{unit[1]}.{unit[2]}.weight"
        if len(unit) == 2:  # stacked quantized experts: layers.N.mlp.experts.part.suffix
            head, part, suffix = name.rsplit(".", 2)
            return f"model.{head}.{unit[1]}.{part}.{suffix}"
        if self.c.family == "llada2":  # as LLaDA2 names it
            if name == "embed_tokens.weight":
                return "model.word_embeddings.weight"
            m = _LAYER.match(name)
            if m:
                rest = m.group(2)
                for hub, ours in BAILING_NAMES:
                    rest = hub + rest[len(ours):] if rest.startswith(ours) else rest
                for part in ("q_proj.", "k_proj.", "v_proj."):
                    if rest.startswith(f"self_attn.{part}"):
                        rest = BAILING_QKV + rest[len(f"self_attn.{part}"):]
                name = f"layers.{m.group(1)}.{rest}"
        return name if name.startswith("lm_head") else f"model.{name}"

    def optional(self, unit: tuple) -> bool:
        """Units a checkpoint may leave out: g_idx of quantized linears (default k // group_size)."""
        return unit[0].endswith(".g_idx")

    def plan(self, name: str, shape: tuple[int, ...]) -> list[Assignment] | None:
        """Assignments for one checkpoint tensor; None if the name is not part of this model."""
        c = self.c
        name = model_name(name, c)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            return []  # tied: the embedding is the head; an extra copy on disk is harmless
        if name.endswith(".weight") and name[: -len(".weight")].endswith(("experts.gate_up_proj", "experts.down_proj")):
            name = name[: -len(".weight")]  # fused expert tensors are sometimes saved with a suffix
        if name in self.params:
            return [Assignment(name, None, self.units[name], tuple(self.params[name].shape))]
        m = _LAYER.match(name)
        if not m:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        prefix = f"layers.{layer}."
        e = _EXPERT.match(rest)
        if e and int(e.group(1)) >= c.num_experts:
            return None
        if e and f"{prefix}mlp.experts.{e.group(2)}.{e.group(3)}" in self.params:  # stacked quantized
            dest = f"{prefix}mlp.experts.{e.group(2)}.{e.group(3)}"
            expert = int(e.group(1))
            return [Assignment(dest, (expert,), ((dest, expert),), tuple(self.params[dest].shape[1:]))]
        if e and e.group(3) == "weight" and f"{prefix}mlp.experts.gate_up_proj" in self.params:
            expert, part = int(e.group(1)), e.group(2)
            inter, hidden = c.moe_intermediate_size, c.hidden_size
            if part == "down_proj":
                dest = f"{prefix}mlp.experts.down_proj"
                return [Assignment(dest, (expert,), ((dest, expert, part),), (hidden, inter))]
            dest = f"{prefix}mlp.experts.gate_up_proj"
            rows = slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter)
            return [Assignment(dest, (expert, rows), ((dest, expert, part),), (inter, hidden))]
        if c.family == "llada2" and rest.startswith(BAILING_QKV) and rest[len(BAILING_QKV):] in QKV_KINDS \
                and f"{prefix}self_attn.q_proj.{rest[len(BAILING_QKV):]}" in self.params:
            return self._split_qkv(prefix, rest[len(BAILING_QKV):])
        if rest == "linear_attn.in_proj_qkvz.weight" and f"{prefix}linear_attn.in_proj_qkv.weight" in self.params:
            return self._split_qkvz(prefix)
        if rest == "linear_attn.in_proj_ba.weight" and f"{prefix}linear_attn.in_proj_b.weight" in self.params:
            return self._split_ba(prefix)
        return None

    def _split_qkv(self, prefix: str, kind: str) -> list[Assignment]:
        """LLaDA2's query_key_value (or its bias, or its GPTQ tensors) into q_proj / k_proj / v_proj: the q heads,
        then the k heads, then the v heads (BailingMoeV2Attention views it as heads + 2 kv_heads heads). A
        16-bit weight splits by rows; GPTQ's qweight, scales and qzeros by columns (the output dimension,
        packed 8 to an int32 in qzeros); g_idx indexes the shared input and goes to all three whole."""
        parts = [f"{prefix}self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
        shapes = [tuple(self.params[d].shape) for d in parts]
        if kind == "g_idx":
            return [Assignment(d, None, ((d,),), shapes[0]) for d in parts]
        axis = 0 if kind in ("weight", "bias") else 1
        widths = [sh[axis] for sh in shapes]
        fused = list(shapes[0])
        fused[axis] = sum(widths)
        out, lo = [], 0
        for dest, width in zip(parts, widths, strict=True):
            cut = (slice(lo, lo + width),) if axis == 0 else (slice(None), slice(lo, lo + width))
            out.append(Assignment(dest, None, ((dest,),), tuple(fused), lambda w, cut=cut: w[cut]))
            lo += width
        return out

    def _split_qkvz(self, prefix: str) -> list[Assignment]:
        """Qwen3-Next stores q, k, v, z interleaved per key head; we keep Qwen3.5's [q; k; v] and z."""
        c = self.c
        nk, dk, dv, r = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, (
            c.linear_num_value_heads // c.linear_num_key_heads
        )
        h = c.hidden_size
        shape = (nk * (2 * dk + 2 * r * dv), h)

        def qkv(w: torch.Tensor) -> torch.Tensor:
            w = w.view(nk, 2 * dk + 2 * r * dv, h)
            return torch.cat([w[:, :dk].reshape(-1, h), w[:, dk : 2 * dk].reshape(-1, h),
                              w[:, 2 * dk : 2 * dk + r * dv].reshape(-1, h)])

        def z(w: torch.Tensor) -> torch.Tensor:
            return w.view(nk, 2 * dk + 2 * r * dv, h)[:, 2 * dk + r * dv :].reshape(-1, h)

        qkv_name, z_name = f"{prefix}linear_attn.in_proj_qkv.weight", f"{prefix}linear_attn.in_proj_z.weight"
        return [
            Assignment(qkv_name, None, ((qkv_name,),), shape, qkv),
            Assignment(z_name, None, ((z_name,),), shape, z),
        ]

    def _split_ba(self, prefix: str) -> list[Assignment]:
        c = self.c
        nk, r, h = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, c.hidden_size
        shape = (2 * nk * r, h)
        b_name, a_name = f"{prefix}linear_attn.in_proj_b.weight", f"{prefix}linear_attn.in_proj_a.weight"
        return [
            Assignment(b_name, None, ((b_name,),), shape, lambda w: w.view(nk, 2 * r, h)[:, :r].reshape(-1, h)),
            Assignment(a_name, None, ((a_name,),), shape, lambda w: w.view(nk, 2 * r, h)[:, r:].reshape(-1, h)),
        ]


# ---- quantized checkpoints ---------------------------------------------------------------------
