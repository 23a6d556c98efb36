"""checkpoint/output.py and checkpoint/save.py directly (mutation round 4): whose directory counts as ours, the
modes of a published output, what a failed write leaves, the lock's re-check of the file it locked, the space
check, safetensors' write errors, and the shards save_checkpoint writes (against hand-worked byte counts)."""

import errno
import fcntl
import json
import os
import stat

import pytest
import safetensors
import torch
from safetensors.torch import load_file
from torch import nn

from clover_lite.checkpoint import output
from clover_lite.checkpoint.output import (
    MARKER,
    OutputError,
    check_file_target,
    check_output,
    exclusive_writer,
    save_tensors,
    write_directory,
    write_text_atomic,
)
from clover_lite.checkpoint.save import checkpoint_tensors, save_checkpoint

from .seed import SEED


def test_a_marker_written_by_someone_else_does_not_make_a_directory_ours(tmp_path):
    """A marker file whose written_by is another tool (same name, same shape) is not clover-lite's: --force is
    refused and nothing changes; with written_by clover-lite the same directory may be replaced."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / MARKER).write_text(json.dumps({"written_by": "other-tool", "files": ["config.json"]}))
    with pytest.raises(OutputError, match="did not write"):
        check_output(out, force=True)
    (out / MARKER).write_text(json.dumps({"written_by": "clover-lite", "files": ["config.json"]}))
    assert check_output(out, force=True) == out


def test_an_older_output_recognises_only_its_exact_file_names(tmp_path):
    """An output without the marker (recognised by quantize_config's "clover" entry) is ours only for files named
    exactly as we write them: a 'config.json.bak' or 'model.safetensors.old' beside them is someone's and named."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "quantize_config.json").write_text(json.dumps({"bits": 4, "clover": {}}))
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert check_output(out, force=True) == out
    for name in ("config.json.bak", "model.safetensors.old"):
        (out / name).write_text("mine")
        with pytest.raises(OutputError, match=name.replace(".", r"\.")):
            check_output(out, force=True)
        (out / name).unlink()


def test_a_published_directory_has_the_modes_mkdir_and_open_would_give(tmp_path):
    """write_directory's output (a mkdtemp, 0700, filled by writers that may use 0600) ends with the modes a plain
    mkdir and open give under the process umask: 0777 & ~umask for directories, 0666 & ~umask for files."""
    umask = os.umask(0o027)
    try:
        def write(tmp):
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "a.json").write_text("{}")
            os.chmod(tmp / "a.json", 0o600)
            (tmp / "sub" / "b.bin").write_bytes(b"x")
        out = write_directory(tmp_path / "out", write, kind="test")
    finally:
        os.umask(umask)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in (out, *out.rglob("*"))}
    assert modes == {"out": 0o750, "out/sub": 0o750, "out/a.json": 0o640, "out/sub/b.bin": 0o640,
                     f"out/{MARKER}": 0o640}


def test_a_failed_write_leaves_nothing_beside_out(tmp_path):
    """write(tmp) failing with an OSError: one OutputError naming OUT and the OS's words, and no temporary
    sibling or output left in OUT's parent."""
    def write(tmp):
        (tmp / "part").write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(OutputError, match="No space left on device; nothing was written"):
        write_directory(tmp_path / "out", write, kind="test")
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path):
    """needed_bytes beyond the disk's free space: refused up front naming the MiB needed; within it, allowed."""
    with pytest.raises(OutputError, match="needs about .* MiB"):
        check_output(tmp_path / "out", needed_bytes=2**62)
    assert check_output(tmp_path / "out", needed_bytes=1) == tmp_path / "out"
    assert list(tmp_path.iterdir()) == []


def test_a_result_file_target_that_is_a_directory_is_refused(tmp_path):
    """A result path naming a directory is refused up front (a run would fail only at its end)."""
    with pytest.raises(OutputError, match="it is a directory"):
        check_file_target(tmp_path)
    assert check_file_target(tmp_path / "r.json") == tmp_path / "r.json"


def test_write_text_atomic_leaves_no_temporary_file_when_the_rename_fails(tmp_path):
    """A target that cannot be replaced (a directory there): OutputError, the directory untouched and no
    '.NAME.tmp-PID' left beside it."""
    (tmp_path / "state.json").mkdir()
    with pytest.raises(OutputError, match="cannot write"):
        write_text_atomic(tmp_path / "state.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"] and (tmp_path / "state.json").is_dir()
    write_text_atomic(tmp_path / "s2.json", '{"a": 1}')
    assert (tmp_path / "s2.json").read_text() == '{"a": 1}'


@pytest.mark.parametrize("message, code", [
    ("Error while serializing: I/O error: No space left on device (os error 28)", errno.ENOSPC),
    ("Error while serializing: I/O error: Permission denied (os error 13)", errno.EACCES),
    ("Error while serializing: something else", errno.EIO),
])
def test_safetensors_write_errors_become_the_os_error_they_name(tmp_path, monkeypatch, message, code):
    """safetensors reports a failed write as its own SafetensorError with the OS error's number in its text: it
    becomes that OSError (EIO when none is named), with the path."""
    def failing(tensors, filename, metadata=None):
        raise safetensors.SafetensorError(message)
    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError) as err:
        save_tensors({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert err.value.errno == code and err.value.filename == str(tmp_path / "m.safetensors")


def test_the_lock_retries_when_its_file_was_replaced_before_it_was_locked(tmp_path, monkeypatch):
    """If the previous holder removed the lock file between our open and our flock (and a new one appeared), the
    lock we got is on a file nobody else sees: the writer locks the file now at the path instead, so a second
    writer is still refused while the first holds it."""
    out = tmp_path / "q"
    lock = tmp_path / ".q.lock"
    real_flock, swapped = fcntl.flock, []

    def flock_after_swap(fd, op):
        if not swapped:  # the holder before us finished: its file is gone, a new one is at the path
            swapped.append(True)
            lock.unlink()
            lock.touch()
        return real_flock(fd, op)
    monkeypatch.setattr(output.fcntl, "flock", flock_after_swap)
    with exclusive_writer(out, "clover quantize"):
        monkeypatch.setattr(output.fcntl, "flock", real_flock)
        with pytest.raises(OutputError, match="another clover quantize is writing"):
            with exclusive_writer(out, "clover quantize"):
                pass
    assert swapped and not lock.exists()
    with exclusive_writer(out, "clover quantize"):  # free again
        pass


class Params(nn.Module):
    """Named float32 parameters/buffers, as a model's state dict has them."""

    def __init__(self, tensors: dict, buffers: dict | None = None):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(t, requires_grad=False))
        for name, t in (buffers or {}).items():
            self.register_buffer(name.replace(".", "_"), t)


def test_shards_fill_up_to_max_shard_bytes_and_the_index_counts_every_byte(tmp_path):
    """Three 64-byte tensors with max_shard_bytes 128: the first two fill one shard exactly (128 is not over),
    the third starts another; the index maps each name to its shard and totals 192 bytes. With 32 bytes each
    tensor gets its own shard (none empty); the tensors read back equal."""
    gen = torch.Generator().manual_seed(SEED)
    ts = {f"t{i}": torch.randn(16, generator=gen) for i in range(3)}
    model = Params(ts)
    out = save_checkpoint(model, tmp_path / "a", {"k": 1}, max_shard_bytes=128)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    a, b = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert index == {"metadata": {"total_size": 192}, "weight_map": {"model.t0": a, "model.t1": a, "model.t2": b}}
    got = {**load_file(out / a), **load_file(out / b)}
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in ts.items())
    out = save_checkpoint(model, tmp_path / "b", {"k": 1}, max_shard_bytes=32)
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [len(load_file(out / n)) for n in names] == [1, 1, 1]
    assert json.loads((out / "config.json").read_text()) == {"k": 1}


def test_checkpoint_tensors_names_splits_and_casts_as_transformers_saves():
    """Fused experts become per-expert gate (first half of gate_up) / up / down weights under model.; lm_head is
    top-level; float tensors are cast to the dtype asked, GPTQ scales and integer tensors are kept as they are."""
    gen = torch.Generator().manual_seed(SEED)
    e, inter, hidden = 2, 3, 4
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen)
    down = torch.randn(e, hidden, inter, generator=gen)
    head = torch.randn(5, hidden, generator=gen)
    module = nn.Module()
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Module()
    layer.mlp.experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
    layer.mlp.experts.down_proj = nn.Parameter(down, requires_grad=False)
    layer.proj = nn.Module()
    layer.proj.register_buffer("scales", torch.ones(2, 8, dtype=torch.float16))
    layer.proj.register_buffer("qweight", torch.zeros(1, 8, dtype=torch.int32))
    module.layers = nn.ModuleList([layer])
    module.lm_head = nn.Linear(hidden, 5, bias=False)
    module.lm_head.weight.data = head
    got = dict(checkpoint_tensors(module, dtype=torch.bfloat16))
    want = {"lm_head.weight": head, "model.layers.0.proj.scales": torch.ones(2, 8, dtype=torch.float16),
            "model.layers.0.proj.qweight": torch.zeros(1, 8, dtype=torch.int32)}
    for k in range(e):
        want[f"model.layers.0.mlp.experts.{k}.gate_proj.weight"] = gate_up[k, :inter]
        want[f"model.layers.0.mlp.experts.{k}.up_proj.weight"] = gate_up[k, inter:]
        want[f"model.layers.0.mlp.experts.{k}.down_proj.weight"] = down[k]
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        dtype = t.dtype if t.dtype in (torch.float16, torch.int32) else torch.bfloat16
        assert got[name].dtype == dtype and torch.equal(got[name], t.to(dtype)), name


def test_a_failed_checkpoint_write_leaves_nothing(tmp_path, monkeypatch):
    """save_checkpoint whose tensor write fails (a full disk): one OutputError and no temporary directory left."""
    def full(tensors, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    from clover_lite.checkpoint import save
    monkeypatch.setattr(save, "save_tensors", full)
    with pytest.raises(OutputError, match="No space left on device"):
        save_checkpoint(Params({"w": torch.zeros(4)}), tmp_path / "out", {})
    assert list(tmp_path.iterdir()) == []

