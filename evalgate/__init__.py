"""evalgate: does the model still answer as well with the new MoE kernel?

Notebook entry points:
- ``load_run(path)``: a stored run or baseline; ``.samples(task)`` is a pandas DataFrame;
- ``compare(baseline, candidate)``: the two runs paired item by item; ``.summary`` and ``.flips(task)``.
"""

__version__ = "0.1.0"

from evalgate.store import Run, load_run  # noqa: E402
from evalgate.comparison import Comparison, compare  # noqa: E402

__all__ = ["Comparison", "Run", "compare", "load_run", "__version__"]
