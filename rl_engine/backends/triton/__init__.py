"""Triton implementations shared by CUDA and ROCm (one source, registered for both families).

Rules every module here follows (seed 004, design §5):

* ``triton`` is imported lazily: registration modules (``<family>/__init__.py``) import only
  torch; the ``@triton.jit`` kernels live in the family's kernel modules (``<family>/kernels.py``;
  attention has one module per kernel family), imported on the first call.
  So ``import rl_engine`` — and even dispatching on a CPU tensor — compiles and imports nothing.
* every launched kernel's name starts with ``rlk_`` and is listed in ``KERNEL_NAMES``; ``@triton.jit``
  device functions called from kernels are named ``rlk_*`` too and listed in ``DEVICE_FUNCTIONS``;
* compilation happens on the first call of each specialisation and is cached by Triton (in
  memory, and on disk under ``TRITON_CACHE_DIR``);
* eligibility checks (:func:`unavailable_reasons`) are pure: no import of triton, no compile,
  no allocation, no device switch.
* ROCm is declared from the same source but listed in ``untested_families`` until it has been
  validated on an AMD device.

Host overhead. Each operator is a ``torch.library`` custom op (fake implementation, autograd,
``torch.compile``). In a plain eager call that needs none of it — no gradient, plain tensors,
no dispatch or function mode, not tracing — the custom-op layer only adds host time (≈ 28 µs
per call measured on the H200 host, more than a decode-sized GEMM's device time), so
:func:`rl_engine.runtime.custom_ops.call_op` runs the op's Python body directly in that case and
goes through the op in every other case, as for every backend. Both run the same kernels, so
the bits are the same (tested on the device).
:func:`device_guard` switches the current device only when the tensor is not on it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path
from typing import Callable, Generic, TypeVar

import torch

from rl_engine.runtime.registry import Implementation, Request, register

__all__ = ["unavailable_reasons", "arch_reasons", "call_reasons", "register_triton", "device_guard", "arch_of",
           "ArchFiles"]
T = TypeVar("T")


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(t.device)`` when ``t`` is on a GPU other than the current one, else a
    no-op context (the switch and its restore cost host time on every launch)."""
    if not t.is_cuda or t.device.index is None or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> str:
    if torch.version.hip:
        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def arch_of(device: torch.device) -> str | None:
    """The architecture name a GPU device's tile tables are keyed by (``"sm90"`` for an H100 or
    H200; the ``gcnArchName`` on ROCm, e.g. ``"gfx942"``); ``None`` off the GPU (the CPU
    interpreter). Looked up once per device index."""
    if device.type != "cuda":
        return None
    return _arch_of_index(device.index if device.index is not None else torch.cuda.current_device())


class ArchFiles(Generic[T]):
    """Data files of one kind, one per device architecture, in a package directory
    (``<directory>/<arch>.json``: the GEMM and MoE tile tables, the attention tile tables).

    ``load`` reads and validates a file; each architecture's file is loaded once per process. An
    architecture without a file — or ``None``, off the GPU — gets ``fallback``'s file where
    ``fallback`` is given (a missing fallback file is a packaging error), else ``None``."""

    def __init__(self, directory: Path, load: Callable[[Path], T], *, fallback: str | None = None) -> None:
        self.directory, self._load, self.fallback = directory, load, fallback
        self._loaded: dict[str, T] = {}

    def path(self, arch: str) -> Path:
        """Where the file of ``arch`` (``"sm90"``) lives in the package."""
        return self.directory / f"{arch}.json"

    def arches(self) -> list[str]:
        """The architectures with a file in the package."""
        return sorted(p.stem for p in self.directory.glob("*.json"))

    def get(self, arch: str | None) -> T | None:
        for name in (arch, self.fallback):
            if name is None:
                continue
            if name not in self._loaded:
                path = self.path(name)
                if not path.is_file():
                    if name == self.fallback:
                        raise FileNotFoundError(f"the fallback file {path} is missing from the package")
                    continue
                self._loaded[name] = self._load(path)
            return self._loaded[name]
        return None


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
    variants: frozenset[str] = frozenset(),
    device_index_checks: bool = False,
) -> None:
    """Register ``fn`` as ``impl_id`` of ``op`` the way every module here does: for CUDA and
    (declared, untested) ROCm, with :func:`unavailable_reasons` and :func:`call_reasons`
    (``variants``: the contract variants it implements; ``device_index_checks``: its kernels
    assert the index arguments' range where they read them: ``tl.device_assert`` in a kernel
    compiled with ``debug=True``, launched with ``sanitize_overflow=False`` so only the asserts
    are added). A custom op registered as is gets the registry's direct eager call
    (:func:`rl_engine.runtime.custom_ops.eager_entry`)."""
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
            variants=variants,
            device_index_checks=device_index_checks,
        )
    )
