"""Running a check under Triton's interpreter on a CPU (on the GPU where there is one), in a fresh process.

Triton reads TRITON_INTERPRET when it is first imported, and a test session may have imported it already
(transformers can), so each check runs in a process of its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed: pip install triton (its interpreter runs on a CPU)")


def run(setup: str, body: str) -> str:
    """``setup`` then ``body`` (dedented) in a fresh Python that can import the tests' modules: its stdout;
    the test fails with its stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", setup + textwrap.dedent(body)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
