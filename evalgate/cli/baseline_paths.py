"""What ``gate --baseline PATH`` accepts, as the Python API does: a baseline or run folder, a baselines root, a
model or profile folder under one, or a gate's output folder (the baselines it decided with)."""

from __future__ import annotations

from pathlib import Path

from evalgate.errors import UserError

MANIFEST = "manifest.json"
ACCEPTED = ("pass a baseline or run folder (with manifest.json), a baselines root (results/baselines), a model "
            "or profile folder under one, or a gate's output folder (with gate.json)")


def resolve_baselines(paths: tuple[str, ...], kernel: str) -> tuple[tuple[str, ...], str | None]:
    """(baseline folders, a baselines root to look the baseline up in, or None) for the --baseline values."""
    from evalgate.run.baselines import baseline_folders  # reads manifests: loaded only when a --baseline is given

    folders: list[str] = []
    roots: list[Path] = []
    for value in paths:
        path = Path(value)
        if not path.exists():
            raise UserError(f"--baseline {value!r} does not exist; {ACCEPTED}")
        if not path.is_dir():
            raise UserError(f"--baseline {value!r} is a file; {ACCEPTED}")
        if (path / MANIFEST).is_file():
            folders.append(value)
        elif (path / "gate.json").is_file():
            from evalgate.records import load_verdict

            record = load_verdict(path / "gate.json")
            dirs = record.baseline_dirs or ([record.baseline.path] if record.baseline is not None else [])
            if not dirs:
                raise UserError(f"--baseline {value!r}: that gate decided against no stored baseline folder")
            folders += dirs
        elif baseline_folders(path, 3):  # <root>/<model>/<profile>/<kernel>
            roots.append(path)
        elif baseline_folders(path, 2):  # a model folder: its root decides
            roots.append(path.parent)
        elif baseline_folders(path, 1):  # a profile folder: its <kernel> baseline
            from evalgate.records import load_manifest

            stored = {load_manifest(d / MANIFEST).kernel.name: d for d in baseline_folders(path, 1)}
            chosen = stored.get(kernel)
            if chosen is None:
                kernels = ", ".join(sorted(stored))
                raise UserError(f"--baseline {value!r} holds no {kernel} baseline (it has: {kernels}); pass "
                                "--baseline-kernel or another folder")
            folders.append(str(chosen))
        else:
            raise UserError(f"--baseline {value!r} holds no baseline; {ACCEPTED}")
    if roots and (folders or len(set(roots)) > 1):
        raise UserError("--baseline: give one baselines root (or a model folder under it), or baseline folders, "
                        "not both")
    return tuple(folders), (str(roots[0]) if roots else None)
