"""Autoregressive decoding: the encoder as a causal LM.

Encode the prompt, take the last position's logits, pick a token (argmax at temperature 0, else a sample of
softmax(logits / temperature), optionally limited to the top k), encode that token, repeat until EOS or
`max_new_tokens`. A batch is left padded into one cache, each row's positions starting at its first real
token; rows that finish are dropped from the cache (`KVCache.select`). A request that asks for log-probabilities
(`Request.logprobs`) gets, per token, log_softmax of the same raw logits and their top k (`token_logprob`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from printpress.events import CommitEvent, Decode, Event
from printpress.request import Request, RequestState, model_device
from printpress.sampling import sample_next_token, token_logprob


@torch.no_grad()
def autoregressive(model: torch.nn.Module, requests: Sequence[Request], decode: Decode | None) -> Iterator[Event]:
    """Every request of a call decoded as one batch, request i's events carrying i."""
    device = model_device(model)
    started = time.perf_counter()
    rows = [RequestState.start(i, r, device, r.settings.max_new_tokens, started) for i, r in enumerate(requests)]
    ids, mask = _left_pad(rows, _pad_id(model, rows), device)
    cache = model.new_cache(len(rows), ids.shape[1] + max(row.budget for row in rows))
    # Where every row is greedy and none asks for log-probabilities, the passes give only their argmax.
    greedy = all(row.settings.temperature == 0 and row.logprobs is None for row in rows)
    logits = model.encode(ids, cache, attention_mask=mask, logits="last", argmax=greedy)
    while True:
        keep: list[int] = []
        next_ids: list[int] = []
        tokens = logits[:, -1].tolist() if greedy else None
        for position, row in enumerate(rows):
            token = tokens[position] if greedy else sample_next_token(logits[position, -1], row.settings, row.generator)
            row.forward_passes += 1
            row.commit([token])
            logprobs = None
            if row.logprobs is not None:  # asked for (Request.logprobs): the default path computes nothing more
                logprobs = [token_logprob(logits[position, -1], token, row.request.logprobs)]
                row.logprobs.extend(logprobs)
            yield CommitEvent(row.index, len(row.tokens) - 1, [token], row.text_delta(decode), row.finished, logprobs)
            if row.finished:
                yield row.done("ar", decode)
            else:
                keep.append(position)
                next_ids.append(token)
        if not keep:
            return
        if len(keep) < len(rows):
            cache.select(torch.tensor(keep, dtype=torch.long, device=device))
            rows = [rows[k] for k in keep]
        step_ids = torch.tensor(next_ids, dtype=torch.long, device=device)[:, None]
        logits = model.encode(step_ids, cache, logits="last", argmax=greedy)


def _left_pad(rows: list[RequestState], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    longest = max(len(r.request.prompt_ids) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        prompt = row.request.prompt_ids
        ids[i, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, longest - len(prompt):] = True
    # A batch without padding passes no mask, like a single reference prompt.
    return ids, (None if bool(mask.all()) else mask)


def _pad_id(model: torch.nn.Module, rows: list[RequestState]) -> int:
    pad = rows[0].settings.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)
