"""CPU stand-ins for CUDA-graph capture's rules: code that will be captured must never wait for the device
(HostSyncTrap), and must launch the same kernels with the same arguments whatever the host's state, since a
replay repeats what the capture recorded (LaunchRecorder)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that make the host wait for the device, or give an output whose shape depends on the data:
# either one breaks CUDA-graph capture. item()/int()/bool() of a tensor all arrive as _local_scalar_dense.
HOST_SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select",
                 "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                 "repeat_interleave", "masked_scatter"}


class HostSyncTrap(TorchDispatchMode):
    """Fails on any op that would wait for a GPU, seen on CPU tensors: what CUDA-graph capture forbids,
    checked where there is no GPU (boolean-mask indexing too, which runs a nonzero on the device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        bool_index = name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args if isinstance(a, (list, tuple)) for i in a)
        if name in HOST_SYNC_OPS or bool_index:
            raise AssertionError(f"{func._schema.name} waits for the device: not capturable in a CUDA graph")
        return func(*args, **(kwargs or {}))


class LaunchRecorder(TorchDispatchMode):
    """What a CUDA graph freezes of each launch, recorded on a CPU: every torch operator and interpreted
    Triton kernel in order, with its grid, its scalar arguments and, per tensor, shape, strides, dtype and
    which persistent buffer it is (named in `persistent` by storage address; any other is "temp", whose
    address a graph fixes for every replay). A captured step replays exactly these launches, so two runs at
    different cache lengths and ids must record the same list: a host value that reaches a launch (a
    length, a slice bound, a split count) would be the first run's in every replay."""

    def __init__(self, persistent: dict[int, str]):
        super().__init__()
        self.persistent = persistent
        self.launches: list[tuple] = []
        self._in_kernel = False

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            name = self.persistent.get(a.untyped_storage().data_ptr(), "temp")
            return ("tensor", name, tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(self._arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, self._arg(v)) for k, v in a.items())
        return "nan" if isinstance(a, float) and a != a else a  # equal to itself (the poison's fills)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_kernel:  # the interpreter's own copies of a kernel's arguments are not launches
            self.launches.append((str(func), self._arg(args), self._arg(kwargs or {})))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter

        executor = interpreter.GridExecutor
        self._call = call = executor.__call__
        recorder = self

        def recorded(ex, *args, **kwargs):
            grid = ex.grid if isinstance(ex.grid, tuple) else "callable"
            recorder.launches.append((ex.fn.__name__, grid, recorder._arg(args), recorder._arg(kwargs)))
            recorder._in_kernel = True
            try:
                return call(ex, *args, **kwargs)
            finally:
                recorder._in_kernel = False

        executor.__call__ = recorded
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime import interpreter

        interpreter.GridExecutor.__call__ = self._call
        return super().__exit__(*exc)


def first_difference(a: list[tuple], b: list[tuple]) -> str | None:
    """None if two recordings are equal, else where they part: the launch's index and both versions."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"launch {i}: {x} vs {y}"
    return None if len(a) == len(b) else f"{len(a)} launches vs {len(b)}"
