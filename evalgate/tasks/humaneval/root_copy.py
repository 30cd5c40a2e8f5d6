"""Private copies of the files a sandbox can read: the standard library and the shared libraries it loads.

Standard library only: loaded into the executor (``child.py``) as ``_evalgate_root_copy``. The executor's
minimal root is a tmpfs, and these files are copied into it once, when the executor starts, instead of
bind-mounting the host's directories. A bind-mounted file shares its page cache with the host and with every
other harness: which of its pages are cached is state any program can change (by reading a page) and
observe (by timing a read), a store that outlives the program. A page of a tmpfs is in memory for as long as
the file exists, so there is no cache state to read or to write.

What is copied: the standard library's directory without the packages no program of a benchmark uses
(``test``, ``idlelib``, ``tkinter``, ``turtledemo``, ``ensurepip``, ``lib2to3``, ``pydoc_data``, the build's
``config-*``) and without its ``-packages`` directories, with the byte code of the interpreter's own
optimization level only; and the shared libraries its extension modules need (their ``DT_NEEDED``, closed
over), under the directories the dynamic loader searches. No binary of ``/usr/bin``: a program cannot
``execve`` (``syscall_filter.py``).
"""

import os
import shutil
import struct

SKIPPED_PACKAGES = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data")
SKIPPED_EXTENSIONS = ("_tkinter", "_test", "_ctypes_test", "xxlimited", "xxsubtype")  # name prefixes in lib-dynload
C_LIBRARY = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libutil.so.1")
_SHT_DYNAMIC, _DT_NEEDED = 6, 1


def copy_standard_library(stdlib, root):
    """Copy ``stdlib`` to the same path under ``root``; returns (files, bytes) copied."""
    counts = [0, 0]

    def ignore(directory, names):
        skipped = []
        for name in names:
            if directory == stdlib and (name in SKIPPED_PACKAGES or name.startswith("config-")):
                skipped.append(name)
            elif name.endswith("-packages") or ".opt-" in name:  # byte code of -O/-OO: never imported here
                skipped.append(name)
            elif name.endswith(".so") and name.startswith(SKIPPED_EXTENSIONS):
                skipped.append(name)
        return skipped

    def copy(source, target):
        shutil.copyfile(source, target)
        counts[0] += 1
        counts[1] += os.path.getsize(target)

    shutil.copytree(stdlib, root + stdlib, ignore=ignore, copy_function=copy, symlinks=True, dirs_exist_ok=True)
    return tuple(counts)


def needed_names(path):
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF file (empty for anything else)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            return []
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names = []
        for _, kind, _, _, offset, size, link, _, _, _ in sections:
            if kind != _SHT_DYNAMIC:
                continue
            strings = sections[link][4]
            for entry in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, entry)
                if tag == 0:
                    break
                if tag == _DT_NEEDED:
                    start = strings + value
                    names.append(data[start:data.index(b"\0", start)].decode())
        return names
    except (OSError, struct.error, ValueError, IndexError):
        return []


def needed_libraries(starts, search_dirs):
    """{directory: {name: source file}} of the libraries ``starts`` need, closed over, and glibc's own;
    found as the dynamic loader would find them, in ``search_dirs``."""
    found = {}
    seen = set()
    queue = list(starts) + [n for n in C_LIBRARY]
    while queue:
        item = queue.pop()
        if os.sep in item:
            path = item
        else:
            if item in seen:
                continue
            seen.add(item)
            path = next((os.path.join(d, item) for d in search_dirs if os.path.exists(os.path.join(d, item))), None)
            if path is None:
                continue
            found.setdefault(os.path.realpath(os.path.dirname(path)), {})[item] = os.path.realpath(path)
        queue += [n for n in needed_names(path) if n not in seen]
    return found


def copy_libraries(libraries, root):
    """Copy what ``needed_libraries`` found under ``root``; returns (files, bytes) copied."""
    files = size = 0
    for directory, names in libraries.items():
        os.makedirs(root + directory, 0o755, exist_ok=True)
        for name, source in names.items():
            target = os.path.join(root + directory, name)
            if not os.path.exists(target):
                shutil.copyfile(source, target)
                files += 1
                size += os.path.getsize(target)
    return files, size
