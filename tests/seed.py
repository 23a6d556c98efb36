"""The suite's random seed: fresh each run, one for all xdist workers, shown in pytest's header.

Tests draw their inputs from generators seeded with SEED (plus a per-case offset), so each run tries new
inputs; `CLOVER_TEST_SEED=N pytest ...` repeats a run that failed.
"""

import os

# Set in the environment the first time (in the controller, before xdist starts its workers): one seed per run.
SEED = int(os.environ.setdefault("CLOVER_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") % 2**31)))
