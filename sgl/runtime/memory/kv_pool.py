"""Token-level KV pool: one K and one V tensor per layer, indexed by slot.

A slot holds the K/V of exactly one token of one sequence. Slot 0 is never handed out:
it is a scratch slot that padded kernel lanes may write to harmlessly. On the CPU every
layer's K and V are views into one block on huge pages (memory/huge_pages.py): the
decode step reads rows at scattered slots, and 4 KB pages made most of those reads TLB
misses.
"""

from __future__ import annotations

import torch

from sgl.runtime.memory import huge_pages as pages


class KVPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        huge_pages: bool = True,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_slots, num_kv_heads, head_dim)
        if huge_pages and torch.device(device).type == "cpu":
            block = pages.zeros((2, num_layers, *shape), dtype)
            self.k_buffers, self.v_buffers = list(block[0]), list(block[1])
        else:
            self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer_id].index_copy_(0, loc, v.to(self.dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
