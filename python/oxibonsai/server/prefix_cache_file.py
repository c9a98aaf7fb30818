"""``--prefix-cache-file``: the server's prefix cache kept across restarts. The blocks saved at the
last shutdown are loaded when the engine starts (a missing file is a first start; a file for another
model or corrupt one is logged and skipped, never a failed start), and the cache is saved when the
server shuts down, after the drain."""

from __future__ import annotations

import logging
import os

from oxibonsai.async_llm import AsyncLLM

log = logging.getLogger("oxibonsai.server")


def load_saved_cache(engine: AsyncLLM, path: str) -> int:
    """Loads the blocks saved in ``path`` into ``engine``; how many (0 when nothing was loaded)."""
    if not os.path.exists(path):
        log.info("no prefix-cache file at %s yet: starting with an empty cache", path)
        return 0
    try:
        loaded = engine.load_prefix_cache(path)
    except (OSError, ValueError, NotImplementedError) as error:
        log.warning("the prefix-cache file was not loaded: %s", error)
        return 0
    log.info("loaded %d cached blocks from %s", loaded, path)
    return loaded


def save_cache(engine: AsyncLLM, path: str) -> int:
    """Saves ``engine``'s cached blocks to ``path``; how many (0 after a logged failure)."""
    try:
        saved = engine.save_prefix_cache(path)
    except (OSError, ValueError, NotImplementedError) as error:
        log.warning("the prefix cache was not saved: %s", error)
        return 0
    log.info("saved %d cached blocks to %s", saved, path)
    return saved
