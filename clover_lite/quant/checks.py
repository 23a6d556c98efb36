"""What `clover quantize` checks before any work: the linears a model has to quantize, their shapes against
the packing and group size, the options themselves, the calibration window and the source's weights (so a
refused run reads little and writes nothing)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from clover_lite.checkpoint.files import TensorInfo, read_tensor
from clover_lite.checkpoint.load import nonfinite_error
from clover_lite.errors import CloverError
from clover_lite.models.denoiser import Denoiser
from clover_lite.models.moe import SparseMoE
from clover_lite.quant.options import METHODS, QuantizationError, QuantizeOptions
from clover_lite.quant.pack import PACK
from clover_lite.runtime.device import resolve_device

SAFETENSORS_TO_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


# ---- what to quantize in a layer ----------------------------------------------------------------
def layer_targets(layer: torch.nn.Module) -> list[tuple[str, str, str]]:
    """(module name, kind, input group) for every linear to quantize; linears of one input group see the
    same input, so they share one Hessian. Router gates, GDN's tiny b/a projections and the shared
    expert's scalar gate stay in 16-bit."""
    t = []
    if hasattr(layer, "self_attn"):
        t += [(f"self_attn.{n}", "attention", "attn_in") for n in ("q_proj", "k_proj", "v_proj")]
        t += [("self_attn.o_proj", "attention", "attn_out")]
    else:
        t += [(f"linear_attn.{n}", "gdn", "gdn_in") for n in ("in_proj_qkv", "in_proj_z")]
        t += [("linear_attn.out_proj", "gdn", "gdn_out")]
    if isinstance(layer.mlp, SparseMoE):
        if layer.mlp.shared_expert is not None:
            t += [(f"mlp.shared_expert.{n}", "shared_expert", "mlp_in") for n in ("gate_proj", "up_proj")]
            t += [("mlp.shared_expert.down_proj", "shared_expert", "shared_down")]
    else:
        t += [(f"mlp.{n}", "dense", "mlp_in") for n in ("gate_proj", "up_proj")]
        t += [("mlp.down_proj", "dense", "dense_down")]
    return t


GROUP_SIZES = (128, 64, 32, 16)  # what `group_size=None` tries, in order: 128 is the format's usual choice


def linear_shapes(model: Denoiser, options: QuantizeOptions) -> dict[str, tuple[int, int]]:
    """(out, in) features of every linear to quantize, by name."""
    c = model.config
    shapes = {}
    for i, layer in enumerate(model.layers):
        for name, _, _ in layer_targets(layer):
            lin = layer.get_submodule(name)
            shapes[f"layers.{i}.{name}"] = (lin.out_features, lin.in_features)
        if isinstance(layer.mlp, SparseMoE):
            shapes[f"layers.{i}.mlp.experts.*.gate_proj"] = (c.moe_intermediate_size, c.hidden_size)
            shapes[f"layers.{i}.mlp.experts.*.down_proj"] = (c.hidden_size, c.moe_intermediate_size)
    if options.quantize_lm_head:
        shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    return shapes


def fitting_group_sizes(shapes: dict[str, tuple[int, int]]) -> list[int]:
    return [g for g in GROUP_SIZES if all(k % g == 0 for _, k in shapes.values())]


def check_shapes(model: Denoiser, options: QuantizeOptions) -> QuantizeOptions:
    """Fail before any work if a linear cannot be packed with these settings; the options with the group
    size chosen when it was left to us (None: the first of GROUP_SIZES that divides every layer)."""
    return check_linear_shapes(linear_shapes(model, options), options)


def check_linear_shapes(shapes: dict[str, tuple[int, int]], options: QuantizeOptions) -> QuantizeOptions:
    """check_shapes on (out, in) features by name (any model's linears)."""
    for name, (n, k) in shapes.items():
        if k % PACK or n % PACK:
            hint = "; leave out --quantize-lm-head" if name == "lm_head" else ""
            raise QuantizationError(f"{name} is {n} x {k}: INT4 GPTQ packing needs both divisible by {PACK}{hint}")
    fits = fitting_group_sizes(shapes)
    if options.group_size is None:
        return replace(options, group_size=fits[0] if fits else -1)
    for name, (_, k) in shapes.items():
        if options.group_size != -1 and k % options.group_size:
            choices = ", ".join(str(g) for g in fits) + (" or " if fits else "") + "-1 (per-channel)"
            raise QuantizationError(
                f"{name} has {k} input features, not a multiple of group size {options.group_size}; "
                f"pass --group-size {choices}, which divide every layer of this model"
            )
    return options


def check_nf4_shapes(shapes: dict[str, tuple[int, int]], blocksize: int) -> None:
    """NF4 stores one absmax per `blocksize` consecutive weights of the row-major matrix, so each linear's
    weight count must be a multiple of it (no INT4 packing or group constraint applies)."""
    for name, (n, k) in shapes.items():
        if (n * k) % blocksize:
            hint = "; leave out --quantize-lm-head" if name == "lm_head" else ""
            raise QuantizationError(f"{name} is {n} x {k}: NF4 needs its weight count to be a multiple of its block "
                                    f"of {blocksize}{hint}")


def check_options(options: QuantizeOptions) -> QuantizeOptions:
    """Refuse settings no model can use, before anything is read or written (the CLI's option types catch
    them first; this is for the Python API). Returns the options with the device resolved ("auto": cuda/cpu)."""
    if options.method not in METHODS:
        raise QuantizationError(f"unknown method '{options.method}'; use one of {METHODS}")
    if options.moe_calibration not in ("all", "routed"):
        raise QuantizationError(f"moe_calibration must be 'all' or 'routed', got '{options.moe_calibration}'")
    if options.nsamples < 1 or options.seqlen < 1:
        raise QuantizationError(f"--nsamples ({options.nsamples}) and --seqlen ({options.seqlen}) must be at least 1")
    if options.group_size is not None and options.group_size != -1 and options.group_size < 1:
        raise QuantizationError(f"--group-size {options.group_size}: use a positive group size (128, 64, 32...) or -1 "
                                "(per-channel)")
    if not 0 < options.damp_percent <= 1:  # also false for NaN
        raise QuantizationError(f"--damp-percent {options.damp_percent}: use a fraction in (0, 1], such as 0.01")
    try:
        device = resolve_device(options.device)
    except CloverError as e:
        raise QuantizationError(f"--device: {e}") from e
    return replace(options, device=str(device))


def check_seqlen(options: QuantizeOptions, max_positions: int) -> None:
    """Calibration windows run the whole model over `seqlen` positions: longer than the model's context they
    are out of its range (and quadratically slow), so they are refused."""
    if options.method != "nf4" and options.seqlen > max_positions:
        raise QuantizationError(f"--seqlen {options.seqlen} is longer than the model's context "
                                f"(max_position_embeddings {max_positions}); use --seqlen {max_positions} or less")


def scan_finite(tensors: Iterable[TensorInfo]) -> None:
    """Read every float tensor of the source once and refuse one holding NaN/Inf with load's own error (the
    file's tensor name and index), before any layer is quantized: the layer walk would otherwise stop at that
    layer, after the earlier ones, naming a fused tensor the file does not have. One tensor in memory at a time."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in tensors:
        if info.dtype in SAFETENSORS_TO_TORCH:
            by_file.setdefault(info.file, []).append(info)
    for file, infos in by_file.items():
        with open(file, "rb") as handle:
            for info in sorted(infos, key=lambda i: i.offset):  # sequential reads
                stored = read_tensor(handle, info)
                cast = stored.float()  # what the quantizer computes in
                if not bool(torch.isfinite(cast).all()):
                    # load's message, less its hint about load's own switch, which quantize does not have
                    raise nonfinite_error(info, stored, cast, skip_hint="")
