"""The Triton kernels of the MoE hot path (plain functions; `jitted()` compiles them on first use).

Legend: S tokens, M model dim, E experts, k choices per token, K kept choices (flat), R buffer rows
(E * C, expert-major).

Undecorated so that `TRITON_INTERPRET=1`, set by a test after this module was imported, still
selects the interpreter (`triton.jit` reads it when it runs). Needs `triton`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import triton
import triton.language as tl


def _move_rows(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, w_ptr, M, HAS_W: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr
):
    """dst[dst_idx[i], :] = src[src_idx[i], :] (* w[i]); one program per (i, block of M). `ADD`: +=
    in fp32 (dst fp32; atomics: a row of dst gets at most k <= 2 adds onto zero, and
    (0 + a) + b == (0 + b) + a, so the result is exact whatever the order)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = cols < M
    s = tl.load(src_idx_ptr + i)
    d = tl.load(dst_idx_ptr + i)
    v = tl.load(src_ptr + s * M + cols, mask=mask, other=0.0)
    if HAS_W:
        v = v * tl.load(w_ptr + i).to(v.dtype)
    if ADD:
        tl.atomic_add(dst_ptr + d * M + cols, v.to(tl.float32), mask=mask)
    else:
        tl.store(dst_ptr + d * M + cols, v, mask=mask)


def _row_dots(a_ptr, b_ptr, a_idx_ptr, b_idx_ptr, out_ptr, M, BLOCK_M: tl.constexpr):
    """out[i] = sum_m a[a_idx[i], m] * b[b_idx[i], m] in fp32 (the combine weights' gradient)."""
    i = tl.program_id(0)
    ra = tl.load(a_idx_ptr + i)
    rb = tl.load(b_idx_ptr + i)
    acc = tl.arange(0, BLOCK_M).to(tl.float32) * 0.0  # (tl.zeros is a jit function the interpreter
    # cannot call when triton was imported first)
    for start in range(0, M, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        mask = cols < M
        a = tl.load(a_ptr + ra * M + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rb * M + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + i, tl.sum(acc, axis=0))


def _softmax_topk(
    logits_ptr, gates_ptr, expert_ptr, S, E, K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr
):
    """gates = softmax(logits) in fp32; expert[:, 0] = argmax, expert[:, 1] = argmax with the first
    masked out (on the logits: softmax is monotone; ties go to the lowest index, as torch.argmax)."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < S
    cmask = cols < E
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(cmask[None, :], x, float("-inf"))
    m = tl.max(x, axis=1)
    e = tl.where(cmask[None, :], tl.exp(x - m[:, None]), 0.0)
    g = e / tl.sum(e, axis=1)[:, None]
    tl.store(gates_ptr + rows[:, None] * E + cols[None, :], g, mask=mask)
    first = tl.argmax(x, axis=1)
    tl.store(expert_ptr + rows * K, first.to(tl.int64), mask=rmask)
    if K == 2:
        x2 = tl.where(cols[None, :] == first[:, None], float("-inf"), x)
        second = tl.argmax(x2, axis=1)
        tl.store(expert_ptr + rows * K + 1, second.to(tl.int64), mask=rmask)


def _capacity_slots(expert_ptr, slot_ptr, S, cap, K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program scans the tokens in order: choice j of token s gets its position among choice-j
    tokens of its expert (plus, for j = 1, all first choices of that expert); slot >= cap -> -1."""
    cols = tl.arange(0, BLOCK_E)
    first_total = cols * 0
    for j in tl.static_range(K):
        counts = cols * 0
        for start in range(0, S, BLOCK_S):
            rows = start + tl.arange(0, BLOCK_S)
            rmask = rows < S
            ex = tl.load(expert_ptr + rows * K + j, mask=rmask, other=-1)
            onehot = (ex[:, None] == cols[None, :]).to(tl.int32)  # [BLOCK_S, BLOCK_E]
            before = tl.cumsum(onehot, axis=0) - onehot + counts[None, :]
            if j == 1:
                before = before + first_total[None, :]
            pos = tl.sum(onehot * before, axis=1)
            slot = tl.where(pos < cap, pos, -1)
            tl.store(slot_ptr + rows * K + j, slot.to(tl.int64), mask=rmask)
            counts += tl.sum(onehot, axis=0)
        if j == 0:
            first_total = counts


def _combine_weights(gates_ptr, expert_ptr, slot_ptr, weight_ptr, S, E, eps, K: tl.constexpr, BLOCK_S: tl.constexpr):
    """weight = gate of each kept choice (0 when dropped); top-2: renormalized to sum to 1."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rmask = rows < S
    e0 = tl.load(expert_ptr + rows * K, mask=rmask, other=0)
    s0 = tl.load(slot_ptr + rows * K, mask=rmask, other=-1)
    g0 = tl.load(gates_ptr + rows * E + e0, mask=rmask, other=0.0)
    g0 = tl.where(s0 >= 0, g0, 0.0)
    if K == 2:
        e1 = tl.load(expert_ptr + rows * K + 1, mask=rmask, other=0)
        s1 = tl.load(slot_ptr + rows * K + 1, mask=rmask, other=-1)
        g1 = tl.load(gates_ptr + rows * E + e1, mask=rmask, other=0.0)
        g1 = tl.where(s1 >= 0, g1, 0.0)
        den = tl.maximum(g0 + g1, eps)
        tl.store(weight_ptr + rows * K + 1, g1 / den, mask=rmask)
        g0 = g0 / den
    tl.store(weight_ptr + rows * K, g0, mask=rmask)


def _gating_backward(
    gates_ptr,
    expert_ptr,
    slot_ptr,
    g_gates_ptr,
    g_weight_ptr,
    dx_ptr,
    S,
    E,
    eps,
    K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The logits' gradient of gates = softmax(logits) and weight (`_combine_weights`), given the
    gradients of gates [S, E] and weight [S, k]: weight's gradient goes to the gates of the kept
    choices (top-2: through the renormalization p_j / max(p_0 + p_1, eps), whose denominator passes
    a gradient only where p_0 + p_1 >= eps, as torch's clamp), then through the softmax:
    dx = g * (dg - sum_e dg * g). In fp32; parallel over token blocks."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < S
    mask = rmask[:, None] & (cols < E)[None, :]
    at = rows[:, None] * E + cols[None, :]
    g = tl.load(gates_ptr + at, mask=mask, other=0.0)
    dg = tl.load(g_gates_ptr + at, mask=mask, other=0.0).to(tl.float32)
    e0 = tl.load(expert_ptr + rows * K, mask=rmask, other=-1)
    kept0 = tl.load(slot_ptr + rows * K, mask=rmask, other=-1) >= 0
    dw0 = tl.load(g_weight_ptr + rows * K, mask=rmask, other=0.0).to(tl.float32)
    hit0 = (cols[None, :] == e0[:, None]) & kept0[:, None]
    if K == 2:
        e1 = tl.load(expert_ptr + rows * K + 1, mask=rmask, other=-1)
        kept1 = tl.load(slot_ptr + rows * K + 1, mask=rmask, other=-1) >= 0
        dw1 = tl.load(g_weight_ptr + rows * K + 1, mask=rmask, other=0.0).to(tl.float32)
        hit1 = (cols[None, :] == e1[:, None]) & kept1[:, None]
        p0 = tl.sum(tl.where(hit0, g, 0.0), axis=1)
        p1 = tl.sum(tl.where(hit1, g, 0.0), axis=1)
        den = p0 + p1
        dc = tl.maximum(den, eps)
        d_den = tl.where(den >= eps, -(dw0 * p0 + dw1 * p1) / (dc * dc), 0.0)
        dg = dg + tl.where(hit0, (dw0 / dc + d_den)[:, None], 0.0) + tl.where(hit1, (dw1 / dc + d_den)[:, None], 0.0)
    else:
        dg = dg + tl.where(hit0, dw0[:, None], 0.0)
    dot = tl.sum(dg * g, axis=1)
    tl.store(dx_ptr + at, g * (dg - dot[:, None]), mask=mask)


_KERNELS = (_move_rows, _row_dots, _softmax_topk, _capacity_slots, _combine_weights, _gating_backward)
_JITTED: dict[str, SimpleNamespace] = {}


def jitted() -> SimpleNamespace:
    """The kernels compiled with `triton.jit` (interpreted when TRITON_INTERPRET=1 at this call)."""
    key = os.environ.get("TRITON_INTERPRET", "0")
    if key not in _JITTED:
        _JITTED[key] = SimpleNamespace(**{f.__name__.lstrip("_"): triton.jit(f) for f in _KERNELS})
    return _JITTED[key]


def next_power_of_2(n: int) -> int:
    """The block size covering `n` (triton's helper)."""
    return int(triton.next_power_of_2(max(1, n)))
