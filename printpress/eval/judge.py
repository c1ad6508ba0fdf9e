"""Judge likelihood: how probable a continuation is under a model's causal (AR) head.

Scored per character, so judges and generators with different tokenizers can be compared.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def nll_per_char(judge, prompt: str, completion: str) -> float:
    """NLL (nats) per character of `completion` after `prompt`, under `judge` (a `Pipeline`) as an AR LM."""
    if not completion:
        return float("nan")
    tok = judge.tokenizer
    prompt_ids = [judge.generation_config.bos_token_id] + tok.encode(prompt, add_special_tokens=False).ids
    ids = prompt_ids + tok.encode(completion, add_special_tokens=False).ids
    limit = judge.config.text.max_position_embeddings
    if len(ids) > limit:
        raise ValueError(f"prompt + completion is {len(ids)} tokens, over the judge's limit of {limit}")
    cache = judge.model.new_cache(1, len(ids))
    logits = judge.model.encode(torch.tensor([ids]), cache)
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    targets = torch.tensor(ids[1:])
    token_nll = -logp[torch.arange(len(targets)), targets]
    return token_nll[len(prompt_ids) - 1 :].sum().item() / len(completion)
