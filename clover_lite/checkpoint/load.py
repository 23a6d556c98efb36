"""Load a Hugging Face safetensors checkpoint into a Denoiser built on the meta device.

The whole plan (every tensor's destination and shape) is checked from the file headers before any
data is read, so a wrong checkpoint fails in a second with one message naming the tensor and file.
Tensors are then read one at a time, cast, and copied into place: peak host memory is the model
plus one tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_lite.checkpoint.files import SAFETENSORS_DTYPES, TensorInfo, checkpoint_files, read_header, read_tensor
from clover_lite.checkpoint.names import Assignment, NameMap, canonical_name, model_name
from clover_lite.errors import CheckpointError
from clover_lite.models.config import ModelConfig
from clover_lite.models.denoiser import Denoiser


@dataclass
class LoadReport:
    files: list[Path]
    tensors: int
    skipped: list[str]
    notes: list[str]


def read_quant_config(path: Path) -> dict | None:
    """The quantization settings of a checkpoint (quantize_config.json, or config.json's
    quantization_config); None for a 16-bit checkpoint."""
    file = path / "quantize_config.json"
    if file.exists():
        try:
            qc = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e}); re-download or re-quantize the model") from e
    else:
        file = path / "config.json"
        try:
            qc = json.loads(file.read_text(encoding="utf-8"))
            qc = qc.get("quantization_config") if isinstance(qc, dict) else None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            qc = None  # config.json's own reader reports a broken file
    if qc is None:
        return None
    return _checked_quant_config(qc, file)


def _checked_quant_config(qc: object, file: Path) -> dict:
    """The quantization settings, each key the runtime reads checked for its type and range."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{file}: the quantization settings must be a JSON object")

    def integer(key: str, default: int, ok) -> int:
        v = qc.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not ok(v):
            raise CheckpointError(f"{file}: '{key}' is {json.dumps(v)[:40]}, not a valid value; re-quantize the model")
        return v

    for key in ("lm_head", "sym", "desc_act"):
        if key in qc and not isinstance(qc[key], bool):
            raise CheckpointError(f"{file}: '{key}' must be true or false, got {json.dumps(qc[key])[:40]}")
    method = qc.get("quant_method", "gptq")
    if method == "nf4":
        integer("blocksize", 64, lambda v: 1 <= v <= 1 << 16)
        return qc
    if method != "gptq":
        raise CheckpointError(f"{file}: quantization method {json.dumps(method)[:40]} is not supported "
                              "(GPTQ INT4 or NF4)")
    if integer("bits", 4, lambda v: True) != 4:
        raise CheckpointError(f"{file}: {qc.get('bits')}-bit GPTQ is not supported; clover-lite runs 4-bit weights")
    integer("group_size", 128, lambda v: v == -1 or 1 <= v <= 1 << 20)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{file}: checkpoint_format {json.dumps(fmt)[:40]} is not supported (gptq or gptq_v2)")
    return qc


# Tensor names that tell which family a checkpoint is, for the unexpected-tensor error.
FAMILY_MARKERS = (
    ("right_conv", "the official Clover checkpoint's block-diffusion GDN (its right / clean-prefix convolutions), "
                   "which clover-lite does not run yet: its code is not public, and without it the model would run "
                   "wrong, so it is refused"),
    ("query_key_value", "LLaDA2 (BailingMoeV2) names: is config.json's model_type llada2_moe?"),
    ("word_embeddings", "LLaDA2 (BailingMoeV2) names: is config.json's model_type llada2_moe?"),
    ("linear_attn.", "Gated DeltaNet tensors (Qwen3.5-MoE / Clover): is config.json's model_type clover_moe or "
                     "qwen3_5_moe, with its layer_types?"),
)


def family_hint(names: list[str], config: ModelConfig) -> str:
    """What the unexpected tensors' names say about the checkpoint, else the generic advice."""
    for marker, says in FAMILY_MARKERS:
        if any(marker in n for n in names) and not (marker in ("query_key_value", "word_embeddings")
                                                     and config.family == "llada2"):
            return f"They look like {says}."
    return "Check that config.json matches the weights."


def install_quantized_modules(model: Denoiser, canon: dict[str, TensorInfo], qc: dict) -> None:
    """Swap the float modules that the checkpoint stores quantized (GPTQ `qweight`, NF4 `nf4_weight`)
    for quantized ones, on the meta device."""
    from clover_lite.models.quantized import NF4Linear, QuantLinear, gptq_experts, nf4_experts

    nf4 = qc.get("quant_method") == "nf4"
    marker = ".nf4_weight" if nf4 else ".qweight"
    fmt = qc.get("checkpoint_format", "gptq")
    blocksize = int(qc.get("blocksize", 64))
    c = model.config
    canon = {model_name(n, c): info for n, info in canon.items()}  # the family's module names -> the model's
    expert_layers: dict[str, dict[str, TensorInfo | None]] = {}
    for name in canon:
        if not name.endswith(marker):
            continue
        path = name[: -len(marker)]
        m = re.match(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$", path)
        if m:
            expert_layers.setdefault(m.group(1), {})[m.group(3)] = canon.get(f"{path}.scales")
            continue
        bias, scales = f"{path}.bias" in canon, canon.get(f"{path}.scales")
        targets = [path]
        if c.family == "llada2" and path.endswith(".attention.query_key_value"):
            # Other tools quantize LLaDA2's fused projection as one linear: its three parts share its groups.
            base = path[: -len("attention.query_key_value")]
            targets = [f"{base}self_attn.{part}" for part in ("q_proj", "k_proj", "v_proj")]
        for target in targets:
            try:
                old = model.get_submodule(target)
            except AttributeError:
                continue  # reported as an unexpected tensor by the name map
            if not isinstance(old, torch.nn.Linear):
                continue
            if nf4:
                new = NF4Linear(old.in_features, old.out_features, blocksize, bias=bias)
            else:
                groups = scales.shape[0] if scales is not None else 1
                new = QuantLinear(old.in_features, old.out_features, groups, bias=bias, checkpoint_format=fmt)
            parent, _, child = target.rpartition(".")
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


def fill_default_g_idx(model: Denoiser, filled: set) -> None:
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


def plan_checkpoint(model: Denoiser, ckpt: Checkpoint) -> tuple[dict[str, list[Assignment]], list[str], NameMap]:
    """Check every tensor of the checkpoint against the model (names, shapes, dtypes, completeness) and
    return where each goes. Nothing is read but the headers."""
    mapping = NameMap(model, model.config)
    plans: dict[str, list[Assignment]] = {}
    skipped, unexpected = [], []
    for name, info in ckpt.headers.items():
        canon = canonical_name(name)
        if canon is None:
            skipped.append(name)
            continue
        plan = mapping.plan(canon, info.shape)
        if plan is None:
            unexpected.append(f"{name} ({info.file.name})")
            continue
        for a in plan:
            if tuple(info.shape) != a.shape:
                raise CheckpointError(
                    f"tensor '{name}' in {info.file} has shape {list(info.shape)} but the config expects "
                    f"{list(a.shape)}; check that config.json belongs to these weights"
                )
            want_int = not mapping.params[a.dest].is_floating_point()
            is_int = info.dtype in ("I32", "I64", "I16", "I8", "U8")
            if is_int != want_int or info.dtype not in SAFETENSORS_DTYPES:
                kind = "an integer (packed GPTQ)" if want_int else "a float"
                raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}; expected {kind} tensor")
        plans[name] = plan
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensor(s) in {ckpt.path} that this {model.config.model_type} config has "
            f"no place for: {shown}. {family_hint(unexpected, model.config)}"
        )
    filled = {u for plan in plans.values() for a in plan for u in a.units}
    missing = [u for units in mapping.units.values() for u in units if u not in filled and not mapping.optional(u)]
    if missing:
        names = [mapping.checkpoint_name(u) for u in missing]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise CheckpointError(
            f"{len(missing)} tensor(s) missing from {ckpt.path}: {shown}. The checkpoint is incomplete or does "
            "not match config.json."
        )
    return plans, skipped, mapping


def copy_tensors(
    model: Denoiser,
    ckpt: Checkpoint,
    plans: dict[str, list[Assignment]],
    only: Callable[[str], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    check_finite: bool = False,
) -> int:
    """Read the planned tensors (those whose name in the model, checkpoint/names.model_name's, passes `only`)
    into the model, one at a time, cast to each destination's dtype. Destinations are looked up now, so a
    model whose layers were materialised after planning (the streaming quantizer) gets the real tensors.
    `check_finite` scans each
    float tensor, as cast for its destination and still on the host, for NaN/Inf (one isfinite pass over
    bytes just read; integer GPTQ tensors are skipped) and raises CheckpointError naming it. Off by default
    here: load_weights turns it on, and the streaming quantizer runs its own check."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    todo = [n for n in plans if only is None or only(model_name(canonical_name(n), model.config))]
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
                        cast = src.to(dest.dtype)
                        if check_finite and cast.is_floating_point() and not bool(torch.isfinite(cast).all()):
                            raise nonfinite_error(ckpt.headers[name], tensor, cast)
                        target.copy_(cast)
                    del tensor
                    done += 1
                    if progress:
                        progress(done, total)
    return done


def nonfinite_error(info: TensorInfo, stored: torch.Tensor, cast: torch.Tensor,
                    skip_hint: str = " (load(..., check_finite=False) / --no-check-finite skips this scan)"
                    ) -> CheckpointError:
    """The error for a tensor holding NaN/Inf (`stored` as read, `cast` as it would enter the model): how
    many of each and where the first is, or, when the stored values are finite, the cast that overflowed.
    `skip_hint` names the caller's way to skip the scan ("" where there is none)."""
    def first_bad(t: torch.Tensor) -> list[int]:
        return [int(i) for i in (~torch.isfinite(t)).nonzero()[0].tolist()]

    head = f"tensor '{info.name}' in {info.file}"
    if stored.is_floating_point() and not bool(torch.isfinite(stored).all()):
        where = first_bad(stored)
        nan, inf = int(torch.isnan(stored).sum()), int(torch.isinf(stored).sum())
        return CheckpointError(
            f"{head} holds {nan} NaN and {inf} Inf value(s) of {stored.numel()} (the first at index "
            f"{where}): the file is corrupt or was exported from a diverged model; re-download or "
            f"re-export the checkpoint{skip_hint}"
        )
    biggest = float(stored.abs().max()) if stored.numel() else 0.0
    # float16 overflows where bfloat16 and float32 do not; past float32's range (from an F64 file) no dtype
    # the model computes in holds the values.
    fix = ("load with a wider dtype (bfloat16 or float32)" if cast.dtype == torch.float16 else
           f"no dtype the model computes in holds them: re-export the checkpoint with values within {cast.dtype}'s "
           "range")
    return CheckpointError(
        f"{head} has values up to {biggest:.4g}, beyond the range of {cast.dtype} (first at index "
        f"{first_bad(cast)}): {fix}{skip_hint}"
    )


def load_weights(
    model: Denoiser,
    ckpt: Checkpoint,
    progress: Callable[[int, int], None] | None = None,
    check_finite: bool = True,
) -> LoadReport:
    """Fill `model`'s tensors (already materialised on their device) from the checkpoint; `check_finite`
    refuses a float tensor holding NaN or Inf (copy_tensors)."""
    plans, skipped, _ = plan_checkpoint(model, ckpt)
    total = copy_tensors(model, ckpt, plans, progress=progress, check_finite=check_finite)
    filled = {u for plan in plans.values() for a in plan for u in a.units}
    fill_default_g_idx(model, filled)
    notes = []
    if not check_finite:
        notes.append("the NaN/Inf scan of the weights was skipped (check_finite=False / --no-check-finite); "
                     "non-finite logits still stop a generation with an error")
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
    check_finite: bool = True,
) -> tuple[Denoiser, LoadReport]:
    """Load a checkpoint; `kernels` (auto|torch|triton, default $CLOVER_KERNELS or auto) picks the
    implementation of the quantized modules once, here. `check_finite` (default) refuses a float tensor
    (fp16 GPTQ scales included) holding NaN or Inf, naming it; off, the report's notes say it was skipped."""
    from clover_lite.kernels import dispatch

    ckpt = Checkpoint(path)
    model = build_model(config, device, dtype, ckpt)
    report = load_weights(model, ckpt, progress, check_finite=check_finite)
    model.eval()
    dispatch.apply(model, dispatch.select(device, kernels))
    return model, report
