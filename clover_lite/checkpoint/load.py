"""Stream a Hugging Face safetensors checkpoint into a Denoiser built on the meta device.

The whole plan (every tensor's destination and shape) is checked from the file headers before any
data is read, so a wrong checkpoint fails in a second with one message naming the tensor and file.
Tensors are then read one at a time, cast, and copied into place: peak host memory is the model
plus one tensor.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_lite.errors import CheckpointError
from clover_lite.models.config import ModelConfig
from clover_lite.models.denoiser import Denoiser

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Tensors of checkpoints that carry more than the text denoiser: multi-token-prediction heads and the
# vision tower of the multimodal Qwen3.5 wrapper. Skipped with a note.
SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0  # absolute byte offset of the data in the file
    nbytes: int = 0


@dataclass(frozen=True)
class Assignment:
    """Where (part of) a source tensor goes: param[index] = transform(tensor)."""

    dest: str
    index: tuple | None
    units: tuple[tuple, ...]  # what this fills, for the missing-tensor check
    shape: tuple[int, ...]  # expected shape of the source tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class LoadReport:
    files: list[Path]
    tensors: int
    skipped: list[str]
    notes: list[str]


# ---- reading headers ---------------------------------------------------------------------------
def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check the file holds every byte it promises."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{file}: truncated or empty safetensors file ({size} bytes); re-download it")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise CheckpointError(
                    f"{file}: truncated or not a safetensors file (header of {header_len} bytes in a "
                    f"{size}-byte file); re-download it"
                )
            header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e}); re-download it") from e
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e})") from e
    data_len = size - 8 - header_len
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        if end > data_len:
            raise CheckpointError(
                f"{file}: truncated: tensor '{name}' ends at byte {end} of the data section but the file holds "
                f"only {data_len}; re-download or re-save the checkpoint"
            )
        out[name] = TensorInfo(name, file, tuple(meta["shape"]), meta["dtype"], 8 + header_len + start, end - start)
    return out


def read_tensor(handle, info: TensorInfo) -> torch.Tensor:
    """One tensor read with plain file I/O (no mmap: the pages of a 70 GB checkpoint never pile up in the
    process's resident memory; only this tensor's bytes are held)."""
    handle.seek(info.offset)
    buf = bytearray(info.nbytes)
    if handle.readinto(buf) != info.nbytes:
        raise CheckpointError(f"tensor '{info.name}' in {info.file}: file ended early; re-download it")
    dtype = SAFETENSORS_DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointError(f"tensor '{info.name}' in {info.file} has unsupported dtype {info.dtype}")
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    if single.exists():
        return [single]
    found = sorted(p.name for p in path.glob("*.safetensors"))
    hint = f" (found {', '.join(found)} but no model.safetensors.index.json)" if found else ""
    raise CheckpointError(
        f"{path}: no model.safetensors or model.safetensors.index.json{hint}; "
        "clover-lite reads Hugging Face safetensors checkpoints"
    )


# ---- name mapping ------------------------------------------------------------------------------
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|qweight|qzeros|scales|g_idx|bias|nf4_weight|nf4_absmax)$"
)
# GPTQ tensors of a quantized linear; g_idx may be absent (then groups are k // group_size).
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def canonical_name(name: str) -> str | None:
    """Checkpoint name -> name inside the text model ('layers.3.mlp...'), or None to skip it."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name  # lm_head.weight


class Planner:
    """Maps checkpoint tensors to model parameters for one config."""

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
        return name if name.startswith("lm_head") else f"model.{name}"

    def optional(self, unit: tuple) -> bool:
        """Units a checkpoint may leave out: g_idx of quantized linears (default k // group_size)."""
        return unit[0].endswith(".g_idx")

    def plan(self, name: str, shape: tuple[int, ...]) -> list[Assignment] | None:
        """Assignments for one checkpoint tensor; None if the name is not part of this model."""
        c = self.c
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
        if rest == "linear_attn.in_proj_qkvz.weight" and f"{prefix}linear_attn.in_proj_qkv.weight" in self.params:
            return self._split_qkvz(prefix)
        if rest == "linear_attn.in_proj_ba.weight" and f"{prefix}linear_attn.in_proj_b.weight" in self.params:
            return self._split_ba(prefix)
        return None

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
def read_quant_config(path: Path) -> dict | None:
    """The quantization settings of a checkpoint (quantize_config.json, or config.json's
    quantization_config); None for a 16-bit checkpoint."""
    file = path / "quantize_config.json"
    if file.exists():
        try:
            qc = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    else:
        try:
            qc = json.loads((path / "config.json").read_text()).get("quantization_config")
        except (OSError, json.JSONDecodeError):
            qc = None
    if qc is None:
        return None
    method = qc.get("quant_method", "gptq")
    if method == "nf4":
        return qc
    if method != "gptq":
        raise CheckpointError(f"{path}: quantization method '{method}' is not supported (GPTQ INT4 or NF4)")
    if int(qc.get("bits", 4)) != 4:
        raise CheckpointError(f"{path}: {qc.get('bits')}-bit GPTQ is not supported; clover-lite runs 4-bit weights")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{path}: checkpoint_format '{fmt}' is not supported (gptq or gptq_v2)")
    return qc


def install_quantized_modules(model: Denoiser, canon: dict[str, TensorInfo], qc: dict) -> None:
    """Swap the float modules that the checkpoint stores quantized (GPTQ `qweight`, NF4 `nf4_weight`)
    for quantized ones, on the meta device."""
    from clover_lite.models.quantized import NF4Linear, QuantLinear, gptq_experts, nf4_experts

    nf4 = qc.get("quant_method") == "nf4"
    marker = ".nf4_weight" if nf4 else ".qweight"
    fmt = qc.get("checkpoint_format", "gptq")
    blocksize = int(qc.get("blocksize", 64))
    c = model.config
    expert_layers: dict[str, dict[str, TensorInfo | None]] = {}
    for name in canon:
        if not name.endswith(marker):
            continue
        path = name[: -len(marker)]
        m = re.match(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$", path)
        if m:
            expert_layers.setdefault(m.group(1), {})[m.group(3)] = canon.get(f"{path}.scales")
            continue
        try:
            old = model.get_submodule(path)
        except AttributeError:
            continue  # reported as an unexpected tensor by the planner
        if not isinstance(old, torch.nn.Linear):
            continue
        bias = f"{path}.bias" in canon
        if nf4:
            new = NF4Linear(old.in_features, old.out_features, blocksize, bias=bias)
        else:
            scales = canon.get(f"{path}.scales")
            groups = scales.shape[0] if scales is not None else 1
            new = QuantLinear(old.in_features, old.out_features, groups, bias=bias, checkpoint_format=fmt)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, new.to(device="meta"))
    for mlp_path, parts in expert_layers.items():
        if set(parts) != {"gate_proj", "up_proj", "down_proj"}:
            raise CheckpointError(f"{mlp_path}: quantized experts need gate_proj, up_proj and down_proj tensors")
        E, H, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        if nf4:
            experts = nf4_experts(E, H, inter, blocksize)
        else:
            g_in = parts["gate_proj"].shape[0] if parts["gate_proj"] is not None else 1
            g_down = parts["down_proj"].shape[0] if parts["down_proj"] is not None else 1
            experts = gptq_experts(E, H, inter, g_in, g_down, fmt)
        model.get_submodule(mlp_path).experts = experts.to(device="meta")


def _fill_default_g_idx(model: Denoiser, filled: set) -> None:
    from clover_lite.models.quantized import QuantLinear

    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            key = f"{name}.g_idx"
            if (key,) in filled or any(u[0] == key for u in filled if len(u) == 2):
                continue
            K = module.in_features
            module.g_idx.copy_(torch.arange(K, dtype=torch.int32, device=module.g_idx.device) // (K // module.groups))


# ---- loading -----------------------------------------------------------------------------------
class Checkpoint:
    """The tensors of a checkpoint directory, known from the file headers alone."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files = checkpoint_files(self.path)
        self.headers: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_header(f).items():
                if name in self.headers:
                    raise CheckpointError(f"tensor '{name}' appears in both {self.headers[name].file} and {f}")
                self.headers[name] = info
        self.quant_config = read_quant_config(self.path)

    def canonical(self) -> dict[str, TensorInfo]:
        out = {}
        for name, info in self.headers.items():
            canon = canonical_name(name)
            if canon is not None:
                out[canon] = info
        return out


def plan_checkpoint(model: Denoiser, ckpt: Checkpoint) -> tuple[dict[str, list[Assignment]], list[str], Planner]:
    """Check every tensor of the checkpoint against the model (names, shapes, dtypes, completeness) and
    return where each goes. Nothing is read but the headers."""
    planner = Planner(model, model.config)
    plans: dict[str, list[Assignment]] = {}
    skipped, unexpected = [], []
    for name, info in ckpt.headers.items():
        canon = canonical_name(name)
        if canon is None:
            skipped.append(name)
            continue
        plan = planner.plan(canon, info.shape)
        if plan is None:
            unexpected.append(f"{name} ({info.file.name})")
            continue
        for a in plan:
            if tuple(info.shape) != a.shape:
                raise CheckpointError(
                    f"tensor '{name}' in {info.file} has shape {list(info.shape)} but the config expects "
                    f"{list(a.shape)}; check that config.json belongs to these weights"
                )
            want_int = not planner.params[a.dest].is_floating_point()
            is_int = info.dtype in ("I32", "I64", "I16", "I8", "U8")
            if is_int != want_int or info.dtype not in SAFETENSORS_DTYPES:
                kind = "an integer (packed GPTQ)" if want_int else "a float"
                raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}; expected {kind} tensor")
        plans[name] = plan
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensor(s) in {ckpt.path} that this {model.config.model_type} config has "
            f"no place for: {shown}. Check that config.json matches the weights."
        )
    filled = {u for plan in plans.values() for a in plan for u in a.units}
    missing = [u for units in planner.units.values() for u in units if u not in filled and not planner.optional(u)]
    if missing:
        names = [planner.checkpoint_name(u) for u in missing]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise CheckpointError(
            f"{len(missing)} tensor(s) missing from {ckpt.path}: {shown}. The checkpoint is incomplete or does "
            "not match config.json."
        )
    return plans, skipped, planner


def copy_tensors(
    model: Denoiser,
    ckpt: Checkpoint,
    plans: dict[str, list[Assignment]],
    only: Callable[[str], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Read the planned tensors (those whose canonical name passes `only`) into the model, one at a time,
    cast to each destination's dtype. Destinations are looked up now, so a model whose layers were
    materialised after planning (the streaming quantizer) gets the real tensors."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    todo = [n for n in plans if only is None or only(canonical_name(n))]
    total, done = len(todo), 0
    with torch.no_grad():
        for f in ckpt.files:
            names = [n for n in todo if ckpt.headers[n].file == f]
            if not names:
                continue
            with open(f, "rb") as handle:
                for name in sorted(names, key=lambda n: ckpt.headers[n].offset):  # sequential reads
                    tensor = read_tensor(handle, ckpt.headers[name])
                    for a in plans[name]:
                        src = a.transform(tensor) if a.transform else tensor
                        dest = tensors[a.dest]
                        target = dest if a.index is None else dest[a.index]
                        target.copy_(src.to(dest.dtype))
                    del tensor
                    done += 1
                    if progress:
                        progress(done, total)
    return done


def load_weights(
    model: Denoiser,
    ckpt: Checkpoint,
    progress: Callable[[int, int], None] | None = None,
) -> LoadReport:
    """Fill `model`'s tensors (already materialised on their device) from the checkpoint."""
    plans, skipped, _ = plan_checkpoint(model, ckpt)
    total = copy_tensors(model, ckpt, plans, progress=progress)
    filled = {u for plan in plans.values() for a in plan for u in a.units}
    _fill_default_g_idx(model, filled)
    notes = []
    if skipped:
        kinds = sorted({n.split(".")[0] if n.startswith("mtp.") else "vision" for n in skipped})
        notes.append(f"skipped {len(skipped)} tensor(s) not used by the text denoiser ({', '.join(kinds)})")
    return LoadReport(files=ckpt.files, tensors=total, skipped=skipped, notes=notes)


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    ckpt: Checkpoint | None = None,
    materialize: bool = True,
) -> Denoiser:
    """A Denoiser with tensors allocated (not initialised) on `device`: floats in `dtype`, modules that the
    checkpoint stores as GPTQ tensors swapped for quantized ones (their scales stay fp16)."""
    with torch.device("meta"):
        model = Denoiser(config)
    model = model.to(dtype=dtype)
    if ckpt is not None and ckpt.quant_config is not None:
        install_quantized_modules(model, ckpt.canonical(), ckpt.quant_config)
        for module in model.modules():  # quantized modules' float parameters (biases) in the model dtype
            for name, p in list(module.named_parameters(recurse=False)):
                if p.dtype != dtype:
                    setattr(module, name, torch.nn.Parameter(p.to(dtype), requires_grad=False))
    return model.to_empty(device=device) if materialize else model


def load_model(
    path: str | os.PathLike,
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    kernels: str | None = None,
) -> tuple[Denoiser, LoadReport]:
    """Load a checkpoint; `kernels` (auto|torch|triton, default $CLOVER_KERNELS or auto) picks the
    implementation of the quantized modules once, here."""
    from clover_lite.kernels import dispatch

    ckpt = Checkpoint(path)
    model = build_model(config, device, dtype, ckpt)
    report = load_weights(model, ckpt, progress)
    model.eval()
    dispatch.apply(model, dispatch.select(device, kernels))
    return model, report
