"""Platform discovery: one frozen value per device; HIP is checked before CUDA; arch spellings.

ROCm and CUDA machines are simulated by monkeypatching ``torch.version.hip`` and ``torch.cuda``
(the classification itself is the pure ``_classify``), so these tests run on the CPU CI.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from rl_engine import platforms
from rl_engine.platforms import Platform, _classify, current_platform, describe_environment, platform_of

MI300X = SimpleNamespace(name="AMD Instinct MI300X", major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-")
H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0)


@pytest.fixture
def fresh_platform_cache():
    """Platform lookups are cached per process; clear them around a simulated machine."""
    platforms._gpu_platform.cache_clear()
    platforms._cpu_platform.cache_clear()
    yield
    platforms._gpu_platform.cache_clear()
    platforms._cpu_platform.cache_clear()


def _simulate_gpu(monkeypatch, props, hip: str | None, cuda: str | None) -> None:
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)


# ---- the pure classification ------------------------------------------------------------------


def test_classify_hip_is_checked_before_cuda():
    # a ROCm build answers torch.cuda.* and reports compute capability 9.4 for MI300: never "sm94"
    assert _classify("6.2.41133", True, MI300X, "x86_64") == ("rocm", "gfx942")


def test_classify_cuda_arch_is_smXY():
    assert _classify(None, True, H200, "x86_64") == ("cuda", "sm90")
    assert _classify("", True, SimpleNamespace(major=8, minor=0), "x86_64") == ("cuda", "sm80")
    assert _classify(None, True, SimpleNamespace(major=12, minor=0), "aarch64") == ("cuda", "sm120")


def test_classify_rocm_arch_drops_feature_flags():
    assert _classify("6.0", True, SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-"), "x86_64") == ("rocm", "gfx90a")
    assert _classify("6.0", True, SimpleNamespace(gcnArchName="gfx1100"), "x86_64") == ("rocm", "gfx1100")


@pytest.mark.parametrize(
    "machine, arch",
    [("x86_64", "x86_64"), ("AMD64", "x86_64"), ("aarch64", "aarch64"), ("arm64", "aarch64"), ("", "unknown")],
)
def test_classify_cpu_arch(machine, arch):
    assert _classify(None, False, None, machine) == ("cpu", arch)
    # no GPU being described: the CPU, whatever the torch build
    assert _classify("6.0", False, None, machine) == ("cpu", arch)
    assert _classify(None, True, None, machine) == ("cpu", arch)


# ---- simulated machines through the public functions ----------------------------------------


def test_simulated_rocm_machine(monkeypatch, fresh_platform_cache):
    _simulate_gpu(monkeypatch, MI300X, hip="6.2.41133", cuda=None)
    p = platform_of("cuda:0")
    assert (p.family, p.arch, p.device_name, p.hip_version) == ("rocm", "gfx942", "AMD Instinct MI300X", "6.2.41133")
    assert p.key == "rocm:gfx942"
    assert current_platform() == p
    assert platform_of(torch.device("cuda")) == p  # no index: the current device
    env = describe_environment()
    assert env["default_platform"]["family"] == "rocm"
    assert [d["family"] for d in env["devices"]] == ["cpu", "rocm"]


def test_simulated_cuda_machine(monkeypatch, fresh_platform_cache):
    _simulate_gpu(monkeypatch, H200, hip=None, cuda="12.8")
    p = platform_of(torch.device("cuda", 0))
    assert (p.family, p.arch, p.cuda_version, p.hip_version) == ("cuda", "sm90", "12.8", None)
    assert current_platform().key == "cuda:sm90"
    # a CPU tensor on a GPU machine is routed to the CPU platform
    assert platform_of(torch.zeros(1)).family == "cpu"


def test_simulated_cpu_only_machine(monkeypatch, fresh_platform_cache):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(platforms._py_platform, "machine", lambda: "AMD64")
    p = current_platform()
    assert (p.family, p.arch) == ("cpu", "x86_64")


# ---- the value itself ---------------------------------------------------------------------------


def test_platform_is_frozen_and_hashable():
    p = platform_of("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.family = "cuda"  # type: ignore[misc]
    assert hash(p) == hash(platform_of("cpu"))
    assert platform_of("cpu") is p  # one cached value per device
    assert set(p.as_dict()) == {f.name for f in dataclasses.fields(Platform)}
    assert p.key == f"{p.family}:{p.arch}"


def test_this_machine_cpu_platform():
    p = platform_of(torch.zeros(2))
    assert p.family == "cpu"
    assert p.arch and p.arch == p.arch.strip()
    assert p.torch_version == torch.__version__
    if not torch.cuda.is_available():
        assert current_platform() == p


def test_unsupported_device_type_names_the_argument():
    with pytest.raises(ValueError, match="^device: unsupported device type 'meta'"):
        platform_of("meta")


def test_describe_environment_report():
    import rl_engine

    env = describe_environment()
    assert set(env) == {"rl_engine", "python", "os", "default_platform", "devices", "torch_num_threads"}
    assert env["rl_engine"] == rl_engine.__version__
    assert env["devices"][0] == platform_of("cpu").as_dict()
    assert env["default_platform"] == current_platform().as_dict()
