"""evalgate: does the model still answer as well with the new MoE kernel?

Notebook entry points (``evalgate.api``, loaded on first use so that ``import evalgate.<module>`` stays light):
- ``load_run(path)``: a stored run or baseline; ``.samples(task)`` is a pandas DataFrame;
- ``compare(baseline, candidate)``: the two runs paired item by item; ``.summary`` (scores, Δ, CI, b/c, p,
  verdict), ``.flips(task, direction=, failure_class=)``, ``.changed(task)``, ``.show(task, doc_id)`` (side-by-side
  diff, HTML in Jupyter); the comparison itself renders as an HTML summary;
- ``decide(baseline, candidate)``: the gate's Verdict from stored runs;
- ``run_kernel(kernel, out, limit=N)``: a kernel's run on the canary (or ``model=``), as ``evalgate run`` makes it.
"""

from evalgate.quiet import quiet_third_party
from evalgate.version import __version__

quiet_third_party()

__all__ = ["Comparison", "Run", "compare", "decide", "load_run", "run_kernel", "__version__"]


def __getattr__(name: str):
    if name in ("Comparison", "Run", "compare", "decide", "load_run", "run_kernel"):
        from evalgate import api

        return getattr(api, name)
    raise AttributeError(f"module 'evalgate' has no attribute {name!r}")
