"""The out-of-bounds check that every test runs under (tests/triton_bounds.py, enabled in conftest) catches
what it must: a planted load or store one element past a tensor, and nothing in a correct kernel."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from .triton_bounds import OutOfBounds, check_bounds  # noqa: E402


@triton.jit
def _copy(x_ptr, y_ptr, n_load, n_store, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n_load, other=0.0), mask=offs < n_store)


@pytest.mark.parametrize("n", [1, 10, 37])
def test_bounds_check_passes_a_correct_kernel_and_catches_overruns(n):
    x = torch.randn(n)
    y = torch.full((n,), float("nan"))
    with check_bounds():
        _copy[(triton.cdiv(n, 16),)](x, y, n, n, BLOCK=16)
        assert torch.equal(x, y)
        for n_load, n_store, kind in ((n + 1, n, "load"), (n, n + 1, "store")):
            with pytest.raises(Exception, match=f"{kind} of 1 element") as e:
                _copy[(triton.cdiv(n + 1, 16),)](x, y, n_load, n_store, BLOCK=16)
            assert isinstance(e.value.__cause__, OutOfBounds) or isinstance(e.value, OutOfBounds)


def test_bounds_check_holds_a_view_to_its_own_elements():
    """Past a view's last element but inside its storage: no crash on a GPU, still a wrong write."""
    x, y = torch.randn(9), torch.empty(12)[:9]
    with check_bounds():
        _copy[(1,)](x, y, 9, 9, BLOCK=16)
        with pytest.raises(Exception, match="store of 1 element"):
            _copy[(1,)](x, y, 9, 10, BLOCK=16)
