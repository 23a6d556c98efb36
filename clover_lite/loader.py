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
from safetensors import safe_open

from .errors import CheckpointError
from .models.config import ModelConfig
from .models.denoiser import Denoiser

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
        out[name] = TensorInfo(name, file, tuple(meta["shape"]), meta["dtype"])
    return out


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
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


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
        self.params = dict(model.named_parameters())
        # Every unit that must be filled, per parameter: plain params are one unit; experts one per
        # expert and part, so per-expert and fused checkpoints are checked the same way.
        self.units: dict[str, tuple[tuple, ...]] = {}
        for name in self.params:
            if name.endswith("experts.gate_up_proj"):
                parts = ("gate_proj", "up_proj")
            elif name.endswith("experts.down_proj"):
                parts = ("down_proj",)
            else:
                self.units[name] = ((name,),)
                continue
            self.units[name] = tuple((name, e, p) for e in range(config.num_experts) for p in parts)

    def checkpoint_name(self, unit: tuple) -> str:
        """The per-expert / plain checkpoint name a unit would come from, for error messages."""
        name = unit[0]
        if len(unit) == 3:
            base = name.rsplit(".", 2)[0]  # layers.N.mlp
            return f"model.{base}.experts.{unit[1]}.{unit[2]}.weight"
        return name if name.startswith("lm_head") else f"model.{name}"

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
        if e and f"{prefix}mlp.experts.gate_up_proj" in self.params:
            expert, part = int(e.group(1)), e.group(2)
            if expert >= c.num_experts:
                return None
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


# ---- loading -----------------------------------------------------------------------------------
def load_weights(
    model: Denoiser,
    path: str | os.PathLike,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> LoadReport:
    """Fill `model`'s parameters (already materialised on their device) from the checkpoint at `path`."""
    path = Path(path)
    files = checkpoint_files(path)
    planner = Planner(model, model.config)
    headers: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in headers:
                raise CheckpointError(f"tensor '{name}' appears in both {headers[name].file} and {f}")
            headers[name] = info

    plans: dict[str, list[Assignment]] = {}
    skipped, unexpected = [], []
    for name, info in headers.items():
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
        if info.dtype not in ("F32", "F16", "BF16", "F64"):
            raise CheckpointError(
                f"tensor '{name}' in {info.file} has dtype {info.dtype}; expected a float tensor "
                "(quantized checkpoints are read by the GPTQ loader)"
            )
        plans[name] = plan
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensor(s) in {path} that this {model.config.model_type} config has no "
            f"place for: {shown}. Check that config.json matches the weights."
        )
    filled = {u for plan in plans.values() for a in plan for u in a.units}
    missing = [u for units in planner.units.values() for u in units if u not in filled]
    if missing:
        names = [planner.checkpoint_name(u) for u in missing]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise CheckpointError(
            f"{len(missing)} tensor(s) missing from {path}: {shown}. The checkpoint is incomplete or does not "
            "match config.json."
        )

    total, done = len(plans), 0
    with torch.no_grad():
        for f in files:
            names = [n for n, i in headers.items() if i.file == f and n in plans]
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: cannot be opened as safetensors ({e}); re-download it") from e
            for name in names:
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"tensor '{name}' in {f} cannot be read ({e}); re-download the file") from e
                for a in plans[name]:
                    src = a.transform(tensor) if a.transform else tensor
                    dest = planner.params[a.dest]
                    target = dest if a.index is None else dest[a.index]
                    target.copy_(src.to(dtype))
                done += 1
                if progress:
                    progress(done, total)
    notes = []
    if skipped:
        kinds = sorted({n.split(".")[0] if n.startswith("mtp.") else "vision" for n in skipped})
        notes.append(f"skipped {len(skipped)} tensor(s) not used by the text denoiser ({', '.join(kinds)})")
    return LoadReport(files=files, tensors=total, skipped=skipped, notes=notes)


def build_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> Denoiser:
    """An uninitialised Denoiser with parameters allocated (not initialised) on `device` in `dtype`."""
    with torch.device("meta"):
        model = Denoiser(config)
    model = model.to(dtype=dtype)
    return model.to_empty(device=device)


def load_model(
    path: str | os.PathLike,
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Denoiser, LoadReport]:
    model = build_model(config, device, dtype)
    report = load_weights(model, path, dtype, progress)
    model.eval()
    return model, report
