"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the
request's last n tokens, for n from max_n down to min_n.

Pure host code over the request's prompt + output token ids; it keeps no per-request state, so
it never needs cleaning up. It must not import jax: the scheduler calls it while planning.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], max_num: int) -> tuple[int, ...]:
        """Up to max_num proposed next tokens; () when no n-gram of the suffix recurs.

        Longer n-grams are tried first (a more specific match). Among matches the latest one
        wins. A continuation that runs into the suffix itself repeats with the match's period
        (for "a b c a b c a b", the last "a b" recurs 3 tokens back: propose "c a b c ...").
        """
        if max_num <= 0:
            return ()
        ids = np.asarray(token_ids, dtype=np.int64)  # [L]
        length = len(ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start at s <= L-1-n: every one is followed by at least one token.
            windows = sliding_window_view(ids[:length - 1], n)  # [L-n, n]
            hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
            if hits.size == 0:
                continue
            start = int(hits[-1]) + n          # first token after the match
            period = length - start            # distance from the match to the suffix
            out = ids[start:start + max_num].tolist()
            while len(out) < max_num:
                out.append(out[len(out) - period])
            return tuple(out)
        return ()
