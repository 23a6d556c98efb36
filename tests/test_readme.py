"""The README opens with exactly two set-up commands, and CI runs the second one verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands():
    text = (ROOT / "README.md").read_text()
    head = text.split("---", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", head, re.S)


def test_two_setup_commands_and_ci_runs_the_second():
    cmds = _setup_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "clover run" in cmds[0] and "pytest" in cmds[1]
    assert "-c constraints.txt" in cmds[0] and "-c constraints.txt" in cmds[1]
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert cmds[1] in ci_lines


def test_constraints_pin_torch():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in lines
