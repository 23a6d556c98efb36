"""The device option (tests/devices.py, tests/conftest.py) on the CPU: `--device cuda` without a GPU stops with
one message, every kernel test file is in the GPU run, a GPU run that runs nothing fails, and the GPU's
parameters are collected there. Each in a pytest of its own (the option is read once per process), some
with a stand-in for torch.cuda.is_available: they collect, and run only tests that are skipped there."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# What benchmarks/gpu_session.sh hands pytest --device cuda.
SESSION_FILES = ("tests/test_kernels_*.py", "tests/test_triton_memcheck.py")
PRETEND_CUDA = ("import sys, pytest, torch; torch.cuda.is_available = lambda: True; "
                "torch.cuda.get_device_name = lambda *a: 'a stand-in'; sys.exit(pytest.main(sys.argv[1:]))")


def pytest_run(*args: str, pretend_cuda: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", PRETEND_CUDA] if pretend_cuda else [sys.executable, "-m", "pytest"]
    return subprocess.run([*cmd, "-p", "no:cacheprovider", "-p", "no:xdist", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def collected(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stdout.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_device_cuda_without_a_gpu_stops_with_one_message():
    r = pytest_run("--device", "cuda", "-q", "tests/test_kernels_norm.py")
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]  # pytest's usage error: nothing ran
    assert r.stderr.startswith("ERROR: --device cuda: no CUDA device here (torch "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "passed" not in r.stdout


def test_every_kernel_test_file_runs_on_the_gpu():
    """The GPU run (marker gpu) holds every tests/test_kernels_*.py file, each with tests that run there (not
    all interpret_only), every test in those files is marked (a new test is in the GPU run without a thought),
    and gpu_session.sh hands pytest every file that has a GPU test."""
    kernel_files = {p.name for p in TESTS.glob("test_kernels_*.py")}
    assert len(kernel_files) >= 8
    gpu = pytest_run("--collect-only", "-q", "-m", "gpu", "tests")
    assert gpu.returncode == 0, gpu.stdout[-3000:] + gpu.stderr[-2000:]
    files = {line.split("::")[0].removeprefix("tests/") for line in collected(gpu)}
    assert kernel_files <= files and files <= kernel_files | {"test_triton_memcheck.py"}, files
    assert all(any(Path("tests", f).match(g) for g in SESSION_FILES) for f in files)
    runs = pytest_run("--collect-only", "-q", "-m", "gpu and not interpret_only", *sorted(f"tests/{f}" for f in files))
    assert {line.split("::")[0].removeprefix("tests/") for line in collected(runs)} == files
    unmarked = pytest_run("--collect-only", "-q", "-m", "not gpu", *sorted(f"tests/{f}" for f in kernel_files))
    assert not collected(unmarked), collected(unmarked)


def test_a_gpu_run_collects_the_kernel_tests_alone_with_the_gpus_parameters():
    """--device cuda (a stand-in for the CUDA device): other tests are deselected, and the kernel tests take
    their GPU parameters (bf16, the model's shapes)."""
    r = pytest_run("--device", "cuda", "--collect-only", "-q", "tests/test_layout.py", "tests/test_kernels_norm.py",
                   "tests/test_kernels_attention.py", pretend_cuda=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    ids = collected(r)
    assert ids and all(i.startswith(("tests/test_kernels_norm.py", "tests/test_kernels_attention.py")) for i in ids)
    assert re.search(r"(\d+) deselected", r.stdout) and "test_layout" not in r.stdout
    assert "tests/test_kernels_norm.py::test_norm_at_the_models_widths[dtype1]" in ids  # bf16: a GPU's
    assert sum("test_attention_at_the_models_heads" in i for i in ids) == 20  # Clover's heads, 0 to 32K keys


def test_a_gpu_run_in_which_no_kernel_test_ran_fails():
    """The cuda path cannot pass by skipping: a run whose kernel tests were all skipped (interpret_only, with
    the reason) fails, and says why."""
    r = pytest_run("--device", "cuda", "-rs", "tests/test_kernels_norm.py", "-k", "rejects_mismatched_shapes",
                   pretend_cuda=True)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 skipped" in r.stdout and "interpret_only: argument checks before any launch" in r.stdout
    assert "no kernel test ran on cuda" in r.stdout
