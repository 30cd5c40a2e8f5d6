"""What a run is made from: its ``RunSpec`` (stored in the manifest), and its tasks loaded for it (items and
profile resolved, the run's overrides and sampling folded into the settings hashed into the profile id)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from evalgate.run.samples import Sampling
from evalgate.tasks import get_task, resolve_profile
from evalgate.tasks.base import Task
from evalgate.types import ResolvedProfile


@dataclass
class RunSpec:
    """Everything a run is made from; stored in the manifest so a run can be reproduced."""

    model: str
    kernel: str
    tasks: list[str]
    profiles: dict[str, str] = field(default_factory=dict)  # task -> profile name (default profile if absent)
    limit: int | None = None
    batch_size: int = 8
    device: str = "cpu"
    dtype: str | None = None
    data_dir: str | None = None
    datasets: dict = field(default_factory=dict)  # task -> its --dataset choice {"source", "columns"} (evalgate.tasks.source)
    order: str = "doc"  # "doc" or "reverse": the A/A second run decodes items in another order
    max_new_tokens: int | None = None  # override of the profile's limit; changes the profile id (smoke runs)
    # k samples per item at temperature T from run seed S (docs/scoring.md#k-samples); 1, 0.0: greedy
    samples: int = 1
    temperature: float = 0.0
    seed: int = 0

    def sampling(self) -> Sampling:
        return Sampling(self.samples, self.temperature, self.seed).check()


def with_overrides(profile, spec: RunSpec):
    """The profile with the run's overrides folded into its settings, so they are hashed like the rest."""
    if spec.max_new_tokens is None:
        return profile
    settings = {**profile.settings, "max_new_tokens": spec.max_new_tokens,
                "overrides": {"max_new_tokens": spec.max_new_tokens}}
    return replace(profile, settings=settings)


@dataclass(frozen=True)
class LoadedTask:
    """One task of a run, loaded once: its items and its profile resolved against them."""

    task: Task
    items: list[dict]
    resolved: ResolvedProfile
    data_dir: Path | None  # where its data came from (None: packaged); ``prepare`` takes it too

    @property
    def profile_id(self) -> str:
        return self.resolved.profile_id


def load_task(task, spec: RunSpec, data_dir):
    """(items, resolved profile) of ``task`` for ``spec``: overrides folded into the settings, the run's
    sampling settings into the decoding settings (both hashed into the profile id)."""
    profile = with_overrides(resolve_profile(task, spec.profiles.get(task.name)), spec)
    items, resolved = task.load(profile, data_dir, spec.limit, spec.datasets.get(task.name))
    return items, _sampled(resolved, spec)


def _sampled(resolved: ResolvedProfile, spec: RunSpec) -> ResolvedProfile:
    """The run's sampling settings folded into the decoding settings (hashed into the profile id)."""
    return replace(resolved, decoding=spec.sampling().decoding(resolved.decoding))


def with_sampling(loaded: LoadedTask, spec: RunSpec) -> LoadedTask:
    """A task loaded for a greedy run, resolved again for ``spec``'s sampling (the same items: no data read);
    greedy decoding settings are the profile's own, so the sampled ones derive from them as ``load_task``'s do."""
    return replace(loaded, resolved=_sampled(loaded.resolved, spec))


def load_tasks(spec: RunSpec) -> dict[str, LoadedTask]:
    """Every task of ``spec``, its data read and checked once (before any model is loaded)."""
    from evalgate.tasks.data import resolve_data_dir

    data_dir = resolve_data_dir(spec.data_dir)
    loaded = {}
    for name in spec.tasks:
        task = get_task(name)
        items, resolved = load_task(task, spec, data_dir)
        loaded[name] = LoadedTask(task, items, resolved, data_dir)
    return loaded
