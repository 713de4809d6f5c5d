"""Device discovery as one frozen value.

:func:`current_platform` answers "what accelerator does this process drive" once and caches the
answer; :func:`platform_of` answers it for the device a tensor lives on (dispatch uses this, so
a CPU tensor on a GPU machine is routed to CPU implementations).

Detection order follows seed 004: HIP (``torch.version.hip``) is checked *before* CUDA, because
ROCm builds of torch also report ``torch.cuda.is_available()``. Architectures are spelled the
way kernels are targeted: ``sm90`` for compute capability 9.0, ``gfx942`` for MI300, and the
machine name (``x86_64``, ``aarch64``) for CPUs.

Nothing here initialises a device context or allocates memory.
"""

from __future__ import annotations

import functools
import platform as _py_platform
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

Family = Literal["cpu", "cuda", "rocm"]

__all__ = ["Platform", "Family", "current_platform", "platform_of", "describe_environment"]


@dataclass(frozen=True)
class Platform:
    """What one device is, and the software stack that drives it.

    Attributes:
        family: ``"cpu"``, ``"cuda"`` or ``"rocm"``.
        arch: ``"x86_64"``/``"aarch64"`` for CPUs, ``"sm90"`` for NVIDIA, ``"gfx942"`` for AMD.
        device_name: human-readable name (CPU model or GPU product name).
        torch_version, triton_version, cuda_version, hip_version: versions, ``None`` if absent.
    """

    family: Family
    arch: str
    device_name: str
    torch_version: str
    triton_version: str | None
    cuda_version: str | None
    hip_version: str | None

    @property
    def key(self) -> str:
        """``family:arch``, the string used in provenance records."""
        return f"{self.family}:{self.arch}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _triton_version() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None:
        return None
    try:  # reading the metadata avoids importing triton (which may initialise drivers)
        from importlib.metadata import version

        return version("triton")
    except Exception:  # pragma: no cover - a broken install still reports "present"
        return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _py_platform.processor() or _py_platform.machine() or "cpu"


# Spellings some systems report for the two CPU architectures we name (Windows, macOS).
_CPU_ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def _classify(hip_version: str | None, cuda_available: bool, props: Any | None, machine: str) -> tuple[Family, str]:
    """Pure classification of one device: ``(family, arch)``.

    Args:
        hip_version: ``torch.version.hip`` (``None`` or empty on non-ROCm builds).
        cuda_available: whether a GPU is being described (``torch.cuda.is_available()``).
        props: the GPU's ``torch.cuda.get_device_properties`` (``None`` for the CPU).
        machine: ``platform.machine()`` (used for the CPU).

    HIP is checked *before* CUDA: a ROCm build also answers ``torch.cuda.*`` and reports a
    compute capability (9.4 on MI300), which must not be read as ``sm94``.
    """
    if not cuda_available or props is None:
        m = (machine or "unknown").strip()
        return "cpu", _CPU_ARCH_ALIASES.get(m.lower(), m)
    if hip_version:
        return "rocm", str(getattr(props, "gcnArchName", "gfx")).split(":", 1)[0]
    return "cuda", f"sm{props.major}{props.minor}"


@functools.lru_cache(maxsize=None)
def _cpu_platform() -> Platform:
    _, arch = _classify(None, False, None, _py_platform.machine())
    return Platform(
        family="cpu",
        arch=arch,
        device_name=_cpu_name(),
        torch_version=torch.__version__,
        triton_version=_triton_version(),
        cuda_version=torch.version.cuda,
        hip_version=getattr(torch.version, "hip", None),
    )


@functools.lru_cache(maxsize=None)
def _gpu_platform(index: int) -> Platform:
    props = torch.cuda.get_device_properties(index)
    hip = getattr(torch.version, "hip", None)
    family, arch = _classify(hip, True, props, _py_platform.machine())
    return Platform(
        family=family,
        arch=arch,
        device_name=props.name,
        torch_version=torch.__version__,
        triton_version=_triton_version(),
        cuda_version=torch.version.cuda,
        hip_version=hip,
    )


def platform_of(device: torch.device | torch.Tensor | str) -> Platform:
    """The :class:`Platform` of ``device`` (a device, a device string, or a tensor's device)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_platform()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _gpu_platform(index)
    raise ValueError(f"device: unsupported device type {device.type!r} (expected cpu or cuda)")


def current_platform() -> Platform:
    """The accelerator this process would use by default: GPU 0 if one is visible, else the CPU."""
    if torch.cuda.is_available():
        return platform_of(torch.device("cuda", 0))
    return _cpu_platform()


def describe_environment() -> dict[str, Any]:
    """An environment report (for ``rlk env`` and every report's header)."""
    import sys

    import rl_engine

    cur = current_platform()
    devices = [platform_of("cpu").as_dict()]
    if torch.cuda.is_available():
        devices += [platform_of(torch.device("cuda", i)).as_dict() for i in range(torch.cuda.device_count())]
    return {
        "rl_engine": rl_engine.__version__,
        "python": sys.version.split()[0],
        "os": _py_platform.platform(),
        "default_platform": cur.as_dict(),
        "devices": devices,
        "torch_num_threads": torch.get_num_threads(),
    }
