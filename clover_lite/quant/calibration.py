"""Calibration sequences for quantization, shaped the way the denoiser sees its inputs.

Text comes from a file the user gives (plain text, or JSONL with a "text" field or chat "messages") or,
by default, from text present on every machine with Python: the standard library's sources. Windows of
`seqlen` tokens are drawn with a seed; in `diffusion` mode the last block of each window is masked at a
ratio spread over 0.1..1.0, as a denoising step sees it (blocks before it stay clean).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from clover_lite.errors import CloverError
from clover_lite.tokenizer.tokenizer import Tokenizer
from clover_lite.training.corpus import split_files

MODES = ("diffusion", "clean")


def _split() -> tuple[list[Path], list[Path]]:
    """(calibration files, held-out files) of the standard library: the split the bundled model was trained
    on (`corpus.split_files`), so evaluation text is never calibration or training text."""
    train, held = split_files()
    if not train:
        raise CloverError("no Python standard-library sources found for the default text; pass a text file")
    return train, held


def _read(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            yield f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _read_until(files: list[Path], limit_bytes: int) -> list[str]:
    texts, total = [], 0
    for t in _read(files):
        texts.append(t)
        total += len(t)
        if total >= limit_bytes:
            break
    return texts


def stdlib_texts(seed: int = 0) -> Iterator[str]:
    """Python sources of the standard library (tests and held-out files excluded) in a seeded order, read
    lazily: calibration stops reading once it has enough tokens."""
    files = list(_split()[0])
    random.Random(seed).shuffle(files)
    return _read(files)


def heldout_texts(limit_bytes: int = 1_000_000) -> list[str]:
    """The standard-library files `stdlib_texts` never returns, for evaluation."""
    return _read_until(_split()[1], limit_bytes)


# A text file with bytes that are not UTF-8 (Latin-1 accents: a few in a hundred) reads, each as U+FFFD; more
# than this share of them (random or compressed bytes: about half), or any NUL byte, is a binary file (a model
# shard, an archive) given by mistake, which would otherwise calibrate on noise without a word.
_MAX_INVALID_SHARE = 0.2


def _text(p: Path, data: bytes, what: str) -> str:
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = data.decode("utf-8", errors="replace")
        invalid = text.count("\ufffd") - data.count("\ufffd".encode())
        if nul < 0 and invalid <= _MAX_INVALID_SHARE * len(data):
            return text
        nul = e.start if nul < 0 else min(nul, e.start)
    if nul >= 0:
        raise CloverError(f"{p}: the {what} is not text (binary bytes from offset {nul}): give a UTF-8 text file "
                          "(one document) or a .jsonl file (one document per line)")
    return text


def read_calibration_file(path: str | os.PathLike, what: str = "calibration file (--calib)") -> list[str]:
    """Plain text (one document) or JSONL (one document per line: "text", or "messages" joined). `what` names
    the file in errors (`clover eval` reads its held-out text through here too)."""
    p = Path(path)
    if not p.exists():
        raise CloverError(f"{p}: {what} not found")
    try:
        data = p.read_bytes()
    except OSError as e:  # a directory, no permission
        raise CloverError(f"{p}: cannot read the {what}: {e.strerror or e}") from e
    raw = _text(p, data, what)
    if p.suffix.lower() not in (".jsonl", ".ndjson"):
        if not raw.strip():
            raise CloverError(f"{p}: {what} is empty")
        return [raw]
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CloverError(f"{p}:{n}: not valid JSON ({e})") from e
        if isinstance(obj, str):
            texts.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            texts.append(obj["text"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            texts.append("\n".join(str(m.get("content", "")) for m in obj["messages"] if isinstance(m, dict)))
        else:
            raise CloverError(f'{p}:{n}: expected a string or an object with "text" or "messages"')
    if not texts:
        raise CloverError(f"{p}: no documents in the {what}")
    return texts


def token_stream(tokenizer: Tokenizer, texts: Iterable[str], separator: int | None, max_tokens: int | None = None
                 ) -> list[int]:
    """The texts tokenized back to back (separated by `separator`), stopping once `max_tokens` are in."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t)
        if separator is not None:
            ids.append(separator)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return ids


def calibration_ids(
    stream: list[int],
    nsamples: int,
    seqlen: int,
    seed: int,
    mode: str = "diffusion",
    block_size: int = 4,
    mask_token_id: int | None = None,
) -> torch.Tensor:
    """[nsamples, seqlen] windows of the token stream; in diffusion mode the last block of each window is
    masked at a ratio from 0.1 to 1.0 (spread evenly over the samples, in a seeded order)."""
    if mode not in MODES:
        raise CloverError(f"calibration mode must be one of {MODES}, got '{mode}'")
    if len(stream) < seqlen + 1:
        raise CloverError(
            f"calibration text has {len(stream)} tokens; a window of {seqlen} needs at least {seqlen + 1} (give more "
            "text, or a smaller --seqlen)"
        )
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(stream, dtype=torch.long)
    starts = torch.randint(0, len(stream) - seqlen, (nsamples,), generator=gen)
    ids = torch.stack([data[s : s + seqlen] for s in starts.tolist()])
    if mode == "diffusion":
        if mask_token_id is None:
            raise CloverError("diffusion-aware calibration needs the model's mask token; use --calibration clean")
        last = (seqlen - 1) // block_size * block_size  # the last block of the grid
        span = seqlen - last
        ratios = torch.linspace(0.1, 1.0, nsamples)[torch.randperm(nsamples, generator=gen)]
        for i in range(nsamples):
            n_mask = max(1, round(float(ratios[i]) * span))
            pos = last + torch.randperm(span, generator=gen)[:n_mask]
            ids[i, pos] = mask_token_id
    return ids
