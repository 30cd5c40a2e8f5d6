"""Start an OpenAI-compatible server in a subprocess for a test module, and stop it afterwards."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


@contextlib.contextmanager
def running_server(argv: list[str], port: int, log: Path, env: dict, name: str, start_timeout_s: float = 180):
    """Yield the server's base URL once ``/health`` answers; fail the test with the log's tail if the process
    exits or ``start_timeout_s`` passes first. The server is terminated (then killed) on the way out."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
