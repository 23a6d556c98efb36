"""The readers' fuzz targets run long: each reader of a model directory (config.json, tokenizer.json,
tokenizer_config.json, its chat template, the safetensors header, quantize_config.json) takes many seeds x
cases of mutations, and every one must read or be refused with clover-lite's own error. The suite runs the
same targets briefly (tests/test_fuzz_readers.py); this is the longer run whose counts go into benchmarks/RESULTS.md.

    python benchmarks/fuzz_readers.py                    # 10 seeds x 1,000 cases per target
    python benchmarks/fuzz_readers.py --seeds 2 --cases 200 --targets config tokenizer
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.fuzz_targets

from tests.fuzz_targets import TARGETS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--cases", type=int, default=1000, help="Mutations per seed and target.")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # jinja's DeprecationWarnings for mutated escape sequences
    failures = 0
    print(f"{'target':<18}{'cases':>8}{'read':>8}{'refused':>9}{'failed':>8}{'seconds':>9}")
    for name in args.targets:
        totals = {"read": 0, "refused": 0, "failed": 0}
        t = time.perf_counter()
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            with tempfile.TemporaryDirectory() as d:
                try:
                    counts = TARGETS[name].run(Path(d), seed, args.cases)
                except AssertionError as e:  # the first bad case of this seed; the seed reproduces it
                    print(f"FAIL {e}", file=sys.stderr)
                    totals["failed"] += 1
                    continue
            totals["read"] += counts["read"]
            totals["refused"] += counts["refused"]
        failures += totals["failed"]
        n = totals["read"] + totals["refused"]
        print(f"{name:<18}{n:>8}{totals['read']:>8}{totals['refused']:>9}{totals['failed']:>8}"
              f"{time.perf_counter() - t:>9.1f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
