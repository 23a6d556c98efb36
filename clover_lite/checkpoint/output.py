"""Where a command may write a model directory, and how it replaces one, without touching what it did not write.

Every model directory clover-lite writes holds a marker file (`.clover-lite.json`) listing the files it
wrote. `--force` replaces only such a directory (or an older output recognised by its quantize_config),
and only when it holds nothing else; any other non-empty directory, a file, a source inside or around
the output are refused before anything is touched. Replacement is one atomic exchange of the new
directory with the old, so a crash leaves one of the two at OUT, never neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import safetensors
import safetensors.torch

from clover_lite.errors import CloverError

MARKER = ".clover-lite.json"

# What an output of ours written before the marker existed may hold (a quantize_config "clover" entry
# recognises it); anything else in it is someone's file.
_OUR_NAMES = re.compile(
    r"(config\.json|generation_config\.json|quantize_config\.json|model\.safetensors\.index\.json|"
    r"model(-\d{5}-of-\d{5})?\.safetensors|tokenizer\.json|tokenizer_config\.json|tokenizer\.model|"
    r"special_tokens_map\.json|chat_template\.jinja|README\.md)"
)


class OutputError(CloverError, ValueError):
    """An output path that cannot or must not be written."""


def write_marker(directory: Path, kind: str) -> None:
    """Record, inside a finished output directory, that clover-lite wrote it and which files are its."""
    files = sorted(p.name for p in directory.iterdir() if p.name != MARKER)
    (directory / MARKER).write_text(json.dumps({"written_by": "clover-lite", "kind": kind, "files": files}, indent=2))


def owned_files(directory: Path) -> set[str] | None:
    """The names clover-lite wrote in `directory`, or None when it is not an output of ours."""
    marker = directory / MARKER
    if marker.is_file():
        try:
            info = json.loads(marker.read_text())
            if info.get("written_by") == "clover-lite" and isinstance(info.get("files"), list):
                return {str(f) for f in info["files"]} | {MARKER}
        except (OSError, ValueError):
            return None
        return None
    try:
        quant = json.loads((directory / "quantize_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(quant, dict) or "clover" not in quant:
        return None
    return {p.name for p in directory.iterdir() if _OUR_NAMES.fullmatch(p.name)}


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def check_output(out: str | os.PathLike, sources: Iterable[str | os.PathLike] = (), force: bool = False,
                 needed_bytes: int = 0) -> Path:
    """Check up front that a model directory can be written at `out`; raise OutputError naming the
    path and the fix otherwise. Nothing is created or removed."""
    out = Path(out)
    real = out.resolve()
    for src in sources:
        s = Path(src).resolve()
        if real == s:
            raise OutputError(f"OUT {out} is the source itself; choose a new directory for the output")
        if _inside(s, real):
            raise OutputError(f"OUT {out} contains the source {src}; choose a directory outside it")
        if _inside(real, s):
            raise OutputError(f"OUT {out} is inside the source {src}; choose a directory outside it")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"OUT {out} is a file, not a directory; choose a new directory for the output")
    if out.is_dir() and any(out.iterdir()):
        ours = owned_files(out)
        if ours is None:
            raise OutputError(f"OUT {out} is a directory of files clover-lite did not write; "
                              "choose a new or empty directory (nothing was changed)")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
        if foreign:
            listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise OutputError(f"OUT {out} is an earlier output but also holds {listed}, which clover-lite did "
                              "not write; move them out or choose another directory (nothing was changed)")
        if not force:
            raise OutputError(f"OUT {out} already exists (an earlier output); choose another directory, or pass "
                              "--force (in Python: force=True) to replace it")
    parent = real.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {out}: {parent} is not writable; choose a directory you can write to")
    if needed_bytes:
        free = shutil.disk_usage(parent).free
        if free < needed_bytes:
            raise OutputError(f"cannot write {out}: it needs about {needed_bytes / 2**20:.0f} MiB and "
                              f"{parent} has {free / 2**20:.0f} MiB free; free some space or choose another disk")
    return out


def make_parents(out: Path) -> None:
    """Create OUT's missing parent directories; an OSError becomes an OutputError naming the path."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e} ({e.filename or out.parent}); "
                          "choose a directory you can write to") from e


def temporary_sibling(out: Path, suffix: str) -> Path:
    """A new empty directory next to `out` (same filesystem, so it can be renamed into place)."""
    make_parents(out)
    try:
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.{suffix}-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e} in {out.parent}; "
                          "choose a directory you can write to") from e


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_directory(tmp: Path, out: Path, kind: str) -> None:
    """Move a finished directory into place, replacing `out` if it exists, with the modes a plain mkdir
    and open would give (mkdtemp makes it 0700 and safetensors writes 0600, unreadable to anyone else)."""
    write_marker(tmp, kind)
    umask = os.umask(0)
    os.umask(umask)
    for p in (tmp, *tmp.rglob("*")):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
    if not out.exists():
        tmp.rename(out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp)  # now the old output
    else:
        # No atomic exchange here: a crash between the renames leaves the old output at .OUT.old-PID.
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)


def write_directory(out: str | os.PathLike, write: Callable[[Path], None], kind: str, force: bool = False) -> Path:
    """Write a model directory: check `out` (check_output's rules), let `write(tmp)` fill a temporary sibling,
    then move it into place. A failure, a full disk included, leaves nothing behind and one clear error."""
    out = Path(out)
    check_output(out, force=force)
    tmp = temporary_sibling(out, "tmp")
    try:
        write(tmp)
        publish_directory(tmp, out, kind)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write {out}: {e.strerror or e}; nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_file_target(path: str | os.PathLike) -> Path:
    """Check up front that a result file can be written at `path` (so a long run does not fail at its end)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory; give a file name")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {path}: {parent} is not a directory; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: {parent} is not writable; choose a directory you can write to")
    return path


def save_tensors(tensors: dict, path: str | os.PathLike) -> None:
    """safetensors' save_file, whose failed write (a full disk) raises its own SafetensorError, not an OSError:
    turned into the OSError it reports ("... (os error 28)"), so every writer handles one kind of failure."""
    try:
        safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    except safetensors.SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        err = int(code.group(1)) if code else errno.EIO
        raise OSError(err, os.strerror(err), str(path)) from e


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a file whole or not at all (a temporary sibling renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from e


@contextlib.contextmanager
def exclusive_writer(out: Path, command: str) -> Iterator[None]:
    """Hold `.OUT.lock` beside OUT while a long command writes OUT: a second one writing the same OUT is refused
    at once instead of sharing (and corrupting) its partial output. The lock is the kernel's (flock), so a
    killed run leaves no stale lock; the file goes when the holder finishes."""
    make_parents(out)
    path = out.parent / f".{out.name}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot write {out}: {e.strerror or e} in {out.parent}; choose a directory you "
                              "can write to") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"another {command} is writing {out} now (it holds {path}); wait for it to finish "
                              "or choose another output") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder before us removed the file as it finished: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
