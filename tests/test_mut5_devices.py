"""Mutation round 5: the devices a plan is made for, against hand-worked byte counts and the figures the cards'
drivers report."""

import io

import pytest
import torch

from clover_lite.planning import devices
from clover_lite.planning.devices import KNOWN_GPUS, GiB, MiB, fmt_bytes, normalize_gpu_name, resolve_target


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (MiB - 1, "1024.0 KiB"),
    (MiB, "1.0 MiB"), (168 * MiB, "168.0 MiB"), (GiB, "1.00 GiB"), (int(21.34 * GiB), "21.34 GiB"),
    (-2 * MiB, "-2.0 MiB"),
])
def test_fmt_bytes_hand_worked(n, text):
    """Binary units from exactly 1 KiB / 1 MiB / 1 GiB up (a unit's own size is 1.0 of it, not 1024 of the
    one below); GiB with two decimals, MiB and KiB with one, plain bytes below 1 KiB."""
    assert fmt_bytes(n) == text


def test_h200_capacity_is_what_the_driver_reports():
    """The H200 is counted as nvidia-smi's 143771 MiB total, less the 1 GiB reserve when usable."""
    h200 = KNOWN_GPUS["h200"]
    assert h200.capacity == 143771 * MiB and h200.usable == 143771 * MiB - GiB


def test_device_names_with_a_suffix_map_to_their_card():
    """torch.cuda.get_device_name() of a variant ('NVIDIA H200 NVL') names the known card it starts with."""
    assert normalize_gpu_name("NVIDIA H200 NVL") == "h200"
    assert normalize_gpu_name("NVIDIA GB300 Superchip") == "gb300"
    assert normalize_gpu_name("NVIDIA A100") is None


def test_cpu_target_reads_available_ram(monkeypatch):
    """A 'cpu' plan is made against MemAvailable from /proc/meminfo, which is given in KiB."""
    meminfo = "MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n"
    monkeypatch.setattr(devices, "open", lambda *a, **k: io.StringIO(meminfo), raising=False)
    assert devices.available_ram() == 12345678 * 1024
    t = resolve_target("cpu")
    assert (t.name, t.capacity, t.gpu) == ("cpu (available RAM)", 12345678 * 1024, False)


def test_device_names_are_read_in_any_case():
    """'CPU' and 'CUDA:0' are the cpu and cuda targets, as the GPU-name check already treated them (before, they
    reached torch.device as written and came back as torch's RuntimeError)."""
    from clover_lite.errors import CloverError

    assert resolve_target("CPU") == resolve_target("cpu")
    if torch.cuda.is_available():
        assert resolve_target("CUDA:0").name == resolve_target("cuda:0").name
    else:
        with pytest.raises(CloverError) as lower:
            resolve_target("cuda:0")
        with pytest.raises(CloverError) as upper:
            resolve_target("CUDA:0")
        assert str(upper.value).replace("CUDA:0", "cuda:0") == str(lower.value)  # the message quotes it as given
