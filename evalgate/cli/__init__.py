"""The ``evalgate`` command line: ``main`` is the click group; one module per command beside it."""

from evalgate.cli.main import entry, main

__all__ = ["entry", "main"]
