"""Device hygiene: every tensor the library creates is given its device explicitly.

Static half: every call of a torch tensor factory in `megatron_moe/**.py` passes
`device=` (or is a `*_like` call, which inherits the device of its argument).
The dynamic half (the trainer under `torch.set_default_device("meta")`) is
in `tests/test_device_meta.py`.
"""
from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parent.parent / "megatron_moe"
FACTORIES = {"zeros", "empty", "ones", "full", "arange", "tensor", "randn", "rand", "randint", "randperm",
             "linspace", "eye"}


def _factory_name(call: ast.Call) -> str | None:
    """'zeros' for `torch.zeros(...)` (any `<...>.torch.zeros` attribute chain), else None."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in FACTORIES:
        base = f.value
        if isinstance(base, ast.Name) and base.id == "torch":
            return f.attr
        if isinstance(base, ast.Attribute) and base.attr == "torch":
            return f.attr
    return None


def factory_calls_without_device(source: str, filename: str) -> list[str]:
    """`file:line torch.NAME` for every tensor-factory call in `source` that passes no `device=`."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            name = _factory_name(node)
            if name and not any(k.arg == "device" for k in node.keywords):
                out.append(f"{filename}:{node.lineno} torch.{name}")
    return out


def test_checker_flags_a_factory_without_device():
    src = ("import torch\nx = torch.zeros(3)\ny = torch.ones(2, device=d)\nz = torch.zeros_like(x)\n"
           "w = torch.tensor([1], dtype=torch.long)\n")
    assert factory_calls_without_device(src, "m.py") == ["m.py:2 torch.zeros", "m.py:5 torch.tensor"]


def test_library_tensor_factories_pass_device():
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        offenders += factory_calls_without_device(path.read_text(), str(path.relative_to(LIBRARY.parent)))
    assert offenders == [], "tensor factories without device=:\n" + "\n".join(offenders)
