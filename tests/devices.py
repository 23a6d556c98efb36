"""Where the kernel tests run: `pytest --device interpret` (the default: every kernel in Triton's interpreter
on the CPU) or `pytest --device cuda` (the kernel tests, marker `gpu`, compiled by Triton on the CUDA device;
every other test is deselected). docs/ARCHITECTURE.md section 5.

tests/conftest.py calls `choose` from pytest_configure, before any test module is imported: TRITON_INTERPRET
is read when a @triton.jit function is defined, so it must be set before a kernel module is imported, and
this module imports neither triton nor a kernel. Test modules read the choice when they are collected
(`on_gpu()` for parameters that differ by device: bf16, the model's shapes) and take the device itself
from the `device` fixture. A kernel test makes the same calls on both devices: the inputs are made on the
CPU from the same seeded generators and moved to the device; references are computed where they were.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

DEVICES = ("interpret", "cuda")
_chosen = ["interpret"]


def choose(name: str) -> None:
    """Set up the process for `name` (pytest_configure): TRITON_INTERPRET, and on cuda a CUDA device or a
    usage error that says why there is none."""
    if name not in DEVICES:
        raise pytest.UsageError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    early = sorted(m for m in sys.modules if m.startswith("clover_lite.kernels."))
    if early and os.environ.get("TRITON_INTERPRET", "0") != ("1" if name == "interpret" else "0"):
        raise pytest.UsageError(f"--device {name}: kernel modules ({', '.join(early)}) were imported before "
                                "tests/conftest.py set TRITON_INTERPRET; their kernels would run on the wrong device")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(
                f"--device cuda: no CUDA device here (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda or 'none'}, sees no GPU). Without --device the kernel tests run on the CPU "
                "in Triton's interpreter.")
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise pytest.UsageError(f"--device cuda: triton is not importable ({e})") from None
        os.environ["TRITON_INTERPRET"] = "0"
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    _chosen[0] = name


def name() -> str:
    return _chosen[0]


def on_gpu() -> bool:
    """Whether this run's kernel tests run on the CUDA device (compiled), not in the interpreter."""
    return _chosen[0] == "cuda"


def device() -> torch.device:
    return torch.device("cuda") if on_gpu() else torch.device("cpu")


def to(dev: torch.device, obj):
    """`obj` with every tensor in it (nested in dicts, lists and tuples) on `dev`; on the CPU the same objects."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: to(dev, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to(dev, v) for v in obj)
    return obj


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64 on the CPU (0 where both are all zero): the measure of the GPU
    checks at the model's shapes, where one element's rounding should not decide."""
    ref = ref.detach().double().cpu()
    out = out.detach().double().cpu()
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def assert_near(actual: torch.Tensor, expected: torch.Tensor, gpu_rel: float, msg: str | None = None,
                **tol) -> None:
    """torch.testing.assert_close(**tol) in the interpreter; on a GPU the GPU check's measure, rel_err < gpu_rel:
    where tf32 rounds the products (the GDN kernel) an element's error scales with the largest values, not
    with its own, and an element-wise bound would fail on small elements of a right result."""
    if on_gpu():
        err = rel_err(actual, expected)
        assert err < gpu_rel, f"{msg + ': ' if msg else ''}relative error {err:.2e} (bound {gpu_rel:g} on a GPU)"
    else:
        torch.testing.assert_close(actual, expected, msg=msg, **tol)


def assert_same(a: torch.Tensor, b: torch.Tensor, msg: str | None = None) -> None:
    """Two launches of one kernel that differ only in what else they do (write a state or not, sum splits in the
    kernel or in a launch of their own): bit for bit in the interpreter; on a GPU, where each variant is
    compiled on its own and may contract or order its arithmetic differently, within one rounding of
    the dtype."""
    if on_gpu() and a.is_floating_point():
        eps = torch.finfo(a.dtype).eps
        torch.testing.assert_close(a, b, rtol=max(1e-5, eps), atol=max(1e-6, eps), msg=msg)
    else:
        assert torch.equal(a, b), msg


def label() -> str:
    """The device in words, for the run's summary."""
    if not on_gpu():
        return "interpret (Triton's interpreter on the CPU)"
    try:
        return f"cuda ({torch.cuda.get_device_name()})"
    except Exception as e:  # the summary must not fail the run
        return f"cuda (no device name: {type(e).__name__})"
