"""Checks a command makes before its heavy start (imports of torch and transformers, the model's load, a
server's launch): every path it will read or write, the policy file, a server's address, the disk space a
run needs, and a lock on the run folder. Each failure is one line: a UserError (exit 2) for input, an
EnvironmentFailure (exit 4) for a folder that cannot be written or a disk too full.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
from pathlib import Path
from urllib.parse import urlsplit

from evalgate.errors import EnvironmentFailure, UserError

# A run's expected size: per item and sample a stored record (the canary's are 1.3 KB for GSM8K and 2.3 KB
# for HumanEval; a real model's longer answers fit in 16 KB), plus the reports (report.html holds every flip).
RECORD_BYTES = 16 * 1024
REPORT_BYTES = 4 * 1024 * 1024
SERVER_TIMEOUT_S = 5.0


def _existing(path: Path) -> Path:
    """The nearest folder on ``path``'s way that exists (``path`` itself when it does)."""
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return candidate
    return Path(".")


def writable_folder(path: str | Path, flag: str) -> None:
    """``path`` is a folder the command creates or writes in: refuse a file in the way (exit 2) and a folder
    that cannot be written (exit 4), naming the folder that refuses."""
    path = Path(path)
    name_lengths(path, flag)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a file, not a folder; choose a folder")
    existing = _existing(path)
    if not existing.is_dir():
        raise UserError(f"{flag} {str(path)!r}: {str(existing)!r} is a file, not a folder; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only_mount(existing) else "permission denied"
        raise EnvironmentFailure(f"{flag} {str(path)!r} cannot be written ({why} on {str(existing)!r}); "
                                 f"choose a writable {flag}")


def name_lengths(path: Path, flag: str) -> None:
    """Refuse (exit 2) a name in ``path`` longer than its file system allows, before any folder on the way is
    made."""
    for part in path.parts:
        if len(part.encode()) <= 255:
            continue
        shown = f"{part[:40]}…"
        raise UserError(f"{flag} {str(path)[:60] + '…'!r}: the name {shown!r} has {len(part)} characters; the "
                        "file system allows 255: choose a shorter path")


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def free_space(path: str | Path, needed: int, flag: str) -> None:
    """Refuse (exit 4) when the file system of ``path`` has less than ``needed`` bytes free."""
    existing = _existing(Path(path))
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise EnvironmentFailure(f"no space for the run: {free / 2**20:.1f} MiB free on {str(existing)!r}, about "
                                 f"{needed / 2**20:.1f} MiB needed; free space there or choose another {flag}")


def run_bytes(items: int, samples: int = 1) -> int:
    """About how many bytes a run of ``items`` items, ``samples`` each, and its reports take."""
    return items * samples * RECORD_BYTES + REPORT_BYTES


def model_folder(model: str | None) -> None:
    """A --model that is not a checkpoint folder (missing, a file, no config.json with a model_type)."""
    if not model:
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise UserError(f"--model {model!r} does not exist; pass a local transformers checkpoint folder")
    if not path.is_dir():
        raise UserError(f"--model {model!r} is a file; pass the checkpoint's folder (the one holding config.json)")
    config = path / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--model {model!r} has no config.json; pass a transformers checkpoint folder") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{str(config)!r} is not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{str(config)!r} has no model_type; it is not a transformers config")


DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device(value: str, flag: str = "--device") -> None:
    """A device a model can be put on: ``cpu``, ``cuda`` or ``cuda:N``. A CUDA device on a machine with no
    NVIDIA device node (or with ``CUDA_VISIBLE_DEVICES`` empty) is refused without importing torch; where a
    node exists, torch decides later."""
    if not DEVICE.fullmatch(value):
        raise UserError(f"{flag} {value!r} is not a device; pass cpu, cuda or cuda:N")
    if value == "cpu":
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    nodes = os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia/gpus")
    if not nodes or (hidden is not None and hidden.strip() in ("", "-1")):
        why = "CUDA_VISIBLE_DEVICES hides every GPU" if nodes else "no NVIDIA GPU on this machine"
        raise UserError(f"{flag} {value}: no CUDA device is visible ({why}); use {flag} cpu")


def thresholds_file(path: str | None):
    """Parse an explicit policy file now (one line with FILE:LINE when it is wrong); the parsed policy goes on
    to the gate plan, so the file is read once. None when no file is given."""
    if path:
        if not Path(path).is_file():  # before the policy module's imports (pydantic: about a second)
            what = "is a folder" if Path(path).is_dir() else "does not exist"
            raise UserError(f"--thresholds {path!r} {what}; pass a thresholds YAML file, or drop "
                            "--thresholds to use the default policy")
        from evalgate.gate.policy import resolve_policy

        return resolve_policy(path)
    return None


def stored_run(path: str, flag: str = "--candidate") -> None:
    """A stored run's folder: it exists and holds a manifest (read and validated later, by the store)."""
    run = Path(path)
    if not run.is_dir():
        what = "is a file" if run.exists() else "does not exist"
        raise UserError(f"{flag} {path!r} {what}; pass the folder a gate or `evalgate run --out` wrote")
    if not (run / "manifest.json").is_file():
        raise UserError(f"{flag} {path!r} holds no manifest.json; pass the folder a gate or `evalgate run --out` "
                        "wrote (not its gate/ folder or a task file)")


def baselines_root(path: str | None, explicit: bool, flag: str = "--baselines-root") -> None:
    """A baselines root the user named (flag or $EVALGATE_BASELINES) is used, never skipped without a word:
    a file is refused, and for the gate (which only reads it) so is a folder that does not exist."""
    if not path or not explicit:
        return
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise UserError(f"{flag} (or $EVALGATE_BASELINES) {path!r} is a file; name the folder that holds baselines")
    if not root.exists():
        raise UserError(f"{flag} (or $EVALGATE_BASELINES) {path!r} does not exist; name the folder that holds "
                        "baselines, or leave it unset to use ./results/baselines and the canary's")


def server(url: str | None) -> None:
    """A --server that does not answer HTTP: a wrong scheme, a refused or silent port, another protocol."""
    if not url:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--server {url!r} is not an http:// or https:// URL; pass e.g. http://HOST:30000")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UserError(f"--server {url!r} has an invalid port") from None
    connection = (http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection)(
        parts.hostname, port, timeout=SERVER_TIMEOUT_S)
    where = f"{parts.hostname}:{port}"
    try:
        connection.request("GET", (parts.path.rstrip("/") or "") + "/v1/models")
        connection.getresponse().read(1 << 16)
    except ConnectionRefusedError:
        raise UserError(f"--server {url}: connection refused on {where}; start the server, or fix the URL") from None
    except (socket.timeout, TimeoutError):
        raise UserError(f"--server {url}: no answer from {where} within {SERVER_TIMEOUT_S:g} s; check the host "
                        "and port") from None
    except http.client.HTTPException as exc:
        raise UserError(f"--server {url}: {where} does not speak HTTP ({type(exc).__name__}); point --server at "
                        "the OpenAI-compatible server's port") from None
    except OSError as exc:
        raise UserError(f"--server {url}: cannot reach {where} ({exc.strerror or exc}); check the host and "
                        "port") from None
    finally:
        connection.close()


def run_lock(out: str | Path):
    """The run folder's lock (``evalgate.run.lock``): held by this process alone, released by its death."""
    from evalgate.run.lock import run_lock as lock

    return lock(out)
