import os

# Must be set before any @triton.jit function is defined (docs/ARCHITECTURE.md section 5).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread per test process: on a 2-core machine (two xdist workers, or anything else running) OpenMP
# threads spin-waiting for a busy core make small ops 10-100x slower.
torch.set_num_threads(1)


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
    try:
        from .interpreter_speed import faster_interpreter
    except ImportError:  # no triton: nothing is interpreted
        yield
        return
    with faster_interpreter():
        yield


@pytest.fixture(autouse=True)
def _kernels_memcheck():
    """In every test, every interpreted Triton kernel must stay inside the tensors it was given and its
    programs must not race (tests/triton_memcheck.py): both pass unseen in the interpreter and fail on a GPU."""
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
    a read of memory nobody wrote sees fresh zeros on a CPU but a previous tensor's values on a GPU."""
    from .poison_empty import poisoned_empty

    if request.node.get_closest_marker("unpoisoned"):
        yield
        return
    with poisoned_empty():
        yield
