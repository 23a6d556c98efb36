"""The suite's fixtures and its device option (tests/devices.py, docs/ARCHITECTURE.md section 5):

    pytest                        # everything on the CPU, every kernel in Triton's interpreter
    pytest --device cuda          # the kernel tests (marker gpu) compiled on the CUDA device; the rest deselected
    pytest -m gpu                 # the same kernel tests in the interpreter (`--device cuda -m gpu` is `--device cuda`)

A kernel test that only makes sense in the interpreter is marked interpret_only("why") and skipped on cuda
with that reason; one that needs a GPU (CUDA graphs) cuda_only("why"). With --device cuda the summary says
how many kernel tests ran there and the largest relative error each check measured (`report_err`); a run
in which none ran fails.
"""

import pytest
import torch

from . import devices
from .seed import SEED

# One thread per test process: on a 2-core machine (two xdist workers, or anything else running) OpenMP
# threads spin-waiting for a busy core make small ops 10-100x slower.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--device", choices=devices.DEVICES, default="interpret",
                     help="where the kernel tests (marker gpu) run: interpret (default: Triton's interpreter on "
                          "the CPU, with every other test) or cuda (compiled, on the GPU; the rest deselected)")


_RAN = pytest.StashKey[int]()  # kernel tests whose call phase ran
_ERRORS = pytest.StashKey[dict]()  # check -> the largest relative error reported
_config = [None]  # for pytest_runtest_logreport, which is not given it


def pytest_configure(config):
    # Before any test module is imported: TRITON_INTERPRET must be set before a @triton.jit function is defined.
    devices.choose(config.getoption("device"))
    config.stash[_RAN] = 0
    config.stash[_ERRORS] = {}
    _config[0] = config


def pytest_collection_modifyitems(config, items):
    gpu = devices.on_gpu()
    if gpu:  # only the kernel tests run on the GPU
        keep = [item for item in items if item.get_closest_marker("gpu")]
        dropped = [item for item in items if not item.get_closest_marker("gpu")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    for item in items:
        for marker, skip_here in (("interpret_only", gpu), ("cuda_only", not gpu)):
            m = item.get_closest_marker(marker)
            if m and skip_here:
                reason = m.args[0] if m.args else m.kwargs.get("reason", marker)
                item.add_marker(pytest.mark.skip(reason=f"{marker}: {reason}"))


def pytest_runtest_logreport(report):
    """Counted where the reports arrive (the xdist controller too): kernel tests that ran, and their errors."""
    config = _config[0]
    if config is None or report.when != "call" or "gpu" not in report.keywords:
        return
    config.stash[_RAN] += 1
    errors = config.stash[_ERRORS]
    for key, value in report.user_properties:
        if key == "rel_err":
            check, err = value
            errors[check] = max(errors.get(check, 0.0), err)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput") or config.option.collectonly:  # an xdist worker: the controller decides
        return
    if devices.on_gpu() and config.stash.get(_RAN, 0) == 0 and exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a GPU run that ran nothing checked nothing


def pytest_report_header(config):
    return f"random inputs from seed {SEED} (CLOVER_TEST_SEED={SEED} repeats them)"


def pytest_terminal_summary(terminalreporter, config):
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):  # -q hides the header
        terminalreporter.write_line(f"random inputs were from seed {SEED}: CLOVER_TEST_SEED={SEED} repeats them")
    ran, errors = config.stash.get(_RAN, 0), config.stash.get(_ERRORS, {})
    if config.option.collectonly or not (devices.on_gpu() or ran):
        return
    tr = terminalreporter
    if devices.on_gpu() and ran == 0:
        tr.write_sep("=", "no kernel test ran on cuda: nothing was checked on the GPU", red=True)
        return
    tr.write_sep("=", f"{ran} kernel tests ran on {devices.label()}")
    if errors and devices.on_gpu():
        tr.write_line("largest relative error against the reference, per check (tests report_err):")
        for check in sorted(errors):
            tr.write_line(f"  {check:<44} {errors[check]:.1e}")


@pytest.fixture(scope="session")
def device():
    """The device the kernel tests run on: cpu (the interpreter) or cuda (--device cuda)."""
    return devices.device()


@pytest.fixture
def report_err(request):
    """report_err(check, err) -> err: a relative error this test measured, shown per check (the largest) in
    the summary of a GPU run, for benchmarks/RESULTS.md's correctness table."""
    def report(check: str, err: float) -> float:
        request.node.user_properties.append(("rel_err", (check, float(err))))
        return err
    return report


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random clover_moe checkpoint with tokenizer files (block size 4)."""
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=1234)


@pytest.fixture(scope="session")
def tiny2_dir(tmp_path_factory):
    """The tiny checkpoint cut to one GDN and one attention layer, for generations run through every Triton
    kernel in the interpreter, where a block's forward costs seconds per layer."""
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt2") / "tiny2", seed=1234, num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="session")
def tiny128_dir(tmp_path_factory):
    """tiny2 at hidden size 128 (experts of 128, GDN values of 4 x 32): every linear's K a multiple of 128,
    which the kernels' MMA order takes in groups of 128."""
    from clover_lite.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt128") / "tiny128", seed=1234, num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"], hidden_size=128,
                                 moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                 linear_value_head_dim=32)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    import clover_lite

    return clover_lite.load(tiny_dir, device="cpu")


@pytest.fixture(scope="session", autouse=True)
def _interpreter_patches_once():
    """The interpreter without its repeated re-patching of triton.language (tests/interpreter_speed.py)."""
    if devices.on_gpu():  # compiled kernels: no interpreter to patch
        yield
        return
    try:
        from .interpreter_speed import faster_interpreter
    except ImportError:  # no triton: nothing is interpreted
        yield
        return
    with faster_interpreter():
        yield


@pytest.fixture(autouse=True)
def _global_rng_from_seed(request):
    """torch's and Python's global generators start each test from SEED and the test's id: a test drawing
    from them gets fresh inputs each run, the same ones whichever xdist worker runs it after whichever tests
    (before, it saw whatever state the tests before it left), and CLOVER_TEST_SEED repeats them."""
    import random
    import zlib

    seed = (SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    torch.manual_seed(seed)
    random.seed(seed)
    yield


@pytest.fixture(autouse=True)
def _kernels_memcheck():
    """In every test, every interpreted Triton kernel must stay inside the tensors it was given and its
    programs must not race (tests/triton_memcheck.py): both pass unseen in the interpreter and fail on a GPU.
    On cuda the kernels are compiled, and nothing is interpreted to check (compute-sanitizer's job there)."""
    if devices.on_gpu():
        yield
        return
    try:
        from .triton_memcheck import memcheck
    except ImportError:  # no triton: nothing is interpreted
        yield
        return
    with memcheck():
        yield


@pytest.fixture(autouse=True)
def _uninitialized_memory_is_poison(request):
    """In every test, tensors from torch.empty start as NaN or an out-of-range integer (tests/poison_empty.py):
    a read of memory nobody wrote sees fresh zeros on a CPU but a previous tensor's values on a GPU. On cuda
    too: there the NaN stands in for the caching allocator's plausible leftovers."""
    from .poison_empty import poisoned_empty

    if request.node.get_closest_marker("unpoisoned"):
        yield
        return
    with poisoned_empty():
        yield
