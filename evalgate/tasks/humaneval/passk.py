"""The unbiased pass@k estimator (Chen et al., 2021; docs/scoring.md#pass-at-k).

pass@k = 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the
(huge) binomials; it is 1 when n - c < k (every draw of k contains a correct sample).
"""

from __future__ import annotations

from typing import Iterable

from evalgate.errors import UserError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples, drawn without replacement from n with c correct, passes."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise UserError(f"pass@k needs whole numbers, got n={n!r}, c={c!r}, k={k!r}")
    if k < 1 or n < 1:
        raise UserError(f"pass@k needs n >= 1 and k >= 1, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise UserError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if k > n:
        raise UserError(f"pass@{k} needs at least {k} samples per problem, got n={n}; draw more samples or lower k")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """The benchmark score: mean over problems of pass@k, from (n, c) per problem."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise UserError("pass@k over no problems is undefined")
    return sum(values) / len(values)
