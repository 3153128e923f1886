"""The CPU checks' runner: a check script of tests/ in a subprocess with Triton for the CPU on its path.

Triton is not a dependency of the CPU install; `make test` puts Triton 3.6 (the version on the lent H200) in
.venv/triton-cpu, and the tests that need it skip, saying so, where it is absent. A subprocess because
TRITON_INTERPRET is read when a kernel is defined."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRITON_DIR = ROOT / ".venv" / "triton-cpu"
needs_triton = pytest.mark.skipif(not (TRITON_DIR / "triton").is_dir(),
                                  reason=f"Triton for the CPU checks is not installed in {TRITON_DIR} (make test does it)")


def run_check(script: str, mode: str, interpret: bool) -> dict:
    """`python tests/<script> <mode>` (in Triton's interpreter if `interpret`): its last line, as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRITON_DIR), str(ROOT)])}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script), mode], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
