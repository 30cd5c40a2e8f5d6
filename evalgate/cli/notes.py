"""One-line notes on stderr for choices a command makes that the user did not spell out."""

from __future__ import annotations

from pathlib import Path

import click


def note(text: str) -> None:
    click.echo(f"evalgate: note: {text}", err=True)


def skipped_local_policy(source: str) -> None:
    """A ./thresholds.yaml here is not what a canary-scored gate decides by (it takes the canary's own)."""
    local = Path("thresholds.yaml")
    if source != "canary" or not local.is_file():
        return
    from evalgate.gate.policy import default_thresholds_path

    try:  # the packaged default's own copy (a source checkout's root) is not a choice the user made
        if local.read_bytes() == default_thresholds_path().read_bytes():
            return
    except OSError:
        pass
    note("./thresholds.yaml is not used: a run scored with the canary's profiles takes the canary's own policy; "
         "pass --thresholds ./thresholds.yaml to decide by it (its sections must name the canary's profiles)")


def full_profiles_on_canary(model: str | None, chosen: dict[str, str], task_list: list[str]) -> None:
    """--model naming the built-in canary runs the tasks' full profiles (the canary's own are chosen only
    without --model): say so, since on a CPU those take hours where the canary's take minutes."""
    if not model:
        return
    from evalgate.canary import CANARY_DIR, PROFILES

    try:
        if not Path(model).resolve() == CANARY_DIR.resolve():
            return
    except OSError:
        return
    full = [t for t in task_list if t in PROFILES and t not in chosen]
    if full:
        own = " ".join(f"--profile {t}={PROFILES[t]}" for t in full)
        note(f"--model names the built-in canary; {', '.join(full)} run their full profiles (many shots, "
             f"all items: hours on a CPU), not the canary's own: drop --model or pass {own}")
