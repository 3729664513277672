"""Tokenizers: ``byte`` (vocab 256, always available) and ``gpt2`` (tiktoken, vocab 50257).

tiktoken downloads its BPE files on first use, which fails on an offline machine; the
error then says how to proceed instead of surfacing a network traceback.
"""

from __future__ import annotations

import numpy as np

from stabletrain.config import ConfigError

GPT2_VOCAB = 50257


def encode(text_bytes: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    """``(tokens, vocab_size)`` for raw UTF-8 bytes."""
    if name == "byte":
        return text_bytes, 256
    if name == "gpt2":
        enc = gpt2_encoding()
        ids = enc.encode_ordinary(text_bytes.tobytes().decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=np.uint16), GPT2_VOCAB
    raise ConfigError(f"data.tokenizer={name!r} is unknown; choose byte or gpt2")


def gpt2_encoding():
    try:
        import tiktoken

        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline: tiktoken raises connection errors of several kinds
        raise ConfigError(
            f"tiktoken cannot load the gpt2 encoding ({type(e).__name__}); offline it needs its cached files: "
            "set TIKTOKEN_CACHE_DIR to a folder holding them, or use data.tokenizer=byte"
        ) from e
