"""Moved to scripts/benchmarks/bench_latency.py; this path runs it, with the same arguments, for one release."""

import runpy
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parent / "benchmarks" / "bench_latency.py"

if __name__ == "__main__":
    sys.argv[0] = str(TARGET)
    runpy.run_path(str(TARGET), run_name="__main__")
