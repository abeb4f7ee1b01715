"""The window convention: whether a model reads text after a beginning-of-sequence token.

A model reads a window the way it was trained to read a document. Gemma (and Llama 3,
Mistral) always saw a BOS token first and degrade badly without one (Gemma 3 270M:
held-out perplexity 233 without, 30 with); SmolLM2 and Qwen never add one. The tokenizer's
own ``encode`` says which: it prepends BOS exactly when the model expects it. ``data``
puts the token in front of every window; the counting code (losses, KL, activation
statistics) asks :func:`text_start` where the text begins.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import torch

WINDOW_STARTS = ("bos", "text")  # the two conventions, as tables and reports name them
_BOS_PROBE = "The text begins here."
# A Hugging Face tokenizer, fast or slow. Typed Any: the stages only call it on text and read
# a few attributes (bos_token_id, eos_token_id), and the two tokenizer families share no base
# class that declares those calls precisely.
Tokenizer: TypeAlias = Any
_bos_memo: weakref.WeakKeyDictionary[object, int | None] = weakref.WeakKeyDictionary()


def bos_token_id(tokenizer: Tokenizer) -> int | None:
    """The token every window starts with, or None when the model reads text without one.

    A model expects it when its tokenizer's own encoding of a text (special tokens on)
    begins with the tokenizer's BOS token, which plain text never encodes to.

    Args:
        tokenizer: a Hugging Face tokenizer.
    Returns:
        The BOS token id, or None.
    """
    try:
        return _bos_memo[tokenizer]
    except (KeyError, TypeError):
        pass
    bos = getattr(tokenizer, "bos_token_id", None)
    found = None
    if bos is not None:
        encoded = list(tokenizer(_BOS_PROBE)["input_ids"])
        plain = list(tokenizer(_BOS_PROBE, add_special_tokens=False)["input_ids"])
        if encoded[:1] == [int(bos)] and plain[:1] != [int(bos)]:
            found = int(bos)
    try:
        _bos_memo[tokenizer] = found
    except TypeError:  # not weak-referenceable: probed again next time
        pass
    return found


def window_start(tokenizer: Tokenizer) -> str:
    """'bos' when windows for this tokenizer's model start with its BOS token, else 'text'."""
    return "bos" if bos_token_id(tokenizer) is not None else "text"


def text_start(tokenizer: Tokenizer, windows: torch.Tensor) -> int:
    """Leading positions of every window that hold no text (1 for a BOS token, else 0).

    Losses, KLs and activation statistics count positions from here on: the BOS token is
    never a prediction target, and the prediction made from BOS alone (before any text)
    is not counted either, so both conventions score the same text tokens.

    Args:
        tokenizer: the model's tokenizer.
        windows: (N, T) token ids built by this module (or any ids: windows that do not
            all start with the model's BOS token have no leading non-text position).
    """
    bos = bos_token_id(tokenizer)
    if bos is None or windows.ndim != 2 or windows.shape[1] < 2:
        return 0
    return int(bool((windows[:, 0] == bos).all()))


def with_bos(tokenizer: Tokenizer, windows: torch.Tensor) -> torch.Tensor:
    """The windows with the model's BOS token in front when it expects one: (N, T) -> (N, 1 + T)."""
    import torch  # here, not at the top: the cache's no-load lookup reads `window_start`'s names without torch

    bos = bos_token_id(tokenizer)
    if bos is None:
        return windows
    column = torch.full((windows.shape[0], 1), bos, dtype=windows.dtype)  # (N, 1)
    return torch.cat([column, windows], dim=1)  # (N, 1 + T)


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """(B, T-1-start) cross entropy of every counted next token: the targets at positions
    start+1..T-1, each predicted from the position before it (``start`` = :func:`text_start`,
    so neither BOS nor the prediction made from BOS alone counts). Logits are taken as given;
    callers widen them first where they need to."""
    import torch

    batch, vocab = input_ids.shape[0], logits.shape[-1]
    per_token = torch.nn.functional.cross_entropy(
        logits[:, start:-1].reshape(-1, vocab), input_ids[:, start + 1 :].reshape(-1), reduction="none"
    )
    return per_token.view(batch, -1)
