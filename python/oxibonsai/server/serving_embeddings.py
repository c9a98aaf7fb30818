"""``/v1/embeddings``: OpenAI's embeddings over ``AsyncLLM.embed`` (the model's pooling, L2-normalized;
see ``oxibonsai.embedding``). Inputs are tokenized in a worker thread, cut by vLLM's
``truncate_prompt_tokens`` if given, and checked against the context (vLLM's wording) before any is
computed; ``encoding_format: "base64"`` sends each vector as its little-endian float32 bytes, as OpenAI
does. A deployment whose engine has no ``embed`` (the Ray scale-out's) answers 501."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from oxibonsai.async_llm import AsyncLLM
from oxibonsai.sampling_params import truncated
from oxibonsai.server.config import ServerConfig
from oxibonsai.server.errors import APIError
from oxibonsai.server.openai_format import created, response_id
from oxibonsai.server.protocol import EmbeddingRequest


class EmbeddingServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config

    async def respond(self, req: EmbeddingRequest) -> dict[str, Any]:
        embed = getattr(self._engine, "embed", None)
        if embed is None:
            raise APIError(501, "this deployment does not serve embeddings")
        prompts = await asyncio.to_thread(self._token_ids, req)
        outputs = await embed(prompts)
        width = len(outputs[0].outputs.embedding)
        if req.dimensions is not None and req.dimensions != width:
            raise APIError(400, f"dimensions must be the model's, {width}, or left out", param="dimensions")
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(out.outputs.embedding, req.encoding_format),
            }
            for i, out in enumerate(outputs)
        ]
        tokens = sum(len(p) for p in prompts)
        return {
            "id": response_id("embd"),
            "object": "list",
            "created": created(),
            "model": self._config.served_model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def _token_ids(self, req: EmbeddingRequest) -> list[list[int]]:
        tokenizer, limit = self._engine.tokenizer, self._engine.max_model_len
        prompts = []
        for i, item in enumerate(req.inputs()):
            ids = (
                tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                if isinstance(item, str)
                else item
            )
            if not ids:
                raise APIError(400, f"input[{i}] has no tokens", param="input")
            ids = truncated(ids, req.truncate_prompt_tokens, limit)
            if len(ids) > limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, input[{i}] has "
                    f"{len(ids)} tokens. Please reduce the length of the input.",
                    param="input",
                )
            prompts.append(ids)
        return prompts


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
