"""benchmarks/gemm_sass.py: the fast MoE GEMMs compiled for sm_90 on a machine without a GPU, their K loop
counted (a fresh process: Triton's interpreter, which the kernel tests turn on, would change the tilings)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]


def _counted(*args: str) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gemm_sass.py"), *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line.split() for line in proc.stdout.splitlines() if line.startswith(("L1 ", "L2 "))]


@pytest.mark.parametrize("split, limbs", [(1, "1"), (4, "3")])
def test_the_decoding_tiles_k_loop_is_counted_without_a_gpu(split, limbs):
    """Decoding's tiles of 16 rows: unsplit on 1 limb (batch 256), and split K in one launch of the most
    limbs (batch 1): both GEMMs counted, their loop the one that decodes weights, no register spills."""
    rows = _counted("--rows", "16", "--limbs", "1", "--split", str(split))
    assert [r[0] for r in rows] == ["L1", "L2"]
    for _, tile_rows, tile_limbs, half, *_tiling, regs, smem, loop, per_word, spills in (r[:13] for r in rows):
        assert (tile_rows, tile_limbs, half) == ("16", limbs, "0")
        assert int(regs) > 0 and float(smem) > 0 and int(loop) > 0 and float(per_word) > 0
        assert spills == "0"  # a decoding tile's accumulators and decoded weights fit the registers
    for r in rows:
        assert "PRMT" in r[13:]  # the loop counted is the one that decodes the weights (their byte permutes)


def test_a_register_cap_is_compiled_in():
    """--maxnreg (FAST["maxnreg"], a launch's cap) reaches the compiler: 2 limbs on 16 rows take more than 80
    registers a thread uncapped, 80 at most under the cap, and pay for it in spills."""
    free, capped = (_counted("--rows", "16", "--limbs", "2", *cap) for cap in ((), ("--maxnreg", "80")))
    for (name, *_, regs, _smem, _loop, _per_word, spills), (name_c, *_c, regs_c, _smem_c, _loop_c, _pw_c,
                                                             spills_c) in zip((r[:13] for r in free),
                                                                              (r[:13] for r in capped)):
        assert name == name_c
        assert int(regs) > 80 >= int(regs_c)
        assert int(spills_c) > int(spills)
