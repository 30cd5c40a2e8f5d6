"""One gate's sequence of looks, and the α each look spends (docs/gate.md#sequential-rounds).

A gate is identified by what it compares: the baseline (its folders and run ids), the candidate kernel, the
model and the policy file. Every decision of that gate — a round with more samples per item, or the same gate
run again later — is one **look**, decided with the policy at α·2^-(look+1) (``Thresholds.at_look``), so all
looks together spend less than α: rerunning a gate until it PASSes cannot raise the chance that a kernel worse
than the margin PASSes, nor that one within it FAILs. A look that reproduces the candidate data of an earlier
look (the same per-item scores and flags: a bit-reproducible stack run again) is that look, spends nothing new,
and gets that look's verdict.

The ledger is one JSON file per gate identity, ``<ledger dir>/<identity>.json``: a list of looks, each with its
data digest, k, α and verdict. Nothing else reads or writes it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from evalgate.errors import UserError
from evalgate.gate.policy import look_share

MAX_LOOKS = 12  # α·2^-13 is below anything a gate could use; a 13th look is refused


def identity(baseline_dirs, baseline_run_ids, kernel: str, fingerprint: str | None, policy_sha256: str,
             tasks) -> str:
    """The gate's identity: a digest of what it compares and under which policy."""
    key = {"baseline": sorted(str(Path(d).resolve()) for d in baseline_dirs),
           "baseline_runs": sorted(str(r) for r in baseline_run_ids), "kernel": kernel,
           "model": fingerprint, "policy": policy_sha256, "tasks": sorted(tasks)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def data_digest(pairing, tasks=None) -> str:
    """What a look decided on, from the candidate's side of a pairing: per task and item its score, flags
    and sample count. Two looks with the same digest saw the same data."""
    out = {}
    for task in sorted(tasks or pairing.pairs):
        pairs = pairing.pairs[task]
        out[task] = [list(map(str, pairs.doc_ids)), pairs.scores("cand"), [float(x) for x in pairs.invalid("cand")],
                     [float(x) for x in pairs.truncated("cand")], pairs.n_samples("cand")]
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()


@dataclass
class Ledger:
    """The looks one gate has taken (``path``: its JSON file; None: not recorded, e.g. a read-only place)."""

    path: Path | None
    gate: str
    looks: list

    @classmethod
    def open(cls, directory: Path | None, gate: str) -> Ledger:
        if directory is None:
            return cls(None, gate, [])
        path = Path(directory) / f"{gate}.json"
        if not path.is_file():
            return cls(path, gate, [])
        try:
            data = json.loads(path.read_text())
            looks = list(data["looks"])
            if data.get("gate") != gate or not all(isinstance(x.get("look"), int) for x in looks):
                raise ValueError("not this gate's ledger")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path}: the gate's sequence ledger is unreadable ({exc}); it records every look "
                            "this gate took, so it cannot be skipped: restore it, or move it away to start a new "
                            "sequence knowingly") from exc
        return cls(path, gate, looks)

    def look_for(self, digest: str) -> tuple[int, dict | None]:
        """(the look these data are, the earlier look they reproduce or None). Refuses past ``MAX_LOOKS``."""
        for entry in self.looks:
            if entry.get("digest") == digest:
                return entry["look"], entry
        look = len({entry["look"] for entry in self.looks})
        if look >= MAX_LOOKS:
            raise UserError(f"this gate (same baseline, kernel, model and policy) has taken {look} looks, every one "
                            f"at a share of α; a further look is refused ({self.path}). Record a new baseline or "
                            "change the policy in a reviewed commit to start a new sequence")
        return look, None

    @property
    def next_look(self) -> int:
        return len({entry["look"] for entry in self.looks})

    def record(self, look: int, digest: str, k: int, alpha: float, verdict: str, tasks: dict) -> None:
        if any(entry.get("digest") == digest for entry in self.looks):
            return
        self.looks.append({"look": look, "digest": digest, "k": k, "alpha": alpha, "share": look_share(look),
                           "verdict": verdict, "tasks": tasks,
                           "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gate": self.gate, "looks": self.looks}, indent=1))
        tmp.replace(self.path)
