"""Fused kernels: NVIDIA apex's when it is importable (and CUDA is present), else native torch.

`kernel_report()` says which implementation runs; the trainer logs it once.
apex is not on PyPI (the PyPI package named `apex` is unrelated), so it is
never a requirement: install it from NVIDIA's repository to use it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _apex_layer_norm():
    if not torch.cuda.is_available():
        return None
    try:
        from apex.normalization import FusedLayerNorm

        return FusedLayerNorm
    except Exception:
        return None


_APEX_LN = _apex_layer_norm()


def layer_norm(dim: int, eps: float, device: torch.device) -> nn.Module:
    """A LayerNorm over the last dim on `device`: apex FusedLayerNorm if available, else torch.nn.LayerNorm."""
    if _APEX_LN is not None:
        with torch.device(device):  # apex's constructor takes no device= argument
            return _APEX_LN(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, device=device)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation of GELU: aten's kernel (autograd's backward)."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad * gelu_tanh'(x) as a new tensor (the grouped experts' hand-written backward): aten's kernel."""
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


def kernel_report() -> dict:
    """Which kernels run: {'layer_norm': ..., 'attention': ...} (the optimizer reports its own)."""
    return {
        "layer_norm": "apex.FusedLayerNorm" if _APEX_LN is not None else "torch.nn.LayerNorm",
        "attention": "torch.nn.functional.scaled_dot_product_attention",
    }
