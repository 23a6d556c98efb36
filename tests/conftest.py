import os

# Must be set before any @triton.jit function is defined (shared DESIGN.md section 5).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread per test process: on a 2-core machine (two xdist workers, or anything else running) OpenMP
# threads spin-waiting for a busy core make small ops 10-100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random clover_moe checkpoint with tokenizer files (block size 4)."""
    from clover_lite.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=1234)


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir):
    import clover_lite

    return clover_lite.load(tiny_dir, device="cpu")


@pytest.fixture(autouse=True)
def _kernels_stay_in_bounds():
    """In every test, every interpreted Triton kernel's loads and stores must stay inside the tensors it was
    given: an out-of-bounds access, harmless in the interpreter, is a crash or garbage on a GPU."""
    try:
        from .triton_bounds import check_bounds
    except ImportError:  # no triton: nothing is interpreted
        yield
        return
    with check_bounds():
        yield
