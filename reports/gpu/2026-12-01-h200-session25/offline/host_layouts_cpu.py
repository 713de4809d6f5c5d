"""Session 25, on the workstation CPU (Triton 3.6 venv, no GPU needed): the host time that the
cached Gluon host layouts and the cached registry answers remove from each call (best of 5 loops
of 2000 calls, µs per call).

    PYTHONPATH=. /tmp/v36/bin/python reports/gpu/2026-12-01-h200-session25/offline/host_layouts_cpu.py
"""
import time

import torch

from rl_engine.backends.shared.triton.attention import hopper
from rl_engine.runtime import registry


def per_call_us(f, n=2000):
    for _ in range(50):
        f()
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        loops.append((time.perf_counter() - t0) / n * 1e6)
    return round(min(loops), 2)


req = registry.make_request("gemm.linear", torch.zeros(1, 64), features={"K": 64, "N": 96, "bias": False})
cases = {
    "transposed kernel's exchange layouts, built (before)": lambda: hopper._wgt_exchange_layouts.__wrapped__(8),
    "transposed kernel's exchange layouts, cached (now)": lambda: hopper._wgt_exchange_layouts(8),
    "two TMA shared layouts, built (before)": lambda: (hopper._smem_layout.__wrapped__(64, 128, torch.bfloat16),
                                                       hopper._smem_layout.__wrapped__(64, 64, torch.bfloat16)),
    "two TMA shared layouts, cached (now)": lambda: (hopper._smem_layout(64, 128, torch.bfloat16),
                                                     hopper._smem_layout(64, 64, torch.bfloat16)),
    "registry select gemm.linear, computed (before)": lambda: registry._select(req),
    "registry select gemm.linear, cached (now)": lambda: registry.select(req),
}
for name, f in cases.items():
    print(f"{name:55s} {per_call_us(f):8.2f} us")
