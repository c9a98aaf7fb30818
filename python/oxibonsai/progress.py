"""A progress bar on stderr for long ``LLM.generate`` batches, like vLLM's: prompts done, elapsed
time, and input/output tokens per second. On a terminal it redraws one line; otherwise it prints a
line at every tenth of the batch, so logs stay short."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from oxibonsai.outputs import RequestOutput

PROGRESS_MIN_PROMPTS = 16  # batches at least this long show the bar by default


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._printed_tenths = 0

    def update(self, out: RequestOutput) -> None:
        """Counts one finished request."""
        self.done += 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        tenths = self.done * 10 // max(self.total, 1)
        if self._tty or tenths > self._printed_tenths:
            self._printed_tenths = tenths
            self._write(self.line())

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        pct = 100 * self.done // max(self.total, 1)
        return (
            f"Processed prompts: {pct:3d}% {self.done}/{self.total} [{elapsed:.1f}s, "
            f"{self.done / elapsed:.2f} it/s, input: {self.prompt_tokens / elapsed:.1f} toks/s, "
            f"output: {self.output_tokens / elapsed:.1f} toks/s]"
        )

    def _write(self, text: str) -> None:
        end = "" if self._tty else "\n"
        prefix = "\r" if self._tty else ""
        self._stream.write(prefix + text + end)
        self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()
