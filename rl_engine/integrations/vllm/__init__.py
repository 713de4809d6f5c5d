"""vLLM as the rollout engine, running rl_engine operators (issue #8).

Enable it either way (vLLM itself needs no edit):

* environment: ``RLK_VLLM=1`` (or ``RLK_VLLM=strict``) before vLLM starts — the
  ``vllm.general_plugins`` entry point :func:`~.plugin.register` installs it in the engine
  process and in every tensor-parallel worker;
* Python: :func:`install` (``strict=True`` for strict mode) before building ``vllm.LLM``; it
  also exports ``RLK_VLLM`` so that workers spawned later install it too.

With ``logprobs_mode="processed_logprobs"`` the plugin's sampler runs rl_engine's canonical
top-k / top-p filter and returns processed log-probs (renormalised over each token's kept set);
:func:`kept_sets` fetches the kept-set records of the generated tokens, which the trainer
passes to ``rl_engine.ops.logprob`` (``kept=``) to replay the same values.

Then read what ran with :func:`vllm_provenance` (one entry per TP rank: rl_engine operators
with implementation ids, versions, source fingerprints and call counts, the replaced modules'
forwards, and native forwards — zero in a clean run) and check it with
:func:`assert_no_fallbacks`. :mod:`.parity` compares the log-probs vLLM returns with the
training side's, raw bit for raw bit.

Importing this package imports neither vLLM nor any backend.
"""

from __future__ import annotations

from typing import Any

from rl_engine.integrations.vllm.kept import kept_sets
from rl_engine.integrations.vllm.plugin import (
    ENV_VAR,
    NATIVE_WATCH,
    install,
    installed_mode,
    is_installed,
    register,
    uninstall,
)
from rl_engine.integrations.vllm.stats import NativeFallbackError

__all__ = [
    "ENV_VAR",
    "NATIVE_WATCH",
    "NativeFallbackError",
    "ProvenanceError",
    "install",
    "uninstall",
    "is_installed",
    "installed_mode",
    "register",
    "vllm_provenance",
    "reset_provenance",
    "assert_no_fallbacks",
    "QWEN3_KINDS",
    "QWEN3_MOE_KINDS",
    "kept_sets",
]


class ProvenanceError(AssertionError):
    """A provenance check failed: a native operator ran, a fallback happened, or nothing ran."""


def vllm_provenance(llm) -> list[dict[str, Any]]:
    """What every worker of ``llm`` (a ``vllm.LLM``) ran since its start or the last
    :func:`reset_provenance`, one dict per TP rank::

        {"rank": 0, "pid": ..., "mode": "strict", "installed": "strict",
         "operators": [{"op": "gemm.linear", "impl_id": "cpu.exact_sum", "impl_version": "3",
                        "platform": ..., "source_fingerprint": "sha256:...", "policy": "strict",
                        "fallback": False, "calls": 96}, ...],
         "modules": {"RMSNorm": 80, "Attention": 16, ...},   # replaced-module forwards
         "native_calls": {},                                 # native forwards of replaced kinds
         "fallback": False}

    Uses ``llm.collective_rpc("rlk_provenance")`` (a method the plugin adds to vLLM's worker
    wrapper; the workers run in other processes at TP > 1).

    Raises:
        ProvenanceError: the workers do not have the plugin installed.
    """
    return list(_rpc(llm, "rlk_provenance"))


def reset_provenance(llm) -> None:
    """Zero every worker's counts (e.g. after warm-up, before the measured generate).

    Raises:
        ProvenanceError: the workers do not have the plugin installed.
    """
    _rpc(llm, "rlk_reset_provenance")


def _rpc(llm, method: str):
    try:
        return llm.collective_rpc(method)
    except NotImplementedError as exc:
        raise ProvenanceError(f"llm: its workers do not have the rl_engine plugin installed ({exc}); set "
                              f"{ENV_VAR}=1 or call install() before building the LLM") from None


#: Replaced kinds a Qwen3 generate must run (module forwards counted by the plugin).
QWEN3_KINDS = ("RMSNorm", "SiluAndMul", "RotaryEmbedding", "QKVParallelLinear", "MergedColumnParallelLinear",
               "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "Attention",
               "Sampler.compute_logprobs")
#: The same for a Qwen3-MoE generate (every layer sparse: no dense MLP).
QWEN3_MOE_KINDS = ("RMSNorm", "RotaryEmbedding", "QKVParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
                   "ParallelLMHead", "Attention", "GateLinear", "FusedMoE", "Sampler.compute_logprobs")


def assert_no_fallbacks(provenance: list[dict[str, Any]], *, require: tuple[str, ...] = QWEN3_KINDS) -> None:
    """Raise :class:`ProvenanceError` unless every rank ran only rl_engine operators.

    Checks, per rank: the plugin is installed; zero native forwards of replaced kinds; no
    rl_engine fallback (to the float64 reference); every kind in ``require`` ran at least once
    (default: what a Qwen3 generate with ``logprobs`` runs).
    """
    if not provenance:
        raise ProvenanceError("provenance: no worker answered")
    problems = []
    for p in provenance:
        r = p.get("rank")
        if not p.get("installed"):
            problems.append(f"rank {r}: the rl_engine plugin is not installed in worker pid {p.get('pid')}")
        if p.get("native_calls"):
            problems.append(f"rank {r}: native vLLM operators ran: {p['native_calls']}")
        fb = [o["op"] for o in p.get("operators", []) if o["fallback"]]
        if fb:
            problems.append(f"rank {r}: rl_engine fell back to the reference for {sorted(set(fb))}")
        missing = [k for k in require if not p.get("modules", {}).get(k)]
        if missing:
            problems.append(f"rank {r}: no rl_engine forward of {missing} was recorded")
    if problems:
        raise ProvenanceError("provenance: " + "; ".join(problems))
