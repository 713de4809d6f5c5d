"""The vLLM plugin: opt-in, idempotent, reversible installation of rl_engine operators.

vLLM calls every ``vllm.general_plugins`` entry point in every process it starts (the engine
core and each tensor-parallel worker). rl_engine's entry point is :func:`register`, which does
**nothing** unless the environment variable :data:`ENV_VAR` asks for it:

* ``RLK_VLLM=1`` — install; native forwards of the replaced kinds are counted (diagnostic);
* ``RLK_VLLM=strict`` — install; a native forward of a replaced kind raises
  :class:`~.stats.NativeFallbackError`;
* unset, empty or ``0`` — nothing.

:func:`install` does the same from Python (in-process engines) and exports :data:`ENV_VAR`
so that worker processes vLLM spawns afterwards install it too; :func:`uninstall` reverts
everything it did. What an install changes, each change logged on one line of the
``rl_engine.integrations.vllm`` logger:

1. ``register_oot`` of the layer replacements of :mod:`.layers` (vLLM's official
   out-of-tree extension point; removed again from ``op_registry_oot`` on uninstall);
2. ``register_backend`` of :class:`~.attention_backend.RlkAttentionBackend` for
   ``CPU_ATTN`` (CPU) and ``CUSTOM`` (official override registry; ``clear_override`` on
   uninstall); vLLM's cached backend selection and RoPE instance cache are cleared;
3. ``Sampler.compute_logprobs`` (a staticmethod) → ``rl_engine.ops.logprob.log_softmax``
   (class attribute, restored on uninstall): the log-probs vLLM returns
   (``logprobs_mode="raw_logprobs"``, vLLM's default); and ``TopKTopPSampler.forward_cpu`` /
   ``forward_native`` so that with ``logprobs_mode="processed_logprobs"`` (what TRL requests)
   the top-k / top-p filter is rl_engine's canonical one (``ops.logprob.canonical_prefix`` on
   the temperature-scaled logits), vLLM samples natively from the filtered logits, and the
   returned log-probs are ``rl_engine.ops.logprob.log_softmax(z, kept=records)`` — renormalised
   over each row's kept set (the processed log-probs) — counted as
   ``Sampler.processed_logprobs``; ``GPUModelRunner._sample`` publishes each row's request and
   position so the records are stored per token and the client can fetch them
   (:func:`~.kept.kept_sets`, the ``rlk_take_kept_sets`` RPC);
4. counting wrappers around the native forwards of every replaced kind (:data:`NATIVE_WATCH`,
   class attributes, restored on uninstall), so that zero native fallbacks is measured;
5. three methods on vLLM's ``WorkerWrapperBase``, ``rlk_provenance``, ``rlk_reset_provenance``
   and ``rlk_take_kept_sets``, which ``llm.collective_rpc(...)`` calls on every rank (a method
   name needs no pickled callable, which multiprocess vLLM refuses by default).

Modules built *before* the install stay native (the wrappers count them). Build the ``LLM``
after installing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from rl_engine.integrations.vllm import kept as kept_store
from rl_engine.integrations.vllm import stats

__all__ = ["ENV_VAR", "NATIVE_WATCH", "register", "install", "uninstall", "is_installed", "installed_mode"]

log = logging.getLogger("rl_engine.integrations.vllm")

#: Environment variable read by :func:`register` (``1`` or ``strict``).
ENV_VAR = "RLK_VLLM"
_MODES = {"1": "diagnostic", "diagnostic": "diagnostic", "strict": "strict"}

#: (module, class, methods) whose native forwards are counted while installed.
NATIVE_WATCH: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.model_executor.layers.layernorm", "RMSNorm", ("forward",)),
    ("vllm.model_executor.layers.activation", "SiluAndMul", ("forward",)),
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding", ("forward",)),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod", ("apply",)),
    ("vllm.model_executor.layers.linear", "ReplicatedLinear", ("forward",)),
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear", ("forward",)),
    ("vllm.model_executor.layers.linear", "MergedColumnParallelLinear", ("forward",)),
    ("vllm.model_executor.layers.linear", "QKVParallelLinear", ("forward",)),
    ("vllm.model_executor.layers.linear", "RowParallelLinear", ("forward",)),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod", ("apply", "embedding")),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding", ("forward",)),
    ("vllm.model_executor.layers.fused_moe.router.gate_linear", "GateLinear", ("forward",)),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner", ("_forward_impl",)),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", ("forward",)),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl", ("forward",)),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl", ("forward",)),
)

_BACKEND_PATH = "rl_engine.integrations.vllm.attention_backend.RlkAttentionBackend"


@dataclass
class _Install:
    mode: str
    env_before: str | None
    oot_names: list[str] = field(default_factory=list)
    backends: list[Any] = field(default_factory=list)
    patches: list[tuple[type, str, Any, bool]] = field(default_factory=list)  # (cls, attr, old, had_own)


_STATE: dict[str, _Install] = {}


def installed_mode() -> str | None:
    """``"diagnostic"`` or ``"strict"`` while installed in this process, else ``None``."""
    inst = _STATE.get("install")
    return inst.mode if inst is not None else None


def is_installed() -> bool:
    return "install" in _STATE


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install when :data:`ENV_VAR` asks for it.

    Raises:
        ValueError: :data:`ENV_VAR` holds something other than ``""``, ``0``, ``1`` or ``strict``.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0"):
        return
    if value not in _MODES:
        raise ValueError(f"{ENV_VAR}: expected '1' or 'strict' (or unset / '0' to disable), got {value!r}")
    install(strict=_MODES[value] == "strict")


def _patch(inst: _Install, cls: type, attr: str, new: Any) -> None:
    had_own = attr in cls.__dict__
    inst.patches.append((cls, attr, cls.__dict__.get(attr), had_own))
    setattr(cls, attr, new)


def _counting(where: str, fn):
    def wrapper(*args, **kwargs):
        stats.native(where)
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "forward")
    wrapper.__qualname__ = f"rlk_native_counter[{where}]"
    wrapper._rlk_native_counter = True  # type: ignore[attr-defined]
    return wrapper


def _log_probs(logits):
    """``Sampler.compute_logprobs`` replacement: fp32 ``log_softmax`` of the raw logits."""
    from rl_engine.ops.logprob import log_softmax

    return stats.run("Sampler.compute_logprobs", log_softmax, logits.contiguous())


def _processed_logprobs_wrapper(native_forward):
    """A ``TopKTopPSampler.forward_cpu`` / ``forward_native`` whose ``processed_logprobs`` are
    rl_engine's processed log-probs.

    vLLM's sampler calls it with fp32 logits already divided by the temperature (``div_``:
    ``z = fl32(logits) / fl32(T)``, an IEEE division as rl_engine's). With
    ``logprobs_mode="processed_logprobs"``: rl_engine's canonical filter (top-k ``k``, top-p
    ``p`` per row; vLLM's ``k = V`` and ``p = 1`` mean off) gives each row's kept-set record,
    the log-probs are ``rl_engine.ops.logprob.log_softmax(z, kept=records)`` (computed first:
    sampling may reuse the buffer), vLLM samples natively from ``z`` with the dropped entries at
    ``-inf`` (its own filters off), and the records are stored per (request, position) for the
    client (:mod:`.kept`). Other modes run the native forward unchanged.
    """
    def forward(self, logits, generators, k, p):
        if self.logprobs_mode != "processed_logprobs":
            return native_forward(self, logits, generators, k, p)
        from rl_engine.ops.logprob import KeptSet, canonical_prefix, log_softmax

        z = logits.float().contiguous()
        if k is None and p is None:
            kept = KeptSet.everything((z.shape[0],), device=z.device)
        else:
            kept = canonical_prefix(z, 0 if k is None else k, 1.0 if p is None else p).kept.to(z.device)
        ours = stats.run("Sampler.processed_logprobs", log_softmax, z, kept=kept)
        kept_store.record(kept, z.shape[0])
        filtered = z.masked_fill(~kept.mask(z), float("-inf"))
        self.logprobs_mode = "raw_logprobs"  # the native path then returns no log-probs of its own
        try:
            sampled, _ = native_forward(self, filtered, generators, None, None)
        finally:
            self.logprobs_mode = "processed_logprobs"
        return sampled, ours

    forward.__qualname__ = f"rlk_processed_logprobs[{getattr(native_forward, '__name__', 'forward')}]"
    return forward


def _sample_wrapper(native_sample):
    """``GPUModelRunner._sample`` that publishes, while it runs, the request of each logits row,
    the sequence position its sampled token takes (the step's token count) and whether vLLM
    discards that sample (:func:`.kept.sampling_rows`)."""
    def _sample(self, logits, spec_decode_metadata):
        try:
            n = self.input_batch.num_reqs
            rows = (list(self.input_batch.req_ids[:n]), self.optimistic_seq_lens_cpu[:n].tolist(),
                    [bool(x) for x in self.discard_request_mask.np[:n]])
        except AttributeError:  # a runner without these fields: no records are stored
            return native_sample(self, logits, spec_decode_metadata)
        with kept_store.sampling_rows(*rows):
            return native_sample(self, logits, spec_decode_metadata)

    _sample.__qualname__ = "rlk_sample_rows[GPUModelRunner._sample]"
    return _sample


def _rpc_take_kept_sets(self) -> dict[str, dict[int, tuple[float, int]]]:
    """``WorkerWrapperBase.rlk_take_kept_sets``: this rank's kept-set records (removed)."""
    return kept_store.take()


def _rpc_provenance(self) -> dict[str, Any]:
    """``WorkerWrapperBase.rlk_provenance``: this rank's :func:`~.stats.snapshot`."""
    snap = stats.snapshot()
    snap["installed"] = installed_mode()
    rank = getattr(self, "rpc_rank", None)
    snap["rank"] = int(rank) if rank is not None else 0
    return snap


def _rpc_reset(self) -> None:
    """``WorkerWrapperBase.rlk_reset_provenance``: zero this rank's counts."""
    stats.reset()


def install(*, strict: bool = False) -> str:
    """Install the rl_engine operators into vLLM in this process (idempotent).

    Args:
        strict: raise :class:`~.stats.NativeFallbackError` when a native forward of a replaced
            kind runs (default: count it).

    Returns:
        The mode now installed: ``"strict"`` or ``"diagnostic"``.

    Raises:
        RuntimeError: already installed with the other mode (call :func:`uninstall` first).
    """
    mode = "strict" if strict else "diagnostic"
    cur = _STATE.get("install")
    if cur is not None:
        if cur.mode != mode:
            raise RuntimeError(f"strict: rl_engine's vLLM plugin is already installed in {cur.mode!r} mode; "
                               f"call uninstall() before installing in {mode!r} mode")
        return mode
    import importlib

    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers import rotary_embedding as _rope
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector as _selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from rl_engine.integrations.vllm.layers import OOT_CLASSES

    inst = _Install(mode=mode, env_before=os.environ.get(ENV_VAR))
    try:
        for base, repl in OOT_CLASSES.items():
            name = base.__name__
            have = op_registry_oot.get(name)
            if have is not None and have is not repl:
                raise RuntimeError(f"{name}: another out-of-tree replacement is registered in vLLM ({have!r})")
            if have is None:
                base.register_oot(repl, name=name)
                inst.oot_names.append(name)
            log.info("rl_engine: vLLM %s -> %s (register_oot)", name, repl.__name__)
        _rope._ROPE_DICT.clear()
        log.info("rl_engine: cleared vLLM's RoPE instance cache (get_rope)")
        targets = [AttentionBackendEnum.CUSTOM]
        if current_platform.is_cpu():
            targets.append(AttentionBackendEnum.CPU_ATTN)
        for t in targets:
            if t.is_overridden() and t.get_path() != _BACKEND_PATH:
                raise RuntimeError(f"attention: vLLM backend {t.name} is already overridden by {t.get_path()}")
            register_backend(t, _BACKEND_PATH)
            inst.backends.append(t)
            log.info("rl_engine: vLLM attention backend %s -> RlkAttentionBackend (register_backend)", t.name)
        _selector._cached_get_attn_backend.cache_clear()
        for attr, fn in (("rlk_provenance", _rpc_provenance), ("rlk_reset_provenance", _rpc_reset),
                         ("rlk_take_kept_sets", _rpc_take_kept_sets)):
            if attr in WorkerWrapperBase.__dict__:
                raise RuntimeError(f"WorkerWrapperBase: already has an attribute {attr!r}")
            _patch(inst, WorkerWrapperBase, attr, fn)
        log.info("rl_engine: vLLM WorkerWrapperBase.rlk_provenance / rlk_reset_provenance / rlk_take_kept_sets "
                 "(collective_rpc)")
        _patch(inst, Sampler, "compute_logprobs", staticmethod(_log_probs))
        log.info("rl_engine: vLLM Sampler.compute_logprobs -> rl_engine.ops.logprob.log_softmax")
        # logprobs_mode="processed_logprobs" (what TRL asks for): computed in the top-k/top-p
        # sampler from the temperature-scaled logits; a sampler binds its forward when built,
        # so this precedes any LLM built after the install.
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

        for name in ("forward_cpu", "forward_native"):
            _patch(inst, TopKTopPSampler, name, _processed_logprobs_wrapper(TopKTopPSampler.__dict__[name]))
            log.info("rl_engine: vLLM TopKTopPSampler.%s processed_logprobs -> rl_engine's canonical top-k/top-p "
                     "filter + ops.logprob.log_softmax(kept=...)", name)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        _patch(inst, GPUModelRunner, "_sample", _sample_wrapper(GPUModelRunner.__dict__["_sample"]))
        log.info("rl_engine: vLLM GPUModelRunner._sample publishes each row's request and position (kept-set records)")
        for module, cls_name, methods in NATIVE_WATCH:
            try:
                cls = getattr(importlib.import_module(module), cls_name)
            except Exception:  # a backend module that does not import on this platform
                continue
            for m in methods:
                fn = getattr(cls, m)
                if m not in cls.__dict__ and getattr(fn, "_rlk_native_counter", False):
                    continue  # inherits the counter of a watched base class
                _patch(inst, cls, m, _counting(f"{cls_name}.{m}", fn))
            log.info("rl_engine: counting native %s.%s calls (%s mode)", cls_name, "/".join(methods), mode)
    except BaseException:
        _revert(inst)
        raise
    os.environ[ENV_VAR] = "strict" if strict else "1"
    stats.set_mode(mode)
    _STATE["install"] = inst
    return mode


def _revert(inst: _Install) -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers import rotary_embedding as _rope
    from vllm.v1.attention import selector as _selector

    for cls, attr, old, had_own in reversed(inst.patches):
        if had_own:
            setattr(cls, attr, old)
        else:
            delattr(cls, attr)
    inst.patches.clear()
    for t in inst.backends:
        t.clear_override()
    inst.backends.clear()
    for name in inst.oot_names:
        op_registry_oot.pop(name, None)
    inst.oot_names.clear()
    _rope._ROPE_DICT.clear()
    _selector._cached_get_attn_backend.cache_clear()


def uninstall() -> bool:
    """Revert :func:`install` in this process (returns ``False`` when nothing was installed).

    Engines already built keep their rl_engine modules; build a new ``LLM`` afterwards.
    """
    inst = _STATE.pop("install", None)
    if inst is None:
        return False
    _revert(inst)
    if inst.env_before is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = inst.env_before
    stats.set_mode("off")
    log.info("rl_engine: vLLM plugin uninstalled (all replacements reverted)")
    return True
