"""Invariant CPU implementations — the embedded default and what CI validates.

Design rules every module here follows (see docs/design/cpu-backend.md):

* products only through the exact-sum GEMMs of :mod:`~rl_engine.backends.cpu.common`
  (:func:`~rl_engine.backends.cpu.common.exact_matmul`, :func:`~rl_engine.backends.cpu.common.exact_bmm`:
  integer slices in float64 BLAS, whose sums are exact, rounded once), because CPU BLAS picks
  shape-, thread- and instruction-set-dependent algorithms;
* reductions through :func:`~rl_engine.utils.reductions.fixed_order_sum` (fixed lanes at
  absolute positions, then a fixed pairwise tree), never ``torch.sum`` along a row;
* elementwise math only from IEEE correctly-rounded operations (``+ - * / sqrt``) and ``exp`` /
  ``log``, whose vectorised and scalar-tail results agree (a test guards this): ``torch.sigmoid``
  and ``torch.rsqrt`` do *not* (their tail elements can differ by an ulp).
"""
