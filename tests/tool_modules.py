"""The scripts under tools/ as modules, for tests that call their functions directly."""

import importlib.util
import os
from types import ModuleType

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, imported under the module name `name` (not run as a script)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    assert spec is not None and spec.loader is not None, name
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
