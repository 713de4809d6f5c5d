"""Transports: the collectives rl_engine's distributed algorithms run on (``torch.distributed``).

Only :mod:`.torch_dist` exists: a :class:`~.torch_dist.Group` over one ``torch.distributed``
process group (gloo on CPU, NCCL on CUDA), with the handful of collectives the algorithms need
and a record of the bytes each rank sends (:func:`~.torch_dist.comm_log`).
"""

from rl_engine.distributed.transports.torch_dist import CommRecord, Group, comm_log

__all__ = ["Group", "CommRecord", "comm_log"]
