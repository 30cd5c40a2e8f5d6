"""The ``evalgate`` command line: ``main`` is the click group; one module per command beside it."""

from evalgate.cli.main import main

__all__ = ["main"]
