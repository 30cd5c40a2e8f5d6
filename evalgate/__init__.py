"""evalgate: does the model still answer as well with the new MoE kernel?

Notebook entry points:
- ``load_run(path)``: a stored run or baseline; ``.samples(task)`` is a pandas DataFrame;
- ``compare(baseline, candidate)``: the two runs paired item by item; ``.summary`` (scores, Δ, CI, b/c, p,
  verdict), ``.flips(task, direction=, failure_class=)``, ``.changed(task)``, ``.show(task, doc_id)`` (side-by-side
  diff, HTML in Jupyter); the comparison itself renders as an HTML summary.
"""

__version__ = "0.1.0"

from evalgate.run.store import Run, load_run  # noqa: E402
from evalgate.gate.compare import Comparison, compare  # noqa: E402

__all__ = ["Comparison", "Run", "compare", "load_run", "__version__"]
