"""How a run is carried out, beside what it computes (``RunSpec``): one object, built where a command or a
notebook call starts, held by the gate's plan and handed down to the runner and the model's loader.

No process-wide state: two runs in one process (a notebook, a test) each take their own options.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunOptions:
    """``device_map``: stream an FP4 checkpoint onto these devices (``auto``, ``cpu``, ``cuda:0,cuda:1``;
    None: the loader decides). ``threads``: the in-process model's CPU threads (None: ``evalgate.cores``
    decides). ``datasets``: task -> its ``--dataset`` choice ({"source", "columns"}), which becomes the
    RunSpec's items. ``deterministic``: launch a server in its deterministic (batch-invariant) mode and warn
    when a given server's is off."""

    device_map: str | None = None
    threads: int | None = None
    datasets: dict = field(default_factory=dict)
    deterministic: bool = True

    def __post_init__(self):
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        object.__setattr__(self, "datasets", dict(self.datasets))

    def loader_kwargs(self) -> dict:
        """What the in-process model's loader takes of them (``HFAdapter``, ``load_model``)."""
        return {"device_map": self.device_map, "threads": self.threads}
