"""Write a Denoiser as a Hugging Face checkpoint (the layout `load` reads), atomically.

Experts are written per expert (`mlp.experts.N.gate_proj.weight`, ...), as transformers saves them.
The directory appears complete or not at all: everything is written to a temporary sibling that is
renamed into place at the end (checkpoint/output.py says where writing is allowed).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from clover_lite.checkpoint.output import OutputError, check_output, publish_directory, save_tensors, temporary_sibling
from clover_lite.models.denoiser import Denoiser


def checkpoint_tensors(
    module: torch.nn.Module, dtype: torch.dtype | None = None, prefix: str = ""
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs of a Denoiser (or of one of its layers, named under `prefix`, e.g.
    "layers.3.") in the `model.layers.N.` naming. Float tensors are cast to `dtype`; the integer and
    fp16 GPTQ tensors of quantized modules are written as they are. Experts are written per expert."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    for local, p in tensors:
        name = prefix + local
        t = p.detach().to("cpu")
        quant = local.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx", "nf4_weight", "nf4_absmax")
        if dtype is not None and t.is_floating_point() and not quant:
            t = t.to(dtype)
        if name.startswith("lm_head."):
            yield name, t.contiguous()
        elif name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"model.{base}{e}.gate_proj.weight", t[e, :inter].contiguous()
                yield f"model.{base}{e}.up_proj.weight", t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"model.{base}{e}.down_proj.weight", t[e].contiguous()
        elif ".experts." in name:  # stacked quantized experts: experts.<part>.<tensor> [E, ...]
            head, part, suffix = name.rsplit(".", 2)
            for e in range(t.shape[0]):
                yield f"model.{head}.{e}.{part}.{suffix}", t[e].contiguous()
        else:
            yield f"model.{name}", t.contiguous()


def save_checkpoint(
    model: Denoiser,
    out: str | os.PathLike,
    config_json: dict,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    extra_files: Callable[[Path], None] | None = None,
    force: bool = False,
    kind: str = "checkpoint",
) -> Path:
    """Write config.json + safetensors (sharded with an index when over `max_shard_bytes`).

    `extra_files(tmpdir)` may add tokenizer files before the directory is moved into place. `force`
    replaces an earlier output of ours at `out` (never another directory: see checkpoint/output.py).
    """
    out = Path(out)
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.device.type != "meta")
    check_output(out, force=force, needed_bytes=needed)
    tmp = temporary_sibling(out, "tmp")
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in checkpoint_tensors(model, dtype):
            nbytes = t.numel() * t.element_size()
            if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_tensors(shards[0], tmp / "model.safetensors")
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_tensors(shard, tmp / fname)
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
        if extra_files:
            extra_files(tmp)
        publish_directory(tmp, out, kind)
    except OSError as e:  # a full disk, a read-only target: nothing is left behind, one clear error
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write {out}: {e.strerror or e} ({e.filename or tmp}); nothing was written: "
                          "free space or choose another directory") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
