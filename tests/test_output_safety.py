"""Writing outputs never touches what clover-lite did not write: `quantize --force`, `tiny`, `eval`, and the
replacement of an earlier output (atomic: a crash leaves the old output or the new one)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from clover_lite.checkpoint import output
from clover_lite.checkpoint.output import MARKER, OutputError, check_output
from clover_lite.checkpoint.tiny import write_tiny_checkpoint
from clover_lite.cli.main import main
from clover_lite.quant.pipeline import QuantizationError, QuantizeOptions, quantize_model

FAST = dict(group_size=32, nsamples=4, seqlen=32)
CLI_FAST = ["--group-size", "32", "--nsamples", "4", "--seqlen", "32"]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """sandbox/parent/src (a tiny model) with someone's notes beside it, a directory of unrelated files and a
    plain file."""
    root = tmp_path_factory.mktemp("sandbox")
    write_tiny_checkpoint(root / "parent" / "src", seed=3)
    (root / "parent" / "notes.txt").write_text("my notes")
    (root / "theses").mkdir()
    (root / "theses" / "thesis.txt").write_text("four years of work")
    (root / "afile").write_text("not a directory")
    return root


@pytest.mark.parametrize("out, why", [
    ("parent", "contains the source"),
    (".", "contains the source"),
    ("parent/src", "is the source itself"),
    ("parent/src/q", "is inside the source"),
    ("theses", "did not write"),
    ("afile", "is a file"),
    ("afile/out", "is a file, not a directory"),
])
def test_quantize_refuses_and_changes_nothing(tree, out, why):
    before = snapshot(tree)
    r = CliRunner().invoke(main, ["quantize", str(tree / "parent" / "src"), str(tree / out), "--force", *CLI_FAST])
    assert r.exit_code == 1, r.output
    assert why in r.output and "Traceback" not in r.output
    assert snapshot(tree) == before  # every file byte-identical, nothing added


@pytest.mark.parametrize("out", ["/proc/x/out", "/sys/out"])
def test_unwritable_out_is_one_clear_error(tree, out):
    for args in (["quantize", str(tree / "parent" / "src"), out, *CLI_FAST], ["tiny", out]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "cannot write" in r.output, r.output
        assert not isinstance(r.exception, OSError) or isinstance(r.exception, SystemExit)


def test_tiny_refuses_foreign_directories(tree):
    before = snapshot(tree)
    for target, why in (("theses", "did not write"), ("afile", "is a file"), ("afile/x", "is a file")):
        r = CliRunner().invoke(main, ["tiny", str(tree / target), "--force"])
        assert r.exit_code == 1 and why in r.output, r.output
    assert snapshot(tree) == before


def test_force_replaces_only_an_output_of_ours(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)
    out = tmp_path / "int4"
    quantize_model(src, out, QuantizeOptions(**FAST))
    assert json.loads((out / MARKER).read_text())["kind"] == "quantized"
    with pytest.raises(OutputError, match="already exists.*--force"):
        quantize_model(src, out, QuantizeOptions(**FAST))
    quantize_model(src, out, QuantizeOptions(**{**FAST, "group_size": 16}), force=True)
    assert json.loads((out / "quantize_config.json").read_text())["group_size"] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4", "src"]  # no partial, no old copy left

    (out / "mine.txt").write_text("mine")
    before = snapshot(out)
    with pytest.raises(OutputError, match="mine.txt, which clover-lite did not write"):
        quantize_model(src, out, QuantizeOptions(**FAST), force=True)
    assert snapshot(out) == before

    tiny = write_tiny_checkpoint(tmp_path / "tiny", seed=2)
    assert write_tiny_checkpoint(tiny, seed=5, force=True) == tiny  # tiny outputs carry the marker too


def test_older_output_without_marker_is_recognised_by_its_quantize_config(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)
    out = tmp_path / "int4"
    quantize_model(src, out, QuantizeOptions(**FAST))
    (out / MARKER).unlink()
    check_output(out, [src], force=True)
    (out / "notes.txt").write_text("x")
    with pytest.raises(OutputError, match="notes.txt"):
        check_output(out, [src], force=True)


@pytest.mark.parametrize("step", ["before the exchange", "after the exchange"])
def test_a_crash_during_replacement_leaves_old_or_new(tmp_path, monkeypatch, step):
    out = write_tiny_checkpoint(tmp_path / "m", seed=1)
    old = snapshot(out)
    new_dir = tmp_path / "new"
    write_tiny_checkpoint(new_dir, seed=2)
    new = snapshot(new_dir)
    tmp = Path(output.temporary_sibling(out, "tmp"))
    for p in new_dir.iterdir():
        if p.name != MARKER:
            os.replace(p, tmp / p.name)

    def crash(*a, **k):
        raise KeyboardInterrupt

    if step == "before the exchange":
        monkeypatch.setattr(output, "_exchange", crash)
    else:
        monkeypatch.setattr(output.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        output.publish_directory(tmp, out, "tiny")
    assert snapshot(out) == (old if step == "before the exchange" else new)


def test_killed_forced_quantize_keeps_the_old_output(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)
    out = tmp_path / "int4"
    quantize_model(src, out, QuantizeOptions(**FAST))
    old = snapshot(out)
    for kill_at in ("layer", "exchange"):
        script = textwrap.dedent(f"""
            import os, signal
            from clover_lite.checkpoint import output
            from clover_lite.quant.pipeline import QuantizeOptions, quantize_model
            def die(*a, **k):
                os.kill(os.getpid(), signal.SIGKILL)
            swap = output._exchange
            def swap_then_die(a, b):  # right after the swap, before the old copy is removed
                swap(a, b)
                die()
            if {kill_at!r} == "exchange":
                output._exchange = swap_then_die
            quantize_model({str(src)!r}, {str(out)!r}, QuantizeOptions(**{{**{FAST!r}, "group_size": 16}}),
                           force=True, restart=True, on_layer=die if {kill_at!r} == "layer" else None)
        """)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert r.returncode == -9, r.stderr
        group = json.loads((out / "quantize_config.json").read_text())["group_size"]
        if kill_at == "layer":
            assert snapshot(out) == old and group == 32
        else:
            assert group == 16 and (out / MARKER).exists()
    # The old copy the swap left in .int4.partial is ours: the next run clears it without asking.
    quantize_model(src, out, QuantizeOptions(**FAST), force=True)
    assert snapshot(out) == old


def test_rerun_never_discards_finished_layers_silently(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)
    out, partial = tmp_path / "int4", tmp_path / ".int4.partial"

    def stop(i, n, info):
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize_model(src, out, QuantizeOptions(**FAST), on_layer=stop)
    before = snapshot(partial)
    r = CliRunner().invoke(main, ["quantize", str(src), str(out), *CLI_FAST])
    assert r.exit_code == 1 and "2 layers done" in r.output, r.output
    assert r.output.index("--resume") < r.output.index("--restart")  # the safe option first
    with pytest.raises(QuantizationError, match="other settings"):
        quantize_model(src, out, QuantizeOptions(**{**FAST, "seed": 9}), resume=True)
    assert snapshot(partial) == before
    seen = []
    quantize_model(src, out, QuantizeOptions(**FAST), restart=True, on_layer=lambda i, n, info: seen.append(i))
    assert seen == [0, 1, 2, 3] and not partial.exists()


def test_eval_against_another_vocabulary_is_a_clear_error(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=1)
    b = write_tiny_checkpoint(tmp_path / "b", seed=1, vocab_size=300)
    r = CliRunner().invoke(main, ["eval", str(a), "--against", str(b), "--nsamples", "2", "--seqlen", "16"])
    assert r.exit_code == 1 and "differ in vocabulary" in r.output, r.output


def test_eval_against_another_architecture_is_a_clear_error(tmp_path):
    """Same tokenizer and vocabulary, another model (fewer layers): refused, naming what differs."""
    a = write_tiny_checkpoint(tmp_path / "a", seed=1)
    b = write_tiny_checkpoint(tmp_path / "b", seed=1, num_hidden_layers=2,
                              layer_types=["linear_attention", "full_attention"])
    r = CliRunner().invoke(main, ["eval", str(a), "--against", str(b), "--nsamples", "2", "--seqlen", "16"])
    assert r.exit_code == 1 and "different architectures (num_hidden_layers 4 vs 2)" in r.output, r.output


def test_a_failed_write_keeps_the_finished_layers_for_resume(tmp_path, monkeypatch):
    from clover_lite.quant import pipeline

    src = write_tiny_checkpoint(tmp_path / "src", seed=1)
    out, partial = tmp_path / "int4", tmp_path / ".int4.partial"
    real, writes = pipeline.write_text_atomic, []

    def disk_full_on_third_state(path, text):
        writes.append(path.name)
        if writes.count("state.json") == 3:
            raise OutputError(f"cannot write {path}: No space left on device")
        real(path, text)

    monkeypatch.setattr(pipeline, "write_text_atomic", disk_full_on_third_state)
    with pytest.raises(QuantizationError, match="kept in .*rerun with --resume"):
        quantize_model(src, out, QuantizeOptions(**FAST))
    monkeypatch.setattr(pipeline, "write_text_atomic", real)
    assert json.loads((partial / "state.json").read_text())["next_layer"] == 2
    seen = []
    quantize_model(src, out, QuantizeOptions(**FAST), resume=True, on_layer=lambda i, n, info: seen.append(i))
    assert seen == [2, 3] and (out / MARKER).exists()


class FullDisk:
    """A disk that fills up after `room` more bytes: every file write through Python's io or safetensors' writer
    beyond that fails as on a real full disk: ENOSPC from io, safetensors' SafetensorError (not an OSError)
    naming os error 28 from its writer (the bytes that fit are written)."""

    def __init__(self, monkeypatch, room: int):
        import builtins
        import errno

        import safetensors.torch as st
        from safetensors import SafetensorError

        self.room = room
        real_open, real_save_file = builtins.open, st.save_file
        disk = self

        def spend(n: int, name: str) -> None:
            if n > disk.room:
                disk.room = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
            disk.room -= n

        class Writer:
            def __init__(self, f, name):
                self._f, self._name = f, name

            def write(self, data):
                spend(len(data), self._name)
                return self._f.write(data)

            def __getattr__(self, attr):
                return getattr(self._f, attr)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return Writer(f, str(file)) if any(c in mode for c in "wax+") else f

        def save_file(tensors, filename, metadata=None):
            try:
                spend(sum(t.numel() * t.element_size() for t in tensors.values()), str(filename))
            except OSError:  # safetensors' writer reports it as its own error, with the OS error's text
                message = "Error while serializing: I/O error: No space left on device (os error 28)"
                raise SafetensorError(message) from None
            real_save_file(tensors, filename, metadata=metadata)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(st, "save_file", save_file)
        monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: spend(len(text), str(self))
                            or real_write_text(self, text, *a, **k))


real_write_text = Path.write_text


@pytest.mark.parametrize("room", [0, 1_000, 60_000, 200_000])
def test_tiny_on_a_full_disk_leaves_nothing_and_says_so(tmp_path, monkeypatch, room):
    """`clover tiny` (save_checkpoint) with the disk filling at different points: exit 1 with one line naming
    ENOSPC's message, no output and no temporary directory left."""
    FullDisk(monkeypatch, room)
    r = CliRunner().invoke(main, ["tiny", str(tmp_path / "out")])
    monkeypatch.undo()
    assert r.exit_code == 1 and "No space left on device" in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_quantize_on_a_full_disk_keeps_the_finished_layers_and_resumes_byte_identical(tmp_path, monkeypatch):
    """A real OSError (ENOSPC from the writers, not our own error) in the middle of `quantize`: one clear error,
    the finished layers kept, and `--resume` after freeing space gives the uninterrupted run's bytes."""
    src = write_tiny_checkpoint(tmp_path / "src", seed=2)
    ref = tmp_path / "ref"
    quantize_model(src, ref, QuantizeOptions(**FAST))
    FullDisk(monkeypatch, 120_000)
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q"), *CLI_FAST])
    monkeypatch.undo()
    assert r.exit_code == 1 and "No space left on device" in r.output and "--resume" in r.output, r.output
    assert not (tmp_path / "q").exists() and (tmp_path / ".q.partial").is_dir()
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q"), "--resume", *CLI_FAST])
    assert r.exit_code == 0, r.output
    files = sorted(p.name for p in ref.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "q").iterdir())
    for name in files:
        assert (ref / name).read_bytes() == (tmp_path / "q" / name).read_bytes(), name


def test_a_second_quantize_into_the_same_output_is_refused_until_the_first_ends(tmp_path):
    """Another process writing OUT (it holds OUT's lock): quantize is refused at once, naming it, and touches
    nothing; once that process is killed (no clean exit: the kernel drops its lock) the same command runs."""
    src = write_tiny_checkpoint(tmp_path / "src", seed=3)
    out = tmp_path / "q"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from clover_lite.checkpoint.output import exclusive_writer
        with exclusive_writer(Path({str(out)!r}), "clover quantize"):
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError, match="another clover quantize is writing .*q now"):
            quantize_model(src, out, QuantizeOptions(**FAST))
        assert sorted(p.name for p in tmp_path.iterdir()) == [".q.lock", "src"]  # no partial begun
    finally:
        holder.kill()
        holder.wait()
    r = quantize_model(src, out, QuantizeOptions(**FAST))
    assert r.out == out and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]  # the lock file goes with the run
