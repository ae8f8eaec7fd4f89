"""Token-count buckets: a few computed-token counts serve every mask, so captured steps are reused.

Why: a CUDA graph replays fixed shapes (``workers/engine/graphs.py``). A masked job's shapes are
its computed-token count per level, which differs with every mask, so with exact counts a graph
serves only the batch it was captured for and a job joining or leaving always costs a new capture.
Rounded up to a bucket, a new job whose counts fall in the same buckets as a finished one's
replays the graph already captured.

How: buckets grow by ``GROWTH`` (at most that much padded work: about half of it on average),
aligned to ``ALIGN`` tokens (whole tensor-core tiles). The last bucket of a level is one token
short of the level: a count rounded up to the whole level would compute the unmasked tokens fresh
instead of taking the template's, which changes what an edit computes. A count is padded by
repeating its last token index: the repeated token is computed twice from the same inputs, so its
rows are identical and scattering them writes the same values; queries never change the keys
(every key comes from the job's cache with its fresh tokens written in), so what the real tokens
compute is unchanged.
"""

from __future__ import annotations

import torch

GROWTH = 1.25
ALIGN = 16


def _round_up(x: float, align: int) -> int:
    return int(-(-x // align) * align)


def bucket_range(count: int, total: int) -> tuple[int, int]:
    """(lowest count, bucket) of the bucket holding ``count`` computed tokens out of ``total``:
    every count in ``[lowest, bucket]`` is padded to ``bucket``."""
    if count <= 0:
        return 0, 0
    if count >= total:
        return total, total
    prev, b = 0, ALIGN
    while b < count:
        prev, b = b, max(b + ALIGN, _round_up(b * GROWTH, ALIGN))
    return prev + 1, min(b, total - 1)


def token_bucket(count: int, total: int) -> int:
    """The computed-token count a job with ``count`` masked tokens out of ``total`` is padded to."""
    return bucket_range(count, total)[1]


def padded(indices: torch.Tensor, size: int) -> torch.Tensor:
    """``indices`` (sorted, non-empty) padded to ``size`` by repeating the last: still sorted."""
    short = size - int(indices.numel())
    if short <= 0:
        return indices
    return torch.cat([indices, indices[-1:].expand(short)])


__all__ = ["ALIGN", "GROWTH", "bucket_range", "padded", "token_bucket"]
