"""Canonical reduction orders, separate from the transports that move the data.

* :mod:`.tree` — the canonical reduction tree over an ordered list of leaves and when blocks of
  leaves held by different ranks are subtrees of it;
* :mod:`.exact_k` — the sharded-K exact GEMM (bits of the unsharded ``gemm.linear`` on the CPU)
  and the canonical tree all-reduce;
* :mod:`.vocab` — vocabulary shards of whole log-sum-exp blocks and the in-order block merge.
"""
