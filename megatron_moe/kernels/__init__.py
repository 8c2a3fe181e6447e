"""Fused Triton kernels of the MoE hot path: `permute` / `unpermute` (token dispatch into the
expert-major buffer and the weighted combine back) and `topk_gating` (the router's softmax, top-k
and capacity slots, with its backward `gating_backward`).

`use_triton(t)` is the one switch the call sites read. Otherwise the torch path runs; the kernels
also run on CPU tensors under `TRITON_INTERPRET=1` (how the tests compare them with the torch
path). `triton` is never required (requirements-gpu.txt only).
"""

from __future__ import annotations

import os

import torch

try:
    from megatron_moe.kernels.gating import gating_backward, gating_weights, topk_gating
    from megatron_moe.kernels.permute import permute, unpermute

    HAVE_TRITON = True
    TRITON_ERROR = ""
except Exception as e:  # noqa: BLE001  no (or a broken) triton here: the torch path only
    HAVE_TRITON = False
    TRITON_ERROR = f"{type(e).__name__}: {e}"

__all__ = [
    "HAVE_TRITON",
    "TRITON_ERROR",
    "gating_backward",
    "gating_weights",
    "permute",
    "topk_gating",
    "unpermute",
    "use_triton",
]


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernels for tensor `t`: triton importable, `t` on CUDA, not disabled by
    MEGATRON_MOE_NO_TRITON=1."""
    return HAVE_TRITON and t.is_cuda and os.environ.get("MEGATRON_MOE_NO_TRITON", "0") != "1"
