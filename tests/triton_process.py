"""Running a check under Triton's interpreter on a CPU (on the GPU where there is one), in a fresh process.

Triton reads TRITON_INTERPRET when it is first imported, and a check may change module state (tilings,
installed forwards), so each check runs in a process of its own: a child forked from a server process that
imported torch, transformers' DeepSeek-V4 and Triton once (multiprocessing's forkserver; the server itself
runs nothing), so a check costs its own work, not a fresh interpreter's imports."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import multiprocessing
import os
import sys
import textwrap
import traceback

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed: pip install triton (its interpreter runs on a CPU)")

TESTS = os.path.dirname(os.path.abspath(__file__))
PRELOAD = ["torch", "triton", "transformers.models.deepseek_v4.modeling_deepseek_v4", "evalgate.model_adapters.fast.attention_slots",
           "evalgate.model_adapters.fast.triton_layers"]
TIMEOUT_S = 600
_context: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started with TRITON_INTERPRET=1 on a CPU (read when it imports
    Triton) and the imports above done once."""
    global _context
    if _context is None:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # the server inherits this process's environment
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _check(code: str, environ: dict, conn) -> None:
    """In the forked child: run ``code`` as a script in the caller's environment as it is now, its stdout
    captured; send (ok, stdout, traceback)."""
    os.environ.clear()
    os.environ.update(environ)
    sys.path.insert(0, TESTS)  # the tests' modules, as PYTHONPATH gave a fresh Python
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<check>", "exec"), {"__name__": "__main__"})
        conn.send((True, out.getvalue(), ""))
    except BaseException:
        conn.send((False, out.getvalue(), traceback.format_exc()))


def run(setup: str, body: str) -> str:
    """``setup`` then ``body`` (dedented) in a fresh process that can import the tests' modules: its stdout;
    the test fails with the check's traceback."""
    ctx = _server()
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_check, args=(setup + textwrap.dedent(body), dict(os.environ), send))
    child.start()
    send.close()
    try:
        if not receive.poll(TIMEOUT_S):
            child.kill()
            pytest.fail(f"the check ran past {TIMEOUT_S} s")
        ok, stdout, error = receive.recv()
    except EOFError:
        ok, stdout, error = False, "", f"the check's process ended without a result (exit code {child.exitcode})"
    finally:
        child.join(30)
    assert ok, error[-3000:]
    return stdout
