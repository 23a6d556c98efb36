"""`python -m clover_lite ...` is the `clover` command (where the console script is not on PATH)."""

from clover_lite.cli.launch import main

main()
