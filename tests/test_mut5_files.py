"""Mutation round 5: safetensors headers and tensor reads, on files laid out byte by byte here and, for the
readable ones, checked against the safetensors library."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover_lite.checkpoint.files import read_header, read_tensor
from clover_lite.errors import CheckpointError

from .seed import SEED


def _write(f, header, data: bytes) -> int:
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return 8 + len(raw)


@pytest.mark.parametrize("short", [1, 4, 8])
def test_a_length_field_past_the_file_end_is_called_truncated(tmp_path, short):
    """A header length that the file cannot hold (the file ends 1..8 bytes inside the header) is reported as a
    truncated file, not as corrupt JSON."""
    f = tmp_path / "model.safetensors"
    raw = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[: len(raw) - short])
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        read_header(f)


def test_a_tensor_missing_its_last_byte_is_refused_by_the_header_check(tmp_path):
    """A file cut one byte short of its last tensor fails at read_header, naming that tensor (before any tensor
    is read), not later with a partial read."""
    f = tmp_path / "model.safetensors"
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}}
    _write(f, header, b"\0" * 19)
    with pytest.raises(CheckpointError, match="truncated: tensor 'b' ends at byte 20 .* holds only 19"):
        read_header(f)
    _write(f, header, b"\0" * 20)
    assert set(read_header(f)) == {"a", "b"}


def test_a_tensor_spanning_more_bytes_than_its_shape_is_refused(tmp_path):
    """F32 of shape [4] is 16 bytes: data_offsets spanning 20 are a corrupt header, as are 12."""
    f = tmp_path / "model.safetensors"
    for end in (20, 12):
        _write(f, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, end]}}, b"\0" * 24)
        with pytest.raises(CheckpointError, match=f"tensor 'w' spans {end} bytes but shape \\[4\\] of F32 needs 16"):
            read_header(f)


def test_zero_size_tensors_read_as_empty_tensors(tmp_path):
    """Tensors with a 0 in their shape (safetensors writes them) read as empty tensors of that shape and dtype,
    next to a non-empty one that reads as safetensors reads it."""
    f = tmp_path / "model.safetensors"
    g = torch.Generator().manual_seed(SEED)
    tensors = {"empty": torch.zeros(0, 4, dtype=torch.bfloat16), "none": torch.zeros(3, 0, dtype=torch.int32),
               "full": torch.randn(2, 3, generator=g)}
    save_file(tensors, f)
    want = load_file(f)
    infos = read_header(f)
    with open(f, "rb") as h:
        got = {n: read_tensor(h, info) for n, info in infos.items()}
    assert set(got) == set(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert torch.equal(got[n], want[n]), n


def test_a_file_cut_after_its_header_was_read_fails_the_tensor_read(tmp_path):
    """If the file shrinks between read_header and read_tensor, the read names the tensor and says the file ended
    early, rather than returning a tensor padded with zeros."""
    f = tmp_path / "model.safetensors"
    data = torch.arange(1, 9, dtype=torch.float32)
    save_file({"w": data}, f)
    info = read_header(f)["w"]
    f.write_bytes(f.read_bytes()[:-4])
    with open(f, "rb") as h, pytest.raises(CheckpointError, match="tensor 'w' in .*file ended early"):
        read_tensor(h, info)
