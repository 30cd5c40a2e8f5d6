"""A notebook's `import evalgate.kernels` shows none of torchao's import chatter (evalgate.quiet), while the
same import of torchao alone, without evalgate, does show it (so the check below can fail)."""

import importlib.util
import subprocess
import sys

import pytest

NOISE = ("Failed to load", "register_constant() on Enum subclasses")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                reason="torchao (the test extra) is what prints the chatter")


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          check=True).stderr


def test_importing_the_kernels_in_a_notebook_is_quiet():
    noisy = _stderr("import logging; logging.basicConfig(); import torchao")
    if not any(n in noisy for n in NOISE):
        pytest.skip("this torchao build imports quietly: nothing to filter")
    quiet = _stderr("import logging; logging.basicConfig(); import evalgate.kernels, torchao")
    assert not [line for line in quiet.splitlines() if any(n in line for n in NOISE)]
