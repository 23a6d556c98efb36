"""The benchmark scripts run (tiny sizes) and check what they claim, so they never rot."""

import json
import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_cache_benchmark_tokens_identical(tmp_path, monkeypatch):
    out = tmp_path / "cache.json"
    monkeypatch.setattr(sys, "argv", ["cache.py", "--prompt-lengths", "9", "40", "--new-tokens", "6",
                                      "--device", "cpu", "--json", str(out)])
    mod = runpy.run_path(str(BENCH / "cache.py"), run_name="bench")
    assert mod["main"]() == 0
    data = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in data["results"]] == [9, 40]
    assert all(r["identical_tokens"] and r["new_tokens"] == 6 for r in data["results"])
