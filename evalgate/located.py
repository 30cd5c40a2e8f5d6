"""Where a run folder named in a gate's ``gate.json`` is now, wherever that file is read from.

``gate.json`` names the runs it decided on as the gate saw them, often relative to the directory the gate ran
in (``results/runs/gate-…``). Read from another directory, or from a copy of the run (a CI artifact: the run
folder with its ``gate/`` inside), that path names nothing; so a recorded path is resolved at read, in order:

1. as written, when it is absolute and exists;
2. the run folder that holds the gate folder (``<run>/gate/gate.json``), when it is the run recorded (same run
   id, or the same folder name);
3. against each folder above the gate folder (the directory the gate ran in is one of them while the run is
   where it was made).

A path found nowhere is kept as written, so an error still names what the gate recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"


def recorded_run(stored: str, gate_dir: Path, run_id: str | None = None,
                 read_run_id: Callable[[Path], str | None] | None = None) -> str:
    """``stored`` (a run or baseline folder as ``gate.json`` names it) as a path that exists from here.
    ``read_run_id(folder)``: the run id of the run in ``folder`` (None: not a run), which the store knows how
    to read; with ``run_id`` it tells the recorded run from another in the folder that holds the gate's."""
    path = Path(stored)
    if path.is_absolute() and (path / MANIFEST).is_file():
        return stored
    gate_dir = Path(gate_dir).absolute()
    holder = gate_dir.parent
    if (holder / MANIFEST).is_file() and (
            (run_id is not None and read_run_id is not None and read_run_id(holder) == run_id) or holder.name == path.name):
        return str(holder)
    if not path.is_absolute():
        for above in [gate_dir, *gate_dir.parents]:
            if (above / path / MANIFEST).is_file():
                return str(above / path)
    if (path / MANIFEST).is_file():  # relative to the current directory
        return str(path.absolute())
    return stored
