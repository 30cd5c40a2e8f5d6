"""Why an item flipped: where the two kernels' generations first part, and how close the model was to a tie.

``Explainer(pairing)`` loads the checkpoint once per kernel (baseline's and candidate's, canonical numerics)
and replays an item's two generations teacher-forced (``model_adapters/hf/replay.py``): the first token where
they differ; there, each kernel's top-2 tokens with their log-probabilities and the margin between them;
the KL divergence between the kernels' next-token distributions along the shared prefix; and, at the
position that predicts the divergent token, each MoE layer's routed-experts output under both kernels:
as the runs computed it (each on its own hidden states, so upstream drift included) and on the same input
(the baseline's hidden states through both kernels: what this layer's kernel itself changes), with the
selected expert whose contribution differs most.

A flip is a **near-tie** when both kernels' top-2 margins at the first divergent token are under
``NEAR_TIE_NATS``, else a **divergence** (docs/explain.md#near-tie-or-divergence says why that threshold).
Everything here is a function of the two runs and the checkpoint: with canonical numerics an explanation
is the same bit for bit on every replay.
"""

from __future__ import annotations

import html
import time
from dataclasses import asdict, dataclass, field, fields
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from evalgate.errors import UserError

if TYPE_CHECKING:
    from evalgate.gate.compare import Pairing

# Both kernels' top-2 log-probability margins below this at the first divergent token: a near-tie that a
# healthy kernel's rounding can resolve either way (docs/explain.md#near-tie-or-divergence).
NEAR_TIE_NATS = 0.5

NEAR_TIE, DIVERGENCE, SAME_TOKENS, NOT_REPLAYED = "near-tie", "divergence", "same tokens", "not replayed"
SIDES = ("base", "cand")


@dataclass(frozen=True)
class TopToken:
    token: int
    text: str
    logprob: float


@dataclass(frozen=True)
class KernelChoice:
    """One kernel's next-token distribution at the first divergent token (teacher-forced on the shared prefix)."""

    kernel: str
    top: tuple[TopToken, TopToken]
    margin: float  # top-1 minus top-2 log-probability, nats


@dataclass(frozen=True)
class LayerDifference:
    """One MoE layer at the position that predicts the first divergent token."""

    layer: int
    rel_diff: float  # |out_cand - out_base| / |out_base|, each kernel on its own run's hidden states
    local_rel_diff: float  # the same with both kernels fed the baseline's hidden states
    expert: int | None  # the selected expert whose contribution differs most (same input; a contribution is
    # the kernel's output minus its output with that expert's router weight zeroed, combine included)
    expert_rel_diff: float  # |its contribution under cand - under base| / |out_base|
    routing_differs: bool  # the two runs selected different experts here
    selected: tuple[int, ...] = ()  # the experts the baseline's router selected here, in slot order


@dataclass(frozen=True)
class Explanation:
    """Why one item's two generations differ. ``kind``: near-tie, divergence, same tokens (the two runs
    generated the same tokens: the flip is not the kernel's) or not replayed (``cannot`` says why)."""

    task: str
    doc_id: object
    direction: str | None  # "lost", "gained", or None for an item that did not flip
    kind: str
    base_kernel: str
    cand_kernel: str
    threshold: float = NEAR_TIE_NATS
    position: int | None = None  # index, in the generation, of the first token that differs
    shared_text: str | None = None  # the shared generated prefix's last characters
    base: KernelChoice | None = None
    cand: KernelChoice | None = None
    base_token: str | None = None  # what each run generated at ``position``
    cand_token: str | None = None
    kl_mean: float | None = None  # KL(base || cand) of the next-token distributions, nats, positions 0..position
    kl_max: float | None = None
    layers: tuple[LayerDifference, ...] = ()
    layer: int | None = None  # where the kernels' own outputs differ most (same input): layer and expert
    expert: int | None = None
    reproduced: bool | None = None  # the replay reproduced both stored texts
    notes: tuple[str, ...] = ()
    cannot: str | None = None  # what this explanation could not say, and why

    @property
    def margin(self) -> float | None:
        """The larger of the two kernels' top-2 margins at the first divergent token (what ``kind`` compares)."""
        if self.base is None or self.cand is None:
            return None
        return max(self.base.margin, self.cand.margin)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["margin"] = self.margin
        return out

    def line(self) -> str:
        """One line: kind, where, the tokens and margins, the layer and expert."""
        head = f"{self.task} {self.doc_id}" + (f" ({self.direction})" if self.direction else "")
        if self.kind in (SAME_TOKENS, NOT_REPLAYED):
            return f"{head}: {self.kind}" + (f": {self.cannot}" if self.cannot else "")
        where = (f"token {self.position}: {self.base_kernel} {self.base_token!r} vs {self.cand_kernel} "
                 f"{self.cand_token!r}")
        if self.base is None:
            return f"{head}: {self.kind} at {where}" + (f"; {self.cannot}" if self.cannot else "")
        assert self.cand is not None  # replayed: both sides chose
        text = (f"{head}: {self.kind} at {where}; margins {self.base.margin:.3f} / {self.cand.margin:.3f} nats, "
                f"KL along the prefix mean {self.kl_mean:.2e} max {self.kl_max:.2e}")
        if self.layer is not None:
            text += f"; differs most at layer {self.layer} expert {self.expert}"
        return text

    @property
    def top(self):
        """Each kernel's top-2 tokens at the first divergent token, as a DataFrame."""
        import pandas as pd

        rows = [{"kernel": c.kernel, "side": side, "rank": rank + 1, "token": t.text, "token_id": t.token,
                 "logprob": t.logprob, "margin": c.margin}
                for side, c in (("baseline", self.base), ("candidate", self.cand)) if c is not None
                for rank, t in enumerate(c.top)]
        return pd.DataFrame(rows, columns=["kernel", "side", "rank", "token", "token_id", "logprob", "margin"])

    @property
    def frame(self):
        """One row per MoE layer at the first divergent token, as a DataFrame."""
        import pandas as pd

        return pd.DataFrame([asdict(x) for x in self.layers], columns=[f.name for f in fields(LayerDifference)])

    def _repr_html_(self) -> str:
        e = html.escape
        parts = [f"<div><b>{e(self.task)} {e(str(self.doc_id))}</b>"
                 + (f" ({e(self.direction)})" if self.direction else "")
                 + f": <b>{e(self.kind)}</b></div>"]
        if self.position is not None:
            parts.append(f"<div>first divergent token: {self.position}, after …<code>{e(self.shared_text or '')}"
                         f"</code> — {e(self.base_kernel)} <code>{e(repr(self.base_token))}</code>, "
                         f"{e(self.cand_kernel)} <code>{e(repr(self.cand_token))}</code></div>")
        if self.base is not None:
            parts.append(f"<div>margin rule: near-tie when both margins &lt; {self.threshold} nats; KL along the "
                         f"shared prefix mean {self.kl_mean:.3g}, max {self.kl_max:.3g} nats</div>")
            parts.append(self.top.to_html(index=False, float_format=lambda v: f"{v:.4f}"))
        if self.layers:
            parts.append(f"<div>MoE output at that position (differs most: layer {self.layer}, expert "
                         f"{self.expert})</div>")
            parts.append(self.frame.to_html(index=False, float_format=lambda v: f"{v:.3g}"))
        for note in self.notes + ((self.cannot,) if self.cannot else ()):
            parts.append(f"<div><i>{e(note)}</i></div>")
        return "\n".join(parts)


def summary_line(explanations: list[Explanation], threshold: float = NEAR_TIE_NATS) -> str:
    """E.g. "3 of 5 flips are near-ties: margin < 0.5 nats at the first divergent token"."""
    n = len(explanations)
    ties = sum(x.kind == NEAR_TIE for x in explanations)
    verb = "is a near-tie" if ties == 1 else "are near-ties"
    line = f"{ties} of {n} flips {verb}: margin < {threshold:g} nats at the first divergent token"
    other = {k: sum(x.kind == k for x in explanations) for k in (SAME_TOKENS, NOT_REPLAYED)}
    extra = [f"{v} {k}" for k, v in other.items() if v]
    # what could not be explained says why, in the same line (e.g. a server run: no in-process model)
    reasons = list(dict.fromkeys(x.cannot for x in explanations if x.kind == NOT_REPLAYED and x.cannot))
    if reasons:
        extra[-1] += f": {reasons[0]}" + (f" (and {len(reasons) - 1} other reason(s))" if len(reasons) > 1 else "")
    return line + (f" ({'; '.join(extra)})" if extra else "")


# --- the gate's outputs ------------------------------------------------------------------------------


def explained_flips(comparison, explanations, replay_seconds: float | None = None,
                    load_seconds: float | None = None):
    """``explanations`` of ``comparison``'s flips (e.g. ``cmp.explain_flips()``) as the gate's outputs carry
    them: a ``evalgate.report.explained.FlipExplanations``, what ``evalgate gate --explain`` stores and renders."""
    from evalgate.report.explained import FlipExplanations, run_ids

    found = list(explanations)
    return FlipExplanations(tuple({**x.to_dict(), "line": x.line()} for x in found), summary_line(found),
                            NEAR_TIE_NATS, *run_ids(comparison), replay_seconds=replay_seconds,
                            load_seconds=load_seconds, replayed=sum(x.reproduced is not None for x in found))


def _device(run) -> str:
    """Where the run computed, when this machine has it (a replay reproduces the run there); else the CPU."""
    device = str(run.meta.model.device or "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "cpu"
    return device


def explain_flips(verdict, device: str | None = None):
    """Replay every flip of the verdict's comparison (``evalgate gate --explain``); None for an aggregate-only
    verdict (no items). A run through a server is not replayed (no in-process model) and the summary line
    says so; anything else that stops the replay is said there too instead of failing the gate, whose verdict
    stands without it."""
    from evalgate.report.explained import FlipExplanations, flip_ids, run_ids

    cmp = verdict.comparison
    if cmp is None:
        return None
    wanted = flip_ids(cmp)
    if not wanted:
        return FlipExplanations((), "no flips: nothing to explain", NEAR_TIE_NATS, *run_ids(cmp))
    explainer = Explainer(cmp, device=device or _device(cmp.candidate))
    try:
        load_s = explainer.load(sorted({task for task, _ in wanted}))
        t0 = time.perf_counter()
        found = [explainer.explain(task, doc_id) for task, doc_id in wanted]
        spent = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - the verdict is decided; an explanation must not lose it
        why = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        return FlipExplanations((), f"{len(wanted)} flip(s) not explained: {why}", NEAR_TIE_NATS, *run_ids(cmp))
    return explained_flips(cmp, found, replay_seconds=spent, load_seconds=load_s)


# --- replay -----------------------------------------------------------------------------------------


def _spec_of(run, task: str):
    """The run's own RunSpec (the manifest's ``spec``), cut to ``task``: its items and prompts rebuilt."""
    from evalgate.run.spec import RunSpec

    info = run.meta.spec
    stored = info.to_dict() if info is not None else {}  # the RunSpec's fields, by name
    known = {f.name for f in fields(RunSpec)}
    spec = RunSpec(**{k: v for k, v in stored.items() if k in known and k not in ("model", "kernel", "tasks")},
                   model=(info.model if info is not None else None) or "",
                   kernel=(info.kernel if info is not None else None) or "", tasks=[task])
    return spec


def _greedy(run, task: str) -> bool:
    summary = run.meta.tasks.get(task)
    decoding = (summary.decoding if summary is not None else None) or {}
    return not decoding.get("do_sample") and float(decoding.get("temperature") or 0.0) == 0.0


def _in_process(run) -> bool:
    return run.meta.model.adapter == "hf"


@dataclass
class Explainer:
    """Explains items of one pairing by replaying them in-process; loads each kernel's model on first use.

    ``model``: the checkpoint to replay (default: the candidate run's own, checked against its recorded
    fingerprint; the canary's wherever it is installed). A run through a server is replayed only with
    ``model`` given (its kernels' in-process emulations stand in for the server's, and the notes say so)."""

    pairing: Pairing
    model: str | Path | None = None
    device: str = "cpu"
    seconds: dict = field(default_factory=dict)  # (task, doc_id) -> seconds its replay took
    _models: dict = field(default_factory=dict, repr=False)
    _requests: dict = field(default_factory=dict, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def kernels(self) -> dict[str, str]:
        return {"base": self.pairing.baseline.kernel, "cand": self.pairing.candidate.kernel}

    def checkpoint(self) -> Path | None:
        """The checkpoint to replay, or None when there is none to use (a server run without ``model``)."""
        from evalgate.model_adapters.hf.fingerprint import model_fingerprint

        info = self.pairing.candidate.meta.model
        if self.model is not None:
            path = Path(self.model)
        elif _in_process(self.pairing.candidate):
            path = Path(info.path or "")
        else:
            return None
        if not (path / "config.json").is_file():
            from evalgate.canary import canary_path

            canary = canary_path()
            if info.fingerprint and model_fingerprint(canary).get("fingerprint") == info.fingerprint:
                return canary  # the canary of this installation: the same bytes
            raise UserError(f"the run's model {str(path)!r} is not there; pass the checkpoint to replay "
                            "(model=PATH, --model PATH)")
        if self.model is None and info.fingerprint and model_fingerprint(path).get("fingerprint") != info.fingerprint:
            raise UserError(f"{str(path)!r} is no longer the checkpoint the run used (fingerprint changed); pass "
                            "the one it used (model=PATH, --model PATH)")
        return path

    def load(self, tasks: Sequence[str] = ()) -> float:
        """Load both kernels' models (where there is a checkpoint to replay) and ``tasks``' prompts now; the
        seconds it took."""
        t0 = time.perf_counter()
        path = self.checkpoint()
        if path is not None:
            self._loaded(path)
            for task in tasks:
                self._prompts(task)
        return time.perf_counter() - t0

    def _loaded(self, path: Path):
        if not self._models:
            from evalgate.model_adapters.hf.adapter import load_model

            numerics = getattr(self.pairing.candidate.meta.model, "numerics", None) or "canonical"
            mode = "native" if numerics == "native" else "canonical"
            for side, kernel in self.kernels.items():
                model, tokenizer = load_model(path, kernel, self.device, numerics=mode)
                self._models[side] = (model, kernel)
                self._models["tokenizer"] = tokenizer
        return self._models

    def _prompts(self, task: str) -> dict:
        """doc_id -> the Request the run made of each item of ``task``, rebuilt from its manifest's spec."""
        if task not in self._requests:
            from evalgate.run.spec import load_tasks

            loaded = load_tasks(_spec_of(self.pairing.candidate, task))[task]
            self._requests[task] = {str(r.doc_id): r for r in loaded.task.requests(loaded.items, loaded.resolved)}
        return self._requests[task]

    def _request(self, task: str, doc_id):
        request = self._prompts(task).get(str(doc_id))
        if request is None:
            raise UserError(f"{task} item {doc_id!r} is not among the run's items")
        return request

    def explain(self, task: str, doc_id) -> Explanation:
        key = (task, str(doc_id))
        if key not in self._cache:
            t0 = time.perf_counter()
            self._cache[key] = self._explain(task, doc_id)
            self.seconds[key] = time.perf_counter() - t0
        return self._cache[key]

    def _explain(self, task: str, doc_id) -> Explanation:
        from evalgate.types import sha256_text

        p = self.pairing.pairs.get(task)
        if p is None:
            raise UserError(f"no task {task!r} in this comparison; it has: {', '.join(self.pairing.pairs)}")
        index = {str(d): i for i, d in enumerate(p.doc_ids)}
        if str(doc_id) not in index:
            raise UserError(f"{task} has no item {doc_id!r}; ids run from {p.doc_ids[0]!r} to {p.doc_ids[-1]!r}")
        i = index[str(doc_id)]
        base, cand = p.base[i], p.cand[i]
        bs, cs = p.scores("base")[i], p.scores("cand")[i]
        direction = None if bs == cs else ("lost" if bs > cs else "gained")
        head = dict(task=task, doc_id=p.doc_ids[i], direction=direction, base_kernel=self.kernels["base"],
                    cand_kernel=self.kernels["cand"])
        texts = {"base": base.get("resps"), "cand": cand.get("resps")}
        if doc_id in p.imputed or p.doc_ids[i] in p.imputed:
            return Explanation(**head, kind=NOT_REPLAYED, cannot="the candidate stopped early before running this item")
        if not all(isinstance(t, str) for t in texts.values()):
            return Explanation(**head, kind=NOT_REPLAYED, cannot="the records hold k samples per item; explain "
                               "replays greedy runs (one response per item)")
        if not (_greedy(self.pairing.baseline, task) and _greedy(self.pairing.candidate, task)):
            return Explanation(**head, kind=NOT_REPLAYED, cannot="sampled runs (temperature > 0) are not replayed: "
                               "explain covers greedy runs")
        if texts["base"] == texts["cand"]:
            return Explanation(**head, kind=SAME_TOKENS, reproduced=None,
                               cannot="both runs generated the same text: the flip comes from scoring, not the kernel")
        path = self.checkpoint()
        if path is None:
            return _text_only(head, texts, self.pairing.candidate)
        request = self._request(task, p.doc_ids[i])
        notes = []
        for side, record in (("baseline", base), ("candidate", cand)):
            if record.get("prompt_hash") and record["prompt_hash"] != sha256_text(request.prompt):
                raise UserError(f"{task} item {doc_id!r}: the rebuilt prompt is not the one the {side} run was asked "
                                "(prompt_hash differs); the task's data or profile changed since")
        if not _in_process(self.pairing.candidate) or not _in_process(self.pairing.baseline):
            notes.append("a run went through a server: its kernel is replayed by the in-process kernel of the same "
                         "name on the given checkpoint, which may not be the server's numerics")
        models = self._loaded(path)
        from evalgate.model_adapters.hf.replay import replay_pair

        replay = replay_pair({s: models[s] for s in SIDES}, models["tokenizer"], request.prompt, texts, request.stop,
                             request.max_new_tokens, self.device)
        return _from_replay(head, replay, models, notes)


def _text_only(head: dict, texts: dict, run) -> Explanation:
    """A server run without a checkpoint to replay: where the texts part, and what cannot be said."""
    a, b = texts["base"], texts["cand"]
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return Explanation(**head, kind=NOT_REPLAYED, shared_text=a[max(0, at - 40):at], base_token=a[at:at + 12],
                       cand_token=b[at:at + 12],
                       notes=(f"the texts part at character {at}",),
                       cannot="no in-process model: the run went through a server, whose records hold no "
                              "log-probabilities; margins, KL and the MoE layer need the checkpoint replayed "
                              "in-process (`evalgate explain RUN --model PATH`, model=PATH)")


def _top2(logprobs, tokenizer) -> tuple[TopToken, TopToken]:
    """The two most likely tokens, equal log-probabilities in token order (greedy decoding takes the lowest
    index among equal maxima)."""
    values, ids = logprobs.topk(min(16, logprobs.numel()))
    best = sorted(zip((-v for v in values.tolist()), ids.tolist()))[:2]
    first, second = (TopToken(t, tokenizer.decode([t]), -v) for v, t in best)
    return first, second


def _norm(t) -> float:
    return float(t.double().norm())


def _from_replay(head: dict, replay, models: dict, notes: list[str]) -> Explanation:
    import torch

    from evalgate.model_adapters.hf.replay import experts_on

    tokenizer = models["tokenizer"]
    notes = notes + replay.notes
    reproduced = all(s.reproduced for s in replay.sides.values())
    if not reproduced:
        notes.append("the replay did not reproduce a stored text (numerics differ from the run's); the tokens "
                     "explained are the replay's")
    d = replay.divergence
    if d is None:
        return Explanation(**head, kind=SAME_TOKENS, reproduced=reproduced, notes=tuple(notes),
                           cannot="the replayed tokens agree: the texts differ only after decoding")
    fb, fc = replay.forwards["base"], replay.forwards["cand"]
    tokens = {s: replay.sides[s].tokens for s in SIDES}
    lb, lc = fb.logprobs[:d + 1].double(), fc.logprobs[:d + 1].double()
    kl = (lb.exp() * (lb - lc)).sum(-1).clamp(min=0.0)
    choices = {}
    for side, f in (("base", fb), ("cand", fc)):
        top = _top2(f.logprobs[d], tokenizer)
        choices[side] = KernelChoice(head[f"{side}_kernel"], top, top[0].logprob - top[1].logprob)
    kind = NEAR_TIE if max(c.margin for c in choices.values()) < NEAR_TIE_NATS else DIVERGENCE
    shared = tokenizer.decode(tokens["base"][:d], skip_special_tokens=True)
    layers: list[LayerDifference] = []
    worst: tuple[float, int | None, int | None] = (-1.0, None, None)
    position = fb.position(d)
    for layer in sorted(fb.moe):
        cb, cc = fb.moe[layer], fc.moe[layer]
        out_b, out_c = cb.output[position].float(), cc.output[position].float()
        base_norm = max(_norm(out_b), 1e-30)
        args = (layer, cb.hidden[position], cb.index[position], cb.weights[position])
        same_b, slots_b = experts_on(models["base"][0], models["base"][1], *args)
        same_c, slots_c = experts_on(models["cand"][0], models["cand"][1], *args)
        if not torch.equal(same_b, out_b):
            notes.append(f"layer {layer}: the baseline kernel on its captured input did not reproduce its output")
        per_expert = [_norm(slots_c[j] - slots_b[j]) / base_norm for j in range(slots_b.shape[0])]
        j = max(range(len(per_expert)), key=lambda k: per_expert[k]) if per_expert else None
        expert = int(cb.index[position][j]) if j is not None else None
        diff = LayerDifference(layer, _norm(out_c - out_b) / base_norm, _norm(same_c - same_b) / base_norm, expert,
                               per_expert[j] if j is not None else 0.0,
                               sorted(cb.index[position].tolist()) != sorted(cc.index[position].tolist()),
                               tuple(int(e) for e in cb.index[position].tolist()))
        layers.append(diff)
        if diff.expert_rel_diff > worst[0]:
            worst = (diff.expert_rel_diff, layer, expert)
    return Explanation(**head, kind=kind, position=d, shared_text=shared[-60:],
                       base=choices["base"], cand=choices["cand"],
                       base_token=tokenizer.decode([tokens["base"][d]]) if d < len(tokens["base"]) else None,
                       cand_token=tokenizer.decode([tokens["cand"][d]]) if d < len(tokens["cand"]) else None,
                       kl_mean=float(kl.mean()), kl_max=float(kl.max()), layers=tuple(layers),
                       layer=worst[1], expert=worst[2], reproduced=reproduced, notes=tuple(notes))

