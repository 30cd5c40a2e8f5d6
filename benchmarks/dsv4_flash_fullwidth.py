"""A full-width DeepSeek-V4-Flash, random weights in the layout DeepSeek-V4-Flash is released in: write, stream
onto the GPUs, generate GSM8K items in-process with ``w4a4_packed``, and print the figures.

    python benchmarks/dsv4_flash_fullwidth.py --out /local/dsv4-flash            # H200: as many layers as fit
    python benchmarks/dsv4_flash_fullwidth.py --out /tmp/x --scale 0.02 --layers 2 --experts 8 --device-map cpu

Steps: (1) the whole model's bytes from the released layout's headers (``--layout released``, the default:
FP8 dense linears kept FP8 on a GPU, packed FP4 experts, the MTP layer on disk and not loaded; ``--layout
bf16``: evalgate's own FP4 checkpoint, dense weights in BF16) and how many H200s it needs; (2) the layers to
write: ``--layers``, else as many as fit on the visible devices and on the output disk; (3) write them shard
by shard (``benchmarks/random_fp4.py``; never the whole model in memory); (4) load them streamed
(``model_adapters/loading/streamed.py``: planned first, experts kept packed, dense FP8 kept FP8 on a GPU); (5) decode ``--items`` GSM8K test prompts (the default gsm8k profile's few-shot prompts) for
``--max-new-tokens`` tokens at batch ``--batch-size`` (``--items 0``: skip); (6) print tokens/s, the projected
time of a 1,319-item GSM8K run, and peak memory per device against the packed expert bytes; (7) for each
batch of ``--batches``: prefill that many GSM8K prompts (each prompt's prefill and one move into a slot timed,
as a gate pays them; then every prompt again, to tell one-time costs from a prompt's own), time ``--steps``
decoding steps (median) from each cache of ``--cache`` (transformers'; per-row slots; slots with each step a
CUDA graph of the whole step; the slots' steps once per ``--fused`` choice of hyper-connection, RMSNorm, RoPE,
compressor and attention forwards), and hold each step against its weight-read floor (``step_floor``), with
the copy bandwidth of the device measured in this run; then
project the whole gate (GSM8K + HumanEval, the rounds at ``--psi``, one-time costs: Triton's compilation timed
apart by ``compile_clock.CompileClock`` and priced once a process, the rest scaled with the layers) of the
whole model on 2 and 4 H200s (``project_rows``, ``gate_projection.py``); (8) ``--fp8-cost``:
each dense FP8 linear of a CSA layer timed at 1 and 256 rows in canonical numerics, in PyTorch's (dequantized
when read, then a BF16 matmul) and through transformers' own FP8 path where it can run (``fp8_linear_cost``);
(9) ``--aa N``: the model loaded again with canonical numerics decodes N canary GSM8K items at batch 1 and at
``--aa-batch`` and counts the items whose tokens differ (``canonical_aa``).

The configuration is DeepSeek-V4-Flash's (``flash_config``); each value names its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from compile_clock import CompileClock

GiB = 1 << 30
CLOCK = CompileClock()  # entered by ``main``: Triton's compilation in this process
H200_BYTES = 139 * GiB  # what one H200 offers torch (about 139 GiB of its 141 GB)
GSM8K_ITEMS = 1319


def compress_ratios(layers: int) -> list[int]:
    """DeepSeek-V4-Flash's per-layer attention: layers 0 and 1 sliding-window only (ratio 0), then CSA (ratio 4)
    on even and HCA (ratio 128) on odd layers. Source: the DeepSeek-V4-Flash config.json ``compress_ratios``,
    as quoted by antirez/ds4 MODEL_CARD.md ("0, 1: none; even layers from 2 onward: 4") and the
    5-layer excerpt of that config published as inference-optimization/DeepSeek-V4-Flash-bf16-dequantized-5layers
    ([0, 0, 4, 128, 4]). transformers' own default without ``compress_ratios`` is V4-Pro's schedule."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(layers)]


LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def layer_kinds(config) -> set[tuple[str, str]]:
    """The (attention, MoE) kinds of a config's layers: layers of one kind run the same kernel variants."""
    return set(zip(config.layer_types, config.mlp_layer_types))


def flash_config(layers: int | None = None, experts: int | None = None, scale: float = 1.0, vocab: int | None = None):
    """DeepSeek-V4-Flash. Every field below is transformers 5.23's ``DeepseekV4Config`` default, documented
    there for checkpoint deepseek-ai/DeepSeek-V4-Flash-Base (print(DeepseekV4Config())): vocab 129280, hidden
    4096, moe_intermediate 2048, 43 layers, 64 heads of head_dim 512, 1 KV head, q_lora_rank 1024,
    o_groups 8 x o_lora_rank 1024, 256 routed experts + 1 shared, top-6, sqrtsoftplus scoring,
    routed_scaling_factor 1.5, swiglu_limit 10, hc_mult 4 (20 Sinkhorn iterations), sliding_window 128,
    indexer 64 heads x 128 (top 512), compress rates 4 / 128, rope theta 10000 / 160000, 3 hash-routed
    layers (``default_num_hash_layers``) -- except ``layer_types`` (``compress_ratios`` above).
    The compressed layers' YaRN RoPE (factor 16 over 65536 positions, beta 32 / 1) is from the
    ``compress_rope_parameters`` of the DeepSeek-V4 config as mirrored in trl-internal-testing/tiny-DeepseekV4ForCausalLM.
    ``num_nextn_predict_layers`` (the MTP layer) is not instantiated by transformers and not written.

    ``layers`` / ``experts`` override the counts; ``scale`` < 1 shrinks the widths (hidden, intermediate,
    ranks, heads) for a CPU smoke run, keeping every structural feature."""
    from transformers import DeepseekV4Config

    base = DeepseekV4Config()
    n = base.num_hidden_layers if layers is None else layers

    def width(x: int, multiple: int) -> int:
        w = max(multiple, int(round(x * scale / multiple)) * multiple)
        # an FP8 linear's dimensions are multiples of its 128 x 128 blocks or below one (transformers derives
        # the block from the scale grid)
        return w if w <= 128 else int(round(w / 128)) * 128

    rotary = base.default_partial_rotary_factor  # qk_rope_head_dim 64 of head_dim 512
    heads = max(base.o_groups, int(round(base.num_attention_heads * scale / base.o_groups)) * base.o_groups)
    cfg = dict(
        vocab_size=vocab or base.vocab_size,
        hidden_size=width(base.hidden_size, 32),
        moe_intermediate_size=width(base.moe_intermediate_size, 32),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=base.num_key_value_heads,
        head_dim=width(base.head_dim, 64),
        q_lora_rank=width(base.q_lora_rank, 32),
        o_groups=base.o_groups,
        o_lora_rank=width(base.o_lora_rank, 32),
        index_n_heads=max(2, int(round(base.index_n_heads * scale))),
        index_head_dim=width(base.index_head_dim, 16),
        index_topk=base.index_topk,
        n_routed_experts=experts or base.n_routed_experts,
        n_shared_experts=base.n_shared_experts,
        num_experts_per_tok=min(base.num_experts_per_tok, experts or base.n_routed_experts),
        layer_types=[LAYER_TYPE[r] for r in compress_ratios(n)],
        mlp_layer_types=["hash_moe"] * min(n, base.default_num_hash_layers) + ["moe"] * max(0, n - base.default_num_hash_layers),
        rope_parameters={"main": {"rope_type": "default", "rope_theta": base.rope_theta, "partial_rotary_factor": rotary},
                         "compress": {"rope_type": "yarn", "rope_theta": base.compress_rope_theta, "factor": 16.0,
                                      "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
                                      "attention_factor": 1.0, "partial_rotary_factor": rotary}},
        partial_rotary_factor=rotary,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
        max_position_embeddings=base.max_position_embeddings,
    )
    return DeepseekV4Config(**cfg)


def unit_bytes_of(config) -> dict[str, int]:
    """Placement unit -> loaded bytes, from the config alone (a meta model: shapes, no memory)."""
    from evalgate.model_adapters.loading.checkpoint_bytes import unit_of
    from random_fp4 import _meta_model

    model = _meta_model(config)
    sizes: dict[str, int] = {}
    h, i = config.hidden_size, config.moe_intermediate_size
    for key, t in model.state_dict().items():
        unit = unit_of(key)
        if key.endswith("experts.gate_up_proj"):
            n = config.n_routed_experts * 2 * i * (h // 2 + h // 32)
        elif key.endswith("experts.down_proj"):
            n = config.n_routed_experts * h * (i // 2 + i // 32)
        else:
            n = t.numel() * (2 if t.dtype.is_floating_point else t.element_size())
        sizes[unit] = sizes.get(unit, 0) + n
    return sizes


def released_unit_bytes(config, keep_fp8: bool = True) -> tuple[dict[str, int], int, int]:
    """(placement unit -> loaded bytes, stored bytes in all, stored bytes of the MTP layer) of ``config`` in the
    released layout, from the headers ``write_released_checkpoint`` would write (nothing written):
    ``keep_fp8`` counts FP8 dense weights as a GPU holds them, else dequantized to BF16."""
    from evalgate.model_adapters.loading.checkpoint_bytes import mtp_bytes, unit_bytes
    from random_fp4 import released_specs

    specs = released_specs(config)
    return unit_bytes(specs, "bfloat16", keep_fp8), sum(t.nbytes for t in specs), mtp_bytes(specs)


def h200s_needed(sizes: dict[str, int], reserve) -> int:
    from evalgate.errors import UserError
    from evalgate.model_adapters.loading.placement import plan

    for k in range(1, 65):
        try:
            plan(sizes, [(f"cuda:{j}", H200_BYTES) for j in range(k)], reserve)
            return k
        except UserError:
            continue
    return -1


def layers_that_fit(sizes_per_layer: int, fixed: int, devices: list[tuple[str, int]], reserve, disk_free: int,
                    total_layers: int) -> int:
    from evalgate.errors import UserError
    from evalgate.model_adapters.loading.placement import plan

    best = 0
    for n in range(1, total_layers + 1):
        sizes = {"prefix": fixed // 2, **{f"layer.{j}": sizes_per_layer for j in range(n)}, "suffix": fixed - fixed // 2}
        if sum(sizes.values()) > disk_free:
            break
        try:
            plan(sizes, devices, reserve)
        except UserError:
            break
        best = n
    return best


def gsm8k_prompts(n: int, profile: str | None = None) -> tuple[list[str], list[tuple[str, ...]]]:
    from evalgate.tasks import get_task, resolve_profile

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, profile), None, n)
    reqs = task.requests(items, resolved)
    return [r.prompt for r in reqs], [tuple(r.stop) for r in reqs]


def tokenizer_for(out: Path):
    from evalgate.model_adapters.hf.tiny import build_tokenizer
    from evalgate.tasks.gsm8k import load_split

    rows = load_split("train", None)[:2000]
    return build_tokenizer([r["question"] + "\n" + r["answer"] for r in rows], vocab_size=4096)


# --- the weight-read floor of a decoding step ----------------------------------------------------------


def copy_bandwidth(device: str, nbytes: int | None = None, repeat: int = 10) -> float:
    """Bytes per second a device-to-device copy moves on ``device`` (bytes read plus bytes written), the
    median of ``repeat`` copies of ``nbytes`` (2 GiB on a GPU, 256 MiB on a CPU)."""
    nbytes = nbytes or (2 * GiB if device.startswith("cuda") else 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t = _Timer(device)
        dst.copy_(src)
        times.append(t.seconds())
    del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2]


class _Workspace:
    """The most memory a device held above what it held when this was made (a GPU's peak; 0 on a CPU): the
    transient workspace of what ran between."""

    def __init__(self, device: str):
        self.device = device if device.startswith("cuda") else None
        if self.device:
            torch.cuda.synchronize(self.device)
            _PEAKS[self.device] = _peak(self.device)  # the run's peak so far, kept for its rows
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def gib(self) -> float:
        if not self.device:
            return 0.0
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self.base) / GiB


class _Timer:
    """Wall time of device work: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1000
        return time.perf_counter() - self.t0


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dense_step_bytes(model, batch: int) -> int:
    """Bytes of the weights every decoding step reads whatever the routing: every parameter and buffer of
    the decoder layers outside the routed experts (attention, compressors, indexers, routers, shared
    experts, norms, hyper-connections; a hash router's table only for the step's rows), the final norm and
    hyper-connection head, the LM head; of the embedding only the step's rows."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".experts." in name or "rotary_emb" in name:
            continue
        if name.endswith("embed_tokens.weight") or name.endswith("tid2eid"):
            total += batch * t.shape[1] * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


class RoutedExperts:
    """Records, per MoE layer, how many distinct routed experts the tokens of the forward passes it watches
    are sent to (a pre-hook on each experts module: transformers calls it with (hidden, top-k index, top-k
    weights)), and what one expert's packed weights weigh."""

    def __init__(self, model):
        self.modules = [m for m in model.modules() if type(m).__name__ == "DeepseekV4Experts"]
        self.distinct: list[int] = []
        self.handles = []

    def __enter__(self):
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, module, args):
        index = args[1]
        self.distinct.append(int(torch.unique(index[index < module.gate_up_proj.shape[0]]).numel()))

    def bytes(self) -> int:
        """The packed bytes of the experts recorded (each layer's distinct experts x one expert's bytes)."""
        per_expert = [_nbytes(p for n, p in m.named_parameters()) // m.gate_up_proj.shape[0] for m in self.modules]
        return sum(n * per_expert[i % len(per_expert)] for i, n in enumerate(self.distinct))


def _device_allocations(device: str) -> int:
    """How many times PyTorch's caching allocator has asked the device for memory (0 on a CPU)."""
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0) if device.startswith("cuda") else 0


_PEAKS: dict[str, int] = {}  # a device's peak before a ``_Workspace`` reset its statistics


def _peak(device: str) -> int:
    """The most memory ``device`` has held since ``_reset_peaks``."""
    return max(torch.cuda.max_memory_allocated(device), _PEAKS.get(device, 0))


def _reset_peaks(devices: list[str]) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)
            _PEAKS.pop(d, None)


def _median_step(step, steps: int, device: str, warmup: int = 1) -> float:
    """Seconds of ``step()``, the median of ``steps`` after ``warmup`` untimed ones (the first step at a batch
    compiles; a graphed step captures on the second)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = _Timer(device)
        step()
        times.append(t.seconds())
    return sorted(times)[len(times) // 2]


def _row(model, step, cache: str, batch: int, prompt_tokens: int, prefill_s: float, step_s: float, devices, bandwidth):
    """One table row; the floor's experts are counted on one more ``step()``."""
    with RoutedExperts(model) as routed:
        step()
    floor_bytes = dense_step_bytes(model, batch) + routed.bytes()
    floor_s = floor_bytes / bandwidth
    peaks = {d: _peak(d) for d in devices if d.startswith("cuda")}
    return {"cache": cache, "batch": batch, "prompt_tokens": prompt_tokens, "prefill_s": round(prefill_s, 3),
            "prefill_tokens_per_s": round(prompt_tokens / prefill_s, 1), "step_ms": round(step_s * 1e3, 2),
            "tokens_per_s": round(batch / step_s, 1), "floor_gib": round(floor_bytes / GiB, 2),
            "floor_ms": round(floor_s * 1e3, 2), "x_floor": round(step_s / floor_s, 2),
            "peak_gib": {d: round(v / GiB, 2) for d, v in peaks.items()}}


class _ModuleRanges:
    """Names each decoder layer's parts (attention, its compressor and indexer, the MoE, its experts, norms,
    hyper-connections) as profiler ranges, so a profile's table says which part a step's device time is in."""

    def __init__(self, model):
        self.handles, self.open = [], []
        for layer in model.model.layers:
            for module in [layer, *layer.children(), *(g for c in layer.children() for g in c.children())]:
                name = type(module).__name__
                self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter(n)))
                self.handles.append(module.register_forward_hook(lambda m, a, o: self._exit()))

    def _enter(self, name: str) -> None:
        rf = torch.profiler.record_function(f"## {name}")
        rf.__enter__()
        self.open.append(rf)

    def _exit(self) -> None:
        self.open.pop().__exit__(None, None, None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def profile_step(model, step, path: Path, label: str) -> None:
    """One ``step()`` under the torch profiler: its device time by kernel and by operator (and by layer part,
    eagerly), with the number of kernels it launched, written to ``path`` (``--profile``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ranges = _ModuleRanges(model) if "eager" in label else None
    try:
        step()
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                     record_shapes=ranges is not None) as prof:
            step()
            sync()
    finally:
        if ranges is not None:
            ranges.close()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    launched = sum(e.count for e in kernels)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    with path.open("a") as f:
        f.write(f"\n===== {label}: {launched} kernels, {busy:.2f} ms of kernel time =====\n")
        f.write(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=70,
                             max_name_column_width=90))
        parts = [e for e in events if e.key.startswith("## ")]
        if parts:
            f.write("\nby layer part (device time of its kernels, all layers):\n")
            for e in sorted(parts, key=lambda e: -(e.device_time_total if cuda else e.cpu_time_total)):
                ms = (e.device_time_total if cuda else e.cpu_time_total) / 1e3
                f.write(f"  {e.key[3:]:40s} {e.count:6d} calls {ms:9.2f} ms\n")
            f.write("\nby operator and input shapes:\n")
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=40, max_name_column_width=40,
                max_shapes_column_width=80))
    print(f"profile {label}: {launched} kernels, {busy:.2f} ms kernel time -> {path}", flush=True)


def _prompt_ids(tokenizer, prompts: list[str], batch: int) -> list[list[int]]:
    """``batch`` prompts' token ids, the list repeated as needed."""
    repeated = (prompts * (batch // len(prompts) + 1))[:batch]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in repeated]


@torch.inference_mode()
def measure_batch(model, tokenizer, prompts: list[str], batch: int, steps: int, devices: list[str], bandwidth: float):
    """transformers' cache: prefill ``batch`` prompts left-padded (``generation._prefill_in_parts``, as a
    static batch is prefilled), then ``steps`` greedy decoding steps: prefill tokens/s, the median step, its
    floor (the weights the step reads over ``bandwidth``: ``dense_step_bytes`` plus the experts its tokens are
    routed to) and the peak memory per device since the prefill began."""
    from evalgate.model_adapters.hf.generation import _prefill_in_parts

    first = devices[0]
    ids = _prompt_ids(tokenizer, prompts, batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    _reset_peaks(devices)
    t = _Timer(first)
    logits, (past, mask, last_pos, _) = _prefill_in_parts(model, ids, pad, first)
    prefill_s = t.seconds()
    tok = logits.argmax(-1, keepdim=True)

    def step():
        nonlocal mask, last_pos, tok, past
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=mask.device)], -1)
        last_pos = last_pos + 1
        out = model(input_ids=tok, attention_mask=mask, position_ids=last_pos, past_key_values=past, use_cache=True,
                    logits_to_keep=1)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    step_s = _median_step(step, steps, first)
    return _row(model, step, "hf", batch, sum(map(len, ids)), prefill_s, step_s, devices, bandwidth)


@torch.inference_mode()
def measure_slots(model, tokenizer, prompts: list[str], batches: list[int], steps: int, devices: list[str],
                  bandwidth: float, modes: tuple[str, ...] = ("slots", "graphs"),
                  fused: tuple[str, ...] = ("triton",), profile: Path | None = None,
                  prompt_cache: bool = True, prefill_shapes: tuple[tuple[int, int], ...] = ()) -> list[dict]:
    """The per-row preallocated cache (``attention_slots.SlotCache``): the largest batch's prompts prefilled
    one at a time (each distinct prompt once) and admitted into slots, and with ``prompt_cache`` again the way
    slot decoding prefills them (``measure_prompt_cache``), then for each ``fused`` choice
    (``use_fused``) and each batch ``steps`` decoding steps of its first slots, eagerly (``slots``) and as a
    CUDA graph of the whole step (``graphs``, ``step_graphs.StepGraphs``). A graphed row also holds the
    graph's logits against the eager step's of the same rows and tokens, bit for bit (``graph_bits_equal``),
    and how many steps ran again without the graph (``reruns``: the MoE's fast path left rows). ``profile``:
    a folder; one prompt's prefill and the smallest and the largest batch's steps, eager and graphed, are
    profiled into it (``profile_step``)."""
    from evalgate.model_adapters.fast.attention_slots import SlotCache
    from evalgate.model_adapters.fast.step_graphs import StepGraphs
    from evalgate.model_adapters.hf.generation import PROMPT_STORES, REFILL_FRACTION

    first = devices[0]
    ids = _prompt_ids(tokenizer, prompts, max(batches))
    use_fused(model, fused[0])
    cache = SlotCache(model, slots=len(ids),  # spare: the graphs' padding rows, the prompt cache's stores
                      max_length=max(map(len, ids)) + (2 * steps + 12) * len(batches) * len(fused) + 8,
                      spare=2 + PROMPT_STORES)
    _reset_peaks(devices)
    last = [None] * len(ids)
    distinct = {}  # the prompts repeat past len(prompts): each is prefilled once and admitted into its slots
    for slot, prompt in enumerate(ids):
        distinct.setdefault(tuple(prompt), []).append(slot)

    def prefill(prompt):  # as a gate's decoding loop prefills a prompt
        return model(input_ids=torch.tensor([prompt], device=first), use_cache=True, logits_to_keep=1)

    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    # the first prefill compiles the prefill's Triton kernels (tiles of a prompt's rows): a run pays that once,
    # so it is timed apart (``warmup_s``, added once to a projected gate) and not in the prefill rate
    t = _Timer(first)
    prefill(next(iter(distinct)))
    warmup_s = t.seconds()
    moves, firsts = [], []
    allocs, compiled = _device_allocations(first), CLOCK.seconds
    for prompt, slots_of in distinct.items():
        t = _Timer(first)  # what a gate pays per item: its prefill and one move into a slot
        out = prefill(prompt)
        token = out.logits[0, -1].argmax()
        cache.admit(slots_of[0], out.past_key_values, len(prompt))
        firsts.append(t.seconds())
        for slot in slots_of[1:]:  # the same prompt's further slots fill the batch: copies a gate never makes
            t = _Timer(first)
            cache.admit(slot, out.past_key_values, len(prompt))
            moves.append(t.seconds())
        for slot in slots_of:
            last[slot] = token
    prefill_s, allocs, compiled = sum(firsts), _device_allocations(first) - allocs, CLOCK.since(compiled)
    prefilled = sum(map(len, distinct))
    # every prompt again, timed as above (into the same slot: the same state after): a prompt's first prefill in
    # a process can pay one-time costs (a Triton kernel compiled for a new class of shapes, the allocator
    # growing) that a run pays once, not once per prompt
    seconds = []
    for prompt, slots_of in distinct.items():
        t = _Timer(first)
        cache.admit(slots_of[0], prefill(prompt).past_key_values, len(prompt))
        seconds.append(t.seconds())
    again_s = sum(seconds)
    slow = sum(a > SLOW_FIRST * b for a, b in zip(firsts, seconds))
    if profile is not None:  # where a prefill's time goes: one prompt's forward, by kernel, operator and layer part
        prompt = next(iter(distinct))
        profile_step(model, lambda: prefill(prompt), profile / "prefill.txt",
                     f"eager prefill of one prompt of {len(prompt)} tokens")
    alone = f"; a move alone {statistics.median(moves) * 1e3:.2f} ms (median)" if moves else ""
    print(f"prefill: {len(distinct)} prompts, {prefilled} tokens in {prefill_s:.2f} s, each prefilled and moved "
          f"into a slot ({prefilled / prefill_s:.0f} tokens/s; median {statistics.median(firsts) * 1e3:.0f} ms a "
          f"prompt, {allocs} device allocations){alone}; before them one untimed prefill, compiling: "
          f"{warmup_s:.2f} s; every prompt again: {again_s:.2f} s ({prefilled / again_s:.0f} tokens/s; "
          f"median {statistics.median(seconds) * 1e3:.0f} ms a prompt; {slow} first prefills took over "
          f"{SLOW_FIRST}x their second, {prefill_s - again_s:.2f} s more in all, {compiled:.2f} s of it compiling)",
          flush=True)
    figures = {"prefill_first_ms": round(statistics.median(firsts) * 1e3, 1), "prefill_device_allocations": allocs,
               "prefill_again_tokens_per_s": round(prefilled / again_s, 1), "prefill_slow_firsts": slow,
               "prefill_once_s": round(max(0.0, prefill_s - again_s - compiled), 2),
               "prefill_once_compile_s": round(compiled, 2),
               "prefill_again_ms": round(statistics.median(seconds) * 1e3, 1)}
    if prompt_cache:
        figures.update(measure_prompt_cache(cache, distinct, first, max(1, max(batches) // REFILL_FRACTION), again_s,
                                            profile, prefill_shapes))
        for slots_of in distinct.values():  # the same prompt's further slots: its state, copied
            for slot in slots_of[1:]:
                cache.copy(slots_of[0], slot)
    tokens = torch.stack(last)
    rows = []
    for choice in fused:
        use_fused(model, choice)
        cache.follow_model()  # the slots' RoPE, compressor and attention follow the choice too
        graphs = StepGraphs(cache) if "graphs" in modes else None  # captured anew: the forwards changed
        if graphs is not None and graphs.reason:
            print(f"graphs: whole-step CUDA graphs unavailable ({graphs.reason}); the steps run eagerly", flush=True)
        for batch in batches:
            slots, listed = torch.arange(batch, device=tokens.device), list(range(batch))

            def step():
                tokens[:batch] = cache.decode_step(tokens[:batch], slots).argmax(-1)

            def graphed():
                tokens[:batch] = graphs.step(tokens[:batch], listed).argmax(-1)

            for mode in modes:
                if mode == "slots":
                    step_s = _median_step(step, steps, first)
                else:  # a bucket's first step runs eagerly (compiling), its second captures: once a run, timed apart
                    t, compiled = _Timer(first), CLOCK.seconds
                    graphed()
                    graphed()
                    capture_s, compiled = t.seconds(), CLOCK.since(compiled)
                    step_s = _median_step(graphed, steps, first, warmup=0)
                row = _row(model, step, mode, batch, prefilled, prefill_s, step_s, devices, bandwidth)
                row["cache"] += "" if choice == "triton" else f"/{choice}"
                row["warmup_s"] = round(warmup_s, 2)
                row.update(figures)
                if mode == "graphs":  # the step is idempotent until the rows advance: graph and eager, same inputs
                    # beyond two plain steps and the compilation (once a process, whatever the layers)
                    row["capture_s"] = round(max(0.0, capture_s - 2 * step_s - compiled), 3)
                    row["capture_compile_s"] = round(compiled, 3)
                    got = graphs.logits(tokens[:batch], listed)
                    row["graph_bits_equal"] = bool(torch.equal(got, cache.forward(tokens[:batch], slots)))
                    row["reruns"] = graphs.stats["reruns"]
                    row["graphed"] = graphs.stats["replays"] > 0
                if profile is not None and batch in (min(batches), max(batches)):
                    profile_step(model, step if mode == "slots" else graphed, profile / f"{choice}.txt",
                                 f"{'eager' if mode == 'slots' else 'graphed'} step, batch {batch}, --fused {choice}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


SLOW_FIRST = 3  # a first prefill over this many times its second paid a one-time cost (printed as a count)
def measure_prompt_cache(cache, distinct: dict, first: str, take: int, alone_s: float, profile: Path | None = None,
                         shapes: tuple[tuple[int, int], ...] = ()) -> dict:
    """The prompts prefilled as slot decoding prefills them (``generation.PromptCache``: the prefix every prompt
    shares computed once into a spare slot and copied, then ``take`` prompts' own tokens together a call, in
    chunks, ``SlotCache.prefill``), each distinct prompt into its first slot; twice, the first pass paying the
    compilation of the chunks' shapes. Prints and returns the second pass's figures: prompt tokens per second
    (the prefix counted in every prompt, as a gate's rows hold it), the tokens actually computed and their
    rate (``prefix_cache_tokens_per_s``, what ``gate_projection`` prices a prefix-cached prefill at), and the
    ratio to ``alone_s`` (the same prompts one at a time, measured just before). ``profile``: the first take
    profiled (``profile_step``); ``shapes``: (chunk, budget) pairs also timed, each after a compiling pass."""
    from evalgate.model_adapters.fast import attention_slots
    from evalgate.model_adapters.hf.generation import PROMPT_STORES, PromptCache

    prompts = list(distinct)
    enc = [list(p) for p in prompts]
    stores = range(cache.slots + 1, cache.slots + 2 + PROMPT_STORES)
    prompt_tokens = sum(map(len, enc))

    def one_pass():  # every prompt into its first slot, a take at a time: (the cache, seconds, computed, calls)
        cached = PromptCache(cache, enc, stores)
        computed, calls = cache.prefill_tokens, cache.prefill_calls
        t = _Timer(first)
        for k in range(0, len(prompts), take):
            part = list(range(k, min(k + take, len(prompts))))
            cached.admit([distinct[prompts[i]][0] for i in part], part)
        return cached, t.seconds(), cache.prefill_tokens - computed, cache.prefill_calls - calls

    compiled = CLOCK.seconds
    _, first_s, _, _ = one_pass()  # the first compiles
    compiled = CLOCK.since(compiled)
    workspace = _Workspace(first)
    cached, seconds, computed, calls = one_pass()
    workspace_gib = workspace.gib()
    sweep = CLOCK.seconds
    for chunk, budget in shapes:  # the same prefill in other call shapes (a row's tokens, a call's tokens)
        kept = attention_slots.PREFILL_CHUNK, attention_slots.PREFILL_BUDGET
        attention_slots.PREFILL_CHUNK, attention_slots.PREFILL_BUDGET = chunk, budget
        try:
            one_pass()  # compiles the new shapes
            shape_workspace = _Workspace(first)
            _, took, _, shape_calls = one_pass()
            print(f"prefill with the prompt cache, chunks of {chunk} tokens, {budget} a call: {took:.2f} s "
                  f"({prompt_tokens / took:.0f} prompt tokens/s, {shape_calls} calls; workspace "
                  f"{shape_workspace.gib():.2f} GiB)", flush=True)
        finally:
            attention_slots.PREFILL_CHUNK, attention_slots.PREFILL_BUDGET = kept
    CLOCK.exclude(CLOCK.since(sweep))  # the other call shapes' compilation: not a gate's
    if profile is not None:
        taken = PromptCache(cache, enc, stores)
        part = list(range(min(take, len(prompts))))
        profile_step(cache.model, lambda: taken.admit([distinct[prompts[i]][0] for i in part], part),
                     profile / "prefill_take.txt", f"eager prefill take of {len(part)} prompts (prompt cache)")
    own = cached.prefix + sum(len(e) - cached.prefix for e in enc)  # the prefix once, every prompt's own tokens
    print(f"prefill with the prompt cache: {len(enc)} prompts, {prompt_tokens} prompt tokens, a shared prefix of "
          f"{cached.prefix} computed once, {own} tokens computed (+{computed - own} pads) in {seconds:.2f} s "
          f"({prompt_tokens / seconds:.0f} prompt tokens/s, {own / seconds:.0f} computed tokens/s; {calls} calls, "
          f"{take} prompts a take, chunks of {attention_slots.PREFILL_CHUNK} tokens, {attention_slots.PREFILL_BUDGET} "
          f"a call; workspace {workspace_gib:.2f} GiB); first pass: {first_s:.2f} s, {compiled:.2f} s of it "
          f"compiling; {alone_s / seconds:.1f}x the prompts one at a time ({alone_s:.2f} s)", flush=True)
    return {"prompt_cache_s": round(seconds, 3), "prompt_cache_first_s": round(first_s, 3),
            "prompt_cache_once_s": round(max(0.0, first_s - seconds - compiled), 3),
            "prompt_cache_compile_s": round(compiled, 3), "prompt_cache_workspace_gib": round(workspace_gib, 2),
            "prompt_cache_prompt_tokens": prompt_tokens, "prompt_cache_computed_tokens": own,
            "prompt_cache_pad_tokens": computed - own, "prompt_cache_prefix_tokens": cached.prefix,
            "prompt_cache_tokens_per_s": round(prompt_tokens / seconds, 1),
            "prefix_cache_tokens_per_s": round(own / seconds, 1), "prompt_cache_speedup": round(alone_s / seconds, 2)}
def project_rows(rows: list[dict], figures: dict, tokenizer, args, layers: int, total_layers: int) -> dict:
    """The whole gate priced from each row (``gate_projection``): its tasks' real prompts in this tokenizer,
    the rounds a healthy kernel needs at ``--psi`` (simulated through the gate's own decision path), early
    stop's last check, and the one-time costs measured here. Each row gets ``gate_min_{2,4}_h200``: the gate
    (expected answer lengths, the baseline's samples stored by ``calibrate``, the prefix cache where the row
    measured one); the row the gate would run at (the most tokens/s) gets the whole table, printed."""
    import os

    import gate_projection as gp

    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    tasks = gp.task_loads(tokenize, args.projection_items, {"gsm8k": args.gsm8k_profile} if args.gsm8k_profile else None)
    try:  # the gate's own decision path, simulated: what it cannot run leaves the GPU figures standing
        rounds = gp.gate_rounds(args.psi, args.gate_reps, workers=os.cpu_count() or 1, moves=args.gate_moves)
        check_s = gp.early_stop_check_s()
    except Exception as exc:  # noqa: BLE001
        print(f"projection: the rounds could not be simulated ({type(exc).__name__}: {exc}); the greedy pass only",
              flush=True)
        rounds, check_s = dataclasses.replace(gp.GREEDY_ONLY, source=f"greedy pass only: {type(exc).__name__}"), 0.0
    per_replica = max(1, figures["h200s_needed"])
    out = {"tasks": [dataclasses.asdict(t) for t in tasks], "rounds": dataclasses.asdict(rounds),
           "early_stop_check_s": round(check_s, 2), "per_replica": per_replica, "conformance_s": figures.get("conformance_s")}
    for line in gp.describe_inputs(tasks, rounds):
        print("projection: " + line, flush=True)
    best = max(rows, key=lambda r: r["tokens_per_s"], default=None)
    for row in rows:
        capture = capture_parts(rows, row["batch"])
        if row is best:
            out["capture_s"] = {"per_bucket": capture[0], "compile": round(capture[1], 3)}
        m = measured_for(row, figures, layers, check_s, capture)
        cached = m.cached_prefill_tokens_per_s is not None
        for gpus in (2, 4):
            p = gp.project(tasks, rounds, m, total_layers, per_replica, gpus, "expected", cached)
            row[f"gate_min_{gpus}_h200"] = round(p.minutes(), 1)
            row[f"gate_tokens_per_s_per_gpu_{gpus}_h200"] = round(p.tokens_per_s_per_gpu())
        if row is best:
            lines, table = gp.table(tasks, rounds, m, total_layers, per_replica, (False, True) if cached else (False,))
            print(f"projected gate of the whole model ({total_layers} layers, {per_replica} H200(s) a copy) from "
                  f"{row['cache']} at batch {row['batch']}: greedy = the candidate's greedy pass alone; gate = with "
                  f"the rounds, the baseline's samples stored by calibrate; +base = the baseline kernel sampled in "
                  f"the gate; once = load, compilation, graph capture, conformance + witness; calibrate = once a "
                  f"baseline (A/A and the rounds' samples)", flush=True)
            for line in [gp.describe_once(m, total_layers), *lines]:
                print("  " + line, flush=True)
            out.update(row={"cache": row["cache"], "batch": row["batch"]}, measured=dataclasses.asdict(m), table=table)
    return out


def capture_parts(rows: list[dict], batch: int) -> tuple[float, float]:
    """(a bucket's graph capture, these layers; compilation once a run beyond the run's ``compile_s``) for a gate
    whose batch shrinks from ``batch`` through every power-of-two bucket, from the graphed rows. Where the rows
    timed their compilation apart (``capture_compile_s``, in the run's ``compile_s``), the slowest capture
    beyond it is a bucket's, and each bucket no row measured compiles as the measured ones after the first
    did; else the fastest capture is a bucket's own and the rest of the first the compilation (with one
    graphed batch, all of it counts per bucket)."""
    from evalgate.model_adapters.fast.step_graphs import bucket_of

    graphed = [r for r in rows if "capture_s" in r]
    if not graphed:
        return 0.0, 0.0
    if all("capture_compile_s" in r for r in graphed):
        later = [r["capture_compile_s"] for r in graphed[1:]] or [graphed[0]["capture_compile_s"]]
        missing = len(_buckets(batch) - {bucket_of(r["batch"], batch) for r in graphed})
        return max(r["capture_s"] for r in graphed), missing * statistics.mean(later)
    captures = [r["capture_s"] for r in graphed]
    return min(captures), max(captures) - min(captures)


def _buckets(batch: int) -> set[int]:
    """step_graphs' buckets a batch shrinking from ``batch`` goes through: 1, 2, 4, ... and ``batch`` (its slots)."""
    from evalgate.model_adapters.fast.step_graphs import bucket_of

    return {bucket_of(rows, batch) for rows in range(1, batch + 1)}


def measured_for(row: dict, figures: dict, layers: int, check_s: float, capture: tuple[float, float] = (0.0, 0.0)):
    """A row's figures as the projection takes them: prefill at the second pass's rate where the prompts were
    prefilled twice (the first pass's extra paid once), the prefix cache's rate where measured
    (``prefix_cache_tokens_per_s``: tokens computed per second with the cache) and its first pass's extra,
    ``capture``: (a bucket's graph capture, these layers; the first capture's compilation, once a run) with one
    capture per batch bucket up to the row's batch. The run's Triton compilation (``compile_s``, timed apart
    from the rest) is priced once; without it, the first prefill's and the first capture's time stand for it."""
    import gate_projection as gp

    buckets = len(_buckets(row["batch"]))
    compile_s = figures.get("compile_s", row.get("warmup_s", 0.0)) + capture[1]
    return gp.Measured(layers=layers, batch=row["batch"], step_s=row["step_ms"] / 1e3,
                       prefill_tokens_per_s=row.get("prefill_again_tokens_per_s", row["prefill_tokens_per_s"]),
                       cached_prefill_tokens_per_s=row.get("prefix_cache_tokens_per_s"),
                       load_s=figures.get("load_s", 0.0), compile_s=compile_s,
                       prefill_once_s=row.get("prefill_once_s", 0.0),
                       cached_prefill_once_s=row.get("prompt_cache_once_s"), capture_s=capture[0] * buckets,
                       conformance_s=figures.get("conformance_s") or 0.0, check_s=check_s)


def conformance_seconds(model, tokenizer, kernel: str, prompts: list[str], device: str) -> dict | None:
    """Seconds of what a run does before generating (``HFAdapter.conformance``): the kernel's conformance on the
    first prompts' hidden states and the execution witness, each, and the compilation within them. None (and
    why, printed) where it cannot run here."""
    from evalgate.kernels import get_kernel
    from evalgate.kernels.checkpoint import experts_modules
    from evalgate.kernels.conformance import model_conformance
    from evalgate.kernels.witness import watch
    from evalgate.model_adapters.hf.adapter import greedy_decoder

    t, compiled = _Timer(device), CLOCK.seconds
    try:
        ids = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
        model_conformance(model, kernel, ids)
        conformance_s = t.seconds()
        if experts_modules(model):
            watch(model, get_kernel(kernel), prompts, device, greedy_decoder(model, tokenizer, device))
    except Exception as exc:  # noqa: BLE001  (priced as nothing, and said so)
        print(f"conformance + witness: not measured ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
              flush=True)
        return None
    seconds, compiled = t.seconds(), CLOCK.since(compiled)
    print(f"conformance + witness: {seconds:.2f} s (conformance {conformance_s:.2f} s, witness "
          f"{seconds - conformance_s:.2f} s), {compiled:.2f} s of it compiling", flush=True)
    return {"conformance_s": round(max(0.0, seconds - compiled), 2), "conformance_compile_s": round(compiled, 2),
            "conformance_only_s": round(conformance_s, 2), "witness_s": round(seconds - conformance_s, 2)}


def use_fused(model, choice: str) -> None:
    """The hyper-connections', RMSNorms' and (through the mark ``SlotCache.follow_model`` reads) the slot step's
    RoPE, compressor and attention for the steps that follow: ``triton`` (``triton_layers``, ``triton_compressor``,
    ``triton_attention``, where they can run) or ``torch`` (transformers' own, PyTorch's compressor step, the
    gathered attention)."""
    import types

    from evalgate.model_adapters.fast import triton_layers

    if choice == "triton" and triton_layers.install(model):
        return
    if choice == "triton":
        print(f"fused: the Triton kernels do not run here ({triton_layers.usable(model)}); transformers' forwards",
              flush=True)
    for module in model.modules():
        if type(module).__name__ in triton_layers.FORWARDS:
            module.forward = types.MethodType(type(module).forward, module)
    model._evalgate_triton_layers = False


def print_table(rows: list[dict], bandwidth: float, device: str) -> None:
    print(f"decode steps against the weight-read floor (copy bandwidth of {device}: {bandwidth / 1e9:.0f} GB/s "
          "read + written, measured in this run)")
    print(f"{'cache':>15s} {'batch':>5s} {'prefill tok/s':>13s} {'step ms':>8s} {'tokens/s':>9s} {'floor GiB':>9s} "
          f"{'floor ms':>8s} {'x floor':>7s} {'peak GiB':>9s} {'gate 2xH200 min':>15s} {'gate 4xH200 min':>15s}")
    for r in rows:
        peak = "/".join(f"{v:.1f}" for v in r["peak_gib"].values()) or "-"
        print(f"{r['cache']:>15s} {r['batch']:5d} {r['prefill_tokens_per_s']:13.1f} {r['step_ms']:8.2f} "
              f"{r['tokens_per_s']:9.1f} {r['floor_gib']:9.2f} {r['floor_ms']:8.2f} {r['x_floor']:7.2f} {peak:>9s} "
              f"{r['gate_min_2_h200']:15.1f} {r['gate_min_4_h200']:15.1f}")


def generate_items(model, tokenizer, placement, args, layers: int, total_layers: int, packed: int) -> dict:
    """Decode ``--items`` GSM8K prompts at ``--batch-size`` (``generation.decode``): tokens/s, the projected
    1,319-item GSM8K time, peak memory per device against the packed expert bytes."""
    from evalgate.model_adapters.hf.generation import decode
    from evalgate.model_adapters.loading.placement import gib

    figures = {}
    prompts, stops = gsm8k_prompts(args.items)
    first = placement.devices[0]
    for d in placement.devices:
        if d.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(d)
    decode(model, tokenizer, prompts[:1], stops[:1], [2], device=first)  # warm-up: Triton compiles
    tokens, t0 = 0, time.perf_counter()
    for b in range(0, len(prompts), args.batch_size):
        batch = prompts[b:b + args.batch_size]
        gens = decode(model, tokenizer, batch, stops[b:b + args.batch_size], [args.max_new_tokens] * len(batch), device=first)
        tokens += sum(len(g.token_ids) for g in gens)
    wall = time.perf_counter() - t0
    batches = math.ceil(len(prompts) / args.batch_size)
    per_batch = wall / batches
    # a 1,319-item run at this batch size, every item running to the profile's limit (decode time grows with
    # tokens; prefill is counted once per batch, so this slightly overstates it); full model: x layers ratio
    project = per_batch * math.ceil(GSM8K_ITEMS / args.batch_size) * args.profile_tokens / args.max_new_tokens
    project_full = project * total_layers / layers
    figures.update(tokens=tokens, generate_s=round(wall, 2), tokens_per_s=round(tokens / wall, 2),
                   projected_gsm8k_s_these_layers=round(project), projected_gsm8k_s_full_model=round(project_full))
    peaks = {d: torch.cuda.max_memory_allocated(d) for d in placement.devices if d.startswith("cuda")}
    figures["peak_memory_gib"] = {d: round(v / GiB, 2) for d, v in peaks.items()}
    figures["packed_expert_gib"] = round(packed / GiB, 2)
    print(f"generated {tokens} tokens for {len(prompts)} GSM8K items (batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens) in {wall:.1f} s: {tokens / wall:.1f} tokens/s")
    print(f"projected 1,319-item GSM8K run ({args.profile_tokens} tokens per item, batch {args.batch_size}): "
          f"{project / 60:.1f} min with these {layers} layers, {project_full / 60:.1f} min for all "
          f"{total_layers} (x layers)")
    if peaks:
        print("peak memory: " + ", ".join(f"{d} {gib(v)}" for d, v in peaks.items())
              + f"; packed FP4 experts {gib(packed)} ({sum(peaks.values()) / packed:.2f}x)")
    return figures


def _median_call(fn, device: str, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = _Timer(device)
        fn()
        times.append(t.seconds())
    return sorted(times)[len(times) // 2]


def use_local_hf_fp8_kernel(path: str) -> None:
    """Hand transformers a local copy of the Hub's ``kernels-community/finegrained-fp8`` Python package (its
    ``torch-ext/finegrained_fp8`` folder) for a machine without the Hub. DeepGEMM's linear is switched off, as
    transformers fetches that one from the Hub too: its FP8 path then runs the Triton kernel."""
    import importlib.util
    import os

    from transformers.integrations import hub_kernels

    init = Path(path) / "__init__.py"
    spec = importlib.util.spec_from_file_location("finegrained_fp8", init, submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["finegrained_fp8"] = module
    spec.loader.exec_module(module)
    hub_kernels._KERNEL_MODULE_MAPPING["finegrained-fp8"] = module
    os.environ["TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR"] = "1"


def _transformers_fp8(module):
    """transformers' own FP8 linear for an FP8-kept module (``FP8Linear``'s call: activations quantized per 128,
    an FP8 GEMM; DeepGEMM or its Triton kernel from the Hub), or the reason it cannot run here."""
    try:
        from transformers.integrations.finegrained_fp8 import fp8_linear, load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception as exc:  # no `kernels` package, no Hub: the path does not exist on this machine
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return (lambda x: fp8_linear(x, module.weight_fp8, module.weight_scale_inv, [128, 128])), None


@torch.inference_mode()
def fp8_linear_cost(model, device: str, rows: tuple[int, ...] = (1, 256)) -> list[dict]:
    """Each dense FP8 linear of the first CSA layer (attention, compressor, indexer, shared expert) at ``rows``
    input rows: canonical numerics (the cached fixed-point grid, ``invariant.linear_forward``), PyTorch's
    (the weight dequantized when read, then a BF16 matmul: what a native GPU load runs), a BF16 matmul of a
    weight dequantized once (what a BF16 load runs) and transformers' FP8 path where it can run. Median of 20
    calls each, device time."""
    import types

    from evalgate.model_adapters.canonical import invariant
    from evalgate.model_adapters.canonical.fp8_linear import is_fp8

    layer = next(i for i, t in enumerate(model.config.layer_types) if t == "compressed_sparse_attention")
    mods = [(n, m) for n, m in model.model.layers[layer].named_modules() if is_fp8(m) and type(m).__name__.startswith("Fp8Linear")]
    out, reason = [], None
    if not mods:
        print("dense FP8 linears: none kept FP8 here (a CPU load dequantizes them)")
        return out
    for name, m in mods:
        w = m.weight
        k = w.shape[1]
        canonical = types.MethodType(invariant.linear_forward, m)
        theirs, reason = _transformers_fp8(m) if device.startswith("cuda") else (None, "not on a GPU")
        for r in rows:
            x = torch.randn(r, k, device=w.device, dtype=torch.bfloat16)
            row = {"linear": name, "shape": list(w.shape), "rows": r,
                   "canonical_us": _median_call(lambda: canonical(x), device) * 1e6,
                   "pytorch_us": _median_call(lambda: m(x), device) * 1e6,
                   "bf16_us": _median_call(lambda: torch.nn.functional.linear(x, w), device) * 1e6}
            if theirs is not None:
                row["transformers_fp8_us"] = _median_call(lambda: theirs(x), device) * 1e6
            out.append({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in row.items()})
    print(f"dense FP8 linears of layer {layer}, device time (median of 20) in us"
          + (f"; transformers' FP8 path does not run here: {reason}" if reason else ""))
    print(f"{'linear':45s} {'N x K':>13s} {'rows':>5s} {'canonical':>10s} {'pytorch':>9s} {'bf16':>8s} {'hf fp8':>8s}")
    for r in out:
        print(f"{r['linear']:45s} {'x'.join(map(str, r['shape'])):>13s} {r['rows']:5d} {r['canonical_us']:10.1f} "
              f"{r['pytorch_us']:9.1f} {r['bf16_us']:8.1f} {r.get('transformers_fp8_us', float('nan')):8.1f}")
    for r in rows:
        sel = [x for x in out if x["rows"] == r]
        c, p_, b = (sum(x[f] for x in sel) for f in ("canonical_us", "pytorch_us", "bf16_us"))
        t = sum(x.get("transformers_fp8_us", 0) for x in sel)
        print(f"  {r} rows, all {len(sel)}: canonical {c:.0f} us, pytorch {p_:.0f} us ({c / p_:.2f}x), bf16 {b:.0f} us"
              + (f", transformers' FP8 {t:.0f} us (canonical {c / t:.2f}x)" if t else ""))
    return out


def canonical_aa(out: Path, args) -> dict:
    """The model at ``out`` loaded again with canonical numerics; ``--aa`` canary GSM8K items decoded greedily
    at batch 1 (each alone) and at ``--aa-batch`` (continuous batching, as a gate decodes), ``--aa-tokens`` new
    tokens each: the items whose token ids differ, and each side's time."""
    from gpu_batch_invariance import decode_all, first_difference, requests

    from evalgate.model_adapters.hf.adapter import load_model
    from evalgate.model_adapters.canonical.invariant import numerics

    t0 = time.perf_counter()
    model, tokenizer = load_model(out, args.kernel, numerics="canonical", device_map=args.device_map)
    load_s = time.perf_counter() - t0
    device = model._evalgate_placement.devices[0]
    reqs = [dataclasses.replace(r, max_new_tokens=args.aa_tokens) for r in requests(args.aa)]
    many, secs_many = decode_all(model, tokenizer, reqs, device, args.aa_batch)
    print(f"canonical A/A: batch {args.aa_batch}: {len(reqs)} items in {secs_many:.1f} s", flush=True)
    one, secs_one = decode_all(model, tokenizer, reqs, device, 1)
    differ = [i for i in range(len(reqs)) if list(one[i].token_ids) != list(many[i].token_ids)]
    r = {"numerics": numerics(model), "items": len(reqs), "new_tokens": args.aa_tokens, "differ": len(differ),
         "first_diff_positions": [first_difference(list(one[i].token_ids), list(many[i].token_ids)) for i in differ][:20],
         "tokens": sum(len(g.token_ids) for g in one), "load_s": round(load_s, 1), "batch1_s": round(secs_one, 1),
         f"batch{args.aa_batch}_s": round(secs_many, 1)}
    print(f"canonical A/A ({r['numerics']}): {r['differ']} of {r['items']} items differ at batch 1 against batch "
          f"{args.aa_batch} ({args.aa_tokens} new tokens each; batch 1 {secs_one:.1f} s, load {load_s:.1f} s)",
          flush=True)
    return r


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/dsv4-flash-fp4", help="checkpoint folder (on a local disk)")
    p.add_argument("--layers", type=int, default=None, help="write only the first N layers [default: as many as fit]")
    p.add_argument("--experts", type=int, default=None, help="routed experts per layer [default: 256]")
    p.add_argument("--scale", type=float, default=1.0, help="width factor (< 1 for a CPU smoke run)")
    p.add_argument("--device-map", default="auto", help="auto (every visible GPU, else the CPU), cpu, cuda:0,cuda:1")
    p.add_argument("--items", type=int, default=16, help="GSM8K test items to generate")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profile-tokens", type=int, default=256, help="the GSM8K profile's token limit, for the projection")
    p.add_argument("--kernel", default="w4a4_packed")
    p.add_argument("--reuse", action="store_true", help="keep a checkpoint already in --out written with the same config")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards (default: delete it)")
    p.add_argument("--batches", default="1,16,64,256", help="decode-step batches held against the floor ('' to skip)")
    p.add_argument("--steps", type=int, default=8, help="timed decoding steps per batch (median)")
    p.add_argument("--cache", default="hf,slots,graphs", help="caches to decode from: hf (transformers', "
                   "left-padded static batch), slots (preallocated per row, attention_slots.py), graphs (slots, "
                   "each step a CUDA graph of the whole step per batch bucket, step_graphs.py)")
    p.add_argument("--fused", default="triton", help="hyper-connection weights, RMSNorms, RoPE, compressor and "
                   "attention of the slots' steps, comma-separated: triton (one kernel each, triton_layers.py, "
                   "triton_compressor.py and triton_attention.py, what a GPU load binds), torch (transformers' "
                   "forwards, PyTorch's compressor step, the gathered attention); several: the slots and graphs "
                   "rows once per choice, in this run")
    p.add_argument("--no-prompt-cache", action="store_true", help="slots: prefill the prompts one at a time only "
                   "(default: also as slot decoding does, the shared prefix once and each take's prompts together, "
                   "with the ratio between the two)")
    p.add_argument("--prefill-shapes", default="", help="slots' prompt cache: also time these CHUNKxBUDGET call "
                   "shapes (tokens a row, tokens a call), e.g. 512x16384")
    p.add_argument("--profile", default=None, help="a folder: profile one prompt's prefill and the smallest and "
                   "largest batch's slot steps into it (device time by kernel, operator and layer part; host time "
                   "on a CPU)")
    p.add_argument("--layout", default="released", choices=("released", "bf16"), help="released: DeepSeek-V4-Flash's "
                   "own layout (FP8 dense linears, FP4 experts, the MTP layer); bf16: evalgate's FP4 checkpoint with "
                   "BF16 dense weights")
    p.add_argument("--fp8-cost", action="store_true", help="time each dense FP8 linear of a CSA layer: canonical, "
                   "PyTorch's, transformers' FP8 path")
    p.add_argument("--aa", type=int, default=0, help="canonical A/A: decode this many canary GSM8K items at batch 1 "
                   "and at --aa-batch with canonical numerics and count the items whose tokens differ")
    p.add_argument("--aa-batch", type=int, default=256)
    p.add_argument("--aa-tokens", type=int, default=16, help="new tokens per A/A item")
    p.add_argument("--hf-fp8-kernel", default=None, help="with --fp8-cost on a machine without the Hub: a local "
                   "copy of kernels-community/finegrained-fp8's Python package (torch-ext/finegrained_fp8) for "
                   "transformers' FP8 path (needs the `kernels` package installed)")
    p.add_argument("--psi", type=float, default=0.06, help="the projected gate: a healthy kernel's flip rate ψ, "
                   "for the rounds of samples it needs")
    p.add_argument("--gate-reps", type=int, default=16, help="the projected gate: simulated gates averaged for the "
                   "rounds' samples per item (0: the greedy pass only)")
    p.add_argument("--gate-moves", default="independent", choices=("independent", "persistent"), help="the projected "
                   "gate: how the healthy kernel's answers move (simulate_gate's worlds)")
    p.add_argument("--gsm8k-profile", default=None, help="the GSM8K profile of the measured prompts and of the "
                   "projected gate [default: the gate's]")
    p.add_argument("--projection-items", type=int, default=None, help="count the prompts of only the first N items "
                   "of each task (a smoke run; the item counts stay the tasks')")
    p.add_argument("--no-conformance", dest="conformance", action="store_false", help="do not time the kernel "
                   "conformance + execution witness a run does before generating (the projection prices it)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    fused = tuple(f.strip() for f in args.fused.split(",") if f.strip())
    for choice in fused:
        if choice not in ("triton", "torch"):
            p.error(f"--fused {choice!r}: expected triton or torch")
    with CLOCK:  # Triton's compilation, timed apart from what it ran in
        return measure(args, fused)


def measure(args, fused: tuple[str, ...]) -> dict:
    """What ``main`` was asked to measure, with its parsed arguments."""
    import evalgate.kernels.catalogs  # noqa: F401  (registers the kernels)
    from evalgate.model_adapters.fast import attention
    from evalgate.model_adapters.hf.adapter import load_model
    from evalgate.model_adapters.loading.placement import gib
    from evalgate.model_adapters.canonical.fp8_linear import is_fp8
    from random_fp4 import write_random_fp4_checkpoint, write_released_checkpoint
    from evalgate.model_adapters.loading.streamed import default_reserve, device_capacities, resolve_devices

    out = Path(args.out)
    full = flash_config(experts=args.experts, scale=args.scale)
    devices = device_capacities(resolve_devices(args.device_map))
    on_gpus = all(d.startswith("cuda") for d, _ in devices)
    released = args.layout == "released"
    stored = mtp = None
    if released:  # what a GPU holds: FP8 dense weights as stored (a CPU dequantizes them to BF16)
        full_sizes, stored, mtp = released_unit_bytes(full, keep_fp8=True)
    else:
        full_sizes = unit_bytes_of(full)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    reserve = default_reserve(full.to_dict(), "bfloat16", tokens=max([args.batch_size, *batches]) * 2048)
    per_layer = max(v for k, v in full_sizes.items() if k.startswith("layer."))
    fixed = full_sizes["prefix"] + full_sizes["suffix"]
    whole = sum(full_sizes.values())
    expert_layer = full.n_routed_experts * 3 * full.hidden_size * full.moe_intermediate_size * 17 // 32
    figures = {"config": {k: getattr(full, k) for k in ("hidden_size", "moe_intermediate_size", "num_hidden_layers",
                                                         "n_routed_experts", "num_experts_per_tok", "vocab_size")},
               "layout": args.layout, "whole_model_bytes": whole, "whole_model_gib": round(whole / GiB, 2),
               "per_layer_gib": round(per_layer / GiB, 3), "experts_per_layer_gib": round(expert_layer / GiB, 3),
               "h200s_needed": h200s_needed(full_sizes, reserve)}
    dense = "FP8 as stored" if released else "BF16"
    print(f"whole model ({full.num_hidden_layers} layers, {args.layout} layout): {gib(whole)} resident on GPUs "
          f"(packed FP4 experts {gib(expert_layer)} per layer, dense {dense} {gib(per_layer - expert_layer)} per "
          f"layer, embedding + head {gib(fixed)}); {reserve.describe()}: needs {figures['h200s_needed']} H200(s) "
          "of 139 GiB")
    if released:
        figures.update(stored_gib=round(stored / GiB, 2), mtp_stored_gib=round(mtp / GiB, 2))
        print(f"on disk: {gib(stored)} ({gib(mtp)} of it the MTP layer, never loaded)")
    if released and not on_gpus:  # a CPU dequantizes the FP8 dense weights: plan with what it will hold
        full_sizes = released_unit_bytes(full, keep_fp8=False)[0]
        per_layer = max(v for k, v in full_sizes.items() if k.startswith("layer."))
        fixed = full_sizes["prefix"] + full_sizes["suffix"]

    out.parent.mkdir(parents=True, exist_ok=True)
    disk_free = shutil.disk_usage(out.parent).free - 2 * GiB
    fit = layers_that_fit(per_layer, fixed, devices, reserve, disk_free, full.num_hidden_layers)
    layers = args.layers if args.layers is not None else fit
    if layers < 1:
        sys.exit(f"not even one layer fits: {gib(per_layer)} per layer + {gib(fixed)}, devices "
                 f"{', '.join(f'{d} {gib(c)}' for d, c in devices)}, disk {gib(disk_free)} free")
    print(f"writing {layers} of {full.num_hidden_layers} layers (fit: {fit} on "
          f"{', '.join(f'{d} {gib(c)} free' for d, c in devices)}; disk {gib(disk_free)} free) to {out}")
    config = flash_config(layers=layers, experts=args.experts, scale=args.scale)
    t0 = time.perf_counter()
    stamp = out / "config.json"
    if args.reuse and stamp.is_file() and json.loads(stamp.read_text()).get("num_hidden_layers") == layers:
        print("reusing the checkpoint in", out)
    else:
        if out.exists():
            shutil.rmtree(out)
        write = write_released_checkpoint if released else write_random_fp4_checkpoint
        write(out, config, tokenizer_for(out), log=lambda s: print("  " + s, flush=True))
    figures["write_s"] = round(time.perf_counter() - t0, 1)
    figures["layers"] = layers

    if args.aa and not (args.items > 0 or batches or args.fp8_cost):  # the canonical A/A alone: one load
        figures["canonical_aa"] = canonical_aa(out, args)
        return _close(figures, out, args)
    _reset_peaks([d for d, _ in devices])
    t0 = time.perf_counter()
    model, tokenizer = load_model(out, args.kernel, numerics="native", device_map=args.device_map)
    figures["load_s"] = round(time.perf_counter() - t0, 1)
    placement = model._evalgate_placement
    resident = _nbytes(list(model.parameters()) + list(model.buffers()))
    figures["resident_gib"] = round(resident / GiB, 2)
    fp8 = [m for m in model.modules() if is_fp8(m)]
    held = _nbytes(m.__dict__["_evalgate_held"] for m in fp8 if "_evalgate_held" in m.__dict__)
    figures["held_dequantized_gib"] = round(held / GiB, 2)
    print(f"loaded in {figures['load_s']} s: {placement.summary()}; resident {gib(resident)} (parameters and "
          f"buffers; {len(fp8)} dense linears kept FP8) + {gib(held)} of their BF16 dequantizations held (read by "
          "the steps; the floor counts the FP8 codes)")
    bad = [n for n, p_ in model.named_parameters() if ".experts." in n and p_.dtype.is_floating_point]
    assert not bad, f"dequantized expert parameters: {bad[:3]}"
    attention.install(model)  # what a GPU load installs; on a CPU too, so a smoke run measures the same path

    if args.items > 0:
        figures.update(generate_items(model, tokenizer, placement, args, layers, full.num_hidden_layers,
                                      layers * expert_layer))
    if batches:
        first = placement.devices[0]
        device = first if first.startswith("cuda") else "cpu"
        bandwidth = copy_bandwidth(device)
        prompts, _ = gsm8k_prompts(min(max(batches), 64), args.gsm8k_profile)  # the projected profile's prompts
        gsm8k_prompt = sum(len(tokenizer(x, add_special_tokens=False)["input_ids"]) for x in prompts) / len(prompts)
        measured = []
        measure_batch(model, tokenizer, prompts, 1, 1, placement.devices, bandwidth)  # warm-up: Triton compiles
        caches = [c.strip() for c in args.cache.split(",") if c.strip()]
        slot_modes = tuple(c for c in caches if c in ("slots", "graphs"))
        for cache in [c for c in caches if c not in slot_modes] + (["slots"] if slot_modes else []):
            try:
                if cache == "slots":
                    measured += measure_slots(model, tokenizer, prompts, batches, args.steps, placement.devices,
                                              bandwidth, slot_modes, fused,
                                              Path(args.profile) if args.profile else None,
                                              prompt_cache=not args.no_prompt_cache,
                                              prefill_shapes=tuple(tuple(map(int, s.split("x")))
                                                                   for s in args.prefill_shapes.split(",") if s))
                    continue
                for b in batches:
                    measured.append(measure_batch(model, tokenizer, prompts, b, args.steps, placement.devices,
                                                  bandwidth))
                    print(json.dumps(measured[-1]), flush=True)
            except torch.cuda.OutOfMemoryError as exc:  # the table says so, and what was measured still counts
                print(f"{cache} cache: out of memory: {str(exc).splitlines()[0]}", flush=True)
                figures.setdefault("out_of_memory", []).append(cache)
                torch.cuda.empty_cache()
        rows = measured
        if args.conformance:
            figures.update(conformance_seconds(model, tokenizer, args.kernel, prompts[:2], first)
                           or {"conformance_s": None})
        figures.update(compile_s=round(CLOCK.counted(), 2), compiled_kernels=dict(CLOCK.kernels))
        if not layer_kinds(full) <= layer_kinds(config):  # a kind the measured layers lack compiles its own kernels
            figures["compile_s"] = round(figures["compile_s"] * full.num_hidden_layers / layers, 2)
        print(f"Triton compilation in this run: {figures['compile_s']:.2f} s priced once a gate, "
              f"{sum(CLOCK.kernels.values())} kernel variants ({len(CLOCK.kernels)} kernels)", flush=True)
        figures["gate_projection"] = project_rows(rows, figures, tokenizer, args, layers, full.num_hidden_layers)
        figures.update(copy_bandwidth_gb_s=round(bandwidth / 1e9, 1), gsm8k_prompt_tokens=round(gsm8k_prompt, 1),
                       batches=rows)
        print_table(rows, bandwidth, device)
    if args.fp8_cost:
        if args.hf_fp8_kernel:
            use_local_hf_fp8_kernel(args.hf_fp8_kernel)
        figures["fp8_linear_cost"] = fp8_linear_cost(model, placement.devices[0])
    if args.aa:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        figures["canonical_aa"] = canonical_aa(out, args)
    return _close(figures, out, args)


def _close(figures: dict, out: Path, args) -> dict:
    """Write the figures (``--json``), delete the checkpoint unless ``--keep``, print them."""
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
