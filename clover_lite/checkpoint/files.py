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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # JSON nested past the stack too
        raise CheckpointError(f"{file}: corrupt safetensors header ({e}); re-download it") from e
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (a JSON object expected); re-download it")
    data_len = size - 8 - header_len
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_info(file, name, meta, 8 + header_len, data_len)
    spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in out.items() if info.nbytes)
    reach, last = 0, None  # the furthest end so far, and whose
    for start, end, name in spans:
        if start < reach:
            raise CheckpointError(f"{file}: corrupt safetensors header: tensors '{last}' and '{name}' overlap in "
                                  "the data section; re-download it")
        if end > reach:
            reach, last = end, name
    return out


def _tensor_info(file: Path, name: str, meta, data_start: int, data_len: int) -> TensorInfo:
    """One header entry, checked as untrusted input: a dtype name, a shape of non-negative ints, offsets
    inside the data section and, for the dtypes we read, exactly the shape's bytes (a tensor of another
    dtype fails when it is read, so a skipped one, e.g. FP8 in a vision tower, does not stop a load)."""
    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: corrupt safetensors header: tensor '{name}' {why}; re-download it")

    if not isinstance(meta, dict):
        raise corrupt("is not described by a JSON object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise corrupt(f"has dtype {dtype!r} (a name such as 'BF16' expected)")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise corrupt(f"has shape {shape!r} (a list of non-negative integers expected)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise corrupt(f"has data_offsets {offsets!r} (two integers, start <= end, expected)")
    start, end = offsets
    if end > data_len:
        raise CheckpointError(
            f"{file}: truncated: tensor '{name}' ends at byte {end} of the data section but the file holds "
            f"only {data_len}; re-download or re-save the checkpoint"
        )
    if dtype in SAFETENSORS_DTYPES:
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * SAFETENSORS_DTYPES[dtype].itemsize
        if end - start != expected:
            raise corrupt(f"spans {end - start} bytes but shape {shape} of {dtype} needs {expected}")
    return TensorInfo(name, file, tuple(shape), dtype, data_start + start, end - start)


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

