"""A bad kernel cannot buy a PASS by rerunning (issue 45): the real CLI, five attempts of one candidate from
fresh working directories — a policy copy with a comment added, a deleted results folder, two launched at
once — each with new data (a server that is not bit-reproducible). Every attempt after the first got a lucky
draw that PASSes at look 0's α/2, so a ledger reset by any of them would have bought a PASS; recorded with
the baseline, they are looks 2-5 and none PASSes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from evalgate.stats.exact_ni import exact_pvalues
from synthetic_runs import write_run
import cli_process

N, MARGIN_PP = 164, 5.0
POLICY = """alpha: 0.05
tasks:
  gsm8k: {{profile: gsm8k-lmeval-v3, metric: "exact_match,strict-match", margin_pp: 1.5}}
  humaneval: {{profile: humaneval-completion-codex, metric: pass@1, margin_pp: {margin}}}
"""
BASE = [i % 10 < 7 for i in range(N)]  # 70% right
RIGHT = [i for i in range(N) if BASE[i]]
WRONG = [i for i in range(N) if not BASE[i]]
UNLUCKY, LUCKY = (5, 2), (3, 1)  # (lost, gained): exact p of "Δ ≤ -M" 0.055 (INCONCLUSIVE), 0.020 (PASS at α/2)


def _candidate(root: Path, name: str, lost: int, gained: int, offset: int) -> Path:
    """One draw of the candidate: ``lost`` of the baseline's right items wrong, ``gained`` wrong ones right,
    other items at each attempt (``offset``) — new data, the same kernel and model."""
    cand = list(BASE)
    for i in RIGHT[offset:offset + lost]:
        cand[i] = False
    for i in WRONG[offset:offset + gained]:
        cand[i] = True
    return write_run(root / name, "w4a4_packed", [], cand, ["failed:assertion"] * N, 1)


def _gate(cwd: Path, candidate: Path, base: Path, policy: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALGATE_")}
    return cli_process.start(["gate", "--candidate", str(candidate), "--baseline",
                             str(base), "--thresholds", str(policy), "--allow-uncalibrated", "--report-dir",
                             str(cwd / "report")], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen, cwd: Path) -> tuple[int, dict]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode in (0, 1, 3), f"{out}\n{err}"
    record = json.loads((cwd / "report" / "gate.json").read_text())
    return proc.returncode, record["sequence"]["looks"][0]


@pytest.mark.slow  # six CLI processes, ~5 s each on 2 cores
def test_resets_buy_no_pass(tmp_path):
    assert exact_pvalues(*UNLUCKY, N, MARGIN_PP / 100)[0] > 0.05  # not even at the full α
    assert 0.0125 < exact_pvalues(*LUCKY, N, MARGIN_PP / 100)[0] <= 0.025  # PASS at look 0 only
    base = write_run(tmp_path / "baseline", "w4a8", [], BASE, ["failed:assertion"] * N, 0)
    policy = tmp_path / "thresholds.yaml"
    policy.write_text(POLICY.format(margin=MARGIN_PP))
    draws = [_candidate(tmp_path, f"draw-{j}", *(UNLUCKY if j == 0 else LUCKY), offset=3 * j) for j in range(5)]

    first = tmp_path / "a"
    results = [_finish(_gate(first, draws[0], base, policy), first)]
    edited = tmp_path / "b" / "thresholds.yaml"  # a copy of the policy with a comment: other bytes
    edited.parent.mkdir()
    edited.write_text("# tried again\n" + policy.read_text())
    results.append(_finish(_gate(tmp_path / "b", draws[1], base, edited), tmp_path / "b"))
    fresh = tmp_path / "c"
    (fresh / "results" / "runs" / ".sequences").mkdir(parents=True)  # where the looks once lived: deleted
    shutil.rmtree(fresh / "results")
    results.append(_finish(_gate(fresh, draws[2], base, policy), fresh))
    both = [(_gate(tmp_path / d, draws[j], base, policy), tmp_path / d) for d, j in (("d", 3), ("e", 4))]
    results += [_finish(proc, cwd) for proc, cwd in both]  # launched at once: two looks, never both look 1

    codes = [code for code, _ in results]
    looks = [entry["look"] for _, entry in results]
    assert codes == [3] * 5, codes  # INCONCLUSIVE every time: no PASS bought
    assert looks[:3] == [0, 1, 2] and sorted(looks[3:]) == [3, 4]
    alphas = [entry["alpha"] for _, entry in results]
    assert sorted(alphas, reverse=True) == pytest.approx([0.05 * 0.5 ** (j + 1) for j in range(5)])
    assert sum(alphas) < 0.05
    # the same data again: the same look and verdict, nothing spent
    code, entry = _finish(_gate(tmp_path / "f", draws[1], base, policy), tmp_path / "f")
    assert (code, entry["look"], entry["repeated"]) == (3, 1, True)
