"""The public API: every name in fp8train.__all__ resolves, and importing the package stays light."""

import subprocess
import sys

import fp8train


def test_all_names_resolve():
    for name in fp8train.__all__:
        assert getattr(fp8train, name) is not None, name


def test_core_import_does_not_pull_transformers():
    code = "import sys, fp8train; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
