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

**bfloat16 and float16: 16-bit storage, float32 sums.** The same formula with bfloat16's ``eps = 2^-7`` says
nothing: ``6 * depth * width * eps`` is 9 at depth 3 and width 64, nine times the output. But that formula assumes
every addition of a dot product rounds to the stored precision, and 16-bit models do not compute that way: CPU
(oneDNN) and GPU (cuBLAS) kernels multiply 16-bit inputs exactly, sum the products in float32 and round the sum
once to the output dtype. For that scheme (Blanchard, Higham, Lopez, Mary and Pranesh, *Mixed precision block
fused multiply-add: error analysis and application to GPU tensor cores*, SIAM J. Sci. Comput. 42(3), 2020), a dot
product of length n is within ``(u + gamma_n(u_acc)) * sum|a_i * b_i| ~ (u + n * u_acc) * sum|a_i * b_i|`` of the
exact one, ``u = 2^-8`` bfloat16's unit roundoff and ``u_acc = 2^-24`` float32's: one rounding to 8 significant
bits, which the width hardly changes. Between the products a layer also rounds the result of each elementwise
step to 16 bits, another ``u`` of values of the same order each: softmax, the activation, two normalisations, two
residual additions (six, as many as the products; in float32 they are negligible beside ``width * u``). Per route
and layer that is ``6 * (u + width * u_acc) + 6 * u``, so for two routes::

    |a - b| <= 2 routes * depth * (12 * u + 6 * width * u_acc) * scale + eps
             = 6 * depth * (2 * eps + width * eps_acc) * scale + eps

which is ``0.28 * scale`` at depth 3 and width 64 in bfloat16: 8-bit significands cannot tell rounding from a
small effect, and a single head of the suite's tiny language models moves their loss by less (median 2.5% and 7%
of the scale). The bound keeps the float32 derivation's assumption that layer norms hold every layer's values at
the order of the output, without amplification; the suite's classifiers, whose random weights are scaled up
(``initializer_range=1.0``), break it: their bfloat16 losses differ from the float32 ones by 20% and 37% of the
scale, beyond one route's half of the bound. The routes the contract suite compares in bfloat16 (weight surgery,
reuse, packed masks) all run bit for bit equal on the CPU (measured on its four transformers cases, torch 2.13),
so the bound is what a machine whose kernels sum in another order (a GPU) may use, not what the CPU needs.
"""

from __future__ import annotations

import numpy as np
import torch

#: Dot products chained in one Transformer layer (see the module docstring).
PRODUCTS_PER_LAYER = 6
#: The dtype 16-bit dtypes' products are summed in (CPU and GPU matrix-product kernels).
ACCUMULATES_IN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


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
    only in summation order: ``6 * depth * width * eps * max|reference| + eps``; for bfloat16 and float16,
    summed in float32, ``6 * depth * (2 * eps + width * eps_float32) * max|reference| + eps``.

    ``depth``: Transformer layers both routes pass through (count a decoder layer, with its two attentions,
    as two); ``width``: the longest inner product (hidden size, feed-forward size, or sequence length);
    ``dtype``: the dtype the routes computed in (default: a tensor's own; float32 for arrays and floats).
    """
    dtype = dtype or _dtype_of(reference)
    eps = torch.finfo(dtype).eps
    per_layer = width * eps
    if dtype in ACCUMULATES_IN:
        per_layer = 2 * eps + width * torch.finfo(ACCUMULATES_IN[dtype]).eps
    ref = _as_float64(reference)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    return PRODUCTS_PER_LAYER * depth * per_layer * scale + eps


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
