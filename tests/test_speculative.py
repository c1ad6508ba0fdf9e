"""Self-speculative decoding gives exactly the AR model's tokens (greedy) or distribution (sampled), and the
KV cache rolls back to precisely what AR decoding would hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from printpress.config import TextConfig
from printpress.draft_table import DraftTable
from printpress.engine import CommitEvent, DoneEvent, Request, StepEvent, run
from printpress.errors import GenerationError
from printpress.model import DiffusionGemma, native_layers
from printpress.sampling import MODES, SamplerSettings, draw_kernels, next_token_probs
from printpress.speculative import ContextLookup, _sampled_accept, greedy_accept, sampled_accept, speculative

from helpers import bench_module

# Sliding windows smaller than the prompts, so the rings wrap and rollback must restore overwritten slots.
TINY = {
    "ring3": {"vocab_size": 8, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "global_head_dim": 16,
              "num_global_key_value_heads": 1, "sliding_window": 4,
              "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
              "num_experts": 2, "top_k_experts": 1, "moe_intermediate_size": 8, "max_position_embeddings": 256},
    "ring6": {"vocab_size": 12, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8,
              "sliding_window": 7,
              "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
              "num_experts": 3, "top_k_experts": 2, "moe_intermediate_size": 8, "max_position_embeddings": 256},
}


def tiny_model(name: str, seed: int = 0) -> DiffusionGemma:
    torch.manual_seed(seed)
    model = DiffusionGemma(TextConfig(**TINY[name])).eval()
    with torch.no_grad():  # norms and scales off one, so a misplaced one would show
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model


def settings(**overrides) -> SamplerSettings:
    base = {"max_new_tokens": 20, "max_denoising_steps": 2, "eos_token_ids": (), "mode": "speculative"}
    return SamplerSettings(**{**base, **overrides})


def collect(events) -> tuple[list, list]:
    events = list(events)
    return events, [e.result for e in events if isinstance(e, DoneEvent)]


def ar_tokens(model, prompt: list[int], **overrides) -> list[int]:
    s = settings(**overrides).with_overrides(mode="ar")
    return collect(run(model, 8, [Request(prompt, s, 0)]))[1][0].token_ids


def readable(cache) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """What attention can read from a cache, per layer: absolute position -> (key, value), copied."""
    out = []
    for index, layer in enumerate(cache.layers):
        positions = cache.prefix_positions(layer.sliding).tolist()
        keys, values = cache.sliding_prefix(index) if layer.sliding else cache.full_prefix(index)
        out.append({p: (keys[:, :, i].clone(), values[:, :, i].clone()) for i, p in enumerate(positions)})
    return out


def assert_bit_equal(got: list[dict], expected: list[dict]) -> None:
    for mine, theirs in zip(got, expected, strict=True):
        assert sorted(mine) == sorted(theirs)
        for p in theirs:
            assert torch.equal(mine[p][0], theirs[p][0]) and torch.equal(mine[p][1], theirs[p][1]), p


# -- the cache rollback -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("prefix", [2, 9])  # before and after the ring wraps
@pytest.mark.parametrize("block", ["window", 2])
def test_truncate_restores_exactly_the_cache_of_the_kept_tokens(name, prefix, block):
    """After encoding a block and truncating to its first `kept` tokens, every key/value attention can read is
    bit for bit the one written for that position (by the prefix pass, or by the block pass for kept
    tokens), the ring holds exactly the last window positions, and decoding goes on as after encoding only
    the kept tokens (bit for bit when none is kept; to rounding otherwise, as any encoding in pieces). Blocks of
    the whole window (the longest that can be rolled back part way: its slots wrap around the ring: two runs)
    and of 2 (one run of slots, or two on ring3 after 2 tokens)."""
    native_layers()  # the batched copies through the C++ layers where they build (else each through ATen)
    model = tiny_model(name)
    window = model.new_cache(1, 64).window
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, prefix + window + 4), generator=g)
    block = window if block == "window" else block
    junk = torch.randint(3, vocab, (1, block), generator=g)
    canvas = torch.randint(3, vocab, (1, 8), generator=g)
    with torch.no_grad():
        for kept in range(block + 1):
            drafted = torch.cat([ids[:, prefix : prefix + kept], junk[:, kept:]], dim=1)
            rolled = model.new_cache(1, 64)
            model.encode(ids[:, :prefix], rolled, logits="none")
            before = readable(rolled)
            snapshot = rolled.snapshot(block)
            model.encode(drafted, rolled, logits="none")
            after = readable(rolled)
            rolled.truncate(prefix + kept, snapshot)

            length = prefix + kept
            expected = []
            for layer, old, new in zip(rolled.layers, before, after):
                first = max(0, length - window) if layer.sliding else 0
                expected.append({p: (new if p >= prefix else old)[p] for p in range(first, length)})
            assert_bit_equal(readable(rolled), expected)
            assert rolled.length == length and bool(rolled.pad_mask[:, :length].all())

            straight = model.new_cache(1, 64)
            model.encode(ids[:, :prefix], straight, logits="none")
            if kept:
                model.encode(ids[:, prefix:length], straight, logits="none")
            rest = ids[:, length:]
            got, want = model.encode(rest, rolled), model.encode(rest, straight)
            if kept == 0:
                assert torch.equal(got, want)
                assert_bit_equal(readable(rolled), readable(straight))
                assert torch.equal(model.denoise(canvas, rolled), model.denoise(canvas, straight))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            torch.testing.assert_close(model.denoise(canvas, rolled), model.denoise(canvas, straight), rtol=0,
                                       atol=1e-5)


def test_truncate_refuses_what_it_cannot_restore():
    model = tiny_model("ring3")
    cache = model.new_cache(1, 64)
    model.encode(torch.tensor([[3, 4, 5, 6, 7]]), cache, logits="none")
    snapshot = cache.snapshot(5)
    with pytest.raises(GenerationError, match="the snapshot covers positions 5..10 and the cache holds 5"):
        cache.truncate(5, snapshot)  # nothing was encoded after the snapshot
    model.encode(torch.tensor([[3, 4, 5, 6, 7]]), cache, logits="none")
    with pytest.raises(GenerationError, match="cannot truncate to 4"):
        cache.truncate(4, snapshot)  # before the block
    with pytest.raises(GenerationError, match="block of 5 tokens part way: the sliding window keeps 3"):
        cache.truncate(7, snapshot)
    cache.truncate(5, snapshot)  # all of the block, or none of it, can still go
    assert cache.length == 5


def test_what_the_cache_knows_of_its_padding_and_offsets_follows_its_tensors():
    """`all_valid` and `row_positions` keep what they learnt (no tensor is asked each step): after valid blocks, a
    truncation, a block with a pad, a row selection and new offsets, each answer is still the tensors' own."""
    model = tiny_model("ring3")
    cache = model.new_cache(2, 64)

    def agrees() -> bool:
        positions = torch.arange(cache.length, cache.length + 2)
        want = positions if not bool(cache.offsets.any()) else positions[None, :] - cache.offsets[:, None]
        return (cache.all_valid() == bool(cache.pad_mask[:, : cache.length].all())
                and torch.equal(cache.row_positions(positions), want))

    model.encode(torch.tensor([[3, 4, 5], [5, 6, 7]]), cache, logits="none")
    assert agrees() and cache.all_valid()
    snapshot = cache.snapshot(2)
    model.encode(torch.tensor([[3, 4], [5, 6]]), cache, logits="none")
    cache.truncate(4, snapshot)
    cache.advance(1, torch.tensor([[True], [False]]))  # row 1's slot 4 holds a pad
    assert agrees() and not cache.all_valid()
    cache.advance(1, None)  # a valid block after the pad: still not all valid
    assert agrees() and not cache.all_valid()
    cache.select([0])
    assert agrees() and cache.all_valid()
    cache.set_offsets(torch.tensor([[False] + [True] * (cache.length - 1)]))  # a new tensor, as fresh as the last
    assert agrees()
    cache.offsets[0] = 0  # in place: the kept answer (some offset set) must not outlive it
    assert agrees()
    cache.set_offsets(torch.tensor([[True] * cache.length]))
    assert agrees()


# -- the fused draft+verify pass ---------------------------------------------------------------------------


def assert_fused_pass_matches_encode_and_denoise(model, prefix: torch.Tensor, block: torch.Tensor,
                                                 canvases: torch.Tensor, atol: float) -> None:
    """`verify_and_draft` after `prefix`: its block logits are `encode(block)`'s, canvas j's logits are `denoise`'s
    after encoding block[:j + 1] (this pins the mask), and after rolling back to any kept count the cache holds
    what encoding the prefix and the kept tokens holds. All to rounding: more rows change a GEMM's."""
    m1, room = block.shape[1], prefix.shape[1] + block.shape[1] + 8
    with torch.no_grad():
        for kept in range(m1 + 1):
            fused = model.new_cache(1, room)
            model.encode(prefix, fused, logits="none")
            snapshot = fused.snapshot(m1)
            logits, hidden = model.verify_and_draft(block, canvases, fused)
            plain = model.new_cache(1, room)
            model.encode(prefix, plain, logits="none")
            torch.testing.assert_close(logits, model.encode(block, plain)[0], rtol=0, atol=atol)
            assert fused.length == plain.length
            fused.truncate(prefix.shape[1] + kept, snapshot)
            straight = model.new_cache(1, room)
            model.encode(torch.cat([prefix, block[:, :kept]], dim=1), straight, logits="none")
            for mine, theirs in zip(readable(fused), readable(straight), strict=True):
                assert sorted(mine) == sorted(theirs)
                for position in theirs:
                    torch.testing.assert_close(mine[position], theirs[position], rtol=0, atol=atol)
        for j in range(canvases.shape[0]):
            context = model.new_cache(1, room)
            model.encode(torch.cat([prefix, block[:, : j + 1]], dim=1), context, logits="none")
            torch.testing.assert_close(model.logits(hidden[j]), model.denoise(canvases[j : j + 1], context)[0],
                                       rtol=0, atol=atol)


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("prefix,drafts,outcomes,length", [
    (2, 3, 4, 5),  # the rings not yet full
    (9, 2, 3, 4),  # wrapped rings (windows 3 and 6): the canvases see part of the ring and part of the block
    (13, 5, 2, 3),  # canvases for the first outcomes only, as near the end of the token budget
])
def test_fused_pass_equals_encode_then_denoise(name, prefix, drafts, outcomes, length):
    model = tiny_model(name)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(prefix)
    ids = torch.randint(3, vocab, (1, prefix), generator=g)
    block = torch.randint(3, vocab, (1, min(drafts, model.new_cache(1, 64).window - 1) + 1), generator=g)
    canvases = torch.randint(0, vocab, (min(outcomes, block.shape[1]), length), generator=g)
    assert_fused_pass_matches_encode_and_denoise(model, ids, block, canvases, atol=1e-5)


def test_fused_pass_refuses_what_it_cannot_lay_out():
    model = tiny_model("ring3")
    cache = model.new_cache(1, 16)
    model.encode(torch.tensor([[3, 4]]), cache, logits="none")
    with pytest.raises(ValueError, match="3 canvases for a block of 2 tokens"):
        model.verify_and_draft(torch.tensor([[3, 4]]), torch.zeros(3, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="batch 1"):
        model.verify_and_draft(torch.tensor([[3, 4], [5, 6]]), torch.zeros(1, 4, dtype=torch.long), cache)


# -- the acceptance rules -----------------------------------------------------------------------------------


def test_greedy_accept_keeps_the_matching_prefix_then_the_ar_token():
    targets = torch.tensor([2, 5, 1, 4])  # the AR argmax after each verified position
    assert greedy_accept(torch.tensor([2, 5, 1]), targets) == [2, 5, 1, 4]  # all kept, plus the bonus
    assert greedy_accept(torch.tensor([2, 0, 1]), targets) == [2, 5]  # mismatch at the second: the AR token
    assert greedy_accept(torch.tensor([3, 5, 1]), targets) == [2]  # later matches do not count
    assert greedy_accept(torch.tensor([], dtype=torch.long), targets[:1]) == [2]


def test_sampled_accept_in_one_kernel_call_gives_the_python_loops_tokens_and_generator_state():
    """`sampled_accept` (with the sampling kernels: `printpress_draw::speculative_accept`) and `_sampled_accept` (the
    loop in Python) decide the same tokens from the same generator and leave it in the same state: 0 to 4 drafts,
    drawn from q or not (rejections at every position), q equal to p (the all-zero residual: a draw from p), and a
    vocabulary that is no multiple of a vector."""
    if not draw_kernels():
        pytest.skip("the sampling kernels are not built here")
    g = torch.Generator().manual_seed(0)
    rejections = 0
    for case in range(400):
        m, vocab = case % 5, (4096, 50)[case % 2]
        p = next_token_probs(torch.randn(m + 1, vocab, generator=g) * 3, SamplerSettings(temperature=0.8, top_k=20))
        q = p[:m].clone() if case % 7 == 0 else torch.softmax(torch.randn(m, vocab, generator=g) * 3, dim=-1)
        draft = torch.multinomial(q, 1, generator=g)[:, 0] if m else torch.empty(0, dtype=torch.long)
        kernel, loop = torch.Generator().manual_seed(case), torch.Generator().manual_seed(case)
        tokens = sampled_accept(draft, q, p, kernel)
        assert tokens == _sampled_accept(draft, q, p, loop)
        assert torch.equal(kernel.get_state(), loop.get_state())
        rejections += len(tokens) <= m
    assert rejections > 100


@pytest.mark.slow  # a statistical sweep: 20,000 sampled acceptances
def test_sampled_accept_follows_the_target_distribution():
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g)
    first = torch.zeros(4)
    second_given_0 = torch.zeros(4)
    for draft in drafts.tolist():
        out = sampled_accept(torch.tensor([draft]), q, p, g)
        first[out[0]] += 1
        if out[0] == draft and out[0] == 0:  # kept: a bonus token from p[1] follows
            second_given_0[out[1]] += 1
    assert (first / n - p[0]).abs().sum() / 2 < 0.01  # total variation: p, not q (0.4 away)
    assert (second_given_0 / second_given_0.sum() - p[1]).abs().sum() / 2 < 0.03
    # Drafts are kept with probability sum(min(p, q)) = 0.1 + 0.2 + 0.1 + 0.1 = 0.5.
    kept = sum(int(sampled_accept(torch.tensor([d]), q, p, g)[:1] == [d]) for d in drafts[:4000].tolist())
    assert abs(kept / 4000 - 0.5) < 0.03


def plain_sampled_accept(draft, q, p, generator):
    """sampled_accept written plainly, element by element (its form before session 39)."""
    tokens = draft.tolist()
    uniforms = torch.rand(len(tokens), generator=generator) if tokens else None
    for i, x in enumerate(tokens):
        if float(uniforms[i]) * float(q[i, x]) < float(p[i, x]):
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        return tokens[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return tokens + [int(torch.multinomial(p[len(tokens)], 1, generator=generator))]


def test_sampled_accept_decides_and_draws_as_the_rule_written_plainly():
    """The same kept tokens, the same draw after them and the generator left in the same state, for drafts of 0-4
    tokens from random p and q (some q equal to p: every draft kept, then the bonus draw)."""
    rng = torch.Generator().manual_seed(1)
    for case in range(300):
        m, vocab = case % 5, 6
        p = torch.softmax(torch.randn(m + 1, vocab, generator=rng) * 2, dim=-1)
        q = p[:m].clone() if case % 7 == 0 else torch.softmax(torch.randn(m, vocab, generator=rng) * 2, dim=-1)
        draft = torch.multinomial(q, 1, generator=rng)[:, 0] if m else torch.empty(0, dtype=torch.long)
        ours, plain = torch.Generator().manual_seed(case), torch.Generator().manual_seed(case)
        assert sampled_accept(draft, q, p, ours) == plain_sampled_accept(draft, q, p, plain), case
        assert torch.equal(ours.get_state(), plain.get_state()), case


# -- generation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY))
def test_greedy_speculative_equals_ar_on_tiny_models(name):
    model = tiny_model(name)
    vocab = model.config.vocab_size
    accepted = 0
    for seed, (length, new, steps, drafts) in enumerate([(3, 20, 1, None), (9, 25, 2, 2), (14, 12, 3, 1)]):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        s = settings(max_new_tokens=new, max_denoising_steps=steps)
        (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=8, draft_length=drafts))[1]
        assert result.token_ids == ar_tokens(model, prompt, max_new_tokens=new)
        assert len(result.token_ids) == new
        accepted += result.stats.accepted_drafts
    assert accepted > 0  # a vocabulary this small makes random drafts match often: rollbacks part way happen


@pytest.mark.parametrize("name", sorted(TINY))
def test_greedy_fused_speculative_equals_ar_on_tiny_models(name):
    """Fused rounds (one pass verifies and drafts the next round) keep AR's tokens: prompts shorter and longer
    than the rings, several fused canvas lengths, drafts capped by them or by the budget near the end."""
    model = tiny_model(name)
    vocab = model.config.vocab_size
    fused_drafts = 0
    for seed, (length, new, drafts, canvas) in enumerate([(3, 20, None, 4), (9, 25, 2, 8), (14, 12, 1, 3),
                                                          (5, 30, None, 8)]):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        s = settings(max_new_tokens=new, max_denoising_steps=1, fused_draft=True)
        events, (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=8,
                                                draft_length=drafts, fused_canvas=canvas))
        assert result.token_ids == ar_tokens(model, prompt, max_new_tokens=new)
        stats = result.stats
        assert stats.denoising_steps == 1 == sum(isinstance(e, StepEvent) for e in events)  # the first round's
        assert stats.forward_passes == 1 + 1 + stats.verifications  # prompt pass, first draft, one pass per round
        assert stats.accepted_drafts == new - 1 - stats.verifications
        fused_drafts += stats.drafted_tokens
    assert fused_drafts > 40  # most drafts came from fused passes


def test_context_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    assert ContextLookup([1, 2, 3, 4, 1, 2]).draft(3) == [3, 4, 1]
    # The longest suffix that occurred before wins: (1, 2) -> 3 9 2, though the latest 2 was followed by 4.
    assert ContextLookup([1, 2, 3, 9, 2, 4, 1, 2]).draft(3) == [3, 9, 2]
    assert ContextLookup([1, 2, 3, 9, 2, 4, 7, 2]).draft(3) == [4, 7, 2]  # only (2) matched: its latest occurrence
    assert ContextLookup([5, 5]).draft(3) == [5]  # what follows runs into the end of the text
    assert ContextLookup([1, 2, 3]).draft(3) == [] == ContextLookup([]).draft(3)  # the suffix never occurred before
    assert ContextLookup([1, 2, 3, 9, 2, 4, 1, 2], longest=1).draft(3) == [4, 1, 2]  # (1, 2) is past `longest`
    grown = ContextLookup([1, 2])
    grown.extend([3, 9, 2])
    grown.extend([4, 1, 2])
    assert grown.follow == ContextLookup([1, 2, 3, 9, 2, 4, 1, 2]).follow and grown.draft(3) == [3, 9, 2]


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("source", ["lookup", "both"])
def test_greedy_speculative_with_context_drafts_equals_ar(name, source):
    """Drafts from the context (and diffusion where it has none) keep AR's tokens; lookup alone runs no decoder
    pass, so a round that finds no draft is an AR step (a verification of the last token alone)."""
    model = tiny_model(name)
    vocab = model.config.vocab_size
    drafted = 0
    for seed, (length, new, drafts) in enumerate([(3, 20, None), (9, 25, 2), (14, 12, 1), (2, 30, 6)]):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        s = settings(max_new_tokens=new, max_denoising_steps=1, draft_source=source)
        (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=8, draft_length=drafts))[1]
        assert result.token_ids == ar_tokens(model, prompt, max_new_tokens=new)
        stats = result.stats
        assert stats.forward_passes == 1 + stats.denoising_steps + stats.verifications
        if source == "lookup":
            assert stats.denoising_steps == 0
        drafted += stats.drafted_tokens
        assert stats.accepted_drafts == new - 1 - stats.verifications
    assert drafted > 20


@pytest.mark.parametrize("name", sorted(TINY))
def test_greedy_speculative_with_a_draft_table_equals_ar_and_keeps_its_drafts(name):
    """A table made from the model's own greedy continuations (as `printpress draft-table` makes it) drafts what AR
    then writes: AR's tokens, no decoder pass, more drafts kept than the context lookup keeps; a table of another
    model's habits (here: random rows) costs speed, never the output."""
    model = tiny_model(name)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(3, vocab, (4,), generator=g).tolist() for _ in range(12)]
    rows = np.array([p + ar_tokens(model, p, max_new_tokens=16) for p in prefixes])
    kept = {}
    for label, table in (("own", DraftTable.from_rows(rows, first=4, longest=3)),
                         ("random", DraftTable.from_rows(np.random.default_rng(0).integers(0, vocab, (8, 20)), 2))):
        model.draft_table = table
        for source in ("table", "lookup"):
            total = 0
            for seed in range(4):
                prompt = torch.randint(3, vocab, (5,), generator=g).tolist()
                s = settings(max_new_tokens=24, draft_source=source)
                (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=8))[1]
                assert result.token_ids == ar_tokens(model, prompt, max_new_tokens=24), (label, source)
                assert result.stats.denoising_steps == 0
                assert result.stats.forward_passes == 1 + result.stats.verifications
                total += result.stats.accepted_drafts
            kept[label, source] = total
    assert kept["own", "table"] > kept["own", "lookup"], kept
    del model.draft_table
    with pytest.raises(GenerationError, match="draft_source 'table' needs the model's draft table "
                                              r"\(draft_table.safetensors in its folder\), and this model has none"):
        list(speculative(model, [Request([3], settings(draft_source="table"), 0)], canvas_length=8))


def own_table(model: DiffusionGemma, g: torch.Generator, sampled: bool = False) -> DraftTable:
    """A draft table (contexts of up to 3 tokens) of the model's own greedy continuations of 12 random prefixes (as
    `printpress draft-table` makes one), drawn with `g`; with `sampled`, those rows as its sampled counts too."""
    prefixes = [torch.randint(3, model.config.vocab_size, (4,), generator=g).tolist() for _ in range(12)]
    rows = np.array([p + ar_tokens(model, p, max_new_tokens=16) for p in prefixes])
    return DraftTable.from_rows(rows, first=4, longest=3, sampled_rows=rows if sampled else None)


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_draft_replay_counts_the_engines_verifications_exactly(name):
    """bench/draft_table_acceptance.py replays greedy rounds on AR's continuation instead of running them: for the
    engine's own draft rule (table and text, each token from the longer context) its count of verifications and
    committed tokens is the engine's, so a rule screened there is what the engine will do."""
    replay = bench_module("draft_table_acceptance").replay
    model = tiny_model(name)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    table = model.draft_table = own_table(model, g)
    for seed in range(4):
        prompt = torch.randint(3, vocab, (5,), generator=g).tolist()
        (result,) = collect(speculative(model, [Request(prompt, settings(max_new_tokens=24, draft_source="table"),
                                                        seed)], canvas_length=8))[1]
        drafts = min(7, model.new_cache(1, 32).window - 1)  # the engine's cap: a small sliding window caps drafts
        tokens, rounds = replay(prompt, result.token_ids, lambda text, lookup, m: table.draft(text, m, lookup), drafts)
        assert (tokens, rounds) == (len(result.token_ids) - 1, result.stats.verifications)
    del model.draft_table


def test_the_tree_replay_counts_a_chain_as_the_replay_does_and_keeps_a_trees_longest_branch():
    """bench/draft_table_acceptance.py --trees: `replay_tree` with a chain (the tree of its prefixes) commits and
    counts as `replay` does with the same drafts; a tree whose second branch is the one AR wrote commits that branch
    where the chain would have committed the AR token alone."""
    bench = bench_module("draft_table_acceptance")
    model = tiny_model("ring6")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(9)
    table = own_table(model, g)
    for _ in range(4):
        prompt = torch.randint(3, vocab, (5,), generator=g).tolist()
        continuation = ar_tokens(model, prompt, max_new_tokens=20)
        chain = bench.replay_tree(prompt, continuation, lambda text, m: bench.chain_paths(table, text, m), 5)
        assert chain == bench.replay(prompt, continuation, lambda text, lookup, m: table.draft(text, m, lookup), 5)
    prompt, continuation = [3, 4], [5, 6, 7, 8]  # 5 comes from the prompt's pass; the rounds verify 6, 7 and 8
    second_branch = lambda text, m: [[9], [9, 7], [6], [6, 7]][:m]  # noqa: E731 - the second branch is AR's
    assert bench.replay_tree(prompt, continuation, second_branch, 4) == (3, 1)  # 6 and 7 kept, 8 from the pass
    assert bench.replay(prompt, continuation, lambda text, lookup, m: [9, 7][:m], 2) == (3, 3)  # one AR token a round


def test_the_draft_length_replay_drafts_and_counts_as_the_engine_does():
    """bench/draft_length.py prices rules for a draft's length by replaying greedy rounds: its drafts are the
    table's (`DraftTable.draft`) and, at the engine's cap, its counts of verifications and tokens the engine's."""
    bench = bench_module("draft_length")
    model = tiny_model("ring6")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(8)
    table = model.draft_table = own_table(model, g, sampled=True)
    drafts = min(7, model.new_cache(1, 32).window - 1)
    for seed in range(4):
        prompt = torch.randint(3, vocab, (5,), generator=g).tolist()
        (result,) = collect(speculative(model, [Request(prompt, settings(max_new_tokens=24, draft_source="table"),
                                                        seed)], canvas_length=8))[1]
        lookup = ContextLookup(prompt + result.token_ids[:1])
        assert [d[0] for d in bench.drafted(table, prompt + result.token_ids[:1], lookup)[:drafts]] == \
            table.draft(prompt + result.token_ids[:1], drafts, lookup)
        tokens, rounds, spent = bench.replay(table, [(prompt, result.token_ids)], lambda full: drafts,
                                             lambda t: float(t), 0.5)
        assert (tokens, rounds) == (len(result.token_ids) - 1, result.stats.verifications)
        assert spent > rounds * 1.5  # a block of at least one token and the time beside it, each round
    del model.draft_table


def test_sampled_table_drafts_are_verified_against_the_distribution_they_were_drawn_from(monkeypatch):
    """When sampling, a table draft is drawn from the interpolation of its contexts' counts (and the text's own
    continuation) and the acceptance rule gets exactly that q (row i: the distribution token i was drawn from,
    `DraftTable.interpolated` of the text before it); where no context has counts the greedy chain drafts."""
    import printpress.speculative as module

    model = tiny_model("ring6")
    vocab = model.config.vocab_size
    rows = np.random.default_rng(2).integers(3, vocab, (60, 10))
    table = model.draft_table = DraftTable.from_rows(rows, first=3, longest=2, sampled_rows=rows[:20])
    drawn, verified = [], []
    sample = table.sample_interpolated

    def sample_and_expect(tokens, m, generator, vocab, context):  # what each row must be, from the text as it is now
        out, rows_q = sample(tokens, m, generator, vocab, context)
        expected = [table.interpolated(list(tokens) + out[:i], vocab, context) for i in range(len(out))]
        drawn.append((expected, (out, rows_q)))
        return out, rows_q

    monkeypatch.setattr(table, "sample_interpolated", sample_and_expect)
    accept = module.sampled_accept
    monkeypatch.setattr(module, "sampled_accept", lambda d, q, p, g: verified.append((d, q)) or accept(d, q, p, g))
    for seed in range(6):
        s = settings(max_new_tokens=16, temperature=0.9, draft_source="table")
        collect(speculative(model, [Request([3, 4, 5], s, seed)], canvas_length=8))
    assert len(drawn) == len(verified) and sum(1 for _, (tokens, _) in drawn if tokens) > 10
    greedy_rounds = 0
    for (expected, (tokens, rows_q)), (draft, q) in zip(drawn, verified, strict=True):
        if not tokens:  # no counts for the context: a one-hot draft of the greedy chain (or the lookup)
            greedy_rounds += 1
            assert q is None or bool(((q == 0) | (q == 1)).all())
            continue
        assert draft.tolist() == tokens and q.dtype == torch.float32 and q.shape == (len(tokens), vocab)
        assert torch.equal(q, torch.from_numpy(rows_q))
        for i, token in enumerate(tokens):
            assert np.array_equal(rows_q[i], expected[i]) and q[i, token] > 0
    assert greedy_rounds > 0  # the rows' counts do not cover every context


def test_sample_accepted_only_is_honoured_by_the_draft_and_keeps_ar_output():
    """The draft runs the engine's canvas step, so the faster sampler applies to it as to diffusion decoding: other
    draws (so other drafts), and still exactly the AR model's tokens."""
    model = tiny_model("ring6")
    prompt = [3, 4, 5, 6, 7]

    def drafts(**overrides):
        events, (result,) = collect(speculative(model, [Request(prompt, settings(max_new_tokens=16, max_denoising_steps=4,
                                                                                 **overrides), 1)], canvas_length=8))
        return [e.tokens for e in events if isinstance(e, StepEvent)], result.token_ids

    exact, exact_tokens = drafts()
    fast, fast_tokens = drafts(sample_accepted_only=True)
    assert fast != exact
    assert fast_tokens == exact_tokens == ar_tokens(model, prompt, max_new_tokens=16)


def test_eos_stops_where_ar_stops():
    model = tiny_model("ring3")
    prompt = [3, 4, 5, 6]
    free = ar_tokens(model, prompt, max_new_tokens=30)
    eos = free[7]
    expected = free[: free.index(eos) + 1]
    s = settings(max_new_tokens=30, eos_token_ids=(eos,))
    (result,) = collect(speculative(model, [Request(prompt, s, 0)], canvas_length=8))[1]
    assert result.token_ids == expected
    assert result.completion_ids == expected[:-1]
    assert result.stats.finish_reason == "eos"


@pytest.mark.parametrize("draft_steps,fused", [(3, False), (1, True)])
def test_events_and_statistics_add_up(draft_steps, fused):
    """Also with fused rounds: a fused pass is one verification, no decoder pass and no step event."""
    model = tiny_model("ring6")
    s = settings(max_new_tokens=17, max_denoising_steps=draft_steps, fused_draft=fused)
    requests = [Request([3, 4, 5], s, 0), Request([6, 7, 8, 9, 10], s, 1)]
    events, results = collect(speculative(model, requests, decode=lambda ids: " ".join(map(str, ids)),
                                          canvas_length=6))
    assert isinstance(events[-1], DoneEvent)
    for index, result in enumerate(results):
        mine = [e for e in events if e.request == index]
        commits = [e for e in mine if isinstance(e, CommitEvent)]
        steps = [e for e in mine if isinstance(e, StepEvent)]
        stats = result.stats
        assert [t for c in commits for t in c.token_ids] == result.token_ids
        assert "".join(c.text for c in commits) == result.text == " ".join(map(str, result.token_ids))
        assert [c.finished for c in commits] == [False] * (len(commits) - 1) + [True]
        assert len(commits) == stats.verifications + 1  # the prompt pass commits the first token
        assert len(steps) == stats.denoising_steps
        committed: list[int] = []
        for event in mine:  # every draft canvas starts with the newest committed token, clamped
            if isinstance(event, CommitEvent):
                committed += event.token_ids
            elif isinstance(event, StepEvent):
                assert event.tokens[0] == committed[-1] and event.max_steps == draft_steps and len(event.tokens) == 6
        assert stats.forward_passes == 1 + stats.denoising_steps + stats.verifications
        assert stats.tokens_per_forward == pytest.approx(17 / stats.forward_passes)
        assert stats.accepted_per_verification == pytest.approx(16 / stats.verifications)
        assert stats.accepted_drafts == 16 - stats.verifications
        assert result.mode == "speculative" and result.stats.new_tokens == 17
        assert result.token_ids == ar_tokens(model, requests[index].prompt_ids, max_new_tokens=17)


@pytest.mark.slow  # a statistical sweep: a thousand sampled runs
def test_sampled_speculative_follows_the_ar_distribution():
    """Tokens 2 and 3 come from one verification of one draft; their joint law must be the AR model's."""
    model = tiny_model("ring3")
    vocab = model.config.vocab_size
    prompt = [3, 4, 5]
    temperature = 0.25
    with torch.no_grad():  # exact P(x1, x2, x3) by enumeration
        first = torch.softmax(model.encode(torch.tensor([prompt]), model.new_cache(1, 8))[0, -1] / temperature, -1)
        cache = model.new_cache(vocab * vocab, 8)
        model.encode(torch.tensor([prompt] * vocab * vocab), cache, logits="none")
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
        logits = model.encode(pairs, cache) / temperature
        second = torch.softmax(logits[::vocab, 0], -1)  # rows x1
        third = torch.softmax(logits[:, 1], -1).view(vocab, vocab, vocab)  # [x1, x2, x3]
    exact = (first[:, None, None] * second[:, :, None] * third).sum(0)  # P(x2, x3)
    s = settings(max_new_tokens=3, max_denoising_steps=1, temperature=temperature)
    counts = torch.zeros(vocab, vocab)
    runs, drafted, kept = 1000, 0, 0
    for seed in range(runs):
        (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=4, step_events=False))[1]
        counts[result.token_ids[1], result.token_ids[2]] += 1
        drafted += result.stats.drafted_tokens
        kept += result.stats.accepted_drafts
    assert drafted == runs and 0.05 < kept / runs < 0.95  # both branches of the rule were taken
    tv = (counts / runs - exact).abs().sum() / 2
    assert tv < 0.14, tv  # sampling noise alone is ~0.1 at this count; accepting drafts unchecked: > 0.5


@pytest.mark.slow  # a statistical sweep: 600 sampled runs
def test_sampled_fused_speculative_follows_the_ar_distribution():
    """Every committed token must be a draw from the AR model's next-token distribution given the tokens before it.
    With one draft per round, the rounds after the first verify drafts made by the previous fused pass. The
    exact conditionals come from encoding each finished sequence; the tokens, tallied by the AR argmax of their
    position (so that the test sees conditionals, not only a marginal), must match the summed probabilities."""
    model = tiny_model("ring3")
    vocab = model.config.vocab_size
    prompt = [3, 4, 5]
    temperature, new = 0.1, 10
    s = settings(max_new_tokens=new, max_denoising_steps=1, temperature=temperature, fused_draft=True)
    observed, expected = torch.zeros(vocab, vocab), torch.zeros(vocab, vocab)  # [AR argmax, token]
    runs, drafted, kept = 600, 0, 0
    with torch.no_grad():
        for seed in range(runs):
            (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=4, draft_length=1,
                                            fused_canvas=4, step_events=False))[1]
            drafted += result.stats.drafted_tokens
            kept += result.stats.accepted_drafts
            ids = torch.tensor([prompt + result.token_ids])
            logits = model.encode(ids, model.new_cache(1, ids.shape[1]))[0, len(prompt) - 1 : -1]
            p = torch.softmax(logits / temperature, dim=-1)
            best = logits.argmax(dim=-1)
            expected.index_add_(0, best, p)
            observed.index_put_((best, torch.tensor(result.token_ids)), torch.ones(new), accumulate=True)
    assert drafted > 4 * runs and 0.3 < kept / drafted < 0.7  # mostly fused drafts (1 per run is not), kept and not
    tv = (observed - expected).abs().sum() / 2 / (runs * new)
    # Sampling noise alone: 0.022-0.031 over six other seed ranges. Drafts kept unchecked: 0.09; the drafts' q
    # replaced by a uniform one (a wrong acceptance ratio): 0.042-0.051.
    assert tv < 0.038, tv


@pytest.mark.slow  # a statistical sweep: 600 sampled runs
@pytest.mark.parametrize("source", ["lookup", "table"])
def test_sampled_speculative_with_context_drafts_follows_the_ar_distribution(source):
    """A lookup draft is a draw from a one-hot q: kept with probability p(d), else a draw from p without d; a table's
    draft is a draw from its counts' q (with a share for the text's own continuation, which the table's prompt
    repeats so that it enters often, up to 5 drafts a round). The committed tokens, tallied by the AR argmax of their
    position as in the fused test, must follow AR's law."""
    model = tiny_model("ring3")
    vocab = model.config.vocab_size
    # so the first round already finds a draft
    prompt = [3, 4, 5, 3, 4] if source == "lookup" else [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    caps = {} if source == "lookup" else {"canvas_length": 8, "draft_length": 5}
    temperature, new = (0.3 if source == "lookup" else 1.0), 10  # hot: the table's counts spread over tokens
    if source == "table":  # the model's own sampled continuations: drafts kept often, and refused often too
        g = torch.Generator().manual_seed(1)
        rows = [p + collect(run(model, 8, [Request(p, settings(max_new_tokens=12, temperature=temperature,
                                                               mode="ar"), i)]))[1][0].token_ids
                for i, p in enumerate(torch.randint(3, vocab, (40, 3), generator=g).tolist())]
        model.draft_table = DraftTable.from_rows(np.array(rows), first=3, longest=2, sampled_rows=np.array(rows))
    s = settings(max_new_tokens=new, temperature=temperature, draft_source=source)
    observed, expected = torch.zeros(vocab, vocab), torch.zeros(vocab, vocab)  # [AR argmax, token]
    runs, drafted, kept = 600, 0, 0
    with torch.no_grad():
        for seed in range(runs):
            (result,) = collect(speculative(model, [Request(prompt, s, seed)], **({"canvas_length": 4} | caps),
                                            step_events=False))[1]
            assert result.stats.denoising_steps == 0
            drafted += result.stats.drafted_tokens
            kept += result.stats.accepted_drafts
            ids = torch.tensor([prompt + result.token_ids])
            logits = model.encode(ids, model.new_cache(1, ids.shape[1]))[0, len(prompt) - 1 : -1]
            expected.index_add_(0, logits.argmax(dim=-1), torch.softmax(logits / temperature, dim=-1))
            observed.index_put_((logits.argmax(dim=-1), torch.tensor(result.token_ids)), torch.ones(new),
                                accumulate=True)
    assert drafted > 5 * runs and kept > 300, (drafted, kept)  # both branches of the rule, many times
    tv = (observed - expected).abs().sum() / 2 / (runs * new)
    # Sampling noise alone: 0.028-0.034 over four seed ranges (lookup), 0.037 (table); the drafts' q taken as uniform
    # instead of what they were drawn from (so a wrong acceptance ratio): 0.12-0.14 (lookup's one-hot q), but only
    # 0.060 for the table's q, itself spread over the vocabulary, and a draw that skipped the text's share 0.033: for
    # the table this is a check of the whole loop, not a fine one; test_sampled_table_drafts_are_verified_against_...
    # checks its q row by row, and tests/test_draft_table.py its draws.
    assert tv < 0.06, (tv, drafted, kept)


def test_bad_arguments_are_refused():
    model = tiny_model("ring3")
    request = Request([3, 4], settings(), 0)
    with pytest.raises(GenerationError, match="draft_length must be in 0..7"):
        list(speculative(model, [request], canvas_length=8, draft_length=8))
    with pytest.raises(GenerationError, match="temperature must be >= 0"):
        list(speculative(model, [Request([3], settings(temperature=-1.0), 0)]))
    with pytest.raises(GenerationError, match="the prompt is empty"):
        list(speculative(model, [Request([], settings(), 0)]))
    with pytest.raises(GenerationError, match=r"fused_draft needs draft_steps \(max_denoising_steps\) = 1, got 2"):
        list(speculative(model, [Request([3], settings(fused_draft=True), 0)]))
    with pytest.raises(GenerationError, match="fused_draft drafts with the decoder; it needs draft_source "
                                              "diffusion, got 'lookup'"):
        list(speculative(model, [Request([3], settings(max_denoising_steps=1, fused_draft=True,
                                                       draft_source="lookup"), 0)]))
    with pytest.raises(GenerationError, match="unknown draft_source 'ngram'; expected one of diffusion, lookup, both"):
        list(speculative(model, [Request([3], settings(draft_source="ngram"), 0)]))
    with pytest.raises(GenerationError, match="fused_canvas must be at least 2"):
        list(speculative(model, [Request([3], settings(max_denoising_steps=1, fused_draft=True), 0)], fused_canvas=1))


# -- the shipped joint model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    import printpress

    return printpress.load()


@pytest.mark.parametrize("text,new,steps,drafts,fused", [
    pytest.param("ROMEO:\nWhat light", 80, 1, None, None, marks=pytest.mark.slow),  # 80 new tokens: the ring wraps
    pytest.param("To be, or not to be", 40, 2, 8, None, marks=pytest.mark.slow),
    ("KING HENRY.\n", 24, 1, 3, None),
    pytest.param("ROMEO:\nWhat light", 80, 1, None, 8, marks=pytest.mark.slow),  # fused rounds, canvases of 8
    ("To be, or not to be", 40, 1, 3, 4),
])
def test_greedy_speculative_equals_ar_on_the_shipped_model(shipped, text, new, steps, drafts, fused):
    prompt = shipped.encode_text(text)
    ar = shipped.generate(prompt, mode="ar", max_new_tokens=new, temperature=0)
    s = shipped.settings(mode="speculative", max_new_tokens=new, draft_steps=steps, temperature=0,
                         fused_draft=fused is not None)
    request = Request(prompt, s, 0)
    (result,) = collect(speculative(shipped.model, [request], shipped.decode, canvas_length=32,
                                    draft_length=drafts, step_events=False, fused_canvas=fused))[1]
    assert result.token_ids == ar.token_ids
    assert result.text == ar.text


def test_fused_pass_on_the_shipped_model(shipped):
    """The fused pass against `encode` and `denoise` on real weights: 40 cached tokens, 4 drafts, canvases of 8."""
    ids = torch.tensor([shipped.encode_text("ROMEO:\nWhat light through yonder window breaks? It is the east")])
    prefix, block = ids[:, :-5], ids[:, -5:]
    canvases = torch.randint(0, shipped.model.config.vocab_size, (5, 8), generator=torch.Generator().manual_seed(0))
    assert_fused_pass_matches_encode_and_denoise(shipped.model, prefix, block, canvases, atol=1e-4)


def test_fused_draft_is_a_setting_of_speculative_mode_only(shipped):
    s = shipped.settings(mode="speculative", fused_draft=True)
    assert s.fused_draft and s.max_denoising_steps == 1  # draft_steps' default
    assert not shipped.settings(mode="speculative").fused_draft
    with pytest.raises(GenerationError, match=r"fused_draft needs draft_steps \(max_denoising_steps\) = 1, got 2"):
        shipped.settings(mode="speculative", draft_steps=2, fused_draft=True)
    for mode in ("ar", "diffusion"):
        with pytest.raises(GenerationError, match=f"fused_draft=True does not apply to mode='{mode}' \\(only mode "
                                                  "'speculative' uses it\\)"):
            shipped.settings(mode=mode, fused_draft=True)
        assert not shipped.settings(mode=mode, fused_draft=False).fused_draft  # the default asks for nothing


def test_lookup_drafts_on_the_shipped_model(shipped):
    """Prompt-lookup drafts on real text: AR's tokens, no decoder pass, and drafts that are kept."""
    prompt = shipped.encode_text("ROMEO:\nWhat light through yonder window breaks?\n\nJULIET:\nWhat light")
    ar = shipped.generate(prompt, mode="ar", max_new_tokens=48, temperature=0)
    spec = shipped.generate(prompt, mode="speculative", max_new_tokens=48, temperature=0, draft_source="lookup")
    assert spec.token_ids == ar.token_ids and spec.text == ar.text
    assert spec.stats.denoising_steps == 0 and spec.stats.accepted_drafts > 0
    with pytest.raises(GenerationError, match="draft_source='lookup' does not apply to mode='ar'"):
        shipped.settings(mode="ar", draft_source="lookup")


def test_pipeline_generate_in_speculative_mode(shipped):
    assert "speculative" in MODES
    ar = shipped.generate("ROMEO:", mode="ar", max_new_tokens=30, temperature=0)
    spec = shipped.generate("ROMEO:", mode="speculative", max_new_tokens=30, draft_steps=1, seed=3, temperature=0)
    assert spec.token_ids == ar.token_ids and spec.text == ar.text and spec.mode == "speculative"
    fused = shipped.generate("ROMEO:", mode="speculative", max_new_tokens=30, fused_draft=True, temperature=0)
    assert fused.token_ids == ar.token_ids and fused.stats.denoising_steps == 1
    assert spec.stats.verifications >= 1 and spec.stats.accepted_per_verification >= 1
    sampled = shipped.generate("ROMEO:", mode="speculative", max_new_tokens=30, max_denoising_steps=1, seed=3,
                               temperature=0.8)
    again = shipped.generate("ROMEO:", mode="speculative", max_new_tokens=30, max_denoising_steps=1, seed=3,
                             temperature=0.8)
    assert sampled.token_ids == again.token_ids != ar.token_ids  # seeded: repeatable, and really sampled


def test_cli_generates_in_speculative_mode(capsys):
    import json

    from printpress.cli import main

    common = ["generate", "--max-new-tokens", "12", "--temperature", "0", "--json", "ROMEO:"]
    assert main([*common, "--mode", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main([*common, "--mode", "speculative", "--draft-steps", "1"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == ar["token_ids"] and spec["text"] == ar["text"]
    assert spec["stats"]["forward_passes"] == 1 + spec["stats"]["denoising_steps"] + spec["stats"]["verifications"]
    assert main([*common, "--mode", "speculative", "--fused-draft"]) == 0
    fused = json.loads(capsys.readouterr().out)
    assert fused["token_ids"] == ar["token_ids"] and fused["stats"]["denoising_steps"] == 1
    assert main([*common, "--mode", "speculative", "--draft-source", "lookup"]) == 0
    lookup = json.loads(capsys.readouterr().out)
    assert lookup["token_ids"] == ar["token_ids"] and lookup["stats"]["denoising_steps"] == 0
    assert main([*common, "--mode", "speculative", "--draft-source", "ngram"]) == 2
    assert "unknown draft_source 'ngram'; expected one of diffusion, lookup, both" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(TINY))
def test_draft_agreement_replay_is_the_speculative_run_when_drafter_is_verifier(name):
    """bench/draft_agreement.py replays greedy speculative rounds from the verifier's AR text; with the model as its
    own drafter it must count exactly the verifications and accepted drafts `speculative` makes (same noise)."""
    replay = bench_module("draft_agreement").replay
    model = tiny_model(name)
    vocab = model.config.vocab_size
    for seed, (length, new) in enumerate([(3, 20), (9, 25), (14, 12)]):
        prompt = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
        s = settings(max_new_tokens=new, max_denoising_steps=1)
        (result,) = collect(speculative(model, [Request(prompt, s, seed)], canvas_length=8))[1]
        counts = dict(tokens=0, verifications=0, tried=[0] * 8, matched=[0] * 8)
        replay(model, prompt, result.token_ids, 7, 8, torch.Generator().manual_seed(seed), counts)
        assert counts["verifications"] == result.stats.verifications
        assert counts["tokens"] == new - 1
        assert counts["tokens"] - counts["verifications"] == result.stats.accepted_drafts
