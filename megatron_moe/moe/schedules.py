"""MoE schedules: how a layer's tokens reach the experts and come back.

Legend: G routing groups in the call, S tokens per group, M model dim,
E experts (E_l = E / N_EP local), C capacity (GC = G * C slots per expert in
one buffer), N_EP / N_ESP / N_MP group sizes.

baseline (DeepSpeed-MoE style, Parm Fig. 3a): every MP rank routes the same
tokens; ESP all-gather of the dispatch buffer; EP all-to-all; each ESP rank
runs its H/N_ESP slice of its local experts; ESP all-reduce of the partial
outputs; EP all-to-all back; ESP split; combine. Because the N_MP ranks of an
MP group push identical tokens through the experts, expert weight gradients
are scaled by 1/N_MP (the work is duplicated, the gradient must not be).

Parm's S1 and S2 (`megatron_moe.moe.parm`) pause MP inside the layer and use
one EP x ESP all-to-all instead; `SCHEDULES` maps --moe-schedule names to all three
('auto' is resolved per layer by `megatron_moe.moe.cost_model.choose_for_layer`).

Every schedule has the signature (layer, x_GSM) -> (y_GSM, aux_loss).
"""
from __future__ import annotations

import torch

from megatron_moe.distributed.collectives import all_gather, all_reduce, all_to_all
from megatron_moe.moe.dispatch import combine, dispatch, route_groups
from megatron_moe.moe.parm import s1, s2


def baseline(layer, x_GSM: torch.Tensor):
    """DeepSpeed-MoE's schedule under MP + EP + ESP (see module docstring)."""
    ps = layer.ps
    G, S, M = x_GSM.shape
    E, n_ep, n_esp, n_mp = layer.num_experts, ps.size("ep"), ps.size("esp"), ps.size("mp")
    E_l = E // n_ep
    routes, idx, C, aux = route_groups(layer, x_GSM)
    GC = G * C
    buf_ECM = dispatch(x_GSM.reshape(G * S, M), idx, E * GC).view(E, GC, M)
    gathered = all_gather(buf_ECM[None], ps.group("esp"), dim=0)           # [N_ESP, E, GC, M]
    send = gathered.transpose(0, 1).reshape(n_ep, E_l, n_esp, GC, M)       # by destination EP rank
    recv = all_to_all(send.contiguous(), ps.group("ep"))                    # [N_EP src, E_l, N_ESP, GC, M]
    x_in = recv.permute(1, 0, 2, 3, 4).reshape(E_l, n_ep * n_esp * GC, M)
    partial = layer.experts(x_in, grad_scale=1.0 / n_mp)
    full = all_reduce(partial, ps.group("esp"))                             # sum of H slices
    back = full.reshape(E_l, n_ep, n_esp, GC, M).permute(1, 0, 2, 3, 4).contiguous()
    ret = all_to_all(back, ps.group("ep"))                                  # [N_EP owner, E_l, N_ESP, GC, M]
    out_ECM = ret.reshape(E, n_esp, GC, M)[:, ps.rank("esp")]               # ESP split: our buffer
    y = combine(out_ECM.reshape(E * GC, M), idx, G * S)
    return y.view(G, S, M), aux


SCHEDULES = {"baseline": baseline, "s1": s1, "s2": s2}
