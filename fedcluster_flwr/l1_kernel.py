"""The l1 (cityblock) distances of a block of columns, as a compiled kernel.

Why hand-written: neither scipy nor torch has an l1 kernel fast enough for FL+HC's server step
at 1,000 clients of a 1.66 M-parameter model (8.3e11 absolute differences). torch's ``pdist``
sums each pair's differences in one vector accumulator, so every addition waits for the one
before it; scipy's ``cdist`` and ``torch.cdist(p=1)`` are slower still
(``benchmarks/clustering/results/kernels.md``). This kernel keeps four rows' sums in flight
and reads each column value once for them: 1.7–1.9× ``pdist``'s work per CPU second
(benchmarks/clustering).
"""

from __future__ import annotations

import numpy as np
from numba import njit


def add_l1_distances(columns: np.ndarray, total: np.ndarray) -> None:  # pragma: no cover - compiled below
    """``total[pair(i, j)] += sum_c |columns[c, i] - columns[c, j]|`` for every i < j.

    ``columns``: one block of the update matrix, transposed (block width x N, C-contiguous,
    float32 or float64); the sums over the block run in its dtype, then are added to ``total``,
    the float64 condensed vector of the N(N-1)/2 pairs in scipy's order (i < j, row by row:
    row i's pairs start at i(2N - i - 1)/2). Releases the GIL.

    Rows go four at a time (the body is written out for exactly four: the sums of rows i..i+3
    share each load of row j's values), columns four at a time (a quarter of the loads and
    stores of the sums); without fastmath the order of every addition is as written, so the
    result does not depend on the vector width the CPU offers.
    """
    width, n = columns.shape
    sums = np.empty((4, n), dtype=columns.dtype)
    for i in range(0, n - 1, 4):
        m = n - 1 - i  # the columns j = i+1 .. n-1, as 0 .. m-1 (zero-based loops vectorise)
        # rows past the last are clamped to it; their sums are discarded below
        k1, k2, k3 = min(i + 1, n - 1), min(i + 2, n - 1), min(i + 3, n - 1)
        s0, s1, s2, s3 = sums[0, :m], sums[1, :m], sums[2, :m], sums[3, :m]
        s0[:] = 0
        s1[:] = 0
        s2[:] = 0
        s3[:] = 0
        c = 0
        while c + 4 <= width:
            ra, rb, rc, rd = columns[c, i + 1 :], columns[c + 1, i + 1 :], columns[c + 2, i + 1 :], columns[c + 3, i + 1 :]
            a0, b0, c0, d0 = columns[c, i], columns[c + 1, i], columns[c + 2, i], columns[c + 3, i]
            a1, b1, c1, d1 = columns[c, k1], columns[c + 1, k1], columns[c + 2, k1], columns[c + 3, k1]
            a2, b2, c2, d2 = columns[c, k2], columns[c + 1, k2], columns[c + 2, k2], columns[c + 3, k2]
            a3, b3, c3, d3 = columns[c, k3], columns[c + 1, k3], columns[c + 2, k3], columns[c + 3, k3]
            for j in range(m):
                va, vb, vc, vd = ra[j], rb[j], rc[j], rd[j]
                s0[j] += (abs(va - a0) + abs(vb - b0)) + (abs(vc - c0) + abs(vd - d0))
                s1[j] += (abs(va - a1) + abs(vb - b1)) + (abs(vc - c1) + abs(vd - d1))
                s2[j] += (abs(va - a2) + abs(vb - b2)) + (abs(vc - c2) + abs(vd - d2))
                s3[j] += (abs(va - a3) + abs(vb - b3)) + (abs(vc - c3) + abs(vd - d3))
            c += 4
        while c < width:
            ra = columns[c, i + 1 :]
            a0, a1, a2, a3 = columns[c, i], columns[c, k1], columns[c, k2], columns[c, k3]
            for j in range(m):
                va = ra[j]
                s0[j] += abs(va - a0)
                s1[j] += abs(va - a1)
                s2[j] += abs(va - a2)
                s3[j] += abs(va - a3)
            c += 1
        for k in range(min(4, m)):  # row r = i+k: its pairs (r, r+1 ..) are entries k.. of its sums
            r = i + k
            row_total = total[r * (2 * n - r - 1) // 2 :]
            row_sums = sums[k]
            for j in range(k, m):
                row_total[j - k] += row_sums[j]


try:  # compiled once per dtype and cached on disk (the package's __pycache__, else the user's cache)
    add_l1_distances = njit(nogil=True, boundscheck=False, cache=True)(add_l1_distances)
except RuntimeError:  # numba finds no writable cache directory: compile in every process instead
    add_l1_distances = njit(nogil=True, boundscheck=False)(add_l1_distances)
