"""runtime/nonfinite.py on small hand-built modules (mutation round 4): the module named is the one that made the
NaN/Inf (its inputs, positional or keyword, finite), found inside nested and dataclass outputs; a non-finite value
made by a parent's own arithmetic names the parent, not the child it feeds; the hooks are gone afterwards; the
tied output projection and the dtype advice of the error."""

import dataclasses

import pytest
import torch
from torch import nn

from clover_lite.runtime.nonfinite import find_nonfinite_module, nonfinite_error

from .seed import SEED


def x_in():
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(SEED))


class KwLinear(nn.Linear):
    """A linear called with its input as a keyword argument."""

    def forward(self, *, x):
        return super().forward(x)


class Block(nn.Module):
    """first -> (the block's own arithmetic, Inf where `blow_up`) -> second, called positionally or by keyword."""

    def __init__(self, blow_up: bool, keyword: bool):
        super().__init__()
        self.first, self.blow_up, self.keyword = nn.Linear(4, 4), blow_up, keyword
        self.second = KwLinear(4, 4) if keyword else nn.Linear(4, 4)

    def forward(self, h):
        h = self.first(h)
        if self.blow_up:
            h = h / torch.zeros_like(h)  # no module's forward: the block made these Inf/NaN
        return self.second(x=h) if self.keyword else self.second(h)


class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.block = Block(**kw)
        self.head = nn.Linear(4, 3)

    def forward(self, h):
        return self.head(self.block(h))


@pytest.mark.parametrize("keyword", [False, True])
def test_a_value_made_by_a_parents_own_arithmetic_names_the_parent(keyword):
    """Block divides by zero between its children: 'block.second' (whose input, positional or keyword, is already
    non-finite) merely passes it on, so the module named is 'block'."""
    torch.manual_seed(SEED)
    model = Net(blow_up=True, keyword=keyword)
    name, result = find_nonfinite_module(model, lambda: model(x_in()))
    assert name == "block" and result is None


@dataclasses.dataclass
class Out:
    value: torch.Tensor
    note: str = ""


class MakesNested(nn.Module):
    """Returns (finite, [NaN]) or a dataclass holding the NaN: the NaN arises here."""

    def __init__(self, as_dataclass: bool):
        super().__init__()
        self.as_dataclass = as_dataclass

    def forward(self, h):
        bad = h * torch.tensor([float("nan")] + [1.0] * (h.shape[-1] - 1))
        return Out(bad, "x") if self.as_dataclass else (h, [bad])


class NestedNet(nn.Module):
    def __init__(self, as_dataclass: bool):
        super().__init__()
        self.make, self.use, self.as_dataclass = MakesNested(as_dataclass), nn.Linear(4, 4), as_dataclass

    def forward(self, h):
        out = self.make(h)
        return self.use(out.value if self.as_dataclass else out[1][0])


@pytest.mark.parametrize("as_dataclass", [False, True])
def test_nan_inside_a_nested_or_dataclass_output_names_the_module_that_returned_it(as_dataclass):
    """The NaN sits in a list inside a tuple, or in a dataclass field, of 'make''s output: 'make' is named, not
    'use' that reads it next."""
    torch.manual_seed(SEED)
    model = NestedNet(as_dataclass)
    name, _ = find_nonfinite_module(model, lambda: model(x_in()))
    assert name == "make"


def test_the_hooks_are_removed_after_the_diagnosis():
    """After a diagnosis that found the module, the model runs as before: its output (NaN included) is returned,
    not cut short by a hook left behind, and a finite model's run returns its result with no module named."""
    torch.manual_seed(SEED)
    model = Net(blow_up=True, keyword=False)
    x = x_in()
    assert find_nonfinite_module(model, lambda: model(x))[0] == "block"
    out = model(x)
    assert out.shape == (2, 3) and not bool(torch.isfinite(out).all())
    clean = Net(blow_up=False, keyword=False)
    name, result = find_nonfinite_module(clean, lambda: clean(x))
    assert name is None and torch.equal(result, clean(x))


class TiedLM(nn.Module):
    """An embedding and layers whose logits are the tied embedding's matrix product (no lm_head module)."""

    def __init__(self, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(6, 4).to(dtype)
        self.norm = nn.LayerNorm(4).to(dtype)
        self.lm_head = None

    def forward(self, ids):
        h = self.norm(self.embed_tokens(ids))
        return h @ self.embed_tokens.weight.T


class Runner:
    def __init__(self, model):
        self.model = model

    def step(self, block, positions):
        return self.model(torch.tensor(block))


@pytest.mark.parametrize("dtype, advice", [(torch.bfloat16, "load with dtype float32"),
                                           (torch.float16, "load with dtype bfloat16 or float32"),
                                           (torch.float32, None)])
def test_a_tied_output_projection_is_named_with_the_advice_for_its_dtype(dtype, advice):
    """An Inf in an embedding row no step token looks up shows only in the tied logits (no module's output): the
    error names 'embed_tokens (the tied lm_head)', and advises the next wider dtype (bfloat16 -> float32,
    float16 -> bfloat16 or float32; none past float32)."""
    torch.manual_seed(SEED)
    model = TiedLM(dtype)
    with torch.no_grad():
        model.embed_tokens.weight[5, 1] = float("inf")
    err = nonfinite_error(Runner(model), [], [0, 1, 2], [0, 1, 2], block_start=4)
    assert err.module == "embed_tokens"
    msg = str(err)
    assert "'embed_tokens (the tied lm_head)'" in msg and "position 4" in msg
    if advice:
        assert advice in msg and f"overflow {dtype}" in msg
    else:
        assert "load with dtype" not in msg
