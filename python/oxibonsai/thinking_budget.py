"""Thinking budgets: ``SamplingParams.thinking_token_budget`` (vLLM's name; llama.cpp's
``--reasoning-budget``, Anthropic's ``thinking.budget_tokens``) caps the tokens a request generates
inside its reasoning block. Once the block has that many, the engine forces the block's end token
(``</think>``): the next sampling row allows that id alone, so the model closes the block and goes on
to its answer, exactly as if it had closed it itself (the grammar of structured output, the reasoning
parser and stop strings all see an ordinary ``</think>``).

This module owns one request's count (``ThinkingBudget``): outside a block until the start token
(``<think>``) comes, or inside from the first token when the prompt opened the block (its last token
other than whitespace is ``<think>``, as Qwen3-2507's thinking templates end); each token inside counts
until the end token, natural or forced, after which nothing is counted (one block per request). A
budget of 0 closes a block as soon as it opens. The start and end tokens are the engine's reasoning
parser's, else Qwen3's (every Bonsai model is a Qwen3)."""

from __future__ import annotations

import numpy as np

from oxibonsai.structured_output import Reasoning


class ThinkingBudget:
    """One request's reasoning-token count against its budget, advanced by every token it takes."""

    def __init__(self, reasoning: Reasoning, budget: int, *, opened: bool, vocab_size: int) -> None:
        self._reasoning = reasoning
        self.budget = budget
        self.used = 0
        # "before" (no block yet) -> "inside" -> "after" (the block closed)
        self.phase = "inside" if opened else "before"
        self._vocab_size = vocab_size

    def accept(self, token: int) -> None:
        if self.phase == "before" and token == self._reasoning.start:
            self.phase = "inside"
        elif self.phase == "inside":
            if token == self._reasoning.end:
                self.phase = "after"
            else:
                self.used += 1

    @property
    def forcing(self) -> bool:
        """Whether the next token must be the end token: the block has used its budget."""
        return self.phase == "inside" and self.used >= self.budget

    @property
    def watching(self) -> bool:
        """Whether a later token may still be forced (a block may open, or is open)."""
        return self.phase != "after"

    def end_only(self) -> np.ndarray:
        """The int32 allow-bitmask of the end token alone."""
        mask = np.zeros((self._vocab_size + 31) // 32, dtype=np.uint32)
        end = self._reasoning.end
        mask[end // 32] = np.uint32(1 << (end % 32))
        return mask.view(np.int32)
