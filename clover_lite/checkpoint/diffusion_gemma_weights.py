"""Load a DiffusionGemma checkpoint (transformers' safetensors layout) into models.diffusion_gemma.

Hub names: `model.decoder.*` holds the text weights (the encoder's are tied to them and not stored), each
layer's `layer_scalar` is stored for the decoder (`model.decoder.layers.N.`) and the encoder
(`model.encoder.language_model.layers.N.`) separately, `model.decoder.self_conditioning.*` the
self-conditioning MLP; an untied checkpoint adds `model.encoder.language_model.*` and `lm_head.weight`. The
vision tower and its projection (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`) are skipped
with a note: this is the text path. As checkpoint/load.py does, the whole plan is checked from the headers
before any data is read, and tensors are then read one at a time.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_lite.checkpoint.files import TensorInfo, checkpoint_files, read_header, read_tensor
from clover_lite.errors import CheckpointError
from clover_lite.models.diffusion_gemma import DiffusionGemma
from clover_lite.models.diffusion_gemma_config import DiffusionGemmaConfig, load_diffusion_gemma_config

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
ENCODER = "model.encoder.language_model."
DECODER = "model.decoder."
_SCALAR = re.compile(r"^(encoder|decoder)_layer_scalar\.(\d+)$")


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
    """Every tensor the model needs: checkpoint name -> (our parameter or buffer, element index or None)."""
    out = {hub_name(n): (n, None) for n, _ in model.named_parameters()}
    for which in ("encoder", "decoder"):
        for i in range(model.config.num_hidden_layers):
            out[hub_name(f"{which}_layer_scalar.{i}")] = (f"{which}_layer_scalar", i)
    return out


def _skip_reason(name: str, config: DiffusionGemmaConfig) -> str | None:
    if name.startswith(VISION_PREFIXES):
        return "vision"
    if config.tie_word_embeddings and (name == "lm_head.weight" or
                                       (name.startswith(ENCODER) and not name.endswith("layer_scalar"))):
        return "tied copy"  # some exporters store the tied tensors twice; ours are the decoder's
    return None


def plan_weights(model: DiffusionGemma, path: Path) -> tuple[dict[str, TensorInfo], list[Path], list[str]]:
    """Check the checkpoint's headers against the model: (our tensor -> its checkpoint entry, files, skipped).
    CheckpointError names a missing, unexpected or mis-shaped tensor."""
    files = checkpoint_files(path)
    headers: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in headers:
                raise CheckpointError(f"tensor '{name}' appears in both {headers[name].file} and {f}")
            headers[name] = info
    wanted = tensor_names(model)
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    skipped, unexpected = [], []
    for name, info in headers.items():
        if name in wanted:
            ours, index = wanted[name]
            want = (1,) if index is not None else shapes[ours]
            if tuple(info.shape) != want:
                raise CheckpointError(f"tensor '{name}' in {info.file} has shape {list(info.shape)} but the config "
                                      f"expects {list(want)}; check that config.json belongs to these weights")
            if info.dtype not in ("F32", "F16", "BF16"):
                raise CheckpointError(f"tensor '{name}' in {info.file} has dtype {info.dtype}; a float expected")
        elif _skip_reason(name, model.config):
            skipped.append(name)
        else:
            unexpected.append(f"{name} ({info.file.name})")
    if unexpected:
        shown = ", ".join(unexpected[:20]) + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else "")
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {path} that this diffusion_gemma config "
                              f"has no place for: {shown}. Check that config.json matches the weights.")
    missing = [n for n in wanted if n not in headers]
    if missing:
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise CheckpointError(f"{len(missing)} tensor(s) missing from {path}: {shown}. The checkpoint is "
                              "incomplete or does not match config.json.")
    return {n: headers[n] for n in wanted}, files, skipped


def load_diffusion_gemma(path: str | os.PathLike, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, config: DiffusionGemmaConfig | None = None,
                         ) -> tuple[DiffusionGemma, DiffusionGemmaLoadReport]:
    """Build the model on the meta device, check the plan, then read each tensor into place."""
    path = Path(path)
    config = config or load_diffusion_gemma_config(path)
    with torch.device("meta"):
        model = DiffusionGemma(config)
    wanted = tensor_names(model)
    plan, files, skipped = plan_weights(model, path)
    model = model.to(dtype=dtype).to_empty(device=device)
    dest = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for f in files:
            names = sorted((n for n, info in plan.items() if info.file == f), key=lambda n: plan[n].offset)
            with open(f, "rb") as handle:
                for name in names:
                    ours, index = wanted[name]
                    t = read_tensor(handle, plan[name])
                    target = dest[ours] if index is None else dest[ours][index]
                    target.copy_(t.reshape(target.shape).to(target.dtype))
    model.eval()
    notes = []
    if skipped:
        kinds = sorted({_skip_reason(n, config) or "" for n in skipped})
        notes.append(f"skipped {len(skipped)} tensor(s) not used by the text model ({', '.join(kinds)})")
    return model, DiffusionGemmaLoadReport(files=files, tensors=len(plan), skipped=skipped, notes=notes)
