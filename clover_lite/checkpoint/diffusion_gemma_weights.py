"""Load a DiffusionGemma checkpoint (transformers' safetensors layout) into models.diffusion_gemma.

Hub names: `model.decoder.*` holds the text weights (the encoder's are tied to them and not stored), each
layer's `layer_scalar` is stored for the decoder (`model.decoder.layers.N.`) and the encoder
(`model.encoder.language_model.layers.N.`) separately, `model.decoder.self_conditioning.*` the
self-conditioning MLP; an untied checkpoint adds `model.encoder.language_model.*` and `lm_head.weight`. The
vision tower and its projection (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) are skipped
with a note: this is the text path. As checkpoint/load.py does, the whole plan is checked from the headers
before any data is read, and tensors are then read one at a time.

GPTQ INT4 checkpoints (`clover quantize`'s output, docs/ARCHITECTURE.md sections 3 and 11) take the same path:
a linear stored as `<name>.qweight/qzeros/scales/g_idx` becomes a QuantLinear, the experts stored per expert
(`...experts.E.gate_proj.qweight`, ...) one QuantExperts with Gemma's GELU, both swapped in on the meta device
before any data is read (read_quant_config's settings; a missing g_idx means k // group_size). Last, as for
the block denoisers, kernels/dispatch.py binds the Triton kernels once (section 7.2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from clover_lite.checkpoint.files import TensorInfo, checkpoint_files, read_header, read_tensor
from clover_lite.errors import CheckpointError
from clover_lite.models.diffusion_gemma import DiffusionGemma, GeluExperts
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig, load_diffusion_gemma_config
from clover_lite.models.quantized import QuantExperts, QuantLinear, gptq_experts

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
ENCODER = "model.encoder.language_model."
DECODER = "model.decoder."
_SCALAR = re.compile(r"^(encoder|decoder)_layer_scalar\.(\d+)$")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_INT_DTYPES = ("I32", "I64", "I16", "I8", "U8")


@dataclass
class DiffusionGemmaLoadReport:
    files: list[Path]
    tensors: int
    skipped: list[str]
    notes: list[str]


def hub_name(ours: str) -> str:
    """The checkpoint name of one of our tensors (`encoder_layer_scalar.N` for element N of that buffer)."""
    m = _SCALAR.match(ours)
    if m:
        return f"{ENCODER if m.group(1) == 'encoder' else DECODER}layers.{m.group(2)}.layer_scalar"
    if ours.startswith("self_conditioning.mlp."):
        return DECODER + "self_conditioning." + ours[len("self_conditioning.mlp."):]
    if ours.startswith("self_conditioning."):
        return DECODER + ours
    if ours.startswith("decoder."):
        return DECODER + ours[len("decoder."):]
    if ours.startswith("encoder."):
        return ENCODER + ours[len("encoder."):]
    return ours  # lm_head.weight


def tensor_names(model: DiffusionGemma) -> dict[str, tuple[str, int | None]]:
    """Every tensor the model needs: checkpoint name -> (our parameter or buffer, element index or None).
    Stacked GPTQ experts are stored per expert: element e of `...experts.gate_proj.qweight` is
    `...experts.e.gate_proj.qweight`."""
    stacked = {n for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    out = {}
    for n, _ in [*model.named_parameters(), *model.named_buffers()]:
        owner = n.rsplit(".", 2)[0]
        if n.endswith("_layer_scalar"):
            continue  # the model's own buffers, one element per layer: below
        if owner in stacked:  # <experts>.<part>.<tensor> [E, ...]
            part, leaf = n.rsplit(".", 2)[1:]
            for e in range(model.config.num_experts):
                out[hub_name(f"{owner}.{e}.{part}.{leaf}")] = (n, e)
        else:
            out[hub_name(n)] = (n, None)
    for which in ("encoder", "decoder"):
        for i in range(model.config.num_hidden_layers):
            out[hub_name(f"{which}_layer_scalar.{i}")] = (f"{which}_layer_scalar", i)
    return out


def install_quantized_modules(model: DiffusionGemma, headers: dict[str, TensorInfo], qc: dict,
                              path: Path) -> int:
    """Swap, on the meta device, every linear (not lm_head) and experts block that the checkpoint stores as
    GPTQ tensors for QuantLinear / QuantExperts; returns how many were swapped."""
    if qc.get("quant_method", "gptq") != "gptq":
        raise CheckpointError(f"{path}: {qc.get('quant_method')} DiffusionGemma checkpoints are not supported; "
                              "quantize the 16-bit checkpoint to GPTQ INT4 (clover quantize --method gptq or rtn)")
    fmt, c, swapped = qc.get("checkpoint_format", "gptq"), model.config, 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and name != "lm_head":  # lm_head's weight is read directly: 16-bit
            base = hub_name(f"{name}.weight")[: -len("weight")]
            if base + "qweight" not in headers:
                continue
            scales = headers.get(base + "scales")
            new = _checked(path, base, QuantLinear, mod.in_features, mod.out_features,
                           scales.shape[0] if scales is not None else 1, bias=mod.bias is not None,
                           checkpoint_format=fmt)
        elif isinstance(mod, GeluExperts):
            base = hub_name(f"{name}.gate_up_proj")[: -len("gate_up_proj")]
            have = [p for p in EXPERT_PARTS if f"{base}0.{p}.qweight" in headers]
            if not have:
                continue
            if len(have) < len(EXPERT_PARTS):
                raise CheckpointError(f"{path}: {base[:-1]}: quantized experts need gate_proj, up_proj and down_proj "
                                      "tensors")
            groups = [headers.get(f"{base}0.{p}.scales") for p in ("gate_proj", "down_proj")]
            g_in, g_down = (g.shape[0] if g is not None else 1 for g in groups)
            new = _checked(path, base, gptq_experts, c.num_experts, c.hidden_size, c.moe_intermediate_size, g_in,
                           g_down, fmt, activation=c.hidden_activation)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new.to(device="meta"))
        swapped += 1
    return swapped


def _checked(path: Path, base: str, make: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    try:
        with torch.device("meta"):
            return make(*args, **kwargs)
    except ValueError as e:  # shapes GPTQ cannot pack: a broken or foreign checkpoint
        raise CheckpointError(f"{path}: {base[:-1]}: {e}") from e


def _skip_reason(name: str, config: DiffusionGemmaConfig) -> str | None:
    if name.startswith(VISION_PREFIXES):
        return "vision"
    if config.tie_word_embeddings and (name == "lm_head.weight" or
                                       (name.startswith(ENCODER) and not name.endswith("layer_scalar"))):
        return "tied copy"  # some exporters store the tied tensors twice; ours are the decoder's
    return None


def read_headers(path: Path) -> tuple[dict[str, TensorInfo], list[Path]]:
    """Every tensor's header entry of the checkpoint at `path`, and its files; a name in two files is refused."""
    files = checkpoint_files(path)
    headers: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in headers:
                raise CheckpointError(f"tensor '{name}' appears in both {headers[name].file} and {f}")
            headers[name] = info
    return headers, files


def plan_weights(model: DiffusionGemma, path: Path, headers: dict[str, TensorInfo] | None = None
                 ) -> tuple[dict[str, TensorInfo], list[Path], list[str]]:
    """Check the checkpoint's headers against the model: (our tensor -> its checkpoint entry, files, skipped).
    CheckpointError names a missing, unexpected or mis-shaped tensor."""
    if headers is None:
        headers, files = read_headers(path)
    else:
        files = checkpoint_files(path)
    wanted = tensor_names(model)
    dests = dict(model.named_parameters()) | dict(model.named_buffers())
    skipped, unexpected = [], []
    for name, info in headers.items():
        if name in wanted:
            ours, index = wanted[name]
            dest = dests[ours]
            want = tuple(dest.shape if index is None else dest.shape[1:]) or (1,)
            if tuple(info.shape) != want:
                raise CheckpointError(f"tensor '{name}' in {info.file} has shape {list(info.shape)} but the config "
                                      f"expects {list(want)}; check that config.json belongs to these weights")
            if dest.is_floating_point() and info.dtype not in ("F32", "F16", "BF16"):
                raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}; a float expected")
            if not dest.is_floating_point() and info.dtype not in _INT_DTYPES:
                raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}; an integer (packed "
                                      "GPTQ) tensor expected")
        elif _skip_reason(name, model.config):
            skipped.append(name)
        else:
            unexpected.append(f"{name} ({info.file.name})")
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {path} that this diffusion_gemma config "
                              f"has no place for: {shown}. Check that config.json matches the weights.")
    # A GPTQ g_idx may be left out: it then means k // group_size (filled after loading).
    missing = [n for n in wanted if n not in headers and not n.endswith(".g_idx")]
    if missing:
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise CheckpointError(f"{len(missing)} tensor(s) missing from {path}: {shown}. The checkpoint is "
                              "incomplete or does not match config.json.")
    return {n: headers[n] for n in wanted if n in headers}, files, skipped


def copy_weights(model: DiffusionGemma, plan: dict[str, TensorInfo], only: Callable[[str], bool] | None = None,
                 check_finite: bool = False) -> set[tuple]:
    """Read the planned tensors whose destination (our name) passes `only` into the model, one at a time in
    file order, each cast to its destination's dtype. Destinations are looked up now (the streaming quantizer
    materialises one layer at a time). `check_finite` refuses a float tensor holding NaN/Inf (as stored or
    after the cast) with the block loader's CheckpointError. Returns what was filled: (our name,) or
    (our name, index)."""
    from clover_lite.checkpoint.load import nonfinite_error

    wanted = tensor_names(model)
    dest = dict(model.named_parameters()) | dict(model.named_buffers())
    # A module swapped out since planning (a layer the quantizer finished) has no destination any more.
    todo = [n for n in plan if n in wanted and (only is None or only(wanted[n][0]))]
    filled = set()
    with torch.no_grad():
        for f in dict.fromkeys(plan[n].file for n in todo):
            with open(f, "rb") as handle:
                for name in sorted((n for n in todo if plan[n].file == f), key=lambda n: plan[n].offset):
                    ours, index = wanted[name]
                    t = read_tensor(handle, plan[name])
                    target = dest[ours] if index is None else dest[ours][index]
                    cast = t.reshape(target.shape).to(target.dtype)
                    if check_finite and cast.is_floating_point() and not bool(torch.isfinite(cast).all()):
                        raise nonfinite_error(plan[name], t, cast)
                    target.copy_(cast)
                    filled.add((ours,) if index is None else (ours, index))
    return filled


def build_model(config: DiffusionGemmaConfig, dtype: torch.dtype, headers: dict[str, TensorInfo],
                qc: dict | None, path: Path) -> DiffusionGemma:
    """The model on the meta device in `dtype`, with the quantized modules the checkpoint stores (their scales
    stay fp16, their biases take the model dtype)."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    model = model.to(dtype=dtype)
    if qc is not None:
        install_quantized_modules(model, headers, qc, path)
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.dtype != dtype:
                    setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=False))
    return model


def load_diffusion_gemma(path: str | os.PathLike, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, config: DiffusionGemmaConfig | None = None,
                         kernels: str | None = None, check_finite: bool = True
                         ) -> tuple[DiffusionGemma, DiffusionGemmaLoadReport]:
    """Build the model on the meta device (GPTQ modules swapped in), check the plan, read each tensor into
    place (refusing NaN/Inf unless `check_finite` is False); then `kernels` (auto|torch|triton, default
    $CLOVER_KERNELS or auto) picks the implementation once (kernels/dispatch.py)."""
    from clover_lite.checkpoint.load import fill_default_g_idx, read_quant_config
    from clover_lite.kernels import dispatch
    from clover_lite.kernels.configs import kernel_changes

    path = Path(path)
    config = config or load_diffusion_gemma_config(path)
    headers, files = read_headers(path)
    qc = read_quant_config(path)
    model = build_model(config, dtype, headers, qc, path)
    plan, files, skipped = plan_weights(model, path, headers)
    model = model.to_empty(device=device)
    filled = copy_weights(model, plan, check_finite=check_finite)
    fill_default_g_idx(model, filled)
    model.eval()
    # No GPU has run DiffusionGemma on the kernels yet: `auto` keeps it on the reference until one does
    # (docs/ARCHITECTURE.md section 7.4); kernels="triton" or CLOVER_KERNELS_UNVERIFIED=1 asks for them.
    backend = dispatch.select(device, kernels, verified=kernel_changes().diffusion_gemma)
    notes = []
    if not check_finite:
        notes.append("the NaN/Inf scan of the weights was skipped (check_finite=False / --no-check-finite)")
    if backend != dispatch.select(device, kernels):
        notes.append("PyTorch reference path: DiffusionGemma on the Triton kernels is not yet verified on a GPU "
                     "(CLOVER_KERNELS_UNVERIFIED=1 or kernels='triton' to use them)")
    dispatch.apply(model, backend)
    if skipped:
        kinds = sorted({_skip_reason(n, config) or "" for n in skipped})
        notes.append(f"skipped {len(skipped)} tensor(s) not used by the text model ({', '.join(kinds)})")
    return model, DiffusionGemmaLoadReport(files=files, tensors=len(plan), skipped=skipped, notes=notes)
