"""A preallocated KV cache with static shapes (gpt-fast style).

Full-attention layers keep every position in `[0, max_length)`. Sliding-window layers keep only the last
`sliding_window - 1` positions in a ring buffer, which is exactly what the reference keeps: a new causal
query sees itself plus the `sliding_window - 1` before it, and the bidirectional decoder sees those same
cached positions plus the whole canvas.

Batches are left padded, so every row shares the same absolute positions (the reference numbers pads
too); `pad_mask` records which positions hold real tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from printpress.config import TextConfig
from printpress.errors import GenerationError


@dataclass
class LayerKV:
    keys: torch.Tensor  # (B, H_kv, S, D) with roped, normed keys
    values: torch.Tensor  # (B, H_kv, S, D)
    sliding: bool


class KVCache:
    """Keys and values of the encoded context, written by `encode` and only read by `denoise`."""

    def __init__(
        self,
        config: TextConfig,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_length > config.max_position_embeddings:
            raise GenerationError(
                f"a cache of {max_length} positions exceeds the model's limit of {config.max_position_embeddings}"
            )
        self.batch_size = batch_size
        self.max_length = max_length
        self.window = min(config.sliding_window - 1, max_length)
        self.length = 0
        self.pad_mask = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        # Left pads per row: a row's RoPE positions start at 0 on its first real token, so a prompt gets
        # bit-for-bit the positions it would get alone, whatever the batch pads it to.
        self.offsets = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Absolute position held by each ring slot of the sliding layers (-1: empty).
        self.slot_positions = torch.full((self.window,), -1, dtype=torch.long, device=device)
        self.layers: list[LayerKV] = []
        for spec in config.layers:
            slots = self.window if spec.sliding else max_length
            shape = (batch_size, spec.num_kv_heads, slots, spec.head_dim)
            self.layers.append(
                LayerKV(
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                    spec.sliding,
                )
            )

    @property
    def device(self) -> torch.device:
        return self.pad_mask.device

    # -- what a new block of queries may see ----------------------------------------------------------
    def full_prefix(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[index]
        return layer.keys[:, :, : self.length], layer.values[:, :, : self.length]

    def full_with_block(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a block's keys/values right after the cached ones and return views of prefix + block.

        No copy of the prefix: `encode` then commits the block with `advance`; `denoise` leaves `length`
        alone, so its canvas only borrows the free slots as scratch space."""
        layer, end = self.layers[index], self.length + keys.shape[2]
        layer.keys[:, :, self.length : end] = keys
        layer.values[:, :, self.length : end] = values
        return layer.keys[:, :, :end], layer.values[:, :, :end]

    def has_room(self, new_tokens: int) -> bool:
        return self.length + new_tokens <= self.max_length

    def sliding_prefix(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Until the ring wraps, slot i holds position i: only the filled slots are read.
        layer, filled = self.layers[index], self.filled_slots
        return layer.keys[:, :, :filled], layer.values[:, :, :filled]

    @property
    def filled_slots(self) -> int:
        return min(self.length, self.window)

    def prefix_positions(self, sliding: bool) -> torch.Tensor:
        """Absolute positions of the cached keys a layer reads, in storage order."""
        if sliding:
            return self.slot_positions[: self.filled_slots]
        return torch.arange(self.length, device=self.device)

    def prefix_valid(self, sliding: bool) -> torch.Tensor:
        """(B, S) True where a cached key holds a real token (not left padding)."""
        return self.pad_mask[:, self.prefix_positions(sliding)]

    def set_offsets(self, attention_mask: torch.Tensor) -> None:
        """Record each row's leading pads (call on the first block written)."""
        self.offsets = (~attention_mask.to(torch.bool)).long().cumprod(dim=1).sum(dim=1)

    def row_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE positions of a block at slots `positions` (T,): per row (B, T) when rows are padded."""
        if not bool(self.offsets.any()):
            return positions
        return positions[None, :] - self.offsets[:, None]

    # -- writing ----------------------------------------------------------------------------------------
    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_length:
            raise GenerationError(
                f"the cache holds {self.max_length} positions; {self.length} are used and {new_tokens} more were asked"
            )

    def write(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the keys/values of the block that starts at `self.length` (call `advance` after all layers)."""
        layer = self.layers[index]
        new = keys.shape[2]
        if not layer.sliding:
            layer.keys[:, :, self.length : self.length + new] = keys
            layer.values[:, :, self.length : self.length + new] = values
            return
        keep = min(new, self.window)
        if keep == 0:
            return
        slots = self._ring_slots(new)
        layer.keys.index_copy_(2, slots, keys[:, :, new - keep :])
        layer.values.index_copy_(2, slots, values[:, :, new - keep :])

    def advance(self, new_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Commit a block of `new_tokens` positions: record its pad mask and ring positions."""
        start = self.length
        if attention_mask is None:
            self.pad_mask[:, start : start + new_tokens] = True
        else:
            self.pad_mask[:, start : start + new_tokens] = attention_mask.to(torch.bool)
        keep = min(new_tokens, self.window)
        if keep:
            self.slot_positions[self._ring_slots(new_tokens)] = torch.arange(
                start + new_tokens - keep, start + new_tokens, device=self.device
            )
        self.length = start + new_tokens

    def _ring_slots(self, new_tokens: int) -> torch.Tensor:
        keep = min(new_tokens, self.window)
        first = self.length + new_tokens - keep
        return torch.arange(first, first + keep, device=self.device) % self.window

    # -- batch management -------------------------------------------------------------------------------
    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only `rows` (in that order), in place: finished requests stop costing compute."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.pad_mask = self.pad_mask.index_select(0, rows)
        self.offsets = self.offsets.index_select(0, rows)
        self.batch_size = int(rows.numel())

    def rows(self, rows: torch.Tensor | list[int]) -> KVCache:
        """A new cache holding copies of `rows` only, for decoder passes over part of the batch.

        The decoder never writes, so the copy may be read while this cache keeps serving the other rows.
        """
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        sub = copy.copy(self)
        sub.layers = [LayerKV(layer.keys.index_select(0, rows), layer.values.index_select(0, rows), layer.sliding)
                      for layer in self.layers]
        sub.pad_mask = self.pad_mask.index_select(0, rows)
        sub.offsets = self.offsets.index_select(0, rows)
        sub.slot_positions = self.slot_positions.clone()
        sub.batch_size = int(rows.numel())
        return sub

    def reset(self) -> None:
        self.length = 0
        self.pad_mask.zero_()
        self.offsets.zero_()
        self.slot_positions.fill_(-1)
