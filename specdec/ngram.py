"""Prompt-lookup proposals (n-gram drafting): no model, just the session's own tokens.

The longest suffix n-gram (n from n_max down to n_min) of the sequence that also occurs
earlier proposes the tokens that followed its most recent earlier occurrence. The
proposal is deterministic, i.e. a one-hot q, so the verifier checks it with the same
exact rejection sampler (accept with probability p(x), resample from p without x); it
pays off wherever the output copies the input: summaries, extraction, code edits.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def ngram_propose(tokens: Sequence[int], num_tokens: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """Up to `num_tokens` ids continuing `tokens`, or [] when no suffix n-gram recurs.

    Example:
        >>> ngram_propose([5, 6, 7, 8, 1, 5, 6], 3)
        [7, 8, 1]
    """
    if num_tokens <= 0 or n_min < 1 or n_max < n_min:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    length = seq.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = seq[length - n :]
        # windows[i] = seq[i : i + n] for every start i whose n-gram ends before the suffix does
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent earlier occurrence
            return seq[start : start + num_tokens].tolist()
    return []
