"""Invariant CPU ``silu_and_mul``.

With ``[a, b] = x`` split on the last dimension (``a = x[..., :d]``, ``b = x[..., d:]``)::

    forward   y  = round((a / (1 + exp(-a))) * b)                       # fp32 math
    backward  e  = exp(-a);  s = 1 / (1 + e);  silu = a / (1 + e)
              da = round((g * b) * (s * (1 + a * (1 - s))))
              db = round(g * silu)

Only ``+ - * /`` and ``exp`` are used: they give the same bits for an element whether it falls
in a kernel's vectorised body or its scalar tail, so each output element depends only on its
own ``a``, ``b`` (and ``g``). ``torch.sigmoid`` and ``F.silu`` do not (measured: their scalar
tail differs from the vectorised body in the last bit), so they are not used.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_silu_and_mul
from rl_engine.runtime.registry import Implementation, register
from rl_engine.utils import portable

_DTYPES = (torch.float32, torch.bfloat16)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 views (fp32 input) or copies (bf16 input) of the gate and up halves."""
    d = x.shape[-1] // 2
    return x[..., :d].float(), x[..., d:].float()


def _one_plus_exp_neg(a: torch.Tensor) -> torch.Tensor:
    """``1 + exp(-a)`` in a fresh contiguous fp32 buffer (in-place steps, the same bits)."""
    den = portable.exp(torch.neg(a))
    den.add_(1.0)
    return den


@torch.library.custom_op("rlk::silu_and_mul_cpu", mutates_args=(), device_types="cpu")
def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    a, b = _halves(x)
    y = torch.div(a, _one_plus_exp_neg(a))  # silu(a)
    y.mul_(b)
    return y.to(x.dtype)


@torch.library.custom_op("rlk::silu_and_mul_cpu_backward", mutates_args=(), device_types="cpu")
def silu_and_mul_cpu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = _halves(x)
    g = grad.float()
    den = _one_plus_exp_neg(a)
    s = den.reciprocal()
    silu = torch.div(a, den)
    dsilu = torch.rsub(s, 1.0).mul_(a).add_(1.0).mul_(s)  # s * (a * (1 - s) + 1)
    dx = torch.empty(x.shape, dtype=x.dtype)
    d = x.shape[-1] // 2
    dx[..., :d] = torch.mul(g, b).mul_(dsilu)
    dx[..., d:] = silu.mul_(g)
    return dx


wire_silu_and_mul(silu_and_mul_cpu, silu_and_mul_cpu_backward)

register(
    Implementation(
        op="activation.silu_and_mul",
        impl_id="cpu.ieee_exp",
        version="2",
        fn=silu_and_mul_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "chunk", "run_to_run", "threads", "isa"}),
        priority=10,
    )
)
