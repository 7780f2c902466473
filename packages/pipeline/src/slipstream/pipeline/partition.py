"""Split a list of layer weights into contiguous parts of balanced total weight."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_partition", "uniform_partition"]


def uniform_partition(num_items: int, num_parts: int) -> list[int]:
    """Boundaries splitting ``num_items`` into ``num_parts`` parts whose sizes differ by ≤ 1.

    Returns ``num_parts + 1`` offsets: part ``i`` is ``items[bounds[i]:bounds[i + 1]]``; the
    first parts get the extra items.

    >>> uniform_partition(10, 4)
    [0, 3, 6, 8, 10]
    """
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def balanced_partition(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of the contiguous split of ``weights`` minimising the heaviest part.

    Exact: a binary search over the bottleneck value with a greedy feasibility check would be
    approximate for real weights, so this runs the O(n²·parts) dynamic programme instead
    (layer counts are small). Ties are broken towards earlier boundaries. Parts may be empty
    only when there are fewer items than parts.

    >>> balanced_partition([1, 1, 1, 1, 4], 2)
    [0, 4, 5]
    """
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0, got {list(weights)}")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: the smallest possible heaviest part when the first i items form k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(n + 1):
            # Each part gets at least one item while items remain for every part.
            low = k - 1 if i >= k else i
            for j in range(low, i + 1):
                if best[k - 1][j] == inf:
                    continue
                if i >= k and j == i:
                    continue  # an empty part although enough items exist
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    i = n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]
