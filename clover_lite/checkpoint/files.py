"""Reading safetensors checkpoints: the files of a model directory, their headers, one tensor at a time.

Headers are parsed by hand (8-byte length, JSON), so a corrupt or truncated file fails with a message
naming it before any tensor is read, and each tensor is read with one seek and one read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_lite.errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0  # absolute byte offset of the data in the file
    nbytes: int = 0


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
