"""Token permute (dispatch) and unpermute (combine) as Triton kernels with autograd.

Legend: S tokens, M model dim, K kept choices (flat), R buffer rows (expert-major: row e * C +
slot), w [K] combine weights.

  permute(x [S, M], token [K], row [K], R)   -> buf [R, M]: buf[row[i]] = x[token[i]], zeros elsewhere
  unpermute(buf [R, M], token, row, w, S)     -> y [S, M]:  y[s] = sum over kept i of s of w[i] * buf[row[i]]

Backward: permute's scatter-adds the buffer's rows back to their tokens; unpermute's gives the
buffer w[i] * gy[token[i]] at each kept row (zeros elsewhere) and the weights sum_m gy[token[i], m]
* buf[row[i], m]. Scatter-adds accumulate in fp32, exact and deterministic with k <= 2 (see
`_move_rows`). The torch path (`moe/dispatcher.py`) is the tests' reference.
"""

from __future__ import annotations

import torch

from megatron_moe.kernels import _triton as tk

BLOCK_M = 128


def _copy(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor, w, add: bool = False):
    """dst[dst_idx[i]] = (or `add`: +=, dst fp32) src[src_idx[i]] * w[i] (w None: 1)."""
    if src_idx.numel():
        M, w_arg = src.size(1), src_idx if w is None else w
        grid = (src_idx.numel(), -(-M // BLOCK_M))
        tk.jitted().move_rows[grid](src, dst, src_idx, dst_idx, w_arg, M, HAS_W=w is not None, ADD=add, BLOCK_M=BLOCK_M)


def _scatter_add(
    src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor, w: torch.Tensor | None, rows: int
) -> torch.Tensor:
    out = torch.zeros((rows, src.size(1)), dtype=torch.float32, device=src.device)
    _copy(src, out, src_idx, dst_idx, w, add=True)
    return out.to(src.dtype)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SM, token_K, row_K, num_rows: int):
        x_SM = x_SM.contiguous()
        buf = torch.zeros((num_rows, x_SM.size(1)), dtype=x_SM.dtype, device=x_SM.device)
        _copy(x_SM, buf, token_K, row_K, None)
        ctx.save_for_backward(token_K, row_K)
        ctx.num_tokens = x_SM.size(0)
        return buf

    @staticmethod
    def backward(ctx, g_RM):
        token_K, row_K = ctx.saved_tensors
        return _scatter_add(g_RM.contiguous(), row_K, token_K, None, ctx.num_tokens), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf_RM, weight_K, token_K, row_K, num_tokens: int):
        buf_RM = buf_RM.contiguous()
        w = weight_K.to(buf_RM.dtype).contiguous()
        ctx.save_for_backward(buf_RM, w, token_K, row_K)
        ctx.weight_dtype = weight_K.dtype
        return _scatter_add(buf_RM, row_K, token_K, w, num_tokens)

    @staticmethod
    def backward(ctx, g_SM):
        buf_RM, w, token_K, row_K = ctx.saved_tensors
        g_SM = g_SM.contiguous()
        g_buf = g_w = None
        if ctx.needs_input_grad[0]:
            g_buf = torch.zeros_like(buf_RM)
            _copy(g_SM, g_buf, token_K, row_K, w)
        if ctx.needs_input_grad[1]:
            g_w = torch.zeros((token_K.numel(),), dtype=torch.float32, device=g_SM.device)
            if token_K.numel():
                tk.jitted().row_dots[(token_K.numel(),)](
                    g_SM, buf_RM, token_K, row_K, g_w, g_SM.size(1), BLOCK_M=BLOCK_M
                )
            g_w = g_w.to(w.dtype).to(ctx.weight_dtype)
        return g_buf, g_w, None, None, None


def permute(x_SM: torch.Tensor, token_K: torch.Tensor, row_K: torch.Tensor, num_rows: int) -> torch.Tensor:
    """buf [num_rows, M] with x[token[i]] at row[i], zeros elsewhere (differentiable in x)."""
    return _Permute.apply(x_SM, token_K.contiguous(), row_K.contiguous(), num_rows)


def unpermute(
    buf_RM: torch.Tensor, token_K: torch.Tensor, row_K: torch.Tensor, weight_K: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """y [num_tokens, M] = sum over kept i of weight[i] * buf[row[i]] at token[i] (differentiable in
    buf and weight)."""
    return _Unpermute.apply(buf_RM, weight_K, token_K.contiguous(), row_K.contiguous(), num_tokens)
