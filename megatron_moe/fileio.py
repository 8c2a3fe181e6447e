"""File writes shared by the library and the tools: atomic (a reader never sees a half-written
file), and never through a symbolic link inside an output directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any


def atomic_write_json(path: str, obj: Any, sort_keys: bool = True) -> None:
    """Write `obj` as JSON to `path` via a temporary file in the same folder and a rename (the
    folder is created if missing; the temporary file is removed if writing fails)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=sort_keys)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- output directories
# Inside an output directory (a checkpoint root) a symbolic link is never followed for a write, a
# rename or a deletion: `open(path, "w")` on a planted `latest.tmp` link writes into whatever file
# it names anywhere on disk, and `shutil.rmtree` on a linked `iter_*` fails after the commit (or,
# with other tools, deletes the target's contents). The output directory itself may be a link.


def refuse_link(path: str, expected: str) -> None:
    """ValueError naming `path` when it is a symbolic link; `expected` ("regular file", "directory")
    is what belongs there."""
    if os.path.islink(path):
        raise ValueError(
            f"{path} is a symbolic link where a {expected} is expected (links inside an output "
            f"directory are never followed for writes, renames or deletions): remove it"
        )


def write_new_file(path: str, data: bytes, durable: bool = True) -> None:
    """Create `path` and write `data` (fsynced when `durable`). O_EXCL | O_NOFOLLOW: it never writes
    through a link or into the inode of an existing file (a hard link's other names keep their bytes);
    a leftover regular file of a crashed writer is removed first, a link is refused."""
    refuse_link(path, "regular file")
    if os.path.lexists(path):
        if not os.path.isfile(path):
            raise ValueError(f"{path} exists and is not a regular file")
        os.unlink(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:  # created between the check and the open: by another writer
        raise ValueError(f"{path} appeared while it was being written: another process writes this directory")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def remove_tree(path: str) -> None:
    """`shutil.rmtree(path)` after refusing a link at `path` (the tree's own entries are removed, never followed)."""
    refuse_link(path, "directory")
    shutil.rmtree(path)


def replace_no_link(src: str, dst: str, expected: str) -> None:
    """`os.replace(src, dst)` after refusing a link at either name (a rename never follows the names,
    but a link moved into place would be followed by the next reader or writer)."""
    refuse_link(src, expected)
    refuse_link(dst, expected)
    os.replace(src, dst)
