"""Batched decoding with left padding and per-sequence stop strings: greedy, or keyed (coupled) sampling.

A small loop of our own instead of ``model.generate``: every row gets explicit position ids from its own
attention mask (so left padding never shifts positions), each row stops on its own stop strings or EOS,
and the loop ends when all rows are done. Only the last position's logits are computed, and the next
token is their argmax (the lowest index among equal maxima). A row given a ``SampleKey`` samples instead:
argmax(logits / T + Gumbel noise keyed by its stream seed and position), ``evalgate.model_adapters.sampling``;
its tokens depend on its prompt, seed and temperature alone, like a greedy row's on its prompt.

With canonical numerics (``invariant.install``, what ``hf.load_model`` does by default) what a row produces
is a function of its prompt alone: not of its batch neighbours, the padding, the thread count or the CPU's
instruction set (``tests/test_invariance.py``). With PyTorch's own numerics it can differ in the last bits,
and a near-tie can flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalgate.model_adapters.sampling import SampleKey, next_tokens


@dataclass
class RawGeneration:
    token_ids: list[int]  # generated tokens, up to and including the one that completed a stop / EOS
    text: str  # decoded, cut before the first stop string
    finish_reason: str  # "stop" | "length"
    stop_hit: str | None
    n_prompt_tokens: int


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """``text`` cut before the earliest stop string, and which stop string that was."""
    best, hit = len(text), None
    for s in stops:
        i = text.find(s)
        if i != -1 and i < best:
            best, hit = i, s
    return text[:best], hit


def greedy_generate(model, tokenizer, prompts: list[str], stops: list[tuple[str, ...]], max_new_tokens: list[int],
                    device: str = "cpu") -> list[RawGeneration]:
    """Every row greedy (argmax)."""
    return decode(model, tokenizer, prompts, stops, max_new_tokens, device)


@torch.no_grad()
def decode(model, tokenizer, prompts: list[str], stops: list[tuple[str, ...]], max_new_tokens: list[int],
           device: str = "cpu", keys: list[SampleKey | None] | None = None) -> list[RawGeneration]:
    """One generation per prompt; row i samples with ``keys[i]``, or is greedy when that is None (or no keys)."""
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = set(_eos_ids(model, tokenizer))
    batch, width = len(enc), max(len(e) for e in enc)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, ids in enumerate(enc):  # left padding: real tokens end at the right edge
        input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[i, width - len(ids):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)

    generated: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    texts = [""] * batch
    reasons = ["length"] * batch
    hits: list[str | None] = [None] * batch
    limit = max(max_new_tokens)
    past = None
    step_ids, attn_mask = input_ids, mask  # attn_mask covers the cache and the current step
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for step in range(limit):  # step = the index of the token being generated, the same for every live row
        out = model(input_ids=step_ids, attention_mask=attn_mask, position_ids=positions,
                    past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        live_keys = [None if done[i] else keys[i] for i in range(batch)] if keys else None  # no noise for finished rows
        next_ids = next_tokens(out.logits[:, -1, :].float(), live_keys, step)
        for i in range(batch):
            if done[i]:
                continue
            tok = int(next_ids[i])
            generated[i].append(tok)
            if tok in eos_ids:
                done[i], reasons[i] = True, "stop"
                generated[i].pop()  # EOS is not part of the response text
                texts[i] = tokenizer.decode(generated[i], skip_special_tokens=True)
                generated[i].append(tok)
                continue
            text = tokenizer.decode(generated[i], skip_special_tokens=True)
            cut, hit = cut_at_stop(text, stops[i])
            if hit is not None:
                done[i], reasons[i], hits[i], texts[i] = True, "stop", hit, cut
            elif len(generated[i]) >= max_new_tokens[i]:
                done[i], texts[i] = True, text
        if all(done):
            break
        # finished rows keep decoding a pad token (masked out) so the batch stays rectangular
        feed = torch.tensor([pad_id if done[i] else int(next_ids[i]) for i in range(batch)], device=device)
        step_ids = feed.unsqueeze(-1)
        attn_mask = torch.cat([attn_mask, torch.ones((batch, 1), dtype=torch.long, device=device)], -1)
        positions = positions[:, -1:] + 1
    for i in range(batch):
        if not done[i]:
            texts[i] = tokenizer.decode(generated[i], skip_special_tokens=True)
    return [RawGeneration(generated[i], texts[i], reasons[i], hits[i], len(enc[i])) for i in range(batch)]


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]
