"""evalgate: does the model still answer as well with the new MoE kernel?

Notebook entry points: ``load_run(path)`` (a stored run; ``.samples(task)`` is a DataFrame).
"""

__version__ = "0.1.0"

from evalgate.store import Run, load_run  # noqa: E402

__all__ = ["Run", "load_run", "__version__"]
