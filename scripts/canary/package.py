"""Turn a training snapshot into the shipped canary: DeepSeek-V4 FP4 checkpoint format plus tokenizer.

    python scripts/canary/package.py SNAPSHOT.pt BUILD_DIR [OUT_DIR]

The routed experts are written as int8 packed E2M1 nibbles with e8m0 scales, as in DeepSeek-V4-Flash, so
the real loading path (transformers' FP8 quantizer, then the stored codes attached) is what runs.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from evalgate.canary import CANARY_DIR


def package(snapshot: Path, build_dir: Path, out_dir: Path = CANARY_DIR) -> Path:
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    from evalgate.kernels.checkpoint import save_fp4_checkpoint
    from config import canary_config
    from train import unpack_state

    tokenizer = AutoTokenizer.from_pretrained(build_dir / "tokenizer")
    model = DeepseekV4ForCausalLM(canary_config(len(tokenizer))).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(unpack_state(torch.load(snapshot, map_location="cpu")), strict=False)
    if missing or unexpected:
        raise SystemExit(f"snapshot does not match the canary architecture: missing {missing[:3]}, unexpected {unexpected[:3]}")
    card = out_dir / "MODEL_CARD.md"
    kept_card = card.read_text(encoding="utf-8") if card.is_file() else None
    if out_dir.exists():
        shutil.rmtree(out_dir)
    save_fp4_checkpoint(model.eval(), out_dir)
    tokenizer.save_pretrained(out_dir)
    if kept_card is not None:
        card.write_text(kept_card, encoding="utf-8")
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot")
    parser.add_argument("build_dir")
    parser.add_argument("out_dir", nargs="?", default=str(CANARY_DIR))
    args = parser.parse_args(argv)
    out = package(Path(args.snapshot), Path(args.build_dir), Path(args.out_dir))
    print(out)


if __name__ == "__main__":
    main()
