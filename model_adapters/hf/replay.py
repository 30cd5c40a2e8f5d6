"""Teacher-forced replay of two generations of one prompt, each through the kernel that produced it.

What ``evalgate.explain`` builds its explanation of a flip from. A stored record keeps a generation's text,
not its token ids, so each side's tokens are recovered and checked: the text is tokenized and fed through
its own kernel's model in one forward pass; with canonical numerics that pass's logits at every position
are the decoding loop's bit for bit, so greedy decoding produced exactly the tokens whose argmax chain
holds, and the first position where the chain breaks is the token the run really generated there (a stop
string cut mid-token, or a tokenization that decoding never produced). Where the two recovered prefixes do
not reach their first difference, that side is decoded again greedily (``generation.decode``).

The forward passes record, with forward hooks on every routed-experts module, what each layer's experts
were handed (hidden states, top-k experts, router weights) and what they returned, at every position; the
caller picks the position that predicts the first divergent token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evalgate.kernels import get_kernel
from evalgate.kernels.checkpoint import experts_modules


@dataclass(frozen=True)
class MoECapture:
    """One routed-experts layer over every position of one forward pass."""

    hidden: torch.Tensor  # [T, H] the experts' input, in the dtype they got it
    index: torch.Tensor  # [T, K] selected experts
    weights: torch.Tensor  # [T, K] router weights (routed scaling included)
    output: torch.Tensor  # [T, H] the experts' combined output (what the kernel returned)


@dataclass
class Forward:
    """One teacher-forced pass of ``prompt + continuation`` through one kernel's model."""

    kernel: str
    n_prompt: int
    continuation: list[int]  # the token ids fed after the prompt
    logprobs: torch.Tensor  # [len(continuation) + 1, V] FP32; row i predicts continuation token i
    moe: dict[int, MoECapture]  # layer -> capture, rows = every input position

    def argmax(self) -> list[int]:
        return self.logprobs.argmax(-1).tolist()

    def position(self, i: int) -> int:
        """The input position whose output predicts continuation token ``i``."""
        return self.n_prompt + i - 1


@dataclass
class SideTokens:
    """What is known for certain of one run's generated tokens."""

    tokens: list[int]  # the generated tokens, as far as the replay has proved them
    reproduced: bool  # the replay agrees with the stored text over the whole text or up to the divergence
    regenerated: bool = False  # recovered by decoding again (the text's tokens did not reach the divergence)


@dataclass
class PairReplay:
    """Both runs' generations of one prompt replayed; ``divergence`` None when the token lists agree."""

    prompt_ids: list[int]
    sides: dict[str, SideTokens]
    forwards: dict[str, Forward]  # each side's own tokens through its own kernel
    divergence: int | None  # index into the generation of the first token that differs
    notes: list[str] = field(default_factory=list)


@torch.inference_mode()
def teacher_forced(model, kernel: str, prompt_ids: list[int], continuation: list[int]) -> Forward:
    """``prompt_ids + continuation`` in one forward pass (as the decoding loop's prefill calls the model),
    with every routed-experts module's inputs and output recorded at every position."""
    modules = experts_modules(model)
    seen: dict[int, MoECapture] = {}

    def recorder(layer):
        def hook(module, args, kwargs, output):
            names = ("hidden_states", "top_k_index", "top_k_weights")
            values = list(args[:3]) + [kwargs[n] for n in names[len(args):]]
            seen[layer] = MoECapture(*(v.detach().cpu() for v in values), output.detach().cpu())
        return hook

    hooks = [m.register_forward_hook(recorder(layer), with_kwargs=True) for layer, m in modules.items()]
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([prompt_ids + continuation], dtype=torch.long, device=device)
        mask = torch.ones_like(ids)
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits[0, len(prompt_ids) - 1:].float()
    return Forward(kernel, len(prompt_ids), list(continuation), torch.log_softmax(logits, -1).cpu(), seen)


def _proved(forward: Forward) -> tuple[list[int], bool]:
    """The generated tokens the forward pass proves: the fed tokens while each is its predecessor's argmax,
    then the argmax where the chain first breaks (the token greedy decoding took there)."""
    chosen = forward.argmax()
    for i, tok in enumerate(forward.continuation):
        if chosen[i] != tok:
            return forward.continuation[:i] + [chosen[i]], False
    return forward.continuation + [chosen[len(forward.continuation)]], True


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def replay_pair(models: dict, tokenizer, prompt: str, texts: dict[str, str], stops: tuple[str, ...],
                max_new_tokens: int, device: str = "cpu") -> PairReplay:
    """Replay two generations of ``prompt``. ``models``: side -> (model, kernel name) for the two sides
    ("base", "cand"); ``texts``: side -> the stored response text. Greedy generations only."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    forwards, proved, whole, notes = {}, {}, {}, []
    for side, (model, kernel) in models.items():
        fed = tokenizer(texts[side], add_special_tokens=False)["input_ids"]
        forwards[side] = teacher_forced(model, kernel, prompt_ids, fed)
        proved[side], whole[side] = _proved(forwards[side])
    divergence = _first_difference(proved["base"], proved["cand"])
    regenerated = {}
    if divergence is None:  # the proved tokens end before they differ: decode those sides again
        redo = [s for s in models if not whole[s]]
        if not redo and len(proved["base"]) != len(proved["cand"]):
            redo = [min(models, key=lambda s: len(proved[s]))]
        for side in redo:
            model, kernel = models[side]
            generated = _decoded(model, tokenizer, prompt, stops, max_new_tokens, device)
            regenerated[side] = generated.text == texts[side]
            proved[side] = generated.token_ids
            forwards[side] = teacher_forced(model, kernel, prompt_ids, generated.token_ids[:-1])
            notes.append(f"{side}: the stored text's tokens did not reach the first difference; decoded again")
        divergence = _first_difference(proved["base"], proved["cand"])
        if divergence is None and len(proved["base"]) != len(proved["cand"]):
            divergence = min(len(t) for t in proved.values())
    sides = {}
    for side in models:
        # the replay agrees with the run as far as it is used: over the whole text, or past the divergence
        reproduced = regenerated.get(side, whole[side] or (divergence is not None and len(proved[side]) > divergence))
        sides[side] = SideTokens(proved[side], reproduced, regenerated=side in regenerated)
    return PairReplay(prompt_ids, sides, forwards, divergence, notes)


def _decoded(model, tokenizer, prompt, stops, max_new_tokens, device):
    from evalgate.model_adapters.hf.generation import decode

    return decode(model, tokenizer, [prompt], [stops], [max_new_tokens], device)[0]


@torch.inference_mode()
def experts_on(model, kernel: str, layer: int, hidden: torch.Tensor, index: torch.Tensor,
               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel`` on ``model``'s routed experts of ``layer`` for one token (the captured input, as the layer
    got it): (combined output [H], each selected expert's contribution [K, H] in slot order), FP32 on the
    CPU. A contribution is the combined output minus the output with that slot's router weight zeroed, so
    it is what the kernel's whole computation (combine included) makes of that expert. One call per row:
    a faulty kernel may read across rows."""
    module = experts_modules(model)[layer]
    forward = get_kernel(kernel).experts_forward
    device = next(module.parameters()).device
    x, idx, w = hidden.to(device).view(1, -1), index.to(device).view(1, -1), weights.to(device).view(1, -1)
    combined = forward(module, x, idx, w)[0].float()
    without = []
    for j in range(idx.shape[1]):
        zeroed = w.clone()
        zeroed[0, j] = 0
        without.append(forward(module, x, idx, zeroed)[0].float())
    return combined.cpu(), (combined.unsqueeze(0) - torch.stack(without)).cpu()
