"""File writes shared by the library and the tools: atomic (a reader never sees a half-written
file), and never through a symbolic link inside an output directory; text input read as UTF-8 with
errors naming the line."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Iterator, Optional


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


def read_lines(path) -> Iterator[str]:
    """The lines of the UTF-8 text file `path`, newlines kept; a ValueError naming the file, the
    line and the byte that is not UTF-8 (the decoder's own error gives an offset into its buffer)."""
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{path}: line {n} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        f"save it as UTF-8"
                    ) from None
        raise


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (a leftover temporary file of a dead one may go)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# ----------------------------------------------------------------------------- output directories
# Inside an output directory (a checkpoint root; it may itself be a link) a symbolic link is never
# followed for a write, a rename or a deletion: `open(path, "w")` on a planted `latest.tmp` link
# writes into whatever file it names, and `shutil.rmtree` on a linked `iter_*` fails after the commit.


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


# ----------------------------------------------------------------------------- checking output paths
def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    return p


def _cannot_write_in(directory: str) -> Optional[str]:
    """Why no entry can be created in `directory` (None: it can). A probe file is created and
    removed at once: permission bits alone do not tell (root passes every access() check, yet a
    read-only or pseudo file system such as /sys still refuses)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=directory)
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(probe)
    return None


def output_path_problem(path: str, kind: str) -> Optional[str]:
    """Why `path` cannot be written as a `kind` ("directory" or "file"), in words that follow the
    path ("exists and is not a directory", ...); None when it can. A missing path needs a writable
    nearest existing ancestor; an existing directory must be writable, a regular file openable for
    appending (bytes untouched); other files (/dev/stdout, a FIFO) are left to the writer."""
    if os.path.lexists(path):
        if kind == "directory":
            if not os.path.isdir(path):
                return "exists and is not a directory"
            why = _cannot_write_in(path)
            return f"is not writable ({why})" if why else None
        if os.path.isdir(path):
            return "is a directory, not a file"
        if os.path.isfile(path):
            try:
                open(path, "ab").close()
            except OSError as e:
                return f"is not writable ({e.strerror or type(e).__name__})"
        return None
    folder = path if kind == "directory" else os.path.dirname(os.path.abspath(path))
    anc = _nearest_existing(folder)
    if not os.path.isdir(anc):
        return f"cannot be created: {anc} is not a directory"
    why = _cannot_write_in(anc)
    return f"cannot be created in {anc} ({why})" if why else None
