"""Atomic file writes shared by the library and the tools: a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
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
