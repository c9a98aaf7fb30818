"""Prompt logprobs on the torch runner's device: the logits rows of the prompt tokens that requests
asked to score (``_core.Scheduler.logit_rows``) give each next prompt token's raw logprob (a float64
``log_softmax``, as the Rust ``score_token``), its rank (1 + how many ids have a larger logit) and the
top logprobs (largest first, ties to the lower id); only those numbers cross to the host."""

from __future__ import annotations

import torch

from oxibonsai.runner import PromptScores

PromptRows = list[tuple[int, int, int, list[int], int]]
"""``(request key, start, first_row, targets, top)`` per run of prompt rows (``logit_rows``)."""


def score_prompt_rows(logits: torch.Tensor, prompt: PromptRows) -> PromptScores:
    """Scores every run of prompt rows of ``logits`` (the step's rows, in ``logits_indices`` order)."""
    scores: PromptScores = []
    for request, start, first, targets, top in prompt:
        rows = logits[first : first + len(targets)].double()
        ids = torch.tensor(targets, dtype=torch.long, device=rows.device)[:, None]
        logprobs = torch.log_softmax(rows, dim=-1)
        own = logprobs.gather(1, ids)[:, 0]
        rank = (rows > rows.gather(1, ids)).sum(dim=1) + 1
        top_values, top_ids = logprobs.topk(min(top, rows.shape[1]), dim=-1)
        own_h, rank_h = own.float().tolist(), rank.tolist()
        values_h, ids_h = top_values.float().tolist(), top_ids.tolist()
        # topk's order among equal values is unspecified: ties go to the lower id, as in Rust.
        row_scores = [
            (lp, r, sorted(zip(i, v, strict=True), key=lambda p: (-p[1], p[0])))
            for lp, r, i, v in zip(own_h, rank_h, ids_h, values_h, strict=True)
        ]
        scores.append((request, start, row_scores))
    return scores
