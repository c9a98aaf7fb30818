"""What generation returns, shaped like vLLM's outputs: ``RequestOutput`` holds the prompt and one
``CompletionOutput`` per sample; ``RequestMetrics`` the timings (queue time, time to first token, time
per output token, tokens/s)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token (from the raw logits), its rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence. ``text`` never contains a matched stop string (unless asked for)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds of ``time.perf_counter`` (durations) or derived rates."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """From arrival to the first time the scheduler ran the request."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        """From arrival to the first generated token (queueing plus prefill)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens per second of prefill (from first scheduling to the first token)."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        elapsed = self.first_token_time - self.first_scheduled_time
        return self.num_prompt_tokens / elapsed if elapsed > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens after the first, per second after the first token."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        elapsed = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / elapsed if elapsed > 0 else None

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between generated tokens after the first: the inverse of ``decode_tokens_per_s``."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state: the prompt, its completions so far, whether it is finished, and timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None)
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first (nothing
    comes before it), then the token's raw logprob and rank and the top logprobs at its position;
    set once the prompt is computed."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (not computed for this request)."""


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's name): its pooled, by default L2-normalized, final hidden state."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The output of ``LLM.embed`` for one prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
