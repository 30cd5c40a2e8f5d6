"""A control group per program: its memory in total, and one kill for all of it.

Standard library only: loaded into the executor (``child.py``) as ``_evalgate_cgroups``. The executor finds
the machine's hierarchies at start (cgroup v2, v1 controllers, or both as on a hybrid host), makes a parent
group of its own in each and keeps a descriptor of it, so it can still reach them after ``pivot_root``. For
each program the judge makes a fresh group ``p<n>`` in every hierarchy (never reused), with:

``memory``: the program's total, every process it forks and the memfd, tmpfs and pipe pages it holds
included (``memory.max`` on v2, ``memory.limit_in_bytes`` on v1; no swap); and the sandbox joins them before any program code runs. After the verdict (or when the executor gives up
on a judge) every process left in the group is killed — ``cgroup.kill`` where the kernel has it, else each
listed process until none is left — and the group removed; how many there were is the result's
``survivors``.
"""

import errno
import os
import signal
import time

KILL_WAIT_S = 5.0  # a killed group empties in milliseconds; beyond this, something is wrong with the host


def _read(dir_fd, name):
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 20).decode()
    finally:
        os.close(fd)


def _write(dir_fd, name, text):
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _mounts():
    """(fstype, mount point, mount root, super options) of every cgroup mount this process sees."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and tail and tail[0] in ("cgroup", "cgroup2"):
                found.append((tail[0], fields[4], fields[3], tail[2] if len(tail) > 2 else ""))
    return found


def _own_paths():
    """hierarchy key ("" for v2, else the v1 controller list) -> this process's group path in it."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            paths["" if number == "0" else controllers] = path
    return paths


class Hierarchy:
    """One hierarchy: the executor's parent group in it (an open directory) and what it controls there."""

    def __init__(self, version, parent_fd, controllers, path):
        self.version, self.parent_fd, self.controllers, self.path = version, parent_fd, controllers, path
        self.can_kill = version == 2 and _exists(parent_fd, "cgroup.kill")


def _exists(dir_fd, name):
    try:
        os.stat(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _make_parent(mount_point, mount_root, own_path, tag):
    relative = own_path[len(mount_root):] if mount_root != "/" and own_path.startswith(mount_root) else own_path
    path = os.path.join(mount_point, relative.lstrip("/"), tag)
    os.makedirs(path, exist_ok=True)
    return path, os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


class ProgramGroups:
    """The executor's groups (``discover``); per program: ``create``, ``join``, ``survivors``, ``kill_all``,
    ``remove``. ``hierarchies`` is empty where the machine gives none (no root, no cgroup file system)."""

    def __init__(self, hierarchies, notes):
        self.hierarchies = hierarchies
        self.notes = notes

    @classmethod
    def discover(cls, tag):
        notes, hierarchies = [], []
        try:
            mounts, own = _mounts(), _own_paths()
        except OSError as exc:
            return cls([], [f"no control groups: {exc}"])
        wanted = {"memory"}  # (processes: RLIMIT_NPROC of the program's own uid bounds them already, and each
        # hierarchy joined is one more cgroup migration, which waits for an RCU grace period, on every program)
        for fstype, point, root, _options in mounts:  # v2 first: it can kill a group in one write
            if fstype != "cgroup2" or "" not in own:
                continue
            try:
                path, fd = _make_parent(point, root, own[""], tag)
                available = set(_read(fd, "cgroup.controllers").split())
                enabled = set()
                for name in sorted(wanted & available):
                    try:
                        _write(fd, "cgroup.subtree_control", f"+{name}")
                        enabled.add(name)
                    except OSError:
                        pass
                if enabled:
                    hierarchies.append(Hierarchy(2, fd, enabled, path))
                    wanted -= enabled
                else:  # no controller here (a hybrid host keeps them on v1): a group would only cost a join
                    os.close(fd)
                    os.rmdir(path)
            except OSError as exc:
                notes.append(f"cgroup v2 at {point}: {exc}")
            break
        for fstype, point, root, options in mounts:
            if fstype != "cgroup":
                continue
            names = set(options.split(",")) & wanted
            key = next((k for k in own if k and set(k.split(",")) & names), None)
            if not names or key is None:
                continue
            try:
                path, fd = _make_parent(point, root, own[key], tag)
                hierarchies.append(Hierarchy(1, fd, names, path))
                wanted -= names
            except OSError as exc:
                notes.append(f"cgroup v1 {','.join(sorted(names))} at {point}: {exc}")
        if wanted:
            notes.append(f"no per-program {' or '.join(sorted(wanted))} control group on this machine")
        return cls(hierarchies, notes)

    def descriptors(self):
        return [h.parent_fd for h in self.hierarchies]

    def describe(self):
        controls = sorted(c for h in self.hierarchies for c in h.controllers)
        kill = "cgroup.kill" if any(h.can_kill for h in self.hierarchies) else "each process"
        return {"controls": controls, "kill": kill if self.hierarchies else "none"}

    # -- one program's group (made by its judge) --
    def create(self, name, memory_bytes):
        """Make group ``name`` in every hierarchy with its limits; returns the descriptors the sandbox joins
        with (its ``cgroup.procs``)."""
        joins = []
        for h in self.hierarchies:
            os.mkdir(name, 0o700, dir_fd=h.parent_fd)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=h.parent_fd)
            try:
                if "memory" in h.controllers:
                    if h.version == 2:
                        _write(fd, "memory.max", str(memory_bytes))
                        if _exists(fd, "memory.swap.max"):
                            _write(fd, "memory.swap.max", "0")
                    else:
                        _write(fd, "memory.limit_in_bytes", str(memory_bytes))
                        if _exists(fd, "memory.memsw.limit_in_bytes"):
                            _write(fd, "memory.memsw.limit_in_bytes", str(memory_bytes))
                joins.append(os.open("cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=fd))
            finally:
                os.close(fd)
        return joins

    @staticmethod
    def join(joins):
        """In the sandbox, before any program code: move this process into the program's groups."""
        for fd in joins:
            os.write(fd, b"0")
            os.close(fd)

    def members(self, name):
        """Process ids in group ``name`` (as this process's PID namespace numbers them)."""
        for h in self.hierarchies:
            try:
                return [int(p) for p in _read(h.parent_fd, f"{name}/cgroup.procs").split()]
            except OSError:
                continue
        return []

    def kill_all(self, name):
        """Kill every process of group ``name`` and wait until it is empty; returns their process ids."""
        first = self.members(name)
        killer = next((h for h in self.hierarchies if h.can_kill), None)
        if killer is not None and first:
            try:
                _write(killer.parent_fd, f"{name}/cgroup.kill", "1")
            except OSError:
                killer = None
        deadline = time.monotonic() + KILL_WAIT_S
        left = first
        while left and time.monotonic() < deadline:
            if killer is None:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.0005)
            left = self.members(name)
        return first

    def remove(self, name):
        for h in self.hierarchies:
            for _ in range(200):  # a group empties a moment after its last process is reaped
                try:
                    os.rmdir(name, dir_fd=h.parent_fd)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(0.001)
