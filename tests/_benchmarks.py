"""The scripts of benchmarks/ as modules (they are scripts, not a package), for the tests that run them."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # as when a script runs: its folder first, so that it imports its siblings
    sys.path.insert(0, str(BENCHMARKS))


def load_benchmark(name: str):
    """benchmarks/<name>.py as the module `benchmark_<name>`, registered in sys.modules first: a dataclass
    looks its module up while its class is built."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
