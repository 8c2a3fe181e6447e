"""What a GPU would show, seen on any device: the dtype of every GEMM and the host syncs of a region.

`OpSpy` is a TorchDispatchMode (below autocast, so it sees the dtypes a GEMM really runs in) that
also wraps the Tensor methods which copy device data to the host. Inside `with OpSpy() as spy:`:

- `gemms`: (op, input dtypes, output dtype, shapes) of every matrix multiply and whether it wrote
  into an `out=` tensor (autocast never reaches those);
- `syncs`: every op that makes the host wait for the device on CUDA: reading a value (`item`,
  `tolist`, `int(t)`: aten's `_local_scalar_dense`), copying to the host (`.cpu()`, `.numpy()`,
  `.to("cpu")`), and ops whose output size depends on the data (`nonzero`, boolean-mask
  indexing, `unique`, `bincount`, `repeat_interleave` without `output_size`, ...).

On the CPU none of these waits, so the spy counts them by name; each record carries the innermost
`megatron_moe` frame that made it. On CUDA, `torch.cuda.set_sync_debug_mode` confirms the count
(`scripts/gpu_check.sh`).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addbmm", "matmul", "dot", "mv", "addmv"})
# aten ops that read device data on the host (a sync on CUDA); bincount's CUDA kernel reads the max
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "bincount"})
_TENSOR_METHODS = ("tolist", "cpu", "numpy")


@dataclass
class Gemm:
    op: str
    dtypes: tuple
    out_dtype: Any
    shapes: tuple
    out_arg: bool  # wrote into an `out=` tensor
    where: str

    @property
    def low_precision(self) -> bool:
        return all(d in (torch.bfloat16, torch.float16) for d in self.dtypes)


@dataclass
class OpSpy(TorchDispatchMode):
    gemms: list[Gemm] = field(default_factory=list)
    syncs: list[tuple[str, str]] = field(default_factory=list)  # (what, where)

    def __post_init__(self):
        super().__init__()
        self._saved: dict[str, Any] = {}

    # ------------------------------------------------------------------ dispatch level
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in GEMMS:
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            out = func(*args, **kwargs)
            o = out if isinstance(out, torch.Tensor) else None
            self.gemms.append(
                Gemm(
                    name,
                    tuple(t.dtype for t in ts if t.is_floating_point()),
                    None if o is None else o.dtype,
                    tuple(tuple(t.shape) for t in ts),
                    "out" in kwargs or func._overloadname == "out",
                    _where(),
                )
            )
            return out
        if name in SYNC_OPS or (
            name == "repeat_interleave" and kwargs.get("output_size") is None and _tensor_repeats(args)
        ):
            self.syncs.append((name, _where()))
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ Tensor methods
    def __enter__(self):
        spy = self
        for m in _TENSOR_METHODS:
            orig = getattr(torch.Tensor, m)
            self._saved[m] = orig

            def wrapped(t, *a, _orig=orig, _m=m, **k):
                spy.syncs.append((_m, _where()))
                return _orig(t, *a, **k)

            setattr(torch.Tensor, m, wrapped)
        orig_to = torch.Tensor.to
        self._saved["to"] = orig_to

        def to(t, *a, **k):
            # only the string: `.to(device)` with a device object is a move to the compute device
            dev = k.get("device", a[0] if a else None)
            if isinstance(dev, str) and dev.startswith("cpu"):
                spy.syncs.append(("to(cpu)", _where()))
            return orig_to(t, *a, **k)

        torch.Tensor.to = to
        return super().__enter__()

    def __exit__(self, *exc):
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, orig)
        self._saved.clear()
        return super().__exit__(*exc)

    # ------------------------------------------------------------------ summaries
    def high_precision_gemms(self) -> list[Gemm]:
        return [g for g in self.gemms if not g.low_precision]

    def syncs_in(self, path_part: str) -> list[tuple[str, str]]:
        """The syncs made from a file whose path contains `path_part` (e.g. "megatron_moe/moe/")."""
        return [s for s in self.syncs if path_part in s[1]]


def _tensor_repeats(args) -> bool:
    return len(args) > 1 and isinstance(args[1], torch.Tensor) or (len(args) == 1 and isinstance(args[0], torch.Tensor))


def _where() -> str:
    """The innermost frame in megatron_moe (not this file) as "path:line in function"."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename.replace("\\", "/")
        if "megatron_moe/" in f and not f.endswith("opspy.py"):
            return f"{f[f.rindex('megatron_moe/') :]}:{frame.lineno} in {frame.name}"
    return "<outside megatron_moe>"
