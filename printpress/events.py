"""What generation produces: the event stream and the results it ends with.

Every decoding loop (diffusion, AR, speculative, editing) is a generator of these small dataclasses, and the
CLI, the server, the benchmark and `Pipeline.generate` are consumers of the same stream. This module is a leaf:
it imports nothing from printpress, so any consumer can import the types without pulling in a loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

Decode = Callable[[list[int]], str]  # token ids -> text (the pipeline's tokenizer)


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEvent:
    """One denoising step of one request's canvas.

    `tokens` is the canvas fed to the next step: accepted positions hold the sampled token, the
    others fresh uniform noise. `argmax` is the current best guess, what would be committed if
    denoising stopped now.
    """

    request: int
    canvas: int
    step: int  # 1-based count of decoder passes in this canvas
    max_steps: int
    tokens: list[int]
    argmax: list[int]
    accepted: list[bool]  # accepted this step; every other position was re-noised
    stopped: bool  # the adaptive stop fired: this argmax is committed
    # Per position, the entropy (nats) of the temperature-scaled prediction that the entropy bound compared;
    # None from the loops that do not report it (editing, a speculative draft's final step).
    entropy: list[float] | None = None

    @property
    def renoised(self) -> list[bool]:
        return [not a for a in self.accepted]


@dataclass(frozen=True)
class SpanStepEvent(StepEvent):
    """A `StepEvent` of editing, whose canvas is `[span | clamped suffix]`: `tokens[:span]` are being denoised,
    `tokens[span:]` are the suffix tokens, identical at every step (reported as accepted)."""

    span: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the most likely tokens at its position (AR mode, when asked).

    The log-probabilities are the model's own: log_softmax of the raw next-token logits, before the temperature
    and top-k shape the distribution the token is drawn from (as OpenAI reports them). So a greedy token has the
    largest `logprob` of its position, and a sampled one may fall outside `top`.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the k most likely tokens, most likely first


@dataclass(frozen=True)
class CommitEvent:
    """Tokens appended to a request's output: a whole canvas (diffusion) or one token (AR)."""

    request: int
    canvas: int  # canvas index (diffusion) or token index (AR)
    token_ids: list[int]
    text: str  # text newly added by these tokens ("" without a tokenizer)
    finished: bool
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, for a request that asked (AR)


# --------------------------------------------------------------------------------------------
# Results of generation
# --------------------------------------------------------------------------------------------


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int  # generated tokens that are not pad (the EOS counts; the pad after it does not)
    canvases: int  # committed canvases (diffusion) or 0 (AR)
    forward_passes: int  # decoder passes (diffusion) or token-producing encoder passes (AR)
    denoising_steps: int  # decoder passes, as the reference counts them
    tokens_per_forward: float  # new_tokens / forward_passes, as the reference defines it
    wall_time_s: float
    time_to_first_commit_s: float | None  # until the first canvas (or token) was committed
    finish_reason: str  # "eos" or "length"


@dataclass
class SpeculativeStats(GenerationStats):
    verifications: int = 0  # encoder passes over a draft (the prompt pass not included)
    drafted_tokens: int = 0  # draft tokens offered to verification
    accepted_drafts: int = 0  # of those, how many were kept
    accepted_per_verification: float = 0.0  # tokens committed per verification, the AR token included
    draft_source: str = ""  # where the drafts came from: diffusion, lookup, both or table ("auto" resolved)


@dataclass
class GenerationResult:
    """What one request produced.

    `token_ids` holds every committed token. In diffusion mode that is whole canvases, with pad
    after the first EOS, exactly the new part of the reference's `sequences`. `completion_ids` and
    `text` are the completion: up to (not including) the first EOS and at most `max_new_tokens`
    tokens; `text` is None without a tokenizer. `logprobs` (AR mode, when asked) has one `TokenLogprob`
    per completion id.
    """

    token_ids: list[int]
    completion_ids: list[int]  # the generated tokens before the first EOS, at most max_new_tokens of them
    text: str | None
    prompt_ids: list[int]
    stats: GenerationStats
    mode: str = "diffusion"
    seed: int = 0
    # One per token of `completion_ids` when the request asked for log-probabilities (`logprobs=k`, AR mode).
    logprobs: list[TokenLogprob] | None = None


# --------------------------------------------------------------------------------------------
# Results of editing (printpress.editing)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One denoised middle of a given length and its score under the model's causal head (printpress.editing)."""

    length: int
    seed: int
    middle_ids: list[int]
    middle: str | None
    middle_nll: float  # summed NLL (nats) of the middle's tokens after the prefix
    suffix_nll: float  # summed NLL of the scored suffix tokens (the same for every candidate) after prefix + middle
    suffix_tokens: int  # suffix tokens scored: the first canvas_length of the suffix
    forward_passes: int

    @property
    def score(self) -> float:
        """What the length search minimises: the NLL of the suffix after prefix + middle, a score of the same text
        for every candidate (so no length normalisation can favour long or short middles); without a suffix,
        the middle's own NLL per token."""
        return self.suffix_nll if self.suffix_tokens else self.middle_nll / max(self.length, 1)


@dataclass
class EditStats:
    prefix_tokens: int  # including <bos>
    suffix_tokens: int  # the whole suffix
    clamped_tokens: int  # suffix tokens the decoder saw in the canvas
    length: int  # tokens generated for the middle
    candidates: int  # lengths tried (1 without a search)
    forward_passes: int  # decoder passes, all candidates together
    scoring_passes: int  # causal passes spent scoring candidates
    wall_time_s: float


@dataclass
class EditResult:
    """The edited text. `text[start:end] == middle`; everything outside that span is the input, unchanged."""

    text: str | None  # prefix + middle + suffix (None for token-id input without a tokenizer)
    middle: str | None
    start: int  # character span of the middle in `text`
    end: int
    middle_ids: list[int]
    seed: int
    stats: EditStats
    candidates: list[Candidate] = field(default_factory=list)


@dataclass(frozen=True)
class DoneEvent:
    """A request is finished: `result` is its `GenerationResult` (an `EditResult` from editing)."""

    request: int
    result: GenerationResult | EditResult


Event = Union[StepEvent, CommitEvent, DoneEvent]
