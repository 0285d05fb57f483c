"""A key/value cache for generation: each attention layer appends the keys and
values of the new tokens and attends over everything cached. Plain tensors
(under tensor parallelism each rank caches its own heads)."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0           # tokens cached so far (the position of the next one)

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self, i)


class LayerCache:
    def __init__(self, cache: KVCache, i: int):
        self.cache, self.i = cache, i

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, heads, new tokens, hd) -> everything cached for this layer, new tokens included."""
        if self.i in self.cache.layers:
            k0, v0 = self.cache.layers[self.i]
            k, v = torch.cat((k0, k), dim=2), torch.cat((v0, v), dim=2)
        self.cache.layers[self.i] = (k, v)
        return k, v
