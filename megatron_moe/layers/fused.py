"""Fused kernels: NVIDIA apex's when it is importable (and CUDA is present), else native torch;
on CPU float32 tensors, GPT-2's tanh-GELU runs the vectorized C loops of `kernels/cpu_gelu.py`.

`kernel_report()` says which implementation runs; the trainer logs it once.
apex is not on PyPI (the PyPI package named `apex` is unrelated), so it is
never a requirement: install it from NVIDIA's repository to use it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron_moe.kernels import cpu_gelu


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
    """GPT-2's tanh approximation of GELU (differentiable once): the C loops of
    `kernels/cpu_gelu.py` on CPU float32 tensors where they apply, aten's kernel otherwise."""
    if cpu_gelu.applies(x):
        return _GeluTanh.apply(x)
    return F.gelu(x, approximate="tanh")


def gelu_tanh_out(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = gelu_tanh(x), outside autograd (the experts' hand-written forward)."""
    if cpu_gelu.applies(x, out):
        return cpu_gelu.forward(x, out)
    return torch.ops.aten.gelu.out(x, approximate="tanh", out=out)


def gelu_tanh_backward(grad: torch.Tensor, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad * gelu_tanh'(x), into `out` when given (`out` may be `grad`: in place), else a new tensor."""
    if out is None:
        out = torch.empty_like(grad)
    if cpu_gelu.applies(grad, x, out):
        return cpu_gelu.backward(grad, x, out)
    return torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh", grad_input=out)


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return cpu_gelu.forward(x, torch.empty_like(x))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return gelu_tanh_backward(grad.contiguous(), x)


def kernel_report() -> dict:
    """Which kernels run: {'layer_norm': ..., 'attention': ..., 'gelu_cpu': ...} (the optimizer reports its own)."""
    return {
        "layer_norm": "apex.FusedLayerNorm" if _APEX_LN is not None else "torch.nn.LayerNorm",
        "attention": "torch.nn.functional.scaled_dot_product_attention",
        "gelu_cpu": cpu_gelu.status(),  # CUDA tensors always take aten's fused kernel
    }
