"""Instructions of the fast MoE GEMMs' K loop, compiled for a Hopper GPU on any machine (no GPU needed).

    python benchmarks/gemm_sass.py                                # L1 and L2 at decoding's and prefill's tiles
    python benchmarks/gemm_sass.py --rows 16 --limbs 1 --dump /tmp/sass   # also write each SASS listing
    python benchmarks/gemm_sass.py --rows 16 --split 4                    # decoding's split-K launch (batch 1)

Compiles `fast._l1_kernel` and `fast._l2_kernel` with the tiling a launch of that many rows a tile would take
(`fast.FAST`, `_tiling`, `_stages`) through Triton and its bundled ptxas for sm_90, with the pointers' 16-byte
alignment a real launch specializes on, and counts the SASS of the main K loop (the first backward branch):
instructions per K step and per 32-bit word of packed weights a thread decodes, the busiest opcodes, and
register spills (local loads and stores), with the registers and the shared memory a program takes. Prints
numbers; not a test. A change to the weight decoder or the dot shows here before it is timed on a GPU
(bench_kernels.py).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from evalgate.kernels.triton import fast

HIDDEN, INTERMEDIATE = 4096, 2048  # DeepSeek-V4-Flash: L1 [2 x 2048, K 4096], L2 [4096, K 2048]

# the kernels' tensor and scalar arguments (constexprs are set apart): a parameter missing here is an error
ARG_TYPES = {
    "A": "*i8", "A_ROW": "*i32", "LSTRIDE": "i32", "P": "*i32", "NEED": "*i8", "RW": "*fp32", "W": "*u8",
    "SW": "*u8", "WLO": "*i32", "LUT": "*i8", "SILU": "*fp32", "TILE_EXPERT": "*i32", "TILE_BEGIN": "*i32",
    "TILE_END": "*i32", "Q": "*i8", "QSTRIDE": "i32", "QB": "*u8", "HI": "*i32", "LO": "*i32", "ACC": "*i32",
    "ACC_STRIDE": "i32", "SLOT": "*i32", "OUT": "*i16",
}

_INSTRUCTION = re.compile(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def constants(l1: bool, rows: int, limbs: int, half: int, split: int = 1) -> tuple[dict, int, int]:
    """(constexprs, warps, stages) of a launch with tiles of `rows` rows on `limbs` limbs, K over `split`
    programs (split: one launch of the most limbs, each tile running its own, as `fast._launch_limbs`)."""
    n, k = (INTERMEDIATE, HIDDEN) if l1 else (HIDDEN, INTERMEDIATE)
    bn, bk, warps, stages = fast._tiling(n, k, l1, rows)
    stages, bk = fast._stages(fast.FAST["stages"], limbs, rows, 2 * bn if l1 else bn, bk)
    shared = dict(K=k, BM=rows, BN=bn, BK=bk, LIMBS=limbs, SCALE_FAULT=False, ASM=True, SPLIT=split, DYN=split > 1)
    if l1:
        return dict(shared, I=n, HAS_LIMIT=True, LIMIT=10.0, SILU_LIMIT=fast.silu_of(10.0), E4M3=False, DIV=False,
                    F=6.0, INV_F=1 / 6.0, CLAMP_LO=0, CLAMP_HI=255, FLOOR=0.0), warps, stages
    return dict(shared, N=n, GATHER=True, HALF=half), warps, stages


def compile_sm90(kernel, const: dict, warps: int, stages: int):
    names = kernel.arg_names
    unknown = [a for a in names if a not in const and a not in ARG_TYPES]
    if unknown:
        raise SystemExit(f"gemm_sass: {kernel.__name__} takes arguments this script does not type: {unknown}")
    signature = {a: "constexpr" if a in const else ARG_TYPES[a] for a in names}
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a not in const}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={(names.index(a),): v for a, v in const.items()})
    options = dict(num_warps=warps, num_stages=stages, **fast._regs(const["BM"]))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def loop_counts(sass: str) -> tuple[collections.Counter, int]:
    """Opcodes of the first loop (a label up to the first branch back to it) and the listing's spills."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    body: list[str] = []
    for i, line in enumerate(lines):
        if re.match(r"^\.?L\w*:$", line.strip()):
            labels[line.strip()[:-1]] = i
        back = re.search(r"BRA (\.?L\w+);", line)
        if back and back.group(1) in labels:
            body = lines[labels[back.group(1)] + 1:i + 1]
            break
    ops = collections.Counter(m.group(1) for m in map(_INSTRUCTION.match, body) if m)
    spills = sum(1 for line in lines if re.search(r"\t(?:@!?U?P\w+\s+)?(STL|LDL)\b", line))
    return ops, spills


def registers(sass: str) -> int:
    """Registers a thread uses: one past the highest numbered in the listing (RZ aside)."""
    return 1 + max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,128", help="rows a tile (16: decoding, 128: a prompt-cache call)")
    p.add_argument("--limbs", default="1,2", help="activation limbs the tile's rows need")
    p.add_argument("--split", type=int, default=1, help="K over this many programs (decoding's small grids: 4), "
                   "one launch of the most limbs")
    p.add_argument("--maxnreg", type=int, default=None, help="compile under this register cap (FAST['maxnreg'])")
    p.add_argument("--dump", default=None, help="a folder: write each kernel's SASS there")
    args = p.parse_args(argv)
    if args.maxnreg is not None:
        fast.FAST["maxnreg"] = args.maxnreg
    print(f"Triton {triton.__version__}, sm_90, FAST {fast.FAST}")
    print(f"{'kernel':6s} {'rows':>4s} {'limbs':>5s} {'half':>4s} {'BN':>4s} {'BK':>4s} {'st':>3s} {'warps':>5s} "
          f"{'regs':>4s} {'smemKB':>6s} {'loop':>5s} {'/word':>6s} {'spills':>6s}  busiest opcodes")
    for rows in (int(v) for v in args.rows.split(",")):
        counts = [fast.limb_counts("e2m1")[-1]] if args.split > 1 else [int(v) for v in args.limbs.split(",")]
        for limbs in counts:
            halves = [1, 2] if fast.halves("e2m1", rows) and limbs > 1 and args.split == 1 else [0]
            for name, l1, half in [("L1", True, 0)] + [("L2", False, h) for h in halves]:
                const, warps, stages = constants(l1, rows, limbs, half, args.split)
                compiled = compile_sm90(fast._l1_kernel if l1 else fast._l2_kernel, const, warps, stages)
                sass = compiled.asm["sass"]
                ops, spills = loop_counts(sass)
                loop = sum(ops.values())
                cols = 2 * const["BN"] if l1 else const["BN"]
                words = cols * const["BK"] // 8 // (32 * warps)  # packed 32-bit words a thread decodes a K step
                busiest = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
                smem_kb = compiled.metadata.shared / 1024
                print(f"{name:6s} {rows:4d} {limbs:5d} {half:4d} {const['BN']:4d} {const['BK']:4d} {stages:3d} "
                      f"{warps:5d} {registers(sass):4d} {smem_kb:6.1f} {loop:5d} {loop / words:6.1f} {spills:6d}  "
                      f"{busiest}", flush=True)
                if args.dump:
                    out = Path(args.dump)
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"{name}_rows{rows}_limbs{limbs}_half{half}.sass").write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
