"""The memory check that every test runs under (tests/triton_memcheck.py, enabled in conftest) catches what
it must: a planted load or store one element past a tensor or a view, programs storing to one address or
reading what another stores, a program reading back its own store with no barrier, and nothing in correct
kernels, including a last-arriver reduction that an atomic counter orders (the split-K GEMM's)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from .triton_memcheck import OutOfBounds, Race, memcheck  # noqa: E402

# The memory check wraps Triton's interpreter; on a GPU that is compute-sanitizer's job. The poison of
# uninitialized memory holds on every device: its test runs on the GPU too (--device cuda).
pytestmark = pytest.mark.gpu
INTERPRETER = "the memory check wraps Triton's interpreter (on a GPU: compute-sanitizer)"


@triton.jit
def _copy(x_ptr, y_ptr, n_load, n_store, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n_load, other=0.0), mask=offs < n_store)


@triton.jit
def _shifted_copy(x_ptr, y_ptr, n, shift, BLOCK: tl.constexpr):
    """y[i + shift] = x[i] + y[i]: in place (x is y) each program reads elements another one writes."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs + shift < n
    tl.store(y_ptr + offs + shift, tl.load(x_ptr + offs, mask=ok) + tl.load(y_ptr + offs, mask=ok), mask=ok)


@triton.jit
def _partial_sums(x_ptr, out_ptr, BLOCK: tl.constexpr, SHARED: tl.constexpr):
    """Each program's block sum into out[program], or (SHARED) all into out[0]: a race without atomics."""
    pid = tl.program_id(0)
    total = tl.sum(tl.load(x_ptr + pid * BLOCK + tl.arange(0, BLOCK)), axis=0)
    tl.store(out_ptr + (0 if SHARED else pid), total)


@triton.jit
def _last_program_sums(x_ptr, part_ptr, out_ptr, count_ptr, BLOCK: tl.constexpr, SEM: tl.constexpr,
                       LOAD_FIRST: tl.constexpr, BARRIER: tl.constexpr = True):
    """Each program stores its block's sum at part[program]; the one that counts itself last on the counter
    (acquiring it with SEM) adds the 4 partials into out[0], its own among them, and resets the counter.
    BARRIER: barriers before the count and after it, as the split-K sum has (one thread counts). LOAD_FIRST:
    it also reads part[0] before counting, which nothing orders after program 0's store."""
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, tl.sum(tl.load(x_ptr + pid * BLOCK + tl.arange(0, BLOCK)), axis=0))
    if BARRIER:
        tl.debug_barrier()
    early = 0.0
    if LOAD_FIRST:
        early = tl.load(part_ptr)
    done = tl.atomic_add(count_ptr, 1, sem=SEM)
    if BARRIER:
        tl.debug_barrier()
    if done == tl.num_programs(0) - 1:
        tl.store(out_ptr, tl.sum(tl.load(part_ptr + tl.arange(0, 4)), axis=0) + early * 0.0)
        tl.atomic_xchg(count_ptr, 0)


def _cause(e: pytest.ExceptionInfo):
    return e.value if isinstance(e.value, AssertionError) else e.value.__cause__


@pytest.mark.interpret_only(INTERPRETER)
@pytest.mark.parametrize("n", [1, 10, 37])
def test_memcheck_passes_a_correct_kernel_and_catches_overruns(n):
    x = torch.randn(n)
    y = torch.full((n,), float("nan"))
    with memcheck():
        _copy[(triton.cdiv(n, 16),)](x, y, n, n, BLOCK=16)
        assert torch.equal(x, y)
        for n_load, n_store, kind in ((n + 1, n, "load"), (n, n + 1, "store")):
            with pytest.raises(Exception, match=f"{kind} of 1 element") as e:
                _copy[(triton.cdiv(n + 1, 16),)](x, y, n_load, n_store, BLOCK=16)
            assert isinstance(_cause(e), OutOfBounds)


@pytest.mark.interpret_only(INTERPRETER)
def test_memcheck_holds_a_view_to_its_own_elements():
    """Past a view's last element but inside its storage: no crash on a GPU, still a wrong write."""
    x, y = torch.randn(9), torch.empty(12)[:9]
    with memcheck():
        _copy[(1,)](x, y, 9, 9, BLOCK=16)
        with pytest.raises(Exception, match="store of 1 element"):
            _copy[(1,)](x, y, 9, 10, BLOCK=16)


@pytest.mark.interpret_only(INTERPRETER)
def test_memcheck_catches_programs_that_race():
    x = torch.randn(40)
    with memcheck():
        y = torch.zeros(40)
        _shifted_copy[(3,)](x, y, 40, 0, BLOCK=16)  # each program its own elements: no race
        assert torch.equal(y, x)
        _shifted_copy[(3,)](y, y, 40, 0, BLOCK=16)  # in place, still each program its own elements
        assert torch.equal(y, 2 * x)
        with pytest.raises(Exception, match="loads .* which program .* stores in the same launch") as e:
            _shifted_copy[(3,)](y, y, 40, 3, BLOCK=16)  # program 1 reads y[16:19], which program 0 writes
        assert isinstance(_cause(e), Race)
        sums = torch.zeros(2)
        _partial_sums[(2,)](x, sums, BLOCK=16, SHARED=False)
        torch.testing.assert_close(sums, x[:32].view(2, 16).sum(1))
        with pytest.raises(Exception, match=r"programs \(0, 0, 0\) and \(1, 0, 0\) both store to") as e:
            _partial_sums[(2,)](x, sums, BLOCK=16, SHARED=True)
        assert isinstance(_cause(e), Race)


@pytest.mark.interpret_only(INTERPRETER)
def test_memcheck_accepts_reads_an_atomic_orders_and_catches_the_rest():
    """A program may read what another stored when the writer released an atomic after its store that the
    reader acquired before its load (the split-K GEMM's last split): not with relaxed atomics, nor for a load
    made before the acquire."""
    x = torch.randn(64)
    part, out, count = torch.zeros(4), torch.zeros(1), torch.zeros(1, dtype=torch.int32)
    with memcheck():
        _last_program_sums[(4,)](x, part, out, count, BLOCK=16, SEM="acq_rel", LOAD_FIRST=False)
        torch.testing.assert_close(out[0], x.sum())
        assert int(count) == 0
        for sem, load_first in (("relaxed", False), ("acq_rel", True)):
            with pytest.raises(Exception, match="loads .* which program .* stores in the same launch") as e:
                _last_program_sums[(4,)](x, part, out, count, BLOCK=16, SEM=sem, LOAD_FIRST=load_first)
            assert isinstance(_cause(e), Race)
            count.zero_()
        # Without the barrier the last program reads its own partial unordered: the thread that stored it
        # need not be the one that loads it.
        with pytest.raises(Exception, match="loads an address it stored, with no tl.debug_barrier") as e:
            _last_program_sums[(4,)](x, part, out, count, BLOCK=16, SEM="acq_rel", LOAD_FIRST=False, BARRIER=False)
        assert isinstance(_cause(e), Race)


def test_uninitialized_memory_is_poison_in_every_test(device):
    """conftest poisons torch.empty and its kin (tests/poison_empty.py): a kernel that leaves part of its
    output unwritten, or reads an element nobody wrote, gives NaN on the CPU as it gives garbage on a GPU,
    where a fresh zero page would have hidden it (on a GPU: NaN, not the caching allocator's leftovers).
    Meta tensors and `with torch.device` still work."""
    n = 37
    x = torch.randn(n).to(device)
    for y in (torch.empty(n, device=device), torch.empty_like(x), x.new_empty(n),
              torch.empty_strided((n,), (1,), device=device)):
        _copy[(1,)](x, y, n, n - 5, BLOCK=64)  # the last 5 elements are never stored
        assert torch.equal(y[:n - 5], x[:n - 5]) and y[n - 5:].isnan().all()
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        assert (torch.empty(4, dtype=dtype, device=device) > 32).all()  # as an index: past any small tensor's end
    with torch.device("meta"):
        assert torch.empty(1 << 40).device.type == "meta"  # no fill of a would-be 4 TB tensor
