"""How far apart two routes to the same numbers may be: one bound, derived from the dtype and the magnitude.

Every numeric comparison in the tests is one of three kinds, and says which in a comment:

* exact: both routes run the same kernels on tensors of the same shapes (or differ only by multiplications
  by 1 or 0, which round nothing), so they give the same floats: ``torch.equal`` or ``rtol=0, atol=0``.
* summation order: the routes compute the same function but multiply matrices of other shapes (a pruned
  model's narrower projections, several masks in one batch, a cached prefix, fairseq's fused attention),
  so sums are taken in another order and the float results differ by rounding. These use
  :func:`route_bound`, or run both routes in float64 where that is cheap (the same bound, with float64's
  epsilon, is then about 1e-12).
* other: float64 library comparisons (scipy, sacrebleu), finite differences, statistics; the comment
  says why the number is what it is.

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1): a dot product
of length n computed in floating point is within ``gamma_n * sum|a_i * b_i|`` of the exact one, with
``gamma_n = n*u / (1 - n*u) ~ n*u`` and ``u = eps / 2`` the unit roundoff. A Transformer layer chains
about six such products (query/key/value projection, attention scores, context, output projection,
feed-forward in and out), none longer than ``width``; ``depth`` layers chain their errors, and each of
the two routes carries its own. So::

    |a - b| <= 2 routes * depth * 6 * width * u * scale + eps
             = 6 * depth * width * eps(dtype) * scale + eps(dtype)

where ``scale = max|reference|`` stands in for the sums of |terms| (layer norms keep each layer's hidden
states at the order of the output), and the trailing ``eps`` is an absolute floor for a reference that is
zero throughout. It is a worst-case bound: rounding errors usually partly cancel, and the observed
differences are a few to a hundred epsilons of the scale (test_physical_pruning.py records the margin),
while a real difference (one head more or less) is millions of them.
"""

from __future__ import annotations

import numpy as np
import torch

#: Dot products chained in one Transformer layer (see the module docstring).
PRODUCTS_PER_LAYER = 6


def _as_float64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _dtype_of(x) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        return x.dtype
    # Arrays and Python floats (losses, beam-search scores) are often float64 containers of numbers a
    # float32 model computed: the computation's dtype sets the rounding, so float32 unless told.
    return torch.float32


def route_bound(reference, *, depth: int, width: int, dtype: torch.dtype | None = None) -> float:
    """The largest ``max|actual - reference|`` that float rounding explains, for two routes that differ
    only in summation order: ``6 * depth * width * eps * max|reference| + eps``.

    ``depth``: Transformer layers both routes pass through (count a decoder layer, with its two attentions,
    as two); ``width``: the longest inner product (hidden size, feed-forward size, or sequence length);
    ``dtype``: the dtype the routes computed in (default: a tensor's own; float32 for arrays and floats).
    """
    eps = torch.finfo(dtype or _dtype_of(reference)).eps
    ref = _as_float64(reference)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    return PRODUCTS_PER_LAYER * depth * width * eps * scale + eps


def max_difference(actual, reference) -> float:
    """``max|actual - reference|`` in float64 (0.0 for empty inputs)."""
    diff = np.abs(_as_float64(actual) - _as_float64(reference))
    return float(diff.max()) if diff.size else 0.0


def assert_routes_agree(actual, reference, *, depth: int, width: int, dtype: torch.dtype | None = None,
                        what: object = "") -> tuple[float, float]:
    """Assert that two routes agree within :func:`route_bound`; returns ``(observed difference, bound)``."""
    bound = route_bound(reference, depth=depth, width=width, dtype=dtype)
    diff = max_difference(actual, reference)
    assert diff <= bound, f"{what}: max difference {diff:.3g} exceeds the summation-order bound {bound:.3g}"
    return diff, bound
