"""Rows grouped by expert, padded so that each expert's block starts at a multiple of ``align`` (the
contiguous layouts of DeepGEMM's m-grouped GEMMs and of torch's grouped GEMMs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Padded:
    index: torch.Tensor  # [S]: where each sorted row sits in the padded buffer
    expert: torch.Tensor  # [M] int32: each padded row's expert, -1 for padding
    ends: torch.Tensor  # [E] int32: cumulative padded row counts (torch's ``offs``)
    rows: int  # M


def pad_by_expert(counts: torch.Tensor, align: int) -> Padded:
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts, sorted_starts = ends - padded, torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    index = starts[group] + torch.arange(int(counts.sum()), device=counts.device) - sorted_starts[group]
    m = int(ends[-1]) if len(ends) else 0
    expert = torch.full((m,), -1, dtype=torch.int32, device=counts.device)
    expert[index] = group.to(torch.int32)
    return Padded(index, expert, ends.to(torch.int32), m)


def scatter_rows(x: torch.Tensor, padded: Padded, fill: float = 0.0) -> torch.Tensor:
    """x [S, ...] sorted by expert -> [M, ...] in the padded layout, padding rows ``fill``."""
    fp8 = x.dtype == torch.float8_e4m3fn  # scattered as bytes: not every device indexes float8 tensors
    src = x.view(torch.uint8) if fp8 else x
    out = src.new_zeros((padded.rows, *x.shape[1:]))
    if fill:
        out.fill_(fill)
    out[padded.index] = src
    return out.view(torch.float8_e4m3fn) if fp8 else out
