"""Mutations of JSON files for the readers' fuzz tests: structural (a value replaced by one of another type
or an extreme one, a key removed or added) and textual (bytes changed, deleted, inserted, the file cut
short, non-UTF-8). Deterministic for a random.Random."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**63, -(2**63), 10**30, 0.5, -0.0, 1e308, float("nan"),
    float("inf"), "", "x", "\x00", "\u202e", "a" * 10_000, [], [1, 2], [None], {}, {"a": 1}, {"content": None},
]


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:20]):  # long lists (vocabularies): their first entries are enough
            out += _paths(v, path + (i,))
    return out


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return root


def mutate_structure(data: Any, rng: random.Random, n: int = 1) -> Any:
    """`data` (parsed JSON) with `n` random structural changes."""
    data = copy.deepcopy(data)
    for _ in range(n):
        paths = _paths(data)
        path = rng.choice(paths)
        op = rng.random()
        if op < 0.6 or not path:
            data = _set(data, path, copy.deepcopy(rng.choice(ODD_VALUES)))
        elif op < 0.85:
            node = data
            for p in path[:-1]:
                node = node[p]
            del node[path[-1]]
        else:
            node = data
            for p in path[:-1]:
                node = node[p]
            if isinstance(node, dict):
                node[rng.choice(["__class__", "extra", str(rng.random())])] = rng.choice(ODD_VALUES)
    return data


def mutate_bytes(text: bytes, rng: random.Random) -> bytes:
    """`text` with a few bytes changed, deleted or inserted, cut short, or made non-UTF-8."""
    b = bytearray(text)
    op = rng.random()
    if op < 0.15:
        return bytes(b[: rng.randrange(len(b) + 1)])
    if op < 0.2:
        i = rng.randrange(len(b) + 1)
        return bytes(b[:i] + b"\xff\xfe\xc3" + b[i:])
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(max(len(b), 1))
        r = rng.random()
        if r < 0.5 and b:
            b[i] = rng.choice(b'0123456789{}[]",:-.eE tfn\\' + bytes([rng.randrange(256)]))
        elif r < 0.75 and b:
            del b[i]
        else:
            b.insert(i, rng.randrange(256))
    return bytes(b)


def mutated_json_texts(data: Any, rng: random.Random, cases: int) -> list[bytes]:
    """`cases` mutated versions of a JSON document, half structural and half textual."""
    raw = json.dumps(data).encode()
    out = []
    for k in range(cases):
        if k % 2:
            out.append(mutate_bytes(raw, rng))
        else:
            out.append(json.dumps(mutate_structure(data, rng, rng.randint(1, 3))).encode())
    return out
