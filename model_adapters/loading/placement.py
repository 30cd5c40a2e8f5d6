"""Where each part of a model goes, decided before a byte is loaded: pure arithmetic on byte counts.

A model is a row of *units* in forward order: ``prefix`` (embedding, rotary tables), ``layer 0 .. L-1``,
``suffix`` (final norm, hyper-connection head, output head). Each unit has a byte size (packed FP4 experts at
their stored size, dense weights at the load dtype: ``checkpoint_bytes.unit_bytes``). ``plan`` cuts the row
into contiguous runs, one per device, so that each device holds its weights plus a stated reserve for
activations, the KV cache and the kernels' workspace (``Reserve``). When the row cannot be cut that way it
raises a one-line ``UserError`` (exit 2) with the bytes needed and the bytes available on each device.

Nothing here touches torch or a device: ``device_capacities`` (the only function that asks the machine)
is kept apart so the planner is tested with made-up devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evalgate.errors import UserError

GiB = 1 << 30
PREFIX, SUFFIX = "prefix", "suffix"


def gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class Reserve:
    """Bytes kept free on every device that holds part of the model, beside its weights.

    ``workspace``: activations, logits and the emulated kernels' scratch (a DSV4-Flash MoE layer's
    ``w4a4_packed`` call allocates at most 3.4 GiB at 4096 tokens, 0.42 GiB at 512: README, Measured), the
    CUDA context and allocator slack. ``kv_per_token_layer``: KV-cache bytes one token costs in one layer;
    times the layers on the device and ``tokens`` (batch x sequence length)."""

    workspace: int = 4 * GiB
    kv_per_token_layer: int = 0
    tokens: int = 0

    def on_device(self, layers: int) -> int:
        return self.workspace + self.kv_per_token_layer * self.tokens * layers

    def describe(self) -> str:
        kv = (f" + KV {self.kv_per_token_layer} B/token/layer x {self.tokens} tokens x layers"
              if self.kv_per_token_layer and self.tokens else "")
        return f"reserve {gib(self.workspace)} workspace{kv} per device"


def kv_bytes_per_token_layer(config: dict, dtype_bytes: int = 2) -> int:
    """Upper bound of the KV cache one token adds to one layer: key and value, ``num_key_value_heads`` heads
    of ``head_dim`` at the load dtype (DeepSeek-V4's compressed layers keep fewer entries than that, its
    sliding window at most ``sliding_window`` tokens: an upper bound)."""
    heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // int(config.get("num_attention_heads") or 1))
    return 2 * heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class Placement:
    """unit -> device, in forward order; ``per_device``: bytes of weights placed on each device."""

    units: dict[str, str]  # "prefix" | "layer.N" | "suffix" -> device name
    per_device: dict[str, int] = field(default_factory=dict)
    reserve_per_device: dict[str, int] = field(default_factory=dict)

    @property
    def devices(self) -> list[str]:
        seen = []
        for d in self.units.values():
            if d not in seen:
                seen.append(d)
        return seen

    def device_of_layer(self, layer: int) -> str:
        return self.units[f"layer.{layer}"]

    def summary(self) -> str:
        parts = []
        for d in self.devices:
            layers = [int(u.split(".")[1]) for u, dev in self.units.items() if dev == d and u.startswith("layer.")]
            span = f"layers {min(layers)}-{max(layers)}" if layers else "no layers"
            parts.append(f"{d}: {span}, {gib(self.per_device[d])} weights + {gib(self.reserve_per_device[d])} reserve")
        return "; ".join(parts)


def unit_order(num_layers: int) -> list[str]:
    return [PREFIX] + [f"layer.{i}" for i in range(num_layers)] + [SUFFIX]


def _cut(sizes: list[tuple[str, int]], devices: list[tuple[str, int]], reserve: Reserve, target: float | None):
    """Greedy contiguous cut: fill each device in order up to its capacity (and, when ``target`` is given,
    move on once a device holds ``target`` bytes of weights). None when the row does not fit."""
    units: dict[str, str] = {}
    per_device: dict[str, int] = {}
    reserves: dict[str, int] = {}
    i, n = 0, len(sizes)
    for k, (name, capacity) in enumerate(devices):
        used, layers, last = 0, 0, k == len(devices) - 1
        while i < n:
            unit, size = sizes[i]
            more_layers = layers + unit.startswith("layer.")
            if used + size + reserve.on_device(more_layers) > capacity:
                break
            if target is not None and not last and used > 0 and used + size > target:
                break
            units[unit], used, layers, i = name, used + size, more_layers, i + 1
        if used:
            per_device[name], reserves[name] = used, reserve.on_device(layers)
    if i < n:
        return None
    return Placement(units, per_device, reserves)


def plan(sizes: dict[str, int], devices: list[tuple[str, int]], reserve: Reserve = Reserve(),
         balanced: bool = True) -> Placement:
    """Contiguous placement of ``sizes`` (unit -> bytes, see ``unit_order``) over ``devices`` ([(name,
    available bytes)], in order). Balanced: about the same weight bytes per device; falls back to filling
    devices in order when balancing does not fit. Raises ``UserError`` (one line) when nothing fits."""
    if not devices:
        raise UserError("no device to load the model on; pass --device cpu or make a GPU visible")
    layers = sum(u.startswith("layer.") for u in sizes)
    order = [(u, sizes[u]) for u in unit_order(layers) if u in sizes]
    total = sum(s for _, s in order)
    placement = None
    if balanced and len(devices) > 1:
        placement = _cut(order, devices, reserve, total / len(devices))
    if placement is None:
        placement = _cut(order, devices, reserve, None)
    if placement is None:
        raise UserError(does_not_fit(sizes, devices, reserve))
    return placement


def does_not_fit(sizes: dict[str, int], devices: list[tuple[str, int]], reserve: Reserve) -> str:
    """The one-line refusal: bytes needed (weights + reserve) against the bytes available per device."""
    weights = sum(sizes.values())
    layers = sum(u.startswith("layer.") for u in sizes)
    largest = max(sizes.items(), key=lambda kv: kv[1])
    needed_one = weights + reserve.on_device(layers)
    avail = ", ".join(f"{name} {gib(cap)}" for name, cap in devices)
    total_avail = sum(cap for _, cap in devices)
    return (f"the model does not fit: it needs {gib(needed_one)} ({gib(weights)} of weights over {layers} layers, "
            f"largest part {largest[0]} {gib(largest[1])}; {reserve.describe()}), available: {avail} "
            f"({gib(total_avail)} in all); use more devices (--device-map auto), fewer layers or a smaller batch")


def parse_device_map(value: str | None) -> list[str] | None:
    """``--device-map``: None (the default loader), ``auto`` (every visible GPU, else the CPU), or a comma
    list of devices (``cuda:0,cuda:1``, ``cpu``)."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        raise UserError("--device-map is empty; pass auto, cpu or a list such as cuda:0,cuda:1")
    if value == "auto":
        return ["auto"]
    devices = [d.strip() for d in value.split(",") if d.strip()]
    for d in devices:
        if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
            raise UserError(f"--device-map: unknown device {d!r}; use auto, cpu, cuda or cuda:N (comma-separated)")
    return devices
