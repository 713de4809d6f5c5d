"""Invariant CPU rotate-half RoPE.

With ``R`` = rotary_dim, ``h = R/2``, ``x1 = x[..., :h]``, ``x2 = x[..., h:R]`` and the fp32 table
``(c, s) = rope_cos_sin(positions, R, theta)`` (:mod:`rl_engine.utils.rope_tables`, defined bit
for bit from float64 ``+ - *``), in fp32 and rounded once to ``x.dtype``::

    forward   out1 = x1*c - x2*s          out2 = x2*c + x1*s          out[..., R:] = x[..., R:]
    backward  dx1  = g1*c + g2*s          dx2  = g2*c - g1*s          dx[..., R:]  = g[..., R:]

(HF's ``x*cos + rotate_half(x)*sin`` with ``rotate_half(x) = [-x2, x1]`` is the forward: IEEE
``a + (-b)`` equals ``a - b``.) Every step is elementwise and the table entry depends only on
(position, i), so token ``t``'s output depends only on ``x[t]`` and ``positions[t]``.
"""

from __future__ import annotations

import torch

from rl_engine.backends._customop import wire_apply_rope
from rl_engine.utils.rope_tables import rope_cos_sin
from rl_engine.runtime.registry import Implementation, register

_DTYPES = (torch.float32, torch.bfloat16)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int, transpose: bool) -> torch.Tensor:
    h = rotary_dim // 2
    c, s = rope_cos_sin(positions, rotary_dim, theta)
    c = c[:, None, :]
    s = s[:, None, :]
    x1 = x[..., :h].float()
    x2 = x[..., h:rotary_dim].float()
    out = torch.empty_like(x)
    if transpose:
        out[..., :h] = (x1 * c + x2 * s).to(x.dtype)
        out[..., h:rotary_dim] = (x2 * c - x1 * s).to(x.dtype)
    else:
        out[..., :h] = (x1 * c - x2 * s).to(x.dtype)
        out[..., h:rotary_dim] = (x2 * c + x1 * s).to(x.dtype)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


@torch.library.custom_op("rlk::apply_rope_cpu", mutates_args=(), device_types="cpu")
def apply_rope_cpu(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    return _rotate(x, positions, theta, rotary_dim, transpose=False)


@torch.library.custom_op("rlk::apply_rope_cpu_backward", mutates_args=(), device_types="cpu")
def apply_rope_cpu_backward(grad: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    return _rotate(grad, positions, theta, rotary_dim, transpose=True)


wire_apply_rope(apply_rope_cpu, apply_rope_cpu_backward)

register(
    Implementation(
        op="rope.apply_rope",
        impl_id="cpu.exact_table",
        version="2",
        fn=apply_rope_cpu,
        families=("cpu",),
        dtypes=_DTYPES,
        guarantees=frozenset({"row", "run_to_run", "threads", "isa"}),
        priority=10,
    )
)
