"""Memory errors of interpreted Triton kernels, caught on the CPU: out-of-bounds accesses and races.

The interpreter reads any host address it is given and runs a launch's programs one after another, so
three kinds of bug pass unseen there and fail on a GPU (docs/ARCHITECTURE.md section 5):
- an access past a tensor's end: garbage or an illegal-address crash on a GPU. Every address a kernel
  touches under its mask must lie inside the memory span of one tensor passed to that launch (a view's
  span: from its first to its last element, by its strides).
- a race between programs of one launch: on a GPU they run in no fixed order. No address may be stored by
  two programs, or stored by one and loaded by another, unless an atomic orders the two: the storing
  program releases (an atomic with release semantics, after the store and a barrier) the same address the
  loading one acquires (before a barrier and the load), and the release came first. That is how the
  split-K GEMM's last split reads the others' partials (int4_split_k.last_split_sums); atomics never race.
- a race inside one program: its threads are not ordered either, so a program that loads an address it
  stored must have a barrier (tl.debug_barrier()) between the two, as the split-K sum has before it reads
  its own partial back.
`memcheck()` wraps the interpreter's loads, stores, atomics, barriers and launches to check all three, as
compute-sanitizer's memcheck and racecheck do on a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from triton.runtime import interpreter


class OutOfBounds(AssertionError):
    pass


class Race(AssertionError):
    pass


@dataclass
class _Launch:
    lo: np.ndarray  # sorted starts of the tensor arguments' byte spans
    hi: np.ndarray
    grid: tuple[int, int, int] = (1, 1, 1)
    loads: list = field(default_factory=list)  # (addresses, program, sequence number) per access
    stores: list = field(default_factory=list)
    atomics: list = field(default_factory=list)  # (addresses, program, sequence number, acquires, releases)
    events: int = 0  # accesses so far: the interpreter's order, one program after another
    unfenced: dict = field(default_factory=dict)  # program -> addresses it stored since its last barrier
    barriers: list = field(default_factory=list)  # (program, sequence number) per tl.debug_barrier()

    def seq(self) -> int:
        self.events += 1
        return self.events


def _spans(args) -> list[tuple[int, int]]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.numel():
                last = sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True))
                out.append((a.data_ptr(), a.data_ptr() + (last + 1) * a.element_size()))
        elif isinstance(a, (tuple, list)):
            out += _spans(a)
    return sorted(out)


def _touched(ptrs, mask) -> np.ndarray:
    addr = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
    return addr[np.broadcast_to(mask.data, addr.shape)].astype(np.uint64).ravel()


def _check_bounds(launch: _Launch, kind: str, addr: np.ndarray, elt: int) -> None:
    i = np.searchsorted(launch.lo, addr, side="right") - 1  # the last span starting at or before each address
    ok = i >= 0
    ok[ok] = addr[ok] + np.uint64(elt) <= launch.hi[i[ok]]
    if not ok.all():
        bad = int(addr[~ok][0])
        j = max(0, int(i[~ok][0]))
        where = f"; nearest tensor spans bytes [{launch.lo[j]:#x}, {launch.hi[j]:#x})" if launch.lo.size else ""
        raise OutOfBounds(f"{kind} of {int((~ok).sum())} element(s) outside every tensor argument, first at "
                          f"{bad:#x}{where}")


def _flat(accesses: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(addresses, program, sequence number) per element of a list of (addresses, program, seq, ...)."""
    return (np.concatenate([a[0] for a in accesses]),
            np.concatenate([np.full(a[0].size, a[1], dtype=np.int64) for a in accesses]),
            np.concatenate([np.full(a[0].size, a[2], dtype=np.int64) for a in accesses]))


def _ordered(launch: _Launch, writer: int, stored: int, loader: int, loaded: int) -> bool:
    """Whether `writer`'s store (sequence number `stored`) happens before `loader`'s load (`loaded`): the
    writer released an address after the store that the loader acquired, later, before the load. An atomic
    on a tensor's scalar is one thread's: a barrier must put the writer's other threads' stores before its
    release, and the loader's other threads' loads after its acquire."""
    def fenced(program: int, after: int, before: int) -> bool:
        return any(p == program and after < q < before for p, q in launch.barriers)

    releases = [(set(a.tolist()), q) for a, p, q, _, rel in launch.atomics
                if p == writer and rel and q > stored and fenced(writer, stored, q)]
    return any(q_acq > q_rel and addrs & set(a.tolist())
               for a, p, q_acq, acq, _ in launch.atomics
               if p == loader and acq and q_acq < loaded and fenced(loader, q_acq, loaded)
               for addrs, q_rel in releases)


def _check_races(launch: _Launch) -> None:
    if not launch.stores:
        return
    s_addr, s_prog, s_seq = _flat(launch.stores)
    order = np.lexsort((s_seq, s_prog, s_addr))
    s_addr, s_prog, s_seq = s_addr[order], s_prog[order], s_seq[order]
    clash = (s_addr[1:] == s_addr[:-1]) & (s_prog[1:] != s_prog[:-1])
    if clash.any():
        k = int(np.argmax(clash))
        raise Race(f"programs {_pid(launch, s_prog[k])} and {_pid(launch, s_prog[k + 1])} both store to "
                   f"{int(s_addr[k]):#x} ({int(clash.sum())} such addresses): their order on a GPU is undefined")
    if not launch.loads:
        return
    addr, last = np.unique(s_addr[::-1], return_index=True)  # each address's one writer, its last store
    writer, stored = s_prog[::-1][last], s_seq[::-1][last]
    l_addr, l_prog, l_seq = _flat(launch.loads)
    hit = np.isin(l_addr, addr)
    at = np.searchsorted(addr, l_addr[hit])
    w, ws = writer[at], stored[at]
    bad = w != l_prog[hit]
    if not bad.any():
        return
    pairs = np.unique(np.stack([w[bad], ws[bad], l_prog[hit][bad], l_seq[hit][bad]], axis=1), axis=0)
    for wp, wq, lp, lq in pairs.tolist():
        if not _ordered(launch, wp, wq, lp, lq):
            k = int(np.argmax(bad & (w == wp) & (l_prog[hit] == lp)))
            raise Race(f"program {_pid(launch, lp)} loads {int(l_addr[hit][k]):#x}, which program "
                       f"{_pid(launch, wp)} stores in the same launch: a dependency between programs, undefined "
                       "on a GPU (unless the writer releases an atomic after its store and a barrier, which the loader "
                       "acquires before a barrier and the load)")


def _pid(launch: _Launch, flat: int) -> tuple[int, int, int]:
    gx, gy, _ = launch.grid
    return (int(flat % gx), int(flat // gx % gy), int(flat // (gx * gy)))


@contextlib.contextmanager
def memcheck():
    """While active, an interpreted kernel that touches memory outside its tensor arguments raises OutOfBounds,
    and one whose programs race raises Race (wrapped by the interpreter in an InterpreterError)."""
    launches: list[_Launch] = []
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, call = executor._init_args_hst, executor.__call__
    load, store, set_dim = builder.create_masked_load, builder.create_masked_store, builder.set_grid_dim
    rmw, cas, barrier = builder.create_atomic_rmw, builder.create_atomic_cas, builder.create_barrier

    def program(b) -> int:
        x, y, z = b.grid_idx
        gx, gy, _ = b.grid_dim
        return x + gx * (y + gy * z)

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        spans = _spans(list(args_hst) + list(kwargs_hst.values()))
        launches.append(_Launch(np.array([s for s, _ in spans], dtype=np.uint64),
                                np.array([e for _, e in spans], dtype=np.uint64)))
        return args_hst, kwargs_hst

    def call_checked(self, *args, **kwargs):
        depth = len(launches)
        try:
            out = call(self, *args, **kwargs)
            if len(launches) > depth:
                _check_races(launches[depth])
            return out
        finally:
            del launches[depth:]

    def set_dim_checked(self, nx, ny, nz):
        if launches:
            launches[-1].grid = (nx, ny, nz)
        return set_dim(self, nx, ny, nz)

    def load_checked(self, ptrs, mask, other, *rest):
        if launches:
            addr = _touched(ptrs, mask)
            elt = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            _check_bounds(launches[-1], "load", addr, elt)
            stored = launches[-1].unfenced.get(program(self))
            if stored is not None and np.isin(addr, stored).any():
                raise Race(f"program {_pid(launches[-1], program(self))} loads an address it stored, with no "
                           "tl.debug_barrier() between: another thread of the program may have stored it, and "
                           "nothing orders the two on a GPU")
            launches[-1].loads.append((addr, program(self), launches[-1].seq()))
        return load(self, ptrs, mask, other, *rest)

    def store_checked(self, ptrs, value, mask, *rest):
        if launches:
            addr = _touched(ptrs, mask)
            _check_bounds(launches[-1], "store", addr, value.data.dtype.itemsize)
            launches[-1].stores.append((addr, program(self), launches[-1].seq()))
            unfenced, p = launches[-1].unfenced, program(self)
            unfenced[p] = addr if p not in unfenced else np.concatenate([unfenced[p], addr])
        return store(self, ptrs, value, mask, *rest)

    def atomic(self, ptrs, mask, value, sem) -> None:
        if launches:
            addr = _touched(ptrs, mask)
            _check_bounds(launches[-1], "atomic", addr, value.data.dtype.itemsize)
            name = str(sem)
            launches[-1].atomics.append((addr, program(self), launches[-1].seq(), "ACQUIRE" in name,
                                         "RELEASE" in name))

    def barrier_checked(self):
        if launches:
            launches[-1].unfenced.pop(program(self), None)
            launches[-1].barriers.append((program(self), launches[-1].seq()))
        return barrier(self)

    def rmw_checked(self, op, ptrs, value, mask, sem, scope):
        atomic(self, ptrs, mask, value, sem)
        return rmw(self, op, ptrs, value, mask, sem, scope)

    def cas_checked(self, ptrs, cmp, value, sem, scope):
        atomic(self, ptrs, interpreter.TensorHandle(np.ones_like(ptrs.data, dtype=bool), None), value, sem)
        return cas(self, ptrs, cmp, value, sem, scope)

    executor._init_args_hst, executor.__call__ = init_args_checked, call_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    builder.set_grid_dim = set_dim_checked
    builder.create_atomic_rmw, builder.create_atomic_cas = rmw_checked, cas_checked
    builder.create_barrier = barrier_checked
    try:
        yield
    finally:
        executor._init_args_hst, executor.__call__ = init_args, call
        builder.create_masked_load, builder.create_masked_store = load, store
        builder.set_grid_dim = set_dim
        builder.create_atomic_rmw, builder.create_atomic_cas = rmw, cas
        builder.create_barrier = barrier
