"""The model matches transformers' DiffusionGemma (the reference) on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.cache_utils import DynamicCache

from printpress.checkpoint import load_model
from printpress.errors import GenerationError
from printpress.sampling import row_argmax

TOL = 1e-4


def reference_encoder_logits(ref, hidden: torch.Tensor) -> torch.Tensor:
    logits = ref.lm_head(hidden).float()
    cap = ref.config.text_config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap


def prompt(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


@pytest.fixture(scope="module")
def pairs(reference_checkpoints):
    out = {}
    for name, folder in reference_checkpoints.items():
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(folder).eval()
        model, config, _, _ = load_model(folder)
        out[name] = (ref, model, config)
    return out


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern", "twelve_layers"])
@pytest.mark.parametrize("length", [3, 13])  # 13 is longer than every sliding window
@torch.no_grad()
def test_encoder_and_decoder_logits_match_reference(pairs, name, length):
    ref, model, config = pairs[name]
    vocab, canvas_length = config.text.vocab_size, config.canvas_length
    ids = prompt(vocab, 2, length, seed=length)
    canvas = prompt(vocab, 2, canvas_length, seed=100 + length)
    self_cond = torch.randn(2, canvas_length, vocab, generator=torch.Generator().manual_seed(7)) * 3

    cache_ref = DynamicCache(config=ref.config.text_config)
    out = ref(input_ids=ids, past_key_values=cache_ref, decoder_input_ids=canvas)
    out_sc = ref(past_key_values=cache_ref, decoder_input_ids=canvas, self_conditioning_logits=self_cond)

    cache = model.new_cache(2, 64)
    encoder_logits = model.encode(ids, cache)
    assert (encoder_logits - reference_encoder_logits(ref, out.encoder_last_hidden_state)).abs().max() < TOL
    assert (model.denoise(canvas, cache) - out.logits).abs().max() < TOL
    assert (model.denoise(canvas, cache, self_cond) - out_sc.logits).abs().max() < TOL


@pytest.mark.parametrize("name", ["gqa", "mha"])
@torch.no_grad()
def test_second_canvas_after_committed_text_matches_reference(pairs, name):
    """Encode a prompt, then a committed canvas through the cache, then denoise: the generation pattern."""
    ref, model, config = pairs[name]
    vocab, c = config.text.vocab_size, config.canvas_length
    ids, committed, canvas = prompt(vocab, 1, 5, 1), prompt(vocab, 1, c, 2), prompt(vocab, 1, c, 3)

    cache_ref = DynamicCache(config=ref.config.text_config)
    ref(input_ids=ids, past_key_values=cache_ref, decoder_input_ids=canvas)
    out = ref(input_ids=committed, past_key_values=cache_ref, decoder_input_ids=canvas)

    cache = model.new_cache(1, 64)
    model.encode(ids, cache, logits="none")
    encoder_logits = model.encode(committed, cache)
    assert (encoder_logits - reference_encoder_logits(ref, out.encoder_last_hidden_state)).abs().max() < TOL
    assert (model.denoise(canvas, cache) - out.logits).abs().max() < TOL


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern"])
@torch.no_grad()
def test_encoding_in_pieces_equals_encoding_at_once(pairs, name):
    _, model, config = pairs[name]
    ids = prompt(config.text.vocab_size, 2, 17, seed=5)
    whole = model.new_cache(2, 32)
    at_once = model.encode(ids, whole)
    pieces = model.new_cache(2, 32)
    chunks = [model.encode(ids[:, a:b], pieces) for a, b in [(0, 4), (4, 5), (5, 12), (12, 17)]]
    assert (torch.cat(chunks, dim=1) - at_once).abs().max() < 1e-5
    canvas = prompt(config.text.vocab_size, 2, config.canvas_length, seed=6)
    assert (model.denoise(canvas, pieces) - model.denoise(canvas, whole)).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern"])
@torch.no_grad()
def test_left_padded_batch_matches_reference(pairs, name):
    ref, model, config = pairs[name]
    vocab, c = config.text.vocab_size, config.canvas_length
    ids = prompt(vocab, 3, 12, seed=9)
    lengths = [12, 7, 3]
    mask = torch.zeros(3, 12, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, 12 - n:] = True
    ids = ids.masked_fill(~mask, config.text.pad_token_id)
    canvas = prompt(vocab, 3, c, seed=10)
    self_cond = torch.randn(3, c, vocab, generator=torch.Generator().manual_seed(11))

    cache_ref = DynamicCache(config=ref.config.text_config)
    decoder_mask = F.pad(mask, (0, c), value=True)
    out = ref(input_ids=ids, attention_mask=mask, past_key_values=cache_ref, decoder_input_ids=canvas,
              decoder_attention_mask=decoder_mask, self_conditioning_logits=self_cond)

    cache = model.new_cache(3, 64)
    encoder_logits = model.encode(ids, cache, attention_mask=mask)
    expected = reference_encoder_logits(ref, out.encoder_last_hidden_state)
    assert (encoder_logits - expected).abs()[mask].max() < TOL  # pad positions carry no meaning
    assert (model.denoise(canvas, cache, self_cond) - out.logits).abs().max() < TOL


@pytest.mark.parametrize("name", ["gqa", "default_pattern"])
@torch.no_grad()
def test_padded_row_equals_the_same_row_alone(pairs, name):
    _, model, config = pairs[name]
    vocab, c = config.text.vocab_size, config.canvas_length
    short = prompt(vocab, 1, 4, seed=12)
    long = prompt(vocab, 1, 9, seed=13)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch, dtype=torch.bool)
    mask[1, :5] = False
    cache = model.new_cache(2, 32)
    batched_encoder = model.encode(batch, cache, attention_mask=mask)
    canvas = prompt(vocab, 2, c, seed=14)
    batched = model.denoise(canvas, cache)
    # Each row sees the positions it would see alone (its first real token at 0), so it matches itself alone.
    for row, alone_ids in ((0, long), (1, short)):
        alone = model.new_cache(1, 32)
        alone_encoder = model.encode(alone_ids, alone)
        n = alone_ids.shape[1]
        assert (batched_encoder[row, -n:] - alone_encoder[0]).abs().max() < 1e-5
        assert (batched[row] - model.denoise(canvas[row : row + 1], alone)[0]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_loads_and_tracks_fp32(reference_checkpoints, dtype):
    folder = reference_checkpoints["gqa"]
    model32, config, _, _ = load_model(folder)
    model16, _, _, _ = load_model(folder, dtype=dtype)
    assert model16.embed_tokens.weight.dtype == dtype
    ids = prompt(config.text.vocab_size, 1, 10, seed=3)
    canvas = prompt(config.text.vocab_size, 1, config.canvas_length, seed=4)
    c32, c16 = model32.new_cache(1, 32), model16.new_cache(1, 32)
    assert c16.layers[0].keys.dtype == dtype
    e32, e16 = model32.encode(ids, c32), model16.encode(ids, c16)
    d32, d16 = model32.denoise(canvas, c32), model16.denoise(canvas, c16)
    assert e16.dtype == torch.float32 and torch.isfinite(e16).all() and torch.isfinite(d16).all()
    assert (e16 - e32).abs().max() < 0.5 and (d16 - d32).abs().max() < 0.5
    assert (e16.argmax(-1) == e32.argmax(-1)).float().mean() > 0.8


@torch.no_grad()
def test_bf16_matches_reference_in_bf16(reference_checkpoints):
    folder = reference_checkpoints["gqa"]
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model, config, _, _ = load_model(folder, dtype="bfloat16")
    ids = prompt(config.text.vocab_size, 1, 9, seed=21)
    canvas = prompt(config.text.vocab_size, 1, config.canvas_length, seed=22)
    out = ref(input_ids=ids, past_key_values=DynamicCache(config=ref.config.text_config), decoder_input_ids=canvas)
    cache = model.new_cache(1, 32)
    model.encode(ids, cache, logits="none")
    assert (model.denoise(canvas, cache) - out.logits).abs().max() < 0.1


def test_cache_refuses_to_overflow(pairs):
    _, model, config = pairs["gqa"]
    cache = model.new_cache(1, 8)
    model.encode(prompt(config.text.vocab_size, 1, 6, 0), cache, logits="none")
    with pytest.raises(Exception, match="cache holds 8 positions; 6 are used and 3 more"):
        model.encode(prompt(config.text.vocab_size, 1, 3, 0), cache)


def test_parameter_count_formula_matches_the_module(pairs):
    for _, model, config in pairs.values():
        assert config.text.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.slow  # a model large enough for threads
@torch.no_grad()
def test_decoder_logits_bit_equal_to_the_reference_at_a_threaded_size(tmp_path):
    """At ~10M parameters the expert GEMMs are split across threads, where row order changes rounding:
    printpress groups tokens exactly as the reference does, so the logits match bit for bit (what keeps
    sampling token-exact on near-uniform random models, whose entropy ranking flips on any rounding)."""
    from helpers import TINY_CONFIGS, make_reference

    TINY_CONFIGS["threaded"] = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                    num_global_key_value_heads=1, sliding_window=128, num_experts=8, top_k_experts=2,
                                    moe_intermediate_size=128, max_position_embeddings=1024)
    try:
        ref = make_reference("threaded", canvas_length=64)
    finally:
        del TINY_CONFIGS["threaded"]
    ref.save_pretrained(tmp_path)
    model, _, _, _ = load_model(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = torch.tensor([[2, 5, 9, 100, 7, 30]])
        canvas = prompt(8192, 1, 64, seed=1)
        cache_ref = DynamicCache(config=ref.config.text_config)
        out = ref(input_ids=ids, past_key_values=cache_ref, decoder_input_ids=canvas)
        cache = model.new_cache(1, 200)
        model.encode(ids, cache, logits="none")
        assert torch.equal(model.denoise(canvas, cache), out.logits)
    finally:
        torch.set_num_threads(threads)


def test_expert_loop_for_training_equals_the_grouped_path_for_inference():
    from printpress.config import TextConfig
    from printpress.model import Experts

    text = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, num_experts=8, top_k_experts=3, moe_intermediate_size=16)
    experts = Experts(text)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    g = torch.Generator().manual_seed(0)
    x, weights = torch.randn(40, 32, generator=g), torch.rand(40, 3, generator=g)
    chosen = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(40)])
    trained = experts(x, weights, chosen)  # parameters require grad: the per-expert loop
    assert trained.requires_grad
    with torch.no_grad():
        inferred = experts(x, weights, chosen)  # grouped_mm
    assert torch.equal(trained.detach(), inferred)


@pytest.mark.parametrize("name", ["gqa", "mha", "default_pattern"])
@torch.no_grad()
def test_a_tentative_block_gives_the_bits_of_encoding_it_and_rolling_the_ring_back(pairs, name):
    """`encode_tentatively` (the block's sliding keys beside the rings, the kept ones written in by `keep(n)`; or, while
    a ring has room after its filled slots, in place) gives the logits and leaves the cache, bit for bit, as encoding
    the whole block and rolling it back to its first n tokens (`KVCache.snapshot` / `truncate`, the exact path before)
    does, in every ring slot that holds a position: blocks of 2 to the ring's length, kept in part, whole or not at
    all, in place and beside the ring, before and after the ring wraps; a block longer than the ring, kept in part
    (which a rollback cannot do), leaves what encoding its kept tokens leaves."""
    _, model, config = pairs[name]
    window = config.text.sliding_window - 1
    g = torch.Generator().manual_seed(4)
    vocab = config.text.vocab_size
    caches = [model.new_cache(1, 96) for _ in range(2)]
    first = torch.randint(3, vocab, (1, 3), generator=g)
    for cache in caches:
        model.encode(first, cache, logits="last")
    plan = [(2, 1), (window, window), (3, 0), (window, 2), (2, 2), (window, 1), (3, 3), (2, 0), (window, window - 1)]
    for t, n in plan * 2:
        block = torch.randint(3, vocab, (1, t), generator=g)
        new, keep = model.encode_tentatively(block, caches[0])
        keep(n)
        snapshot = caches[1].snapshot(t)
        old = model.encode(block, caches[1], logits="all")
        caches[1].truncate(snapshot.length + n, snapshot)
        assert torch.equal(new, old)
        assert caches[0].length == caches[1].length
        assert torch.equal(caches[0].slot_positions, caches[1].slot_positions)
        assert torch.equal(caches[0].pad_mask, caches[1].pad_mask)
        filled = caches[0].slot_positions >= 0  # ring slots holding a position: the only ones a pass reads
        for a, b in zip(caches[0].layers, caches[1].layers):
            read = filled if a.sliding else slice(0, caches[0].length)  # later full slots are never read
            assert torch.equal(a.keys[:, :, read], b.keys[:, :, read]) and torch.equal(a.values[:, :, read],
                                                                                       b.values[:, :, read])
    assert caches[0].length > window + 3  # the ring wrapped
    long = torch.randint(3, vocab, (1, window + 3), generator=g)
    _, keep = model.encode_tentatively(long, caches[0])
    keep(window + 1)
    model.encode(long[:, : window + 1], caches[1], logits="none")
    assert torch.equal(caches[0].slot_positions, caches[1].slot_positions)
    for a, b in zip(caches[0].layers, caches[1].layers):
        read = caches[0].slot_positions >= 0 if a.sliding else slice(0, caches[0].length)
        assert (a.keys[:, :, read] - b.keys[:, :, read]).abs().max() < 1e-5  # other row counts: other products
    with pytest.raises(GenerationError, match="cannot keep"):
        keep(1)  # once only


@pytest.mark.parametrize("name", ["gqa", "default_pattern"])  # vocabularies of 128 (the kernel's path) and 160
@pytest.mark.parametrize("scale", [1.0, 5000.0])  # logits far past the softcap, whose tanh then ties many
@torch.no_grad()
def test_argmax_passes_give_the_argmax_of_their_logits(pairs, name, scale):
    """`encode(..., argmax=True)` and `encode_tentatively(..., argmax=True)` (greedy decoding's passes, which skip
    most of the final softcap) give `row_argmax` of the logits the same passes give, and leave the same cache."""
    _, model, config = pairs[name]
    assert model.config.final_logit_softcapping
    ids = prompt(config.text.vocab_size, 1, 2 * config.text.sliding_window + 3, seed=5)
    weight = model.embed_tokens.weight
    saved = weight.clone()
    try:
        weight.mul_(scale)
        caches = [model.new_cache(1, 64) for _ in range(2)]
        outs = [model.encode(ids[:, :-4], cache, logits="all", argmax=argmax) for cache, argmax in zip(caches, (0, 1))]
        assert torch.equal(row_argmax(outs[0]), outs[1])
        top = (outs[0] == outs[0].max(dim=-1, keepdim=True).values).sum(dim=-1)
        assert (top.max() > 1) == (scale > 1)  # scaled up, the softcap ties rows' largest logits: the first one wins
        steps = [model.encode(ids[:, -4:-3], cache, logits="last", argmax=argmax) for cache, argmax in
                 zip(caches, (0, 1))]
        assert torch.equal(row_argmax(steps[0]), steps[1])
        verified = [model.encode_tentatively(ids[:, -3:], cache, argmax=argmax) for cache, argmax in
                    zip(caches, (0, 1))]
        assert torch.equal(row_argmax(verified[0][0]), verified[1][0])
        for _, keep in verified:
            keep(2)
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(caches[0].layers, caches[1].layers))
    finally:
        weight.copy_(saved)


@pytest.mark.parametrize("name", ["gqa", "default_pattern", "twelve_layers"])
@torch.no_grad()
def test_ar_steps_without_a_mask_are_bit_equal_to_masked_ones(pairs, name, monkeypatch):
    """An AR step with no padding attends with no mask (it sees every cached key): bit-identical to building the
    all-true causal and window masks, well past the sliding window."""
    from printpress.cache import KVCache

    _, model, config = pairs[name]
    ids = prompt(config.text.vocab_size, 1, 3 * config.text.sliding_window + 5, seed=21)

    def steps() -> list[torch.Tensor]:
        cache = model.new_cache(1, 64)
        return [model.encode(ids[:, i : i + 1], cache, logits="last") for i in range(ids.shape[1])]

    unmasked = steps()
    monkeypatch.setattr(KVCache, "all_valid", lambda self: False)  # forces the masks to be built
    masked = steps()
    assert all(torch.equal(a, b) for a, b in zip(unmasked, masked))


@pytest.mark.parametrize("name", ["gqa", "default_pattern", "twelve_layers"])
@torch.no_grad()
def test_blocks_without_padding_attend_with_additive_masks_bit_equal_to_boolean_ones(pairs, name, monkeypatch):
    """A block with no padding anywhere (a prompt, a verification) attends with the additive masks
    `_causal_mask` makes in C++ from positions: bit-identical to the boolean causal and window masks of the padded
    case, for blocks of 1 to past the sliding window, before and after the ring wraps."""
    from printpress import model as model_module
    from printpress.cache import KVCache

    if not model_module.native_layers():
        pytest.skip("no C++ compiler for printpress's layers on this machine")
    _, model, config = pairs[name]
    window = config.text.sliding_window
    ids = prompt(config.text.vocab_size, 1, 3 * window + 16, seed=23)
    sizes = [2, 1, window - 1, 3, window + 2, 5, 2, window]
    monkeypatch.setattr(model_module, "NATIVE_LAYERS", True)

    def blocks() -> list[torch.Tensor]:
        cache, start, out = model.new_cache(1, ids.shape[1]), 0, []
        for size in sizes:
            out.append(model.encode(ids[:, start : start + size], cache))
            start += size
        return out

    additive = blocks()
    monkeypatch.setattr(KVCache, "all_valid", lambda self: False)  # forces the boolean masks
    boolean = blocks()
    assert all(torch.equal(a, b) for a, b in zip(additive, boolean, strict=True))


@pytest.mark.parametrize("name", ["gqa", "twelve_layers"])
@torch.no_grad()
def test_ar_steps_reading_rope_from_block_tables_are_bit_equal_to_computing_it(pairs, name, monkeypatch):
    """AR steps and short blocks take their RoPE rows from tables of blocks of positions (a few kept): the same bits as
    computing each step's own, across many blocks and evictions; a block that spans two tables computes its own."""
    import printpress.model as model_module

    _, model, config = pairs[name]
    monkeypatch.setattr(model_module, "ROPE_BLOCK", 8)
    monkeypatch.setattr(model_module, "ROPE_BLOCKS_KEPT", 2)
    model._rope_blocks.clear()
    assert model._rope_rows_hold(torch.device("cpu")), "cos and sin should not depend on the tensor around an element"
    for start, t in [(0, 1), (5, 3), (13, 1), (40, 8), (63, 1)]:
        got = model._block_rope(start, t, torch.device("cpu"))
        want = model.rope(torch.arange(start, start + t))
        assert all(torch.equal(a, b) for kind in want for a, b in zip(got[kind], want[kind]))
    assert model._block_rope(6, 3, torch.device("cpu")) is None  # positions 6..8 span two blocks
    assert len(model._rope_blocks) == 2
    ids = prompt(config.text.vocab_size, 1, 40, seed=22)

    def steps() -> list[torch.Tensor]:
        cache = model.new_cache(1, 64)
        out = [model.encode(ids[:, :5], cache)]  # a block within the first table
        return out + [model.encode(ids[:, i : i + 1], cache, logits="last") for i in range(5, ids.shape[1])]

    from_tables = steps()
    monkeypatch.setattr(type(model), "_block_rope", lambda self, start, t, device: None)
    assert all(torch.equal(a, b) for a, b in zip(from_tables, steps()))


def test_one_token_expert_path_equals_the_per_expert_loop():
    """The AR step's expert path (no sort, gather or scatter) runs the same one-row GEMMs as the loop (which equals
    the grouped path, test above) and sums the k slots in the same order."""
    from printpress.config import TextConfig
    from printpress.model import Experts

    text = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, num_experts=8, top_k_experts=3, moe_intermediate_size=16)
    experts = Experts(text)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        x, weights = torch.randn(1, 32, generator=g), torch.rand(1, 3, generator=g)
        chosen = torch.randperm(8, generator=g)[:3][None]
        looped = experts(x, weights, chosen).detach()  # parameters require grad: the per-expert loop
        with torch.no_grad():
            assert torch.equal(experts(x, weights, chosen), looped)  # the one-token path


@pytest.mark.parametrize("scope", ["layer", "global"])
@torch.no_grad()
def test_forward_hooks_see_each_layer_call_and_change_no_bits(pairs, scope):
    """Passes call the layers' C++ operators straight from `run_layers`, around nn.Module's call, only while no
    forward hook would see it: with a hook on a layer (or on every module) each layer is called as a module, the
    hook sees its output, and the logits are the same bits."""
    _, model, config = pairs["gqa"]
    ids = prompt(config.text.vocab_size, 1, 9, seed=5)

    def logits() -> torch.Tensor:
        return model.encode(ids, model.new_cache(1, 16), logits="all")

    plain = logits()
    seen: list[torch.Size] = []

    def hook(module, _args, out):
        if module is model.layers[1]:
            seen.append(out.shape)

    handle = (model.layers[1].register_forward_hook(hook) if scope == "layer"
              else torch.nn.modules.module.register_module_forward_hook(hook))
    try:
        hooked = logits()
    finally:
        handle.remove()
    assert seen == [torch.Size([9, config.text.hidden_size])]
    assert torch.equal(hooked, plain)
    assert torch.equal(logits(), plain)  # the direct calls again, once the hook is gone
