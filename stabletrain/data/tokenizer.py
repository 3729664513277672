"""Tokenizers: ``byte`` (vocab 256, always available) and ``gpt2`` (tiktoken, vocab 50257).

tiktoken downloads its BPE files on first use, which fails on an offline machine; the
error then says how to proceed instead of surfacing a network traceback.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from stabletrain.config import ConfigError

GPT2_VOCAB = 50257
# Prepared byte-level token files end each document with this byte: valid UTF-8 never
# contains it, so it cannot be mistaken for text (GPT-2's end-of-text token plays that role).
BYTE_EOT = 0xFF


def encode(text_bytes: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    """``(tokens, vocab_size)`` for raw UTF-8 bytes."""
    if name == "byte":
        return text_bytes, 256
    if name == "gpt2":
        enc = gpt2_encoding()
        ids = enc.encode_ordinary(text_bytes.tobytes().decode("utf-8", errors="replace"))
        return np.asarray(ids, dtype=np.uint16), GPT2_VOCAB
    raise ConfigError(f"data.tokenizer={name!r} is unknown; choose byte or gpt2")


class DocEncoder(NamedTuple):
    """Whole documents to token ids, for writing token files (``encode`` takes a batch)."""

    name: str
    vocab_size: int
    eot: int  # ends every document
    encode: Callable[[list], list[np.ndarray]]


def doc_encoder(name: str) -> DocEncoder:
    """``byte``: a document's UTF-8 bytes, unchanged; ``gpt2``: tiktoken's ids (text decoded as UTF-8)."""
    if name == "byte":
        def as_bytes(docs):
            return [np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), dtype=np.uint8) for d in docs]

        return DocEncoder("byte", 256, BYTE_EOT, as_bytes)
    if name == "gpt2":
        enc = gpt2_encoding(fallback="--tokenizer byte")

        def as_gpt2(docs):
            texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
            return [np.asarray(ids, dtype=np.uint32) for ids in enc.encode_ordinary_batch(texts)]

        return DocEncoder("gpt2", GPT2_VOCAB, enc.eot_token, as_gpt2)
    raise ConfigError(f"tokenizer {name!r} is unknown; choose byte or gpt2")


def gpt2_encoding(fallback: str = "data.tokenizer=byte"):
    try:
        import tiktoken

        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline: tiktoken raises connection errors of several kinds
        import os

        given = os.environ.get("TIKTOKEN_CACHE_DIR")
        where = (f"TIKTOKEN_CACHE_DIR={given} does not hold them (they are named by the SHA-1 of their URL, as "
                 f"tiktoken writes them online): copy them there from a machine that has run it" if given else
                 "set TIKTOKEN_CACHE_DIR to a folder holding them")
        raise ConfigError(
            f"tiktoken cannot load the gpt2 encoding ({type(e).__name__}); offline it needs its cached files: "
            f"{where}, or use {fallback}"
        ) from e
