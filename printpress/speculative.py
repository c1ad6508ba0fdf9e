"""Self-speculative decoding: the decoder drafts a canvas by diffusion, the encoder verifies it causally.

A model trained with the joint objective is both a diffusion model (the bidirectional decoder) and an
autoregressive LM (the causal encoder) on the same weights. This mode uses the first to guess and the second
to decide, so the output is the AR model's:

1. The cache holds the prompt and every committed token but the last one, `t` (its encoder pass has not run).
   A canvas starts at that position with `t` clamped in its first slot and uniform noise elsewhere; a few
   denoising steps (the engine's canvas step, printpress/canvas.py: temperature schedule, entropy-bound
   acceptance, re-noising, self-conditioning, `sample_accepted_only`) turn the rest into a draft `d_1..d_m`.
   A draft runs all its steps: the adaptive stop's settings do not apply to this mode.
2. One encoder pass over `[t, d_1, .., d_m]` gives the AR model's next-token distribution after each of them.
   Greedy (temperature 0): keep the drafts that equal the AR argmax, then add the AR argmax at the first
   mismatch (or after the last draft), so every verification commits at least one token. Sampling: the
   standard speculative-sampling rule (accept `d_i` with probability min(1, p/q), else draw from
   norm(max(0, p - q)); a bonus draw from p when every draft is accepted), which makes the output follow the
   AR distribution exactly whatever the draft is.
3. The cache keeps only the accepted tokens (`DiffusionGemma.encode_tentatively`: the exact path writes the
   block's sliding-window keys beside the rings and only the kept ones into them, `KVCache.tentative_joins`; a
   compiled block writes only the kept ones too), so it holds what AR decoding would hold. Greedy rounds read only
   the verification's argmax (`encode_tentatively(..., argmax=True)`), not its logits.

The same `t`-first layout makes the prefill's last logits give the first token, exactly as in `mode="ar"`.
Requests are served one after another (not batched): each verification accepts a different number of tokens,
and per-row rollback of a batched cache is not worth it for a mode meant for one local user.

Fused rounds (`settings.fused_draft`, TiDAR's layout; one draft step only): after the first round, one pass
(`DiffusionGemma.verify_and_draft`) verifies `[t, d_1..d_m]` and, beside it, denoises once a canvas of
`fused_canvas` noise tokens for every outcome j (j drafts accepted), placed right after block row j and seeing
only what the decoder would see once `t, d_1..d_j` were encoded. The verification decides j exactly as above;
canvas j then holds the next round's drafts: its slot 0 sits where the token just committed (the AR token `a`)
goes, so the next block is `[a, c_1..c_m]` with `c_i` taken from slot i (argmax, or drawn from `next_token_probs`).
One pass per round instead of two; the drafts are one token further ahead (slot 0 is noise, not `a`). The
output is still AR's: the canvases' noise is drawn before the pass and no block row attends to a canvas, so
the drafts depend only on committed tokens and fresh noise, which is all the acceptance rule needs.

Drafts from the context (`settings.draft_source`, "lookup": prompt-lookup decoding, as vLLM's n-gram proposer and
llama.cpp's lookup decoding do it): where the text's last n tokens (n = 6, .., 1, the longest that matches) occurred
earlier in the prompt or the output, the tokens that followed their latest such occurrence are the draft, at most
`LOOKUP_DRAFTS` of them unless `draft_length` says otherwise. No decoder pass: a round that finds nothing is a
verification of `[t]` alone, which is an AR step. "both" drafts by diffusion in the rounds where lookup finds
nothing. The acceptance rule is the same; when sampling, a lookup draft is a draw from a one-hot q, so a draft
token is kept with probability p(d) and a rejection draws from p without d: AR's distribution still.
"table" drafts the same way from the model's draft table (`model.draft_table`, read from `draft_table.safetensors`
beside the weights; printpress/draft_table.py): what the model itself most often wrote after the text's last
1..5 tokens in its greedy continuations of training text, token by token, except where the text's own continuation
(the lookup's) follows a context at least as long: the table knows the model's habits, the text what it wrote here.
When sampling, a table with distributions (next-token counts of sampled continuations) draws each draft token from
the counts of every context length it knows there, interpolated (`DraftTable.interpolated`), and passes that
distribution as q, so the rule keeps it with probability min(1, p/q).
"auto", the default, is "table" where the model has a table and the rounds are not fused, else "diffusion"
(`draft_source`; `SpeculativeStats.draft_source` says which ran).

Counting: `forward_passes` = 1 (the prompt pass, which yields the first token) + decoder passes + verification
passes, so `tokens_per_forward` compares with AR's 1.0; a fused pass is one verification and no decoder pass
(only the first round's draft, and any round that drafts without a fused pass before it, counts decoder
passes and step events). `SpeculativeStats` adds the verification count and `accepted_per_verification`:
tokens committed per verification, the correction/bonus token included (>= 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from printpress.canvas import denoise, denoise_step, step_event
from printpress.errors import GenerationError
from printpress.events import CommitEvent, Decode, Event, SpeculativeStats, StepEvent
from printpress.request import Request, RequestState, model_device
from printpress.sampling import (SamplerSettings, draw_kernels, multinomial_one, next_token_probs, row_argmax,
                                 sample_canvas, sample_next_token)

DEFAULT_CANVAS = 32  # the shipped models' canvas, used when the caller does not pass the checkpoint's
# Canvas length of each outcome's draft in a fused pass (fused_draft). It caps the drafts per round at
# FUSED_CANVAS - 1, which is what a caller that does not pass draft_length gets: 3 drafts on canvases of 4 ran
# within 0.03 of the best fused setting on the shipped model (0.60x AR, against 0.44x unfused with its default
# 31 drafts) and at 1.9x AR on the toy model (docs/benchmarks-speculative.md, "Fused draft+verify").
FUSED_CANVAS = 4
# Drafts per round from the context or a draft table (draft_source lookup, both or table) unless draft_length says
# otherwise: a block of 8 verified (docs/benchmarks-speculative.md, "Drafts from the context").
LOOKUP_DRAFTS = 7
# The same cap for drafts sampled from a table's distributions (sampling requests): each is kept with probability
# sum(min(p, q)) (0.57 on the shipped model), so long drafts rarely survive and their q rows cost: 3 drafts ran at
# 1.32x AR sampling, 7 at 1.15x, 11 at 1.14x on a Xeon; 3 and 4 alike on an AMD EPYC, 5 slower
# (docs/benchmarks-speculative.md, "Drafts from a draft table" and "Drafts drawn from every context length").
SAMPLED_TABLE_DRAFTS = 3
LOOKUP_LONGEST = 6  # the longest suffix of the text that lookup matches (3 drafted as well alone; 6 helps a table)


class ContextLookup:
    """Drafts from the text itself: what followed the latest earlier occurrence of its last few tokens.

    `follow` maps each n-gram (n <= `longest`) that has a token after it to the position of that token in its
    latest occurrence, so the text's own suffix, which has none yet, only matches an earlier occurrence.
    """

    def __init__(self, tokens: Sequence[int] = (), longest: int = LOOKUP_LONGEST) -> None:
        self.tokens: list[int] = []
        self.longest = longest
        self.follow: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams that end here are followed by `token`
            for n in range(1, min(self.longest, end) + 1):
                self.follow[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def draft(self, m: int) -> list[int]:
        """Up to `m` tokens after the latest earlier occurrence of the longest suffix that has one; [] if none."""
        n, start = self._follower(self.tokens)
        return self.tokens[start : start + m] if n else []

    def match(self, text: Sequence[int]) -> tuple[int, int | None]:
        """The token that followed the latest occurrence in this text of the longest suffix of `text` (this text
        with drafted tokens after it) that occurred here, and that suffix's length; (0, None) if none did."""
        n, start = self._follower(text)
        return (n, self.tokens[start]) if n else (0, None)

    def _follower(self, text: Sequence[int]) -> tuple[int, int]:
        """The length of the longest suffix of `text` that occurred in this text with a token after it, and that
        token's position (of its latest occurrence); (0, -1) if none did."""
        for n in range(min(self.longest, len(text)), 0, -1):
            start = self.follow.get(tuple(text[-n:]))
            if start is not None:
                return n, start
        return 0, -1


@dataclass
class _State(RequestState):
    """A request in flight, with the counts only this mode has."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_source: str = ""


@torch.no_grad()
def speculative(
    model: torch.nn.Module,
    requests: Sequence[Request],
    decode: Decode | None = None,
    canvas_length: int | None = None,
    draft_length: int | None = None,
    step_events: bool = True,
    fused_canvas: int | None = None,
) -> Iterator[Event]:
    """Generate for each request in turn, yielding the engine's events (same contract as `mode="ar"`).

    Draft steps per verification are `settings.max_denoising_steps`; `temperature`/`top_k` are the AR
    model's, as in `mode="ar"`. `canvas_length` is the decoder's canvas (the checkpoint's); `draft_length`
    caps the drafts verified per pass (default: the whole canvas after the clamped token, canvas - 1).
    `fused_canvas`: each outcome's canvas in a fused pass (requests with `settings.fused_draft`; default
    `FUSED_CANVAS`); their drafts are also capped at fused_canvas - 1. Drafts from the context
    (`settings.draft_source` lookup, both or table) are capped at `draft_length`, else `LOOKUP_DRAFTS` (drafts sampled
    from a table's distributions: `SAMPLED_TABLE_DRAFTS`).
    """
    canvas = DEFAULT_CANVAS if canvas_length is None else canvas_length
    if canvas < 2:
        raise GenerationError(f"speculative decoding needs a canvas of at least 2 positions, got {canvas}")
    drafts = canvas - 1 if draft_length is None else draft_length
    if not 0 <= drafts < canvas:
        raise GenerationError(f"draft_length must be in 0..{canvas - 1} (canvas {canvas}), got {draft_length}")
    fused = FUSED_CANVAS if fused_canvas is None else fused_canvas
    if fused < 2:
        raise GenerationError(f"fused_canvas must be at least 2 (the committed token's slot and a draft), got {fused}")
    for request in requests:
        _check(request)
        if request.settings.draft_source == "table" and model.draft_table is None:
            raise GenerationError("draft_source 'table' needs the model's draft table (draft_table.safetensors in its "
                                  "folder), and this model has none: make one with `printpress draft-table MODEL`, "
                                  "or use draft_source 'lookup'")
    lookup_drafts = (LOOKUP_DRAFTS, SAMPLED_TABLE_DRAFTS) if draft_length is None else (draft_length, draft_length)
    for index, request in enumerate(requests):
        yield from _generate_one(model, index, request, decode, canvas, drafts, lookup_drafts, step_events, fused)


def _check(request: Request) -> None:
    if not request.prompt_ids:
        raise GenerationError("the prompt is empty; give at least one token")
    # Whatever mode the settings name, this mode reads the draft sampler's and the AR sampling's settings.
    dataclasses.replace(request.settings, mode="speculative").validate()


def _generate_one(
    model: torch.nn.Module,
    index: int,
    request: Request,
    decode: Decode | None,
    canvas: int,
    drafts: int,
    lookup_drafts: tuple[int, int],
    step_events: bool,
    fused_canvas: int,
) -> Iterator[Event]:
    device = model_device(model)
    state = _State.start(index, request, device, request.settings.max_new_tokens, step_events=step_events)
    prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
    # The last committed token is never encoded before the next verification: prompt + budget suffices.
    cache = model.new_cache(1, prompt.shape[1] + state.budget)
    logits = model.encode(prompt, cache, logits="last")
    state.forward_passes += 1  # the prompt pass gives the first token, as in mode="ar"
    yield from _commit(state, [sample_next_token(logits[0, -1], state.settings, state.generator)], 0, decode)
    # A block of m + 1 tokens may be rolled back part way only while the sliding ring holds all of it.
    drafts = min(drafts, cache.window - 1)
    lookup_drafts = tuple(min(n, cache.window - 1) for n in lookup_drafts)  # (one-hot drafts, sampled ones)
    fused = request.settings.fused_draft
    if fused:
        drafts = min(drafts, fused_canvas - 1)
    source = state.draft_source = draft_source(model, request.settings)
    lookup = None if source == "diffusion" else ContextLookup(request.prompt_ids)
    drafted = None  # hidden states (1, L, H) of the canvas the last fused pass drafted for what it committed
    round_index = 0
    while not state.finished:
        round_index += 1
        last = state.tokens[-1]
        room = state.budget - len(state.tokens) - 1
        m = min(drafts, room)
        draft, q = torch.empty(0, dtype=torch.long, device=device), None
        if lookup is not None:
            lookup.extend(state.tokens[len(lookup.tokens) - len(request.prompt_ids) :])
            draft, q = _guess(model, source, lookup, [min(n, room) for n in lookup_drafts], state, device)
        if not draft.numel() and source in ("diffusion", "both") and m > 0:
            if drafted is not None:
                draft, q = _canvas_draft(model, state, drafted, m)
            else:
                draft, q = yield from _draft(model, cache, state, last, canvas, m, round_index)
        # Outcomes whose next round still has a draft to make: committing j + 1 tokens leaves budget for one.
        outcomes = min(draft.numel() + 1, state.budget - len(state.tokens) - 2) if fused and drafts else 0
        if outcomes > 0:
            new, drafted = _verify_and_draft(model, cache, state, last, draft, q, outcomes, fused_canvas)
        else:
            new, drafted = _verify(model, cache, state, last, draft, q), None
        yield from _commit(state, new, round_index, decode)
    yield state.done("speculative", decode, _stats(state))


def draft_source(model: torch.nn.Module, settings: SamplerSettings) -> str:
    """The source a request's drafts come from: its setting, with "auto" made "table" where the model has a draft
    table and the rounds are not fused, else "diffusion"."""
    if settings.draft_source != "auto":
        return settings.draft_source
    return "table" if model.draft_table is not None and not settings.fused_draft else "diffusion"


def _draft(
    model: torch.nn.Module,
    cache,
    state: _State,
    last: int,
    canvas_length: int,
    m: int,
    round_index: int,
) -> Iterator[StepEvent]:
    """Denoise one canvas whose first slot is clamped to `last`; return its next `m` tokens and, when
    sampling, the distribution each was drawn from (None when greedy). A generator: it yields step events.

    The steps are the engine's canvas step over the whole canvas (the clamped slot included, so the random
    draws have the diffusion loop's shapes), with the slot put back to `last` after each; a draft runs all
    its steps (no adaptive stop), and the last decoder pass gives the draft's logits instead of a sample.
    """
    settings = state.settings
    vocab = model.config.vocab_size
    state.start_canvas(canvas_length, vocab, cache.device)
    state.canvas[0, 0] = last
    steps = settings.max_denoising_steps
    while True:
        logits = denoise(model, state.canvas, cache, state.self_conditioning)
        state.count_decoder_pass()
        if state.step == 1:
            break
        outcome = denoise_step(logits, [state], vocab)
        outcome.accepted[0, 0] = True
        outcome.next_canvas[0, 0] = last
        state.canvas = outcome.next_canvas
        state.self_conditioning = outcome.feedback(model.dtype)
        state.step -= 1
        if state.step_events:
            yield step_event(state, round_index, outcome, 0, stopped=False)
    tail = logits[0, 1 : m + 1]
    if settings.temperature == 0:
        draft, q = row_argmax(tail), None
    else:
        q = next_token_probs(tail, settings)
        draft = sample_canvas(q, state.generator)
    if state.step_events:
        final = state.canvas.clone()
        final[0, 1 : m + 1] = draft
        yield StepEvent(state.index, round_index, steps, steps, final[0].tolist(), final[0].tolist(),
                        [True] * canvas_length, stopped=True)
    return draft, q


def _guess(model: torch.nn.Module, source: str, lookup: ContextLookup, caps: list[int], state: _State,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft made without the model's passes: from the table (sampled from its distributions when sampling and
    it has them, at most caps[1] tokens; else its greedy chain), else from the context (caps[0]); possibly none."""
    vocab = model.config.vocab_size
    m, sampled_m = caps
    if source == "table":
        table = model.draft_table
        if state.settings.temperature > 0:
            tokens, q = table.sample_interpolated(lookup.tokens, sampled_m, state.generator, vocab, lookup)
            if tokens:
                return torch.tensor(tokens, dtype=torch.long, device=device), torch.from_numpy(q).to(device)
        return _token_draft(table.draft(lookup.tokens, m, lookup), state.settings, vocab, device)
    return _token_draft(lookup.draft(m), state.settings, vocab, device)


def _token_draft(tokens: list[int], settings: SamplerSettings, vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft guessed without the model (context lookup or draft table; possibly none) and, when sampling, its
    one-hot q."""
    draft = torch.tensor(tokens, dtype=torch.long, device=device)
    if settings.temperature == 0 or not draft.numel():
        return draft, None
    return draft, torch.nn.functional.one_hot(draft, vocab).float()


def _verify(
    model: torch.nn.Module, cache, state: _State, last: int, draft: torch.Tensor, q: torch.Tensor | None
) -> list[int]:
    """One causal pass over `[last, *draft]`; returns the tokens AR decoding commits, the cache keeping `last` and
    the accepted drafts."""
    block = torch.cat([torch.tensor([last], dtype=torch.long, device=draft.device), draft])[None]
    # [0, i]: the AR model's view after block[i]; greedy rounds read only its argmax (cheaper than the logits)
    verified, keep = model.encode_tentatively(block, cache, argmax=state.settings.temperature == 0)
    return _accept(keep, state, draft, q, verified[0])


def _verify_and_draft(
    model: torch.nn.Module, cache, state: _State, last: int, draft: torch.Tensor, q: torch.Tensor | None,
    outcomes: int, canvas_length: int,
) -> tuple[list[int], torch.Tensor | None]:
    """`_verify` fused with the next round's draft (`DiffusionGemma.verify_and_draft`): one pass verifies
    `[last, *draft]` and denoises a noise canvas after each of its first `outcomes` rows. Returns the tokens AR
    decoding commits and the final hidden states (1, L, H) of the canvas that follows them (None when the
    outcome had none: the request has no budget for another draft)."""
    block = torch.cat([torch.tensor([last], dtype=torch.long, device=draft.device), draft])[None]
    noise = torch.randint(0, model.config.vocab_size, (outcomes, canvas_length), generator=state.generator,
                          device=draft.device)  # drawn before the verification: independent of its outcome
    snapshot = cache.snapshot(block.shape[1])
    logits, hidden = model.verify_and_draft(block, noise, cache)
    new = _accept(lambda n: cache.truncate(snapshot.length + n, snapshot), state, draft, q, logits)
    outcome = len(new) - 1  # drafts accepted
    return new, hidden[outcome : outcome + 1] if outcome < outcomes else None


def _accept(keep: Callable[[int], None], state: _State, draft: torch.Tensor, q: torch.Tensor | None,
            logits: torch.Tensor) -> list[int]:
    """The verification's decision from its logits (m + 1, V), or from their argmax (m + 1,) when greedy (one pass
    counted); `keep(n)` leaves the block's first n tokens (the last committed one and the accepted drafts) in the
    cache."""
    state.forward_passes += 1
    state.verifications += 1
    if state.settings.temperature == 0:
        new = greedy_accept(draft, logits if logits.dim() == 1 else row_argmax(logits))
    else:
        q = logits.new_empty(0, logits.shape[-1]) if q is None else q  # no draft: the bonus draw only
        new = sampled_accept(draft, q, next_token_probs(logits, state.settings), state.generator)
    accepted = len(new) - 1
    keep(1 + accepted)
    state.drafted += int(draft.numel())
    state.accepted += accepted
    return new


def _canvas_draft(model: torch.nn.Module, state: _State, hidden: torch.Tensor,
                  m: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next `m` drafts from a fused pass's canvas (1, L, H): slots 1..m (slot 0 is the token just
    committed), their argmax, or a draw from `next_token_probs` of their logits (returned as q), as `_draft` does."""
    logits = model.logits(hidden[0, 1 : m + 1])
    if state.settings.temperature == 0:
        return row_argmax(logits), None
    q = next_token_probs(logits, state.settings)
    return sample_canvas(q, state.generator), q


def greedy_accept(draft: torch.Tensor, targets: torch.Tensor) -> list[int]:
    """The drafts (m,) that match the AR argmax after each verified position, `targets` (m + 1,), then the AR argmax
    after them."""
    targets = targets.tolist()  # a few lists of ints: cheaper than tensor ops this small
    tokens = draft.tolist()
    kept = next((i for i, (token, target) in enumerate(zip(tokens, targets)) if token != target), len(tokens))
    return tokens[:kept] + [targets[kept]]


def sampled_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): drafts (m,) drawn from q (m, V), target
    probabilities p (m + 1, V). Each kept token, and the one drawn after them, follows p exactly.

    On a CPU with printpress's sampling kernels, `printpress_draw::speculative_accept` runs the loop below in one call
    (the same tokens and generator state; ~0.1 ms of Python a round otherwise)."""
    m = draft.numel()
    if p.dtype == q.dtype == torch.float32 and p.device.type == "cpu" and generator.device.type == "cpu" \
            and draw_kernels():
        uniforms = torch.rand(m, generator=generator) if m else p.new_empty(0)
        return torch.ops.printpress_draw.speculative_accept(draft, q, p, uniforms, generator).tolist()
    return _sampled_accept(draft, q, p, generator)


def _sampled_accept(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """`sampled_accept` in Python and ATen's operators."""
    m = draft.numel()
    tokens = draft.tolist()
    uniforms = torch.rand(m, generator=generator, device=draft.device).tolist() if m else []
    rows = torch.arange(m, device=draft.device)
    drafted_q, drafted_p = q[rows, draft].tolist(), p[rows, draft].tolist()  # q[i, x] and p[i, x], gathered once
    for i in range(m):
        if uniforms[i] * drafted_q[i] < drafted_p[i]:  # u < p/q without dividing by a tiny q
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection is then a draw from p
            residual = p[i]
        return tokens[:i] + [int(multinomial_one(residual, generator))]
    return tokens + [int(multinomial_one(p[m], generator))]


def _commit(state: _State, new: list[int], round_index: int, decode: Decode | None) -> Iterator[CommitEvent]:
    """Append verified tokens up to the first EOS and the budget; one CommitEvent for them."""
    kept = new[: state.budget - len(state.tokens)]
    eos = next((i for i, t in enumerate(kept) if t in state.settings.eos_token_ids), None)
    if eos is not None:
        kept = kept[: eos + 1]
    state.commit(kept)
    yield CommitEvent(state.index, round_index, kept, state.text_delta(decode), state.finished)


def _stats(state: _State) -> SpeculativeStats:
    return SpeculativeStats(
        **dataclasses.asdict(state.stats("speculative")),
        verifications=state.verifications,
        drafted_tokens=state.drafted,
        accepted_drafts=state.accepted,
        # Every token after the first (the prompt pass's) was committed by a verification.
        accepted_per_verification=(len(state.tokens) - 1) / state.verifications if state.verifications else 0.0,
        draft_source=state.draft_source,
    )
