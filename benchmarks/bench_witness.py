"""The execution witness's cost, and what it sees: for each kernel, the same decoding (the witness's prompts,
prefill and one step) timed plain and under the witness, in this run, and the kernels the witness recorded.

    python benchmarks/bench_witness.py --device cuda --kernels deepgemm/fp8_block128,torch/fp8_rowwise,w4a4_packed
    python benchmarks/bench_witness.py --device cuda --fullwidth-layers 1 --out /tmp/dsv4-1 --kernels w4a4_packed

The canary by default; ``--fullwidth-layers N`` writes N layers of a random full-width DeepSeek-V4-Flash FP4
checkpoint (benchmarks/dsv4_flash_fullwidth.py's configuration) and streams it onto the device instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _decode_s(model, tokenizer, prompts, device, repeat: int) -> float:
    from evalgate.kernels import witness
    from evalgate.model_adapters.hf.generation import decode

    times = []
    for _ in range(repeat):
        if str(device).startswith("cuda"):
            import torch
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        decode(model, tokenizer, prompts, [()] * len(prompts), [witness.NEW_TOKENS] * len(prompts), device=device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernels", default="w4a4_packed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fullwidth-layers", type=int, default=0)
    p.add_argument("--out", default="/tmp/evalgate-witness-model")
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args(argv)

    import evalgate.kernels.catalogs  # noqa: F401
    from evalgate.kernels import get_kernel, witness
    from evalgate.model_adapters.hf.adapter import greedy_decoder, load_model

    prompts = ["Question: Natalia sold clips to 48 of her friends in April, and then half as many in May. How many "
               "clips did she sell altogether?\nAnswer:", "Question: Weng earns $12 an hour for babysitting. "
               "Yesterday she did 50 minutes. How much did she earn?\nAnswer:"][:witness.PROMPTS]
    if args.fullwidth_layers:
        sys.path.insert(0, str(HERE))
        from dsv4_flash_fullwidth import flash_config, tokenizer_for

        from random_fp4 import write_random_fp4_checkpoint

        path = Path(args.out)
        if not (path / "config.json").is_file():
            write_random_fp4_checkpoint(path, flash_config(layers=args.fullwidth_layers), tokenizer_for(path),
                                        log=lambda s: None)
        load = dict(numerics="native", device_map=args.device if args.device.startswith("cuda") else "cpu")
    else:
        from evalgate.canary import CANARY_DIR as path
        load = dict(device=args.device)
    figures = {"device": args.device, "model": str(path), "kernels": {}}
    try:
        import torch
        figures["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        figures["gpu"] = None
    for name in [k.strip() for k in args.kernels.split(",") if k.strip()]:
        kernel = get_kernel(name)
        t0 = time.perf_counter()
        model, tokenizer = load_model(path, name, **load)
        device = getattr(getattr(model, "_evalgate_placement", None), "devices", [args.device])[0]
        load_s = time.perf_counter() - t0
        _decode_s(model, tokenizer, prompts, device, 1)  # warm-up: compiles, converts weights
        plain = _decode_s(model, tokenizer, prompts, device, args.repeat)
        seen = [witness.watch(model, kernel, prompts, device, greedy_decoder(model, tokenizer, device))
                for _ in range(args.repeat)]
        cost = statistics.median(w.seconds for w in seen)
        w = seen[-1]
        figures["kernels"][name] = {"load_s": round(load_s, 2), "decode_s": round(plain, 3),
                                    "witness_s": round(cost, 3), "extra_s": round(cost - plain, 3),
                                    "witness": w.to_dict()}
        print(f"{name}: decode {plain:.3f} s, under the witness {cost:.3f} s (+{cost - plain:.3f} s); "
              f"{w.summary()}")
        for kname, count in list(w.ran.items())[:12]:
            print(f"    {count:5d}  {kname[:150]}")
        del model
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
