"""KV cache of one batch of left-padded sequences.

Legend: B rows (requests), h heads of this MP rank, d head dim, L cached positions, T positions
of this call, Lmax the cache capacity. Row b holds `pad[b]` padding slots, then its real tokens;
padding keys are masked out, so a row attends exactly to its own tokens (a padded query attends
to itself only; its output is never used). Every attention layer keeps its own k, v
[B, h, Lmax, d]; `KVCache.advance(T)` moves the shared length after a forward passed every layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class LayerCache:
    """The cache of one attention layer: `attend(q, k, v)` stores k, v and attends over the cache."""

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [B, h, T, d] of positions L..L+T-1 -> attention output [B, h, T, d]."""
        B, h, T, d = k.shape
        L, cap = self.owner.length, self.owner.capacity
        if L + T > cap:
            raise ValueError(f"KV cache of {cap} positions is full ({L} cached + {T} new)")
        if self.k is None or self.v is None:  # both are made together
            self.k = k.new_zeros(B, h, cap, d)
            self.v = v.new_zeros(B, h, cap, d)
        self.k[:, :, L : L + T] = k
        self.v[:, :, L : L + T] = v
        keys, values = self.k[:, :, : L + T], self.v[:, :, : L + T]
        mask = self.owner.mask(L, T)
        if mask is None:  # no padding: plain causal attention (T == 1: all keys)
            return F.scaled_dot_product_attention(q, keys, values, is_causal=(L == 0 and T > 1))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])


class KVCache:
    """Caches of every attention layer for B left-padded rows (`pad` [B] padding slots each)."""

    def __init__(self, num_layers: int, pad: list[int], capacity: int, device: torch.device):
        self.capacity, self.length = capacity, 0
        self.pad = torch.tensor(pad, dtype=torch.long, device=device)
        self.has_padding = any(p > 0 for p in pad)
        self.layers = [LayerCache(self) for _ in range(num_layers)]

    def positions(self, T: int) -> torch.Tensor:
        """Position ids [B, T] of the next T slots (padding slots get 0)."""
        slot = torch.arange(self.length, self.length + T, device=self.pad.device)
        return (slot[None, :] - self.pad[:, None]).clamp(min=0)

    def real(self, T: int) -> torch.Tensor:
        """[B, T] True where the next T slots hold real tokens."""
        slot = torch.arange(self.length, self.length + T, device=self.pad.device)
        return slot[None, :] >= self.pad[:, None]

    def mask(self, L: int, T: int) -> Optional[torch.Tensor]:
        """Boolean attention mask [B, T, L+T] (True: attend) for queries at slots L..L+T-1; None
        when plain causal attention is exact (no padding)."""
        if not self.has_padding:
            return None
        dev = self.pad.device
        key = torch.arange(L + T, device=dev)
        query = torch.arange(L, L + T, device=dev)
        causal = key[None, :] <= query[:, None]  # [T, L+T]
        valid = key[None, :] >= self.pad[:, None]  # [B, L+T]
        own = key[None, :] == query[:, None]  # a padded query sees itself
        return (causal[None] & valid[:, None, :]) | own[None]

    def advance(self, T: int) -> None:
        """Every layer has stored the last T slots."""
        self.length += T
