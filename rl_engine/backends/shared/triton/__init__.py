"""Triton implementations shared by CUDA and ROCm (one source, registered for both families).

Rules every module here follows (seed 004, design §5):

* ``triton`` is imported lazily: registration modules (``<family>/__init__.py``) import only
  torch; the ``@triton.jit`` kernels live in ``<family>/kernels.py``, imported on the first call.
  So ``import rl_engine`` — and even dispatching on a CPU tensor — compiles and imports nothing.
* every launched kernel's name starts with ``rlk_`` and is listed in ``KERNEL_NAMES``; ``@triton.jit``
  device functions called from kernels are named ``rlk_*`` too and listed in ``DEVICE_FUNCTIONS``;
* compilation happens on the first call of each specialisation and is cached by Triton (in
  memory, and on disk under ``TRITON_CACHE_DIR``);
* eligibility checks (:func:`unavailable_reasons`) are pure: no import of triton, no compile,
  no allocation, no device switch.
* ROCm is declared from the same source but listed in ``untested_families`` until it has been
  validated on an AMD device.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from rl_engine.runtime.registry import Implementation, Request, register

__all__ = ["unavailable_reasons", "arch_reasons", "call_reasons", "register_triton"]


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        return False


def unavailable_reasons() -> list[str]:
    """Why no Triton implementation can run in this process (empty: they can). Pure."""
    reasons = []
    if not _triton_installed():
        reasons.append("triton is not installed (pip install 'rl-kernel[gpu]')")
    if not torch.cuda.is_available():
        reasons.append("no CUDA/ROCm device is visible to torch")
    return reasons


def arch_reasons(family: str, arch: str, *, min_sm: int = 80) -> list[str]:
    """Reasons a device architecture is unsuitable (CUDA: needs ``sm{min_sm}``+ for bf16 MMA)."""
    if family == "cuda":
        digits = arch[2:] if arch.startswith("sm") else ""
        if not digits.isdigit() or int(digits) < min_sm:
            return [f"arch {arch!r}: needs sm{min_sm} or newer (bf16 tensor cores)"]
    return []


def call_reasons(request: Request) -> list[str]:
    """The per-call check of every implementation here: :func:`arch_reasons` of the request's device."""
    return arch_reasons(request.platform.family, request.platform.arch)


def register_triton(
    op: str,
    impl_id: str,
    fn,
    *,
    dtypes: tuple[torch.dtype, ...],
    guarantees: frozenset[str],
    version: str = "1",
    priority: int = 5,
) -> None:
    """Register ``fn`` as ``impl_id`` of ``op`` the way every module here does: for CUDA and
    (declared, untested) ROCm, with :func:`unavailable_reasons` and :func:`call_reasons`."""
    register(
        Implementation(
            op=op,
            impl_id=impl_id,
            version=version,
            fn=fn,
            families=("cuda", "rocm"),
            untested_families=("rocm",),
            dtypes=dtypes,
            guarantees=guarantees,
            priority=priority,
            static_check=unavailable_reasons,
            call_check=call_reasons,
        )
    )
