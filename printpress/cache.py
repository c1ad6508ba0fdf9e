"""A preallocated KV cache with static shapes (gpt-fast style).

Full-attention layers keep every position in `[0, max_length)`. Sliding-window layers keep only the last
`sliding_window - 1` positions in a ring buffer, which is exactly what the reference keeps: a new causal
query sees itself plus the `sliding_window - 1` before it, and the bidirectional decoder sees those same
cached positions plus the whole canvas. A block joins a ring by concatenation (the ring oldest first, then the
block), except while the ring has not wrapped and has room for it after its filled slots (`ring_has_room`): then
it is written in place and read where it lies, as in a full layer.

Batches are left padded, so every row shares the same absolute positions (the reference numbers pads
too); `pad_mask` records which positions hold real tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from printpress import native
from printpress.config import TextConfig
from printpress.errors import GenerationError


@dataclass
class LayerKV:
    keys: torch.Tensor  # (B, H_kv, S, D) with roped, normed keys
    values: torch.Tensor  # (B, H_kv, S, D)
    sliding: bool


@dataclass
class KVJoin:
    """How one layer's block keys/values (B, H_kv, T, D) join its cached ones for attention, described plainly so
    that the C++ layers (`printpress_layers.layer`) run it as `__call__` does.

    In place (full layers with room): the block is written at slot `start` and attention reads slots
    [0, start + T), no copy of the prefix. Otherwise the prefix, slots [0, start), is concatenated before the block,
    read from slot `wrap` on and then from 0 (a ring that has wrapped, read oldest first); then the block's last
    `keep` keys/values are written to ring slots `write_at` onwards (or to the slots `slots`, where they wrap around
    the ring), after the concatenation: the ring may overwrite what it just read."""

    keys: torch.Tensor  # the layer's cache (B, H_kv, S, D)
    values: torch.Tensor
    in_place: bool
    start: int
    wrap: int = 0
    keep: int = 0
    write_at: int = 0
    slots: torch.Tensor | None = None

    def __call__(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_place:
            self.store(keys, values)
            end = self.start + keys.shape[2]
            return self.keys[:, :, :end], self.values[:, :, :end]
        wrap, start = self.wrap, self.start
        joined = tuple(torch.cat([cached[:, :, wrap:start], cached[:, :, :wrap], new], dim=2) if wrap else
                       torch.cat([cached[:, :, :start], new], dim=2)
                       for cached, new in ((self.keys, keys), (self.values, values)))
        self.store(keys, values)  # after the concatenation: the ring may overwrite what it just read
        return joined

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Only the writing: the block at `start` (in place), or its last `keep` keys/values into the ring."""
        t = keys.shape[2]
        for cached, new in ((self.keys, keys), (self.values, values)):
            if self.in_place:
                cached[:, :, self.start : self.start + t] = new
            elif self.keep and self.slots is None:
                cached[:, :, self.write_at : self.write_at + self.keep] = new[:, :, t - self.keep :]
            elif self.keep:
                cached.index_copy_(2, self.slots, new[:, :, t - self.keep :])


def copy_runs(targets: list[torch.Tensor], sources: list[torch.Tensor], starts: list[int], offsets: list[int],
              counts: list[int]) -> None:
    """targets[i][:, :, starts[i] : starts[i] + counts[i]] = sources[i][:, :, offsets[i] : offsets[i] + counts[i]] for
    every i, in one call to the C++ layers where they are loaded (else a view and a copy each)."""
    if not targets:
        return
    if native.loaded("layers.cpp"):
        torch.ops.printpress_layers.write_rows(targets, sources, starts, offsets, counts)
        return
    pairs = [(t.narrow(2, s, c), f.narrow(2, o, c)) for t, f, s, o, c in zip(targets, sources, starts, offsets,
                                                                           counts) if c]
    if pairs:
        torch._foreach_copy_(*map(list, zip(*pairs)))


@dataclass
class RingSnapshot:
    """Sliding-ring contents a block is about to overwrite (see `KVCache.snapshot`)."""

    length: int  # cache length when taken: the block starts here
    new_tokens: int
    runs: list[tuple[int, int, int]]  # the ring slots the block writes: (first slot, index among them, count) each
    slot_positions: torch.Tensor  # positions those slots held before, in block order
    saved: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer: old keys/values of those slots (sliding only)


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
        # pad_mask holds True in every row up to here at least (`all_valid` asks the tensor only past it).
        self._valid_until = 0
        self._offsets_memo: tuple | None = None  # (the tensor, its version, any set) of `offsets` (`row_positions`)
        # Left pads per row: a row's RoPE positions start at 0 on its first real token, so a prompt gets
        # bit-for-bit the positions it would get alone, whatever the batch pads it to.
        self.offsets = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Absolute position held by each ring slot of the sliding layers (-1: empty).
        self.slot_positions = torch.full((self.window,), -1, dtype=torch.long, device=device)
        # Index tensors every sliding layer of a pass asks for, kept for the length they were made at.
        self._order_memo: tuple[int, torch.Tensor | None] = (-1, None)
        self._ring_memo: tuple[tuple[int, int], torch.Tensor | None] = ((-1, 0), None)
        self._scratches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sliding layer -> `_scratch`
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
        layer = self.layers[index]
        return KVJoin(layer.keys, layer.values, True, self.length)(keys, values)

    def prefix_join(self, index: int) -> KVJoin:
        """The layer's cached keys/values in the order `sliding_prefix` / `full_prefix` give them, concatenated
        before a block's (nothing written)."""
        layer = self.layers[index]
        if not layer.sliding:
            return KVJoin(layer.keys, layer.values, False, self.length)
        return KVJoin(layer.keys, layer.values, False, self.filled_slots, wrap=self._oldest_slot())

    def encoder_join(self, index: int, new_tokens: int) -> KVJoin:
        """How `encode` joins a block of `new_tokens` to the layer's cache: written after the prefix (full layers,
        and sliding ones while the ring has room: `ring_has_room`) or into the ring after the prefix is read (sliding
        layers); `advance` commits it after all layers."""
        layer = self.layers[index]
        if not layer.sliding or self.ring_has_room(new_tokens):
            return KVJoin(layer.keys, layer.values, True, self.length)
        join = self.prefix_join(index)
        join.keep = min(new_tokens, self.window)
        if join.keep:
            join.write_at = (self.length + new_tokens - join.keep) % self.window
            if join.write_at + join.keep > self.window:  # the block's slots wrap around the ring
                join.slots = self._ring_slots(new_tokens)
        return join

    def tentative_joins(self, new_tokens: int) -> tuple[list[KVJoin], Callable[[int], None]]:
        """How a block of `new_tokens` that may be kept only in part (a speculative verification) joins every
        layer's cache, and `keep(n)`, which commits the block's first n tokens as `encode` would have (`advance`
        included). Full layers write the block in place after the prefix, as `encoder_join` does (positions past the
        length are never read). Sliding layers leave their ring alone: each reads a scratch buffer holding the ring
        oldest first (what `prefix_join` concatenates) with the block written after it, the same keys in the same
        order; `keep(n)` writes the n kept ones into the ring. Nothing to save beforehand or restore after, as
        `snapshot` and `truncate` do for a block written into the ring. Where the ring has room for the block after
        its filled slots (`ring_has_room`), every layer joins as `encoder_join` has it, in place: the kept keys are
        then in their slots already, and the others past the length, in slots no pass reads."""
        length = self.length
        if self.ring_has_room(new_tokens):
            def advance(n: int) -> None:
                self._check_keep(n, new_tokens, length)
                self.advance(n, None)

            return [self.encoder_join(index, new_tokens) for index in range(len(self.layers))], advance
        filled, wrap = self.filled_slots, self._oldest_slot()
        joins, scratches = [], []
        for index, layer in enumerate(self.layers):
            scratch = self._scratch(index, filled + new_tokens) if layer.sliding else None
            joins.append(KVJoin(*scratch, True, filled) if scratch else self.encoder_join(index, new_tokens))
            scratches.append(scratch)
        # the ring oldest first: its slots from `wrap` on, then those before it
        self._copy_ring_runs(scratches, [(wrap, 0, filled - wrap), (0, filled - wrap, wrap)] if wrap else
                             [(0, 0, filled)], into_ring=False)

        def keep(n: int) -> None:
            self._check_keep(n, new_tokens, length)
            kept = min(n, self.window)  # the ring holds the last `window` of them, read from the block's place
            self._copy_ring_runs(scratches, [(slot, filled + n - kept + index, count)
                                             for slot, index, count in self._ring_runs(length + n, kept)],
                                 into_ring=True)
            self.advance(n, None)

        return joins, keep

    def _check_keep(self, n: int, new_tokens: int, length: int) -> None:
        """`keep(n)` of a tentative block of `new_tokens` encoded at `length` is still possible."""
        if self.length != length or not 0 <= n <= new_tokens:
            raise GenerationError(f"cannot keep {n} of a block of {new_tokens} tokens encoded at {length}: the "
                                  f"cache now holds {self.length}")

    def _scratch(self, index: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer's scratch keys and values (B, H_kv, >= slots, D) for `tentative_joins`, kept between
        blocks (grown when a longer one comes)."""
        held = self._scratches.get(index)
        if held is None or held[0].shape[2] < slots:
            layer = self.layers[index]
            shape = (*layer.keys.shape[:2], max(slots, self.window + 8), layer.keys.shape[3])
            held = self._scratches[index] = (layer.keys.new_empty(shape), layer.values.new_empty(shape))
        return held

    def decoder_join(self, index: int, canvas: int) -> KVJoin:
        """How `denoise` joins a canvas to the layer's cache without committing it: full layers borrow the free slots
        after the prefix when there is room (`full_with_block`), else copy the prefix; sliding layers borrow the
        ring's free slots while it has room (`ring_has_room`), else read the ring."""
        layer = self.layers[index]
        if self.ring_has_room(canvas) if layer.sliding else self.has_room(canvas):
            return KVJoin(layer.keys, layer.values, True, self.length)
        return self.prefix_join(index)

    def has_room(self, new_tokens: int) -> bool:
        return self.length + new_tokens <= self.max_length

    def ring_has_room(self, new_tokens: int) -> bool:
        """Whether the sliding rings have not wrapped yet and have free slots for a block of `new_tokens` after the
        filled ones: slot i then holds position i, so the block joins them in place as in a full layer (written after
        them, attention reading slots [0, length + new_tokens)), the same keys in the same order as the ring's
        concatenation, without copying the ring (a real model's window of 512 or 1024 holds most of a short
        conversation)."""
        return self.length + new_tokens <= self.window

    def all_valid(self) -> bool:
        """True when every cached position holds a real token (no left padding): no key needs masking."""
        return self._valid_until >= self.length or bool(self.pad_mask[:, : self.length].all())

    def sliding_prefix(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding layer's cached keys/values, oldest first.

        Until the ring wraps, slot i holds position i and only the filled slots are read. Once it has wrapped,
        the slots are read rotated into chronological order: the reference keeps its window oldest-first, and
        attention must sum its terms in the same order to give bit-identical logits."""
        layer, filled = self.layers[index], self.filled_slots
        order = self._chronological_slots()
        if order is None:
            return layer.keys[:, :, :filled], layer.values[:, :, :filled]
        return layer.keys.index_select(2, order), layer.values.index_select(2, order)

    def _chronological_slots(self) -> torch.Tensor | None:
        """Ring slots oldest-first once the ring has wrapped with the oldest not in slot 0; None otherwise.

        Every sliding layer of a pass asks for the same order: it is kept for the current length."""
        if self._order_memo[0] == self.length:
            return self._order_memo[1]
        start = self._oldest_slot()
        order = None
        if start:
            order = torch.cat([torch.arange(start, self.window, device=self.device),
                               torch.arange(0, start, device=self.device)])
        self._order_memo = (self.length, order)
        return order

    def _oldest_slot(self) -> int:
        """The ring slot holding the oldest cached position once the ring has wrapped; 0 until then."""
        return self.length % self.window if 0 < self.window < self.length else 0

    @property
    def filled_slots(self) -> int:
        return min(self.length, self.window)

    def prefix_positions(self, sliding: bool) -> torch.Tensor:
        """Absolute positions of the cached keys a layer reads, in the order `sliding_prefix` gives them."""
        if sliding:
            order = self._chronological_slots()
            return self.slot_positions[: self.filled_slots] if order is None else self.slot_positions[order]
        return torch.arange(self.length, device=self.device)

    def prefix_valid(self, sliding: bool) -> torch.Tensor:
        """(B, S) True where a cached key holds a real token (not left padding)."""
        return self.pad_mask[:, self.prefix_positions(sliding)]

    def set_offsets(self, attention_mask: torch.Tensor) -> None:
        """Record each row's leading pads (call on the first block written)."""
        self.offsets = (~attention_mask.to(torch.bool)).long().cumprod(dim=1).sum(dim=1)

    def row_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE positions of a block at slots `positions` (T,): per row (B, T) when rows are padded."""
        offsets = self.offsets  # whether any is set is kept while the tensor and its version stay
        memo = getattr(self, "_offsets_memo", None)  # (a StackedCache borrows this method)
        if memo is None or memo[0] is not offsets or memo[1] != offsets._version:
            memo = self._offsets_memo = (offsets, offsets._version, bool(offsets.any()))
        if not memo[2]:
            return positions
        return positions[None, :] - offsets[:, None]

    # -- writing ----------------------------------------------------------------------------------------
    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_length:
            raise GenerationError(
                f"the cache holds {self.max_length} positions; {self.length} are used and {new_tokens} more were asked"
            )

    def write(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the keys/values of the block that starts at `self.length` (call `advance` after all layers)."""
        self.encoder_join(index, keys.shape[2]).store(keys, values)

    def write_all(self, keys: list[torch.Tensor], values: list[torch.Tensor], n: int) -> None:
        """`write` for every layer at once: the first `n` of each layer's block keys/values (B, KV, T >= n, D), as
        one batched copy where each layer's slots are a contiguous run (always for full layers; for the ring unless
        the block wraps around it). Call `advance(n, ...)` after it."""
        keep = min(n, self.window)
        first = (self.length + n - keep) % self.window if self.window else 0
        contiguous_ring = first + keep <= self.window
        targets, sources, starts, offsets, counts = [], [], [], [], []
        for index, (layer, k, v) in enumerate(zip(self.layers, keys, values)):
            if layer.sliding and not contiguous_ring:
                self.write(index, k[:, :, :n], v[:, :, :n])
                continue
            start, offset, count = (first, n - keep, keep) if layer.sliding else (self.length, 0, n)
            targets += [layer.keys, layer.values]
            sources += [k, v]
            starts += [start, start]
            offsets += [offset, offset]
            counts += [count, count]
        copy_runs(targets, sources, starts, offsets, counts)

    def advance(self, new_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Commit a block of `new_tokens` positions: record its pad mask and ring positions."""
        start = self.length
        if attention_mask is None:
            self.pad_mask.narrow(1, start, new_tokens).fill_(True)
            if self._valid_until >= start:
                self._valid_until = start + new_tokens
        else:
            self.pad_mask[:, start : start + new_tokens] = attention_mask.to(torch.bool)
        keep = min(new_tokens, self.window)
        first = (start + new_tokens - keep) % self.window if keep else 0
        if keep and first + keep <= self.window:  # the ring's slots in one run: written in place
            torch.arange(start + new_tokens - keep, start + new_tokens, out=self.slot_positions.narrow(0, first, keep))
        elif keep:
            self.slot_positions[self._ring_slots(new_tokens)] = torch.arange(
                start + new_tokens - keep, start + new_tokens, device=self.device
            )
        self.length = start + new_tokens

    def _ring_slots(self, new_tokens: int) -> torch.Tensor:
        """Ring slots a block of `new_tokens` starting at the current length writes (kept: every sliding layer
        of a pass writes the same slots)."""
        if self._ring_memo[0] == (self.length, new_tokens):
            return self._ring_memo[1]
        keep = min(new_tokens, self.window)
        first = self.length + new_tokens - keep
        slots = torch.arange(first, first + keep, device=self.device) % self.window
        self._ring_memo = ((self.length, new_tokens), slots)
        return slots

    # -- rolling back (speculative decoding) ------------------------------------------------------------
    def snapshot(self, new_tokens: int) -> RingSnapshot:
        """Save what writing a block of `new_tokens` would overwrite in the sliding rings, so `truncate` can
        undo part of that block. Full layers need nothing saved: positions past the length are never read."""
        keep = min(new_tokens, self.window)
        runs = self._ring_runs(self.length + new_tokens, keep)
        saved = [tuple(t.new_empty(t.shape[0], t.shape[1], keep, t.shape[3]) for t in (layer.keys, layer.values))
                 if layer.sliding else None for layer in self.layers]
        self._copy_ring_runs(saved, runs, into_ring=False)
        positions = torch.cat([self.slot_positions[slot : slot + count] for slot, _, count in runs])
        return RingSnapshot(self.length, new_tokens, runs, positions, saved)

    def _ring_runs(self, end: int, count: int) -> list[tuple[int, int, int]]:
        """The ring slots of positions [end - count, end) (count <= window): (first slot, index among them, count) for
        the slots from the first one on, in one run, or in two where they wrap around the ring's end."""
        first = (end - count) % self.window if count else 0
        runs = [(first, 0, min(count, self.window - first))]
        if count > runs[0][2]:
            runs.append((0, runs[0][2], count - runs[0][2]))
        return runs

    def _copy_ring_runs(self, saved: list[tuple[torch.Tensor, torch.Tensor] | None], runs: list[tuple[int, int, int]],
                        into_ring: bool) -> None:
        """Every sliding layer's ring slots of `runs` ((first slot, index in `saved`, count) each) copied into `saved`,
        or back into the ring (`into_ring`), in one batched copy."""
        rings = [t for layer in self.layers if layer.sliding for t in (layer.keys, layer.values)]
        buffers = [t for pair in saved if pair is not None for t in pair]
        targets, sources, starts, offsets, counts = [], [], [], [], []
        for slot, index, count in runs:
            targets += rings if into_ring else buffers
            sources += buffers if into_ring else rings
            starts += [slot if into_ring else index] * len(rings)
            offsets += [index if into_ring else slot] * len(rings)
            counts += [count] * len(rings)
        copy_runs(targets, sources, starts, offsets, counts)

    def truncate(self, length: int, snapshot: RingSnapshot) -> None:
        """Forget every position from `length` on, as if only the block's first `length - start` tokens had
        been encoded after `snapshot` was taken: ring slots those tokens did not write get their old keys,
        values and positions back, bit for bit."""
        start, end = snapshot.length, snapshot.length + snapshot.new_tokens
        if self.length != end or not start <= length <= end:
            raise GenerationError(
                f"cannot truncate to {length}: the snapshot covers positions {start}..{end} and the cache holds {self.length}"
            )
        if snapshot.new_tokens > self.window and length not in (start, end):
            # The ring kept only the block's last `window` positions: the ones before are gone.
            raise GenerationError(
                f"cannot truncate a block of {snapshot.new_tokens} tokens part way: the sliding window keeps {self.window}"
            )
        # the slots whose block positions are `length` or later get their old keys, values and positions back
        kept = max(0, length - (end - snapshot.slot_positions.numel()))  # block slots holding kept positions
        restore = [(slot + skip, index + skip, count - skip) for slot, index, count in snapshot.runs
                   if (skip := max(0, kept - index)) < count]
        self._copy_ring_runs(snapshot.saved, restore, into_ring=True)
        for slot, index, count in restore:
            self.slot_positions[slot : slot + count] = snapshot.slot_positions[index : index + count]
        self.pad_mask[:, length:end] = False
        self._valid_until = min(self._valid_until, length)
        self.length = length

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
        self._scratches = {}

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
        sub._scratches = {}
        sub.batch_size = int(rows.numel())
        return sub

    def reset(self) -> None:
        self.length = 0
        self._valid_until = 0
        self.pad_mask.zero_()
        self.offsets.zero_()
        self.slot_positions.fill_(-1)


class StackedCache:
    """A read-only batch of single-request caches of different lengths, for one shared decoder pass.

    Continuous batching keeps one `KVCache` per request, so requests can join, commit and leave at any
    step. The decoder reads a batch: each request's keys/values are placed right-aligned (left padded)
    in fresh tensors, in the order each request reads them alone (oldest first, see `sliding_prefix`), so that a
    request's attention sums the same terms in the same order as when it runs alone. Padding is masked
    out. Free slots after the prefix hold the canvas, as with `KVCache.full_with_block`.

    It offers exactly what `DiffusionGemma.denoise` reads; `encode` needs a real `KVCache`.
    """

    def __init__(self, caches: list[KVCache], canvas_length: int) -> None:
        first = caches[0]
        device = first.device
        self.batch_size = len(caches)
        self.length = max(c.length for c in caches)
        self.max_length = self.length + canvas_length
        lengths = torch.tensor([c.length for c in caches], device=device)
        self.offsets = self.length - lengths + torch.stack([c.offsets[0] for c in caches])
        slots = torch.arange(self.length, device=device)
        self._full_valid = slots[None, :] >= (self.length - lengths)[:, None]
        for row, cache in enumerate(caches):  # a request's own left padding stays masked
            self._full_valid[row, self.length - cache.length:] &= cache.pad_mask[0, : cache.length]
        filled = torch.tensor([c.filled_slots for c in caches], device=device)
        self.filled_slots = int(filled.max())
        ring = torch.arange(self.filled_slots, device=device)
        self._sliding_valid = ring[None, :] >= (self.filled_slots - filled)[:, None]
        for row, cache in enumerate(caches):
            own = cache.prefix_valid(True)[0]
            self._sliding_valid[row, self.filled_slots - own.numel():] &= own
        self._all_valid = bool(self._full_valid.all()) and bool(self._sliding_valid.all())
        self.layers: list[LayerKV] = []
        for index, layer in enumerate(first.layers):
            size = self.filled_slots if layer.sliding else self.max_length
            shape = (self.batch_size, layer.keys.shape[1], size, layer.keys.shape[3])
            keys = layer.keys.new_zeros(shape)
            values = layer.values.new_zeros(shape)
            for row, cache in enumerate(caches):
                past_k, past_v = cache.sliding_prefix(index) if layer.sliding else cache.full_prefix(index)
                end = self.filled_slots if layer.sliding else self.length
                keys[row, :, end - past_k.shape[2] : end] = past_k[0]
                values[row, :, end - past_v.shape[2] : end] = past_v[0]
            self.layers.append(LayerKV(keys, values, layer.sliding))

    @property
    def device(self) -> torch.device:
        return self._full_valid.device

    def prefix_valid(self, sliding: bool) -> torch.Tensor:
        return self._sliding_valid if sliding else self._full_valid

    def full_prefix(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[index]
        return layer.keys[:, :, : self.length], layer.values[:, :, : self.length]

    def sliding_prefix(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[index]
        return layer.keys, layer.values

    def has_room(self, new_tokens: int) -> bool:
        return self.length + new_tokens <= self.max_length

    def ring_has_room(self, new_tokens: int) -> bool:
        return False  # its sliding layers hold the filled slots only

    def all_valid(self) -> bool:
        return self._all_valid

    def prefix_join(self, index: int) -> KVJoin:
        layer = self.layers[index]
        return KVJoin(layer.keys, layer.values, False, self.filled_slots if layer.sliding else self.length)

    full_with_block = KVCache.full_with_block
    decoder_join = KVCache.decoder_join
    row_positions = KVCache.row_positions
