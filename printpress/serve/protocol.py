"""The wire format: pydantic models of the OpenAI-compatible requests and responses, and printpress's extensions.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions` schemas for the fields printpress can
honour, and forbid every other field, so a typo is a 400 that names the field instead of being silently ignored.
Fields that stock clients send on every request but printpress cannot honour (`top_p`, the penalties,
`logit_bias`, `best_of`) are accepted at the one value that asks for nothing (`NEUTRAL`: top_p 1, penalties 0, ...)
and refused, naming the field, at any other. `logprobs` (and chat's `top_logprobs`) are honoured in AR mode
(`CompletionLogprobs`, `ChatLogprobs`) and refused, naming the mode, in the others. The sampler settings are extra top-level fields (`steps`,
`entropy_bound`, `t_min`, `t_max`, ...), which the openai client sends with `extra_body={...}`: one field per entry
of `printpress.settings.SETTINGS` (its wire name, bounds and description), shared by the completion and edit
requests (`SamplingRequest`), each of which turns itself into engine settings (`sampler_overrides`). The same
entries, with the served model's defaults, are listed as data by GET /v1/settings (`setting_list`), from which the
web page draws its settings.

Types are strict (pydantic's strict mode): "5" or 5.0 is not an integer, 1 is not a boolean, `true` is not a
token id, so a client's mistake is a 400 naming the field rather than a guess. Every string, however deep,
must be whole Unicode: JSON can carry a lone surrogate ("\\ud800"), which no tokenizer takes.

Value ranges that are the same for every deployment are checked here (pydantic); limits that are settings
of the server (longest output, longest prompt) and checks that need the model (vocabulary, temperature
schedule) are made by the app, which answers with the same error shape.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from printpress.errors import GenerationError
from printpress.settings import EDITING, SETTINGS, SamplerSettings, Setting, from_wire, refuse_canvas_steps

MAX_SEED = 2**64 - 1
MAX_STOP_SEQUENCES = 4
MAX_PROMPTS = 16  # prompts in one /v1/completions request (each takes its own scheduler slot)
MAX_CHOICES = 16  # choices in one request: prompts x n (each choice takes its own scheduler slot)
MAX_LOGPROBS = 5  # completions' `logprobs`: most likely tokens listed per position (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs` (OpenAI's bound)
LOGPROBS_HELP = ("Mode ar: return each generated token's log-probability, log_softmax of the model's raw logits "
                 "(before temperature and top_k). Refused in modes diffusion and speculative.")

# OpenAI fields printpress cannot honour, with the value that asks for nothing (accepted: clients send it on every
# request) and why any other value is refused.
NEUTRAL = {
    "top_p": (1, "printpress has no nucleus sampling (top_k cuts the tail in modes ar and speculative)"),
    "presence_penalty": (0, "printpress applies no penalties"),
    "frequency_penalty": (0, "printpress applies no penalties"),
    "logit_bias": ({}, "printpress does not bias logits"),
    "best_of": (1, "printpress does not rank candidates; n gives several choices"),
}


def _only(*values) -> dict:
    """The OpenAPI document lists the values accepted (so generated clients and fuzzers send those)."""
    return {"enum": [*values, None]}


def _neutral(field: str, value):
    """`value` if it asks for nothing (None or the field's neutral value), else a ValueError naming what to send."""
    neutral, why = NEUTRAL[field]
    if value is None or value == neutral:
        return value
    shown = "null" if neutral is None else json.dumps(neutral)
    raise ValueError(f"{json.dumps(value)} cannot be honoured: {why}; send {shown} or leave it out")


class _Strict(BaseModel):
    """A request (part): unknown fields refused, strict types, whole Unicode strings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _whole_unicode(cls, value):
        _refuse_lone_surrogates(value)
        return value


def _refuse_lone_surrogates(value) -> None:
    """A string (or a list holding strings) with a lone surrogate is refused: it is not text, and the tokenizer,
    the template or the JSON answer would fail on it with a 500."""
    if isinstance(value, list):
        for item in value:
            _refuse_lone_surrogates(item)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send one more chunk, with empty choices, carrying usage.")


class SamplingRequest(_Strict):
    """What every generating request shares (completions, chat, edits): the model, the seed, and the sampler
    settings the route takes (one field per setting, `with_settings`), which the request turns into engine
    settings itself (`sampler_overrides`)."""

    model: str | None = Field(None, description="The served model's id (GET /v1/models). Optional: one model is served.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed, same settings, same input: same output.")

    def sampler_overrides(self) -> dict[str, object]:
        """The sampler settings given, as `Pipeline.settings` keywords (a setting left out keeps the checkpoint's)."""
        fields = type(self).model_fields
        return from_wire({s.wire: getattr(self, s.wire) for s in SETTINGS if s.http is not None and s.wire in fields})


def with_settings(name: str, base: type[SamplingRequest], settings: Iterable[Setting]) -> type[SamplingRequest]:
    """`base` with an optional field per HTTP setting of `settings`: its wire name, bounds and description (None, the
    default, keeps the checkpoint's value)."""
    fields = {}
    for s in settings:
        if s.http is not None:
            kind = Literal[s.choices] if s.choices else s.kind
            fields[s.wire] = (kind | None, Field(None, description=s.description, **s.http))
    return create_model(name, __base__=base, __module__=__name__, **fields)


# The diffusion sampler's settings, which every route takes (editing is diffusion only), then the rest.
EditSampling = with_settings("EditSampling", SamplingRequest, EDITING)
Sampling = with_settings("Sampling", EditSampling, (s for s in SETTINGS if not s.editing))


class GenerationFields(Sampling):
    """Fields shared by both OpenAI endpoints: the sampler settings (`Sampling`), OpenAI's, and printpress's
    extensions."""

    stream: bool = Field(False, description="Answer with server-sent events in OpenAI's chunk format.")
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP_SEQUENCES} strings; the text ends before the first one generated."
    )
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Choices per prompt; choice i uses seed + i.")
    user: str | None = Field(None, max_length=256, description="Accepted for compatibility; not used or logged.")
    # Sent by stock clients; only their neutral values are accepted (NEUTRAL).
    top_p: float | None = Field(None, ge=0, le=1, description="Only 1 (no nucleus sampling).",
                                json_schema_extra=_only(1))
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 (no penalties).",
                                           json_schema_extra=_only(0))
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 (no penalties).",
                                            json_schema_extra=_only(0))
    logit_bias: dict[str, float] | None = Field(None, description="Only {} (no bias).", json_schema_extra=_only({}))
    # printpress's extension: the step stream.
    stream_steps: bool = Field(
        False,
        description="With stream=true, also send every denoising step's canvas as `event: printpress.step` "
        "and every committed canvas as `event: printpress.commit` (see docs/server.md).",
    )

    @field_validator("top_p", "presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _only_neutral(cls, value, info):
        return _neutral(info.field_name, value)


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description=f"Text, token ids, or a list of up to {MAX_PROMPTS} of either."
    )
    max_tokens: int | None = Field(None, ge=1, description="New tokens at most (default: the checkpoint's max_new_tokens).")
    echo: bool = Field(False, description="Put the prompt text before the completion.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=LOGPROBS_HELP + " The number is how many of "
                                 "the most likely tokens to list per position (the generated one is always listed).")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Only 1 (use n for several choices).",
                                json_schema_extra=_only(1))

    @field_validator("best_of")
    @classmethod
    def _only_neutral_here(cls, value, info):
        return _neutral(info.field_name, value)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64, description="The speaker's name (the plain template uses it); no "
                             "':', line breaks or control characters.")

    @field_validator("name")
    @classmethod
    def _speaker_label(cls, name: str | None) -> str | None:
        """The plain template writes the name as the speaker label ("NAME: text"), so a line break or a ':' in it
        could forge a turn (the name "X: hi\\n\\nASSISTANT" would put words in the assistant's mouth); such names,
        and control or format characters (zero-width, bidi), are refused."""
        if name is not None and any(map(_breaks_a_label, name)):
            raise ValueError("a name may not contain ':', line breaks or control characters: it becomes the speaker "
                             "label of the chat template")
        return name


def _breaks_a_label(char: str) -> bool:
    """':', a control, format or private character, or a line or paragraph separator."""
    return char == ":" or unicodedata.category(char)[0] == "C" or unicodedata.category(char) in ("Zl", "Zp")


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description=LOGPROBS_HELP)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs=true: how many of "
                                     "the most likely tokens to list per position.")


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Stats(BaseModel):
    """printpress's figures for one choice (the field `printpress` of a response)."""

    mode: str
    seed: int
    canvases: int
    denoising_steps: int
    forward_passes: int
    tokens_per_forward: float
    wall_time_s: float
    tokens_per_second: float
    finish_reason: str = Field(description="The engine's: eos or length (before stop sequences and max_tokens).")


class CompletionLogprobs(BaseModel):
    """Legacy completions' `logprobs` (mode ar): one entry per generated token in each list. `tokens` join to the
    choice's text (a token holding part of a character is "" and the one completing it holds the character);
    `top_logprobs` maps the most likely tokens' text to their log-probability, the generated token's included."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] = Field(description="Where each token's text starts in the choice's text, in code points.")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    printpress: list[Stats | None] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="The token's UTF-8 bytes, also when they are part of a character.")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The top_logprobs most likely tokens, most likely first.")


class ChatLogprobs(BaseModel):
    """Chat's `logprobs` (mode ar): one entry per generated token; the `token`s join to the message's content."""

    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    printpress: list[Stats | None] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    printpress: list[Stats | None] | None = None


class StepPayload(BaseModel):
    """`event: printpress.step`: one denoising step of one choice's canvas.

    `argmax` is the canvas as it would be committed now; `tokens` is what the next step sees: the accepted
    positions keep their sample, every other position was re-noised with a uniformly random token.
    `argmax_text` and `tokens_text` hold each position's token as text (special tokens included).
    """

    object: Literal["printpress.step"] = "printpress.step"
    id: str
    index: int
    canvas: int
    step: int
    max_steps: int
    accepted: list[bool]
    argmax: list[int]
    tokens: list[int]
    argmax_text: list[str]
    tokens_text: list[str]
    stopped: bool


class CommitPayload(BaseModel):
    """`event: printpress.commit`: a canvas (or an AR token) was appended to one choice's output."""

    object: Literal["printpress.commit"] = "printpress.commit"
    id: str
    index: int
    canvas: int
    token_ids: list[int]
    text: str = Field(description="The text this commit added to the choice (after max_tokens and stop).")
    finished: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "printpress"
    canvas_length: int
    max_position_embeddings: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SettingInfo(BaseModel):
    """One sampler setting of the HTTP API, as a form draws it (GET /v1/settings; the page builds its fields from
    these). Everything is derived from its `printpress.settings.Setting` and the served model."""

    name: str = Field(description="The request field (the setting's wire name).")
    kind: str = Field(description="The value's JSON type, as Python names it: int, float, bool or str.")
    help: str = Field(description="What it does, in one sentence (as the field's description in this document).")
    modes: list[str] = Field(description="The modes whose requests take it; given for another mode, it is refused.")
    editing: bool = Field(description="POST /v1/edits takes it too.")
    choices: list[str] | None = Field(description="The values allowed, for a setting that names one of a few.")
    default: bool | int | float | str | None = Field(
        description="The served model's value when the field is left out (its generation_config.json, else the "
                    "engine's); null when it has none of its own.")
    mode_defaults: dict[str, bool | int | float | str] | None = Field(
        description="What leaving the field out means in the modes where that differs from `default` (temperature "
                    "in mode diffusion: 1, the schedule as set); null when it is `default` in every mode.")
    min: int | float | None = Field(description="The lowest value accepted (exclusive for some settings: the "
                                                "server's message says so).")
    max: int | float | None = Field(description="The highest value accepted (by this server: step counts are capped "
                                                "by `printpress serve --max-steps`).")
    step: int | None = Field(description="1 for integers; null: any value between min and max.")


class SettingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SettingInfo]


def setting_list(defaults: SamplerSettings, max_steps: int) -> SettingList:
    """Every setting with an HTTP field, as `SettingInfo`: `defaults` are the served model's settings
    (`Pipeline.default_settings`), `max_steps` the server's cap on step counts."""
    data = []
    for s in SETTINGS:
        if s.http is None:
            continue
        low = s.http.get("ge", s.http.get("gt"))
        high = s.http.get("le")
        if s.step_count:
            high = max_steps if high is None else min(high, max_steps)
        data.append(SettingInfo(
            name=s.wire, kind=s.kind.__name__, help=s.description, modes=list(accepted_modes(s)), editing=s.editing,
            choices=list(s.choices) or None, default=getattr(defaults, s.name, s.default),
            mode_defaults=dict(s.mode_defaults) or None, min=low, max=high,
            step=1 if s.kind is int else None))
    return SettingList(data=data)


def accepted_modes(s: Setting) -> tuple[str, ...]:
    """The modes whose requests take the setting's HTTP field: those that read it, less those where the routes refuse
    the `steps` field anyway (`refuse_canvas_steps`: in mode speculative, whose drafts have `draft_steps`)."""

    def refused(mode: str) -> bool:
        try:
            refuse_canvas_steps(mode, 1)
        except GenerationError:
            return True
        return False

    return s.modes if s.wire != "steps" else tuple(mode for mode in s.modes if not refused(mode))


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    active: int = Field(description="Requests being generated now.")
    queued: int = Field(description="Requests waiting for a slot.")


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# ------------------------------------------------------------------------------------------------
# printpress's edit extension: POST /v1/edits (infill between two texts, or rewrite a span in place)
# ------------------------------------------------------------------------------------------------

MAX_EDIT_LENGTHS = 8  # candidate lengths in one edit's length search (each is a whole denoising run)


class EditRequest(EditSampling):
    """Either `text` + `span` (rewrite `text[span[0]:span[1]]`) or `prefix` and/or `suffix` (infill between)."""

    text: str | None = Field(None, description="Rewrite: the whole text; `span` names the part to regenerate.")
    span: list[int] | None = Field(
        None, min_length=2, max_length=2,
        description="Rewrite: [start, end) in Unicode code points of `text` (not UTF-16 units, not bytes).",
    )
    prefix: str | None = Field(None, description="Infill: the text before the middle.")
    suffix: str | None = Field(None, description="Infill: the text after the middle.")
    length: int | list[int] | None = Field(
        None, description="Tokens of the new middle (at most the canvas length), or a list of up to "
        f"{MAX_EDIT_LENGTHS} lengths to search. Default: rewrite keeps the span's token count, infill searches a few.",
    )
    suffix_window: int | None = Field(
        None, ge=0, le=4096, description="Suffix tokens clamped into the canvas (default: what fills the trained canvas)."
    )
    stream: bool = Field(False, description="Answer with server-sent events (the result as the last data event).")
    stream_steps: bool = Field(
        False, description="With stream=true, also send every denoising step of the span as `event: printpress.step` "
        "and the chosen middle as `event: printpress.commit` (see docs/server.md).",
    )


class EditStats(BaseModel):
    prefix_tokens: int = Field(description="Tokens before the middle, <bos> included.")
    suffix_tokens: int = Field(description="Tokens after the middle.")
    clamped_tokens: int = Field(description="Suffix tokens the decoder saw, clamped in the canvas behind the span.")
    length: int = Field(description="Tokens generated for the middle.")
    candidates: int = Field(description="Lengths tried (1 without a search).")
    forward_passes: int = Field(description="Decoder passes, all candidates together.")
    scoring_passes: int = Field(description="Causal passes spent scoring the candidates of a length search.")
    wall_time_s: float
    tokens_per_second: float = Field(description="length / wall_time_s.")


class EditCandidate(BaseModel):
    """One length of a length search: its middle and the score it was chosen by (lower is better)."""

    length: int
    seed: int
    middle_ids: list[int]
    middle: str | None
    middle_nll: float = Field(description="Summed NLL (nats) of the middle after the prefix, under the causal head.")
    suffix_nll: float = Field(description="Summed NLL of the scored suffix tokens after prefix + middle.")
    suffix_tokens: int = Field(description="Suffix tokens scored (the first canvas_length).")
    forward_passes: int
    score: float = Field(description="suffix_nll (the same text for every candidate); without a suffix, the "
                                     "middle's NLL per token.")


class EditResponse(BaseModel):
    """`text[start:end] == middle`; everything outside [start, end) is the input, unchanged."""

    id: str
    object: Literal["printpress.edit"] = "printpress.edit"
    created: int
    model: str
    text: str
    middle: str
    start: int = Field(description="Where the middle starts in `text`, in code points.")
    end: int = Field(description="Where it ends (exclusive), in code points.")
    middle_ids: list[int]
    seed: int = Field(description="The request's seed (drawn when not given); candidate i of a length search used "
                      "seed + i.")
    stats: EditStats
    candidates: list[EditCandidate] = Field(description="Every candidate of a length search (empty without one).")


class EditStepPayload(StepPayload):
    """`event: printpress.step` of an edit: the span being denoised (its positions only; the `clamped` suffix
    tokens behind it in the canvas never change). `canvas` is the candidate's index in a length search."""

    span: int = Field(description="Positions of the span (the middle's length in tokens).")
    clamped: int = Field(description="Suffix tokens clamped in the canvas behind the span.")
