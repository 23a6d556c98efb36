"""quant/checks.py (mutation round 4): the up-front checks of `clover quantize` through the Python API, at the edges
of each rule (INT4 packing of both dimensions, NF4's block over the whole weight count, damp_percent's closed
upper end, nsamples and group size at their smallest, the calibration window at the context length) and the
NaN/Inf scan in the precision the quantizer computes in."""

import pytest
import torch
from safetensors.torch import save_file

from clover_lite.checkpoint.files import read_header
from clover_lite.errors import CheckpointError
from clover_lite.quant.checks import (
    check_linear_shapes,
    check_nf4_shapes,
    check_options,
    check_seqlen,
    fitting_group_sizes,
    scan_finite,
)
from clover_lite.quant.options import QuantizationError, QuantizeOptions

from .seed import SEED


def test_int4_packing_needs_both_dimensions_divisible_by_8():
    """INT4 packs 8 values per int32 word along both the output and the input features: 12 x 64 is refused
    (12 out features), 64 x 12 too, 64 x 64 passes."""
    opts = QuantizeOptions(group_size=-1)
    for shape in ((12, 64), (64, 12)):
        with pytest.raises(QuantizationError, match="divisible by 8"):
            check_linear_shapes({"layers.0.mlp.up_proj": shape}, opts)
    assert check_linear_shapes({"layers.0.mlp.up_proj": (64, 64)}, opts) == opts


def test_an_open_group_size_is_the_largest_that_divides_every_layer():
    """group_size=None picks the first of 128, 64, 32, 16 that divides every linear's input features: inputs 384
    and 96 give 32 (128 and 64 fail 96); inputs 24 and 8 fit none (-1, per channel). A fixed group size that fails
    a layer is refused, listing the fitting ones."""
    shapes = {"a": (64, 384), "b": (64, 96)}
    assert fitting_group_sizes(shapes) == [32, 16]
    assert check_linear_shapes(shapes, QuantizeOptions(group_size=None)).group_size == 32
    assert check_linear_shapes({"a": (64, 24), "b": (64, 8)}, QuantizeOptions(group_size=None)).group_size == -1
    with pytest.raises(QuantizationError, match="not a multiple of group size 64; pass --group-size 32, 16 or -1"):
        check_linear_shapes(shapes, QuantizeOptions(group_size=64))


def test_nf4_needs_the_weight_count_not_each_row_to_fill_its_blocks():
    """NF4 blocks run over the row-major weight: 2 x 32 = 64 weights fill one block of 64 (rows shorter than a
    block are fine); 3 x 21 = 63 do not."""
    check_nf4_shapes({"w": (2, 32), "v": (64, 96)}, 64)
    with pytest.raises(QuantizationError, match="multiple of its block of 64"):
        check_nf4_shapes({"w": (3, 21)}, 64)


def test_option_values_at_the_edges_of_their_ranges():
    """damp_percent 1 (all of the mean diagonal) is allowed, above it not; nsamples and seqlen must be >= 1;
    group size 0 is refused like other non-positive sizes but -1 (per channel) is allowed."""
    assert check_options(QuantizeOptions(damp_percent=1.0)).damp_percent == 1.0
    for bad in (1.5, 0.0, float("nan")):
        with pytest.raises(QuantizationError, match="--damp-percent"):
            check_options(QuantizeOptions(damp_percent=bad))
    for kw in ({"nsamples": 0}, {"seqlen": 0}):
        with pytest.raises(QuantizationError, match="must be at least 1"):
            check_options(QuantizeOptions(**kw))
    assert check_options(QuantizeOptions(nsamples=1, seqlen=1)).nsamples == 1
    with pytest.raises(QuantizationError, match="--group-size 0"):
        check_options(QuantizeOptions(group_size=0))
    assert check_options(QuantizeOptions(group_size=-1)).group_size == -1


def test_the_calibration_window_may_be_the_whole_context_and_nf4_has_none():
    """seqlen equal to max_position_embeddings is inside the model's range; one more is refused for GPTQ/RTN; NF4
    runs no calibration, so its seqlen is never checked."""
    check_seqlen(QuantizeOptions(seqlen=256), 256)
    with pytest.raises(QuantizationError, match="--seqlen 257 is longer"):
        check_seqlen(QuantizeOptions(seqlen=257), 256)
    with pytest.raises(QuantizationError):
        check_seqlen(QuantizeOptions(method="rtn", seqlen=257), 256)
    check_seqlen(QuantizeOptions(method="nf4", seqlen=10**6), 256)


def test_the_nonfinite_scan_checks_values_as_float32_as_the_quantizer_computes(tmp_path):
    """A float64 source whose values are finite but beyond float32's range (1e300) would be Inf in the quantizer:
    refused up front naming the tensor; finite float64 values within range and integer tensors pass."""
    gen = torch.Generator().manual_seed(SEED)
    ok = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    big = ok.clone()
    big[1, 2] = 1e300
    assert bool(torch.isfinite(big).all()) and not bool(torch.isfinite(big.float()).all())  # the premise
    save_file({"a.weight": ok, "b.weight": big, "c.idx": torch.arange(6, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    infos = read_header(tmp_path / "model.safetensors")
    scan_finite([infos["a.weight"], infos["c.idx"]])
    with pytest.raises(CheckpointError, match=r"b\.weight.*up to 1e\+300.*\[1, 2\].*re-export") as err:
        scan_finite(infos.values())
    # quantize has no dtype switch and no scan switch: the advice names neither (it used to name load's)
    assert "wider dtype" not in str(err.value) and "check_finite" not in str(err.value), err.value
