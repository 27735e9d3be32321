"""The path bench.py runs for `--suite gpu-estimate`: the checks themselves are
tests/simcuda/checks.py (same arguments)."""
import os
import runpy

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "simcuda", "checks.py"),
               run_name="__main__")
