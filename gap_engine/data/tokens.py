"""Text to token ids in bounded memory: long documents cut into pieces before a space, tokenized
batch by batch into one int64 stream with a separator token between documents.

Used by ``windows`` (the calibration and held-out windows) and its token-count check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from gap_engine.core.errors import DataError
from gap_engine.data.bos import Tokenizer

TokenStream: TypeAlias = npt.NDArray[np.int64]  # (L,) token ids of documents joined by separators

# Characters per tokenizer call. A fast tokenizer holds ~100 bytes of bookkeeping per token
# (offsets, masks, Python ints) until the call returns: one 50 MB line took 5 GB in one call.
# Pieces of at most this size keep that to tens of MB, whatever the shape of the text.
TOKENIZE_PIECE_CHARS = 1 << 20
# Characters per tokenizer call, pieces of several documents together (a fast tokenizer runs a
# batch in parallel); measured on a 50 MB line: 1 MiB per call +50 MB, 8 MiB +350 MB.
TOKENIZE_BATCH_CHARS = 1 << 20


def split_long_text(text: str, limit: int | None = None) -> list[str]:
    """``text`` in pieces of at most ``limit`` characters, each cut just before a space.

    Byte-level BPE tokenizers (Llama, SmolLM2, Qwen) start a word with its space and merge
    nothing across words, so the pieces' ids are the whole text's; a tokenizer that merges
    across spaces (SentencePiece-style) may differ at a cut, once per ``limit`` characters.
    A stretch with no space in the last half of a piece is cut at the limit (default
    TOKENIZE_PIECE_CHARS).
    """
    limit = limit or TOKENIZE_PIECE_CHARS
    pieces = []
    start = 0
    while len(text) - start > limit:
        cut = text.rfind(" ", start + limit // 2, start + limit)
        if cut <= start:
            cut = start + limit
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _piece_batches(docs: Sequence[str]) -> Iterable[list[tuple[int, str]]]:
    """(document index, piece) lists of at most ~TOKENIZE_BATCH_CHARS characters, in order."""
    batch: list[tuple[int, str]] = []
    size = 0
    for index, doc in enumerate(docs):
        for piece in split_long_text(doc):
            if batch and size + len(piece) > TOKENIZE_BATCH_CHARS:
                yield batch
                batch, size = [], 0
            batch.append((index, piece))
            size += len(piece)
    if batch:
        yield batch


def tokenize_stream(tokenizer: Tokenizer, texts: Sequence[str]) -> TokenStream:
    """One token stream for all documents, separator tokens between them. (L,) int64.

    Long documents are tokenized in pieces (``split_long_text``) and the ids kept as int64
    arrays batch by batch, so memory stays near 8 bytes per token plus one batch's work.
    """
    docs = [text for text in texts if text and text.strip()]
    if not docs:
        raise DataError("no text to tokenize")
    if tokenizer.eos_token_id is not None:
        separator = np.asarray([int(tokenizer.eos_token_id)], dtype=np.int64)
    else:
        separator = np.asarray(tokenizer("\n\n", add_special_tokens=False)["input_ids"], dtype=np.int64)
    # Same ids as tokenizing the EOS-joined text, since nothing merges across a special token.
    parts: list[npt.NDArray[np.int64]] = []
    last_doc = 0
    for batch in _piece_batches(docs):
        encoded = tokenizer([piece for _, piece in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for (index, _), ids in zip(batch, encoded):
            if index != last_doc:  # the first piece of the next document
                parts.append(separator)
                last_doc = index
            parts.append(np.asarray(ids, dtype=np.int64))
        del encoded
    return np.concatenate(parts)
