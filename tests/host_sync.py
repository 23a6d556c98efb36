"""A CPU stand-in for CUDA-graph capture's rule: code that will be captured must never wait for the device."""

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
