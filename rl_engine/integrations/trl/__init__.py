"""TRL (``GRPOTrainer``) with rl_engine: HF ``generate`` as the rollout, our operators in the
model, our log-prob head, and optionally our losses.

Pieces (all per instance, all reversible):

* :func:`attach` — on a built ``GRPOTrainer``: installs rl_engine into ``trainer.model``
  (:func:`~rl_engine.integrations.hf.install.install`), replaces TRL's fused LM head
  (``model(..., labels=, fused_lm_head=True)``, added by TRL on the instance) by one computed
  with ``ops.gemm.linear`` + ``ops.logprob.token_logprobs`` / ``entropy`` on fp32 logits — the
  same arithmetic the rollout uses on ``generate``'s raw logits — and returns an
  :class:`Attachment` whose ``detach()`` restores everything. With ``logprobs="processed"``
  (default) top-k / top-p sampling runs as rl_engine's canonical filter
  (:class:`~rl_engine.integrations.hf.rollout.KeptSetRecorder` in ``generate``, or the vLLM
  plugin's sampler), every sampled token's kept-set record is kept in a
  :class:`KeptSetStore` on the model, and the fused LM head scores each completion token
  renormalised over its kept set — the distribution it was drawn from, as the rollout
  reports; ``"full"`` scores the whole vocabulary.
* :class:`LogprobParityMonitor` — a ``TrainerCallback`` that records each generated token's
  log-prob (``generate(output_logits=True)`` → ``log softmax(z / T)``) and every log-prob the
  trainer recomputes for the policy model, matches them by ``(prompt, completion)`` and
  compares raw bits at each step (``history``: one row per step).
* :class:`RLKGRPOTrainer` — ``GRPOTrainer`` whose loss is
  :func:`rl_engine.ops.loss.grpo_loss` / :func:`~rl_engine.ops.loss.dapo_loss` /
  :func:`~rl_engine.ops.loss.dr_grpo_loss` (+ ``kl_penalty`` k3 when ``beta != 0``).

* :func:`vllm_colocate` — TRL with ``use_vllm=True, vllm_mode="colocate"``: enables the
  rl_engine vLLM plugin in this process *before* the trainer builds its ``LLM``, then
  :meth:`VLLMColocate.attach` puts rl_engine into the trainer's forward (as :func:`attach`).
  vLLM samples and returns each token's log-prob with rl_engine operators, the trainer
  recomputes it with the same operators, and TRL's own ``sampling/sampling_logp_difference/max``
  is 0.0 (docs/integrations/trl.md).

TRL computes ``position_ids`` nowhere (HF numbers padded rows physically); the install
derives logical positions from the padding mask, so TRL's left-padded recompute and
``generate`` rotate every token at the same position.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine.integrations.hf.install import HFInstall, install

log = logging.getLogger("rl_engine.integrations.trl")

__all__ = ["attach", "Attachment", "KeptSetStore", "LogprobParityMonitor", "RLKGRPOTrainer", "rlk_fused_forward",
           "vllm_colocate", "VLLMColocate", "sampling_logp_differences", "SAMPLING_LOGP_DIFF_MAX"]

#: The model attributes (instance ``__dict__``) holding the attachment's :class:`KeptSetStore` and
#: what its fused LM head scores (``"processed"``: with the store's records; ``"full"``).
KEPT_ATTR = "_rlk_kept"
MODE_ATTR = "_rlk_logprobs"


class KeptSetStore:
    """Kept-set records of the last generation, by ``(prompt tokens, completion tokens)``.

    ``add`` stores the records ``[N]`` of one generated completion; ``find`` returns those of a
    completion the trainer scores (the stored completion may run on past an EOS where the trainer
    masks it: the trainer's completion is matched as a prefix). A new generation clears it.
    """

    def __init__(self) -> None:
        self._by_prompt: dict[tuple[int, ...], list[tuple[tuple[int, ...], Any]]] = {}
        #: records ``[B, N]`` of the rows of the last ``generate`` call (HF path), for the monitor
        self.last = None

    def clear(self) -> None:
        self._by_prompt.clear()
        self.last = None

    def add(self, prompt: tuple[int, ...], completion: tuple[int, ...], kept) -> None:
        if tuple(kept.shape) != (len(completion),):
            raise ValueError(f"kept: expected {len(completion)} records (one per completion token), got {tuple(kept.shape)}")
        self._by_prompt.setdefault(tuple(prompt), []).append((tuple(completion), kept))

    def find(self, prompt: tuple[int, ...], completion: tuple[int, ...]):
        """The records ``[len(completion)]`` of ``completion`` after ``prompt``, or ``None``."""
        n = len(completion)
        for comp, kept in self._by_prompt.get(tuple(prompt), ()):
            if comp[:n] == tuple(completion) and len(comp) >= n:
                return kept[:n]
        return None

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_prompt.values())


def rlk_fused_forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                      num_items_in_batch=None, **kwargs):
    """TRL's fused-LM-head protocol with rl_engine ops (bound to the model instance).

    ``fused_lm_head=False`` is the model's own forward. With ``True``: backbone → hidden states
    ``[B, L-1, H]`` → ``ops.gemm.linear`` (LM head) → fp32 → ``token_logprobs`` and ``entropy``
    at the trainer's temperature; zero where the label is ``-100``. With the attachment's
    :class:`KeptSetStore` (``logprobs="processed"``), each row's completion tokens are scored
    renormalised over the kept sets recorded when they were generated (looked up by prompt and
    completion tokens); a row without records raises.
    """
    from trl.trainer.utils import FusedCausalLMOutput

    from rl_engine.ops.gemm import linear
    from rl_engine.ops.logprob import entropy, token_logprobs

    if not fused_lm_head:
        for k, v in (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch)):
            if v is not None:
                kwargs[k] = v
        return type(self).forward(self, *args, **kwargs)
    if labels is None and shift_labels is None:
        raise ValueError("labels: the fused LM head needs labels (-100 where not scored)")
    kwargs["use_cache"] = False
    out = self.base_model(*args, **kwargs)
    if shift_labels is None:
        hidden, labels = out.last_hidden_state[:, :-1], labels[:, 1:]
    else:
        hidden, labels = out.last_hidden_state, shift_labels
    T = self.__dict__["_rlk_temperature"]
    head = self.get_output_embeddings()
    z = linear(hidden.contiguous(), head.weight, head.bias).float().contiguous()
    mask = labels != -100
    store = self.__dict__.get(KEPT_ATTR) if self.__dict__.get(MODE_ATTR) == "processed" else None
    ids = kwargs.get("input_ids", args[0] if args else None)
    kept = _row_kept(store, ids, kwargs.get("attention_mask"), labels, mask) if store is not None else None
    lp = token_logprobs(z, labels.masked_fill(~mask, 0).contiguous(), temperature=T, kept=kept)
    ent = entropy(z, temperature=T, kept=kept)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    lp = torch.where(mask, lp, zero)
    ent = torch.where(mask, ent, zero)
    n = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=-lp.sum() / n, log_probs=lp, entropy=ent, label_mask=mask)


def _row_kept(store: KeptSetStore, input_ids, attention_mask, labels, mask):
    """The kept-set records ``[B, L']`` of the (shifted) ``labels`` ``[B, L']``: each row's
    completion (its scored labels) looked up in ``store`` by its prompt (the real tokens of
    ``input_ids`` before the completion) and completion tokens; keep-all where not scored."""
    from rl_engine.ops.logprob import KeptSet

    if input_ids is None:
        raise ValueError("input_ids: processed log-probs look up each row's kept sets by its tokens; pass input_ids")
    kept = KeptSet.everything(labels.shape, device=labels.device)
    for b in range(labels.shape[0]):
        cols = torch.nonzero(mask[b]).squeeze(1)
        if cols.numel() == 0:
            continue
        p0 = int(cols[0]) + 1  # label c is the token at input position c + 1: the completion's first token
        real = attention_mask[b, :p0].bool() if attention_mask is not None else torch.ones(p0, dtype=torch.bool)
        prompt = tuple(input_ids[b, :p0][real.to(input_ids.device)].tolist())
        completion = tuple(labels[b, cols].tolist())
        rec = store.find(prompt, completion)
        if rec is None:
            raise ValueError(f"kept: no kept-set record for row {b} (prompt of {len(prompt)} tokens, completion of "
                             f"{len(completion)}); processed log-probs score only completions of the attached generation")
        kept.threshold[b, cols] = rec.threshold.to(kept.threshold.device)
        kept.boundary[b, cols] = rec.boundary.to(kept.boundary.device, torch.int32)
    return kept


@dataclass
class Attachment:
    """What :func:`attach` changed; :meth:`detach` restores it."""

    model: torch.nn.Module
    install: HFInstall
    previous_forward: Any
    active: bool = True
    #: what the fused LM head scores: ``"processed"`` (with the records) or ``"full"``
    logprobs: str = "processed"
    #: the kept-set records of the last generation (``generate`` or the colocated vLLM)
    kept: KeptSetStore | None = None
    previous_generate: Any = None

    def detach(self) -> None:
        if not self.active:
            return
        if self.previous_forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self.previous_forward
        if self.kept is not None:
            if self.previous_generate is None:
                self.model.__dict__.pop("generate", None)
            else:
                self.model.generate = self.previous_generate
        self.model.__dict__.pop("_rlk_temperature", None)
        self.model.__dict__.pop(KEPT_ATTR, None)
        self.model.__dict__.pop(MODE_ATTR, None)
        self.install.unapply()
        self.active = False


#: Generation options that change the distribution in ways the kept-set records do not describe.
_UNREPLAYED = (("repetition_penalty", (1.0, None)), ("min_p", (0.0, None)))


def _filters_on(trainer) -> bool:
    """Whether the trainer samples with top-k or top-p (else every kept set is the vocabulary)."""
    return getattr(trainer, "top_k", None) not in (0, -1, None) or getattr(trainer, "top_p", None) not in (1.0, None)


def _check_replayable(trainer) -> None:
    for name, neutral in _UNREPLAYED:
        value = getattr(trainer, name, None)
        if value not in neutral:
            raise ValueError(f"args.{name}: {value!r} changes the sampling distribution in a way the kept-set records do "
                             f"not replay (only temperature, top_k and top_p are); use {name}={neutral[0]!r}")


def _recording_generate(model, store: KeptSetStore):
    """``model.generate`` with rl_engine's canonical top-k / top-p filter in place of HF's warpers
    (:class:`~rl_engine.integrations.hf.rollout.KeptSetRecorder`); each call clears ``store`` and
    fills it with every row's records (``store.last``: ``[B, N]``)."""
    import copy

    from rl_engine.integrations.hf.rollout import KeptSetRecorder

    gen = model.generate

    def generate(model_self, *args, **kwargs):
        cfg = copy.deepcopy(kwargs.get("generation_config") or model_self.generation_config)
        store.clear()
        if not cfg.do_sample:
            return gen(*args, **kwargs)
        recorder = KeptSetRecorder(float(cfg.temperature or 1.0), int(cfg.top_k or 0), float(cfg.top_p or 1.0))
        cfg.temperature, cfg.top_k, cfg.top_p = 1.0, 0, 1.0
        kwargs["generation_config"] = cfg
        kwargs["logits_processor"] = [*(kwargs.get("logits_processor") or []), recorder]
        out = gen(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        seqs = out.sequences if hasattr(out, "sequences") else out
        new = seqs[:, ids.shape[1]:]
        kept = recorder.kept(new.shape[0], "cpu")
        store.last = kept
        for b in range(new.shape[0]):
            store.add(tuple(ids[b][mask[b].bool()].tolist()), tuple(new[b].tolist()), kept[b])
        return out

    return generate


def attach(trainer, *, logprobs: str = "processed") -> Attachment:
    """Install rl_engine into ``trainer.model`` and serve TRL's fused LM head with our ops.

    ``model.generate`` samples with rl_engine's canonical top-k / top-p filter
    (:class:`~rl_engine.integrations.hf.rollout.KeptSetRecorder` in place of HF's warpers: the
    same distribution as HF's temperature warper when no filter is on) and records every
    generated token's kept set in the attachment's :class:`KeptSetStore`.

    Args:
        logprobs: what the fused LM head scores. ``"processed"`` (default): each completion
            token renormalised over its recorded kept set — the distribution it was drawn from,
            what a rollout engine reports; ``"full"``: the whole vocabulary (the bias of a trainer
            that ignores the filter). Without top-k / top-p the two are the same bits.

    Raises:
        TypeError: ``trainer`` has no ``model`` / ``temperature`` (not a TRL GRPO-style trainer).
        ValueError: ``logprobs`` is not ``processed`` or ``full``; with ``processed``, a
            ``repetition_penalty`` or ``min_p`` is set (not replayed by the records).
        InstallConflict: see :func:`~rl_engine.integrations.hf.install.install`.
    """
    model = getattr(trainer, "model", None)
    if model is None or not hasattr(trainer, "temperature"):
        raise TypeError(f"trainer: expected a TRL GRPOTrainer-like object, got {type(trainer).__name__}")
    if logprobs not in ("processed", "full"):
        raise ValueError(f"logprobs: expected 'processed' or 'full', got {logprobs!r}")
    if logprobs == "processed":
        _check_replayable(trainer)
    inst = install(model)
    previous = model.__dict__.get("forward")
    model.__dict__["_rlk_temperature"] = float(trainer.temperature)
    model.forward = types.MethodType(rlk_fused_forward, model)
    att = Attachment(model, inst, previous, logprobs=logprobs, kept=KeptSetStore(),
                     previous_generate=model.__dict__.get("generate"))
    model.__dict__[KEPT_ATTR] = att.kept
    # without a filter every record keeps the whole vocabulary: the full scores are those bits, and
    # rows that no attached generation produced (e.g. a hand-made batch) need no record
    model.__dict__[MODE_ATTR] = logprobs if _filters_on(trainer) else "full"
    model.generate = types.MethodType(_recording_generate(model, att.kept), model)
    return att


#: TRL's per-step metric: ``max |logp_train - logp_vllm|`` over the completion tokens.
SAMPLING_LOGP_DIFF_MAX = "sampling/sampling_logp_difference/max"


def sampling_logp_differences(trainer) -> list[dict[str, float]]:
    """TRL's logged vLLM-vs-trainer log-prob differences, one row per logging step:
    ``{"step", "mean", "max"}`` from ``trainer.state.log_history`` (logged when
    ``vllm_importance_sampling_correction=True``, TRL's default)."""
    rows = []
    for r in trainer.state.log_history:
        if SAMPLING_LOGP_DIFF_MAX in r:
            rows.append({"step": r.get("step"), "mean": r.get("sampling/sampling_logp_difference/mean"),
                         "max": r[SAMPLING_LOGP_DIFF_MAX]})
    return rows


class VLLMColocate:
    """TRL GRPO with vLLM colocated, rl_engine on both sides (made by :func:`vllm_colocate`).

    Lifecycle: the plugin is installed when the object is made, TRL's ``LLM`` call gets
    ``llm_kwargs`` and the plugin makes vLLM's sampler return rl_engine's processed log-probs (so
    the ``LLM`` that ``GRPOTrainer.__init__`` builds runs rl_engine layers, attention and
    log-probs);
    :meth:`attach` installs rl_engine into the trainer's model (:func:`attach`) and zeroes the
    vLLM-side counts; :meth:`provenance` / :meth:`assert_no_fallbacks` read what vLLM ran;
    :meth:`close` detaches the trainer side, restores TRL's ``LLM`` and vLLM's sampler, and
    uninstalls the plugin (if this object installed it).
    """

    #: Sampling options whose non-default value makes vLLM's processed log-prob that of a
    #: distribution the trainer cannot replay (``top_k`` / ``top_p`` are: rl_engine's filter in
    #: vLLM's sampler, its kept-set records in the trainer's head).
    _FILTERS = (("min_p", (0.0, None)), ("repetition_penalty", (1.0, None)))

    def __init__(self, strict: bool = True, llm_kwargs: dict[str, Any] | None = None) -> None:
        import trl.generation.vllm_generation as trl_vllm

        from rl_engine.integrations import vllm as rlk_vllm

        self.strict = bool(strict)
        self.llm_kwargs = {"enforce_eager": True, **(llm_kwargs or {})}
        self._vllm = rlk_vllm
        mode = rlk_vllm.installed_mode()
        if mode is not None and mode != ("strict" if self.strict else "diagnostic"):
            raise RuntimeError(f"strict: the rl_engine vLLM plugin is already installed in {mode!r} mode here; "
                               f"uninstall it first or pass strict={mode == 'strict'}")
        if getattr(trl_vllm.LLM, "_rlk_colocate", False):
            raise RuntimeError("vllm_colocate: another vllm_colocate session is open in this process; close it first")
        self._installed_here = mode is None
        if self._installed_here:
            rlk_vllm.install(strict=self.strict)
        # TRL builds its LLM with neither enforce_eager nor dtype; the rl_engine layers run eagerly
        # (vLLM would otherwise torch.compile the model around them), so TRL's LLM gets llm_kwargs.
        self._trl_vllm, self._trl_llm = trl_vllm, trl_vllm.LLM
        original, extra = trl_vllm.LLM, self.llm_kwargs

        def build_llm(*args, **kwargs):
            kwargs.update(extra)
            return original(*args, **kwargs)

        build_llm._rlk_colocate = True  # type: ignore[attr-defined]
        trl_vllm.LLM = build_llm
        log.info("rl_engine: trl.generation.vllm_generation.LLM -> LLM(..., %s)",
                 ", ".join(f"{k}={v!r}" for k, v in self.llm_kwargs.items()))
        self.trainer = None
        self.attachment: Attachment | None = None
        self.active = True

    def attach(self, trainer, *, logprobs: str = "processed") -> Attachment:
        """Install rl_engine into ``trainer.model`` (:func:`attach`) after checking that the
        trainer samples with a colocated vLLM built under the plugin.

        Top-k / top-p run as rl_engine's canonical filter in the plugin's sampler; the trainer's
        ``LLM.generate`` is wrapped to fetch each completion's kept-set records
        (:func:`rl_engine.integrations.vllm.kept_sets`) into the attachment's
        :class:`KeptSetStore`. With ``logprobs="processed"`` (default) the trainer scores each
        completion token renormalised over its kept set — vLLM's processed log-prob, bit for
        bit; with ``"full"`` over the whole vocabulary (TRL's metric then shows the filter's
        bias: the negative control).

        Raises:
            ValueError: ``args.use_vllm`` is off, ``args.vllm_mode`` is not ``"colocate"``, or a
                sampling option the records do not describe is on (``min_p``,
                ``repetition_penalty``) — vLLM's processed log-prob is then that of another
                distribution than the trainer's.
            RuntimeError: the trainer's ``LLM`` does not run the plugin (built before it was
                installed, or in another process).
        """
        if not self.active:
            raise RuntimeError("trainer: this vllm_colocate session is closed")
        if not getattr(trainer, "use_vllm", False) or getattr(trainer, "vllm_mode", None) != "colocate":
            raise ValueError("trainer: expected a GRPOTrainer with args.use_vllm=True and args.vllm_mode='colocate', got "
                             f"use_vllm={getattr(trainer, 'use_vllm', None)!r}, vllm_mode={getattr(trainer, 'vllm_mode', None)!r}")
        for name, neutral in self._FILTERS:
            value = getattr(trainer, name, None)
            if value not in neutral:
                raise ValueError(f"args.{name}: {value!r} filters or penalises the sampling distribution in a way the "
                                 f"trainer does not replay, so vLLM's log-prob is not the trainer's; use "
                                 f"{name}={neutral[0]!r}")
        llm = self.llm_of(trainer)
        try:
            prov = self._vllm.vllm_provenance(llm)
        except AssertionError:  # ProvenanceError: a worker without the plugin
            prov = []
        if not prov or not all(p.get("installed") for p in prov):
            raise RuntimeError("trainer: its vLLM engine does not run the rl_engine plugin (build the GRPOTrainer "
                               "inside vllm_colocate(), after the plugin is installed)")
        self.trainer = trainer
        self.attachment = attach(trainer, logprobs=logprobs)
        self._record_kept_sets(llm, self.attachment)
        self._vllm.reset_provenance(llm)
        return self.attachment

    def _record_kept_sets(self, llm, att: Attachment) -> None:
        """Wrap ``llm.generate`` (on the instance) so every call refills ``att``'s store with the
        kept-set records of its completions; the trainer's fused LM head reads them
        (``logprobs="processed"``)."""
        store = KeptSetStore()
        original = llm.generate
        vllm = self._vllm

        def generate(*args, **kwargs):
            store.clear()
            outs = original(*args, **kwargs)
            for o, kept in zip(outs, vllm.kept_sets(llm, outs, require=False)):
                store.add(tuple(o.prompt_token_ids), tuple(o.outputs[0].token_ids), kept)
            return outs

        llm.generate = generate
        att.model.__dict__[KEPT_ATTR] = store
        att.kept = store
        self._llm_generate = (llm, original)

    @staticmethod
    def llm_of(trainer):
        """The ``vllm.LLM`` TRL built for ``trainer`` (``trainer.vllm_generation.llm``)."""
        gen = getattr(trainer, "vllm_generation", None)
        llm = getattr(gen, "llm", None)
        if llm is None:
            raise ValueError("trainer: no colocated vLLM engine (trainer.vllm_generation.llm) was found")
        return llm

    def provenance(self) -> list[dict[str, Any]]:
        """What every vLLM worker ran since :meth:`attach` (see ``vllm_provenance``)."""
        if self.trainer is None:
            raise RuntimeError("trainer: call attach(trainer) first")
        return self._vllm.vllm_provenance(self.llm_of(self.trainer))

    #: What a TRL colocated generation must run in vLLM: every Qwen3 kind, with the returned
    #: log-probs from the sampler's processed path (TRL samples; ``compute_logprobs`` serves
    #: only greedy requests there).
    REQUIRED_KINDS = ("RMSNorm", "SiluAndMul", "RotaryEmbedding", "QKVParallelLinear", "MergedColumnParallelLinear",
                      "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "Attention",
                      "Sampler.processed_logprobs")

    def assert_no_fallbacks(self) -> list[dict[str, Any]]:
        """:meth:`provenance`, checked: plugin installed, zero native forwards, no rl_engine
        fallback, every kind of :data:`REQUIRED_KINDS` ran (raises ``ProvenanceError`` otherwise)."""
        prov = self.provenance()
        self._vllm.assert_no_fallbacks(prov, require=self.REQUIRED_KINDS)
        return prov

    def close(self) -> None:
        """Detach the trainer side; uninstall the plugin if this session installed it."""
        if not self.active:
            return
        if self.attachment is not None:
            self.attachment.detach()
        wrapped = getattr(self, "_llm_generate", None)
        if wrapped is not None:
            wrapped[0].__dict__.pop("generate", None)
        self._trl_vllm.LLM = self._trl_llm
        if self._installed_here:
            self._vllm.uninstall()
        self.active = False

    def __enter__(self) -> "VLLMColocate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def vllm_colocate(*, strict: bool = True, llm_kwargs: dict[str, Any] | None = None) -> VLLMColocate:
    """Enable rl_engine on both sides of TRL's GRPO with a colocated vLLM (use as a context manager).

    ::

        with vllm_colocate() as colocate:           # the vLLM plugin is on in this process
            trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
            colocate.attach(trainer)                 # rl_engine in the trainer's forward
            trainer.train()
            colocate.assert_no_fallbacks()           # vLLM ran only rl_engine operators
        sampling_logp_differences(trainer)           # TRL's metric: max == 0.0 at every step

    What makes TRL's ``sampling/sampling_logp_difference/max`` exactly 0: TRL builds its
    ``LLM`` with ``logprobs_mode="processed_logprobs"`` (``log softmax(z / T)`` of the sampled
    token, with the fp32 division ``z / T`` vLLM applies before sampling) and ``logprobs=0``;
    under the plugin vLLM's layers, paged attention and LM head are rl_engine operators (linear
    weights stay plain parameters with their ``weight_loader``, so TRL's ``load_weights`` sync
    works on CPU), and the plugin routes that processed log-softmax, which vLLM computes in
    its top-k/top-p sampler, through ``rl_engine.ops.logprob.log_softmax`` (counted as
    ``Sampler.processed_logprobs`` in the vLLM provenance). The trainer recomputes each completion token with
    ``_get_per_token_logps_and_entropies`` → ``model(..., fused_lm_head=True)``, which
    :func:`attach` serves with ``gemm.linear`` + ``logprob.token_logprobs(z, T)`` on a model
    whose modules and attention are rl_engine's (HF install, logical positions under left
    padding). Same operators, same per-row arithmetic (row- and batch-invariant by contract):
    the same bits. Both sides must run one dtype (see ``llm_kwargs``).

    TRL's ``LLM(...)`` call gets ``llm_kwargs`` added (while the session is open): by default
    ``enforce_eager=True`` — the rl_engine layers run eagerly, and TRL passes no such option
    (vLLM would compile the model with ``torch.compile``). ``llm_kwargs={"dtype": "float32"}``
    keeps a float32 checkpoint in float32 (TRL passes no ``dtype``: vLLM's ``"auto"`` runs a
    float32 checkpoint in bf16 on CPU, so the trainer would have to run bf16).

    Args:
        strict: the plugin's strict mode (a native vLLM forward of a replaced kind raises).
        llm_kwargs: extra ``vllm.LLM`` arguments for TRL's engine (override TRL's).

    Raises:
        ImportError: vLLM is not importable (run in the vLLM environment, ``.venv-vllm``).
        RuntimeError: the plugin is already installed here in the other mode.
    """
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        raise ImportError(f"vllm_colocate needs vLLM, which is not importable here ({type(exc).__name__}: {exc}); "
                          "run it in the vLLM environment (.venv-vllm, created by `make test`)") from exc
    return VLLMColocate(strict=strict, llm_kwargs=llm_kwargs)


def _key(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion: torch.Tensor, n: int) -> tuple:
    return tuple(prompt_ids[prompt_mask.bool()].tolist()), tuple(completion[:n].tolist())


@dataclass
class _Rollout:
    logprobs: dict[tuple, torch.Tensor] = field(default_factory=dict)


class LogprobParityMonitor:
    """Raw-bit comparison of rollout log-probs (``generate``) and the trainer's recomputed ones.

    The rollout log-prob of each token is the processed one when :func:`attach` records kept
    sets (``logprobs="processed"``): renormalised over the kept set it was drawn from.

    Use ``monitor = LogprobParityMonitor(trainer)`` before ``trainer.train()`` (it wraps
    ``model.generate`` and the trainer's per-token log-prob method on the instances and adds
    itself as a callback), then read ``monitor.history``: per step ``{"step", "compared",
    "mismatched", "max_abs_diff"}``. ``close()`` removes the wrappers.
    """

    def __init__(self, trainer) -> None:
        from transformers import TrainerCallback

        self.trainer = trainer
        self.model = trainer.model
        self.history: list[dict[str, Any]] = []
        self._rollout: dict[tuple, torch.Tensor] = {}
        self._captured: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = []
        self._orig_generate = self.model.__dict__.get("generate")
        self._orig_logps = trainer.__dict__.get("_get_per_token_logps_and_entropies")
        gen = self.model.generate
        logps = trainer._get_per_token_logps_and_entropies
        monitor = self

        def generate(model_self, *args, **kwargs):
            from rl_engine.ops.logprob import token_logprobs

            import copy

            if kwargs.get("generation_config") is not None:  # ask for the raw logits on a copy of TRL's config
                cfg_copy = copy.deepcopy(kwargs["generation_config"])
                cfg_copy.output_logits, cfg_copy.return_dict_in_generate = True, True
                kwargs["generation_config"] = cfg_copy
            else:
                kwargs.update(output_logits=True, return_dict_in_generate=True)
            out = gen(*args, **kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            cfg = kwargs.get("generation_config") or model_self.generation_config
            T = float(cfg.temperature) if cfg.do_sample else 1.0
            new = out.sequences[:, ids.shape[1]:].contiguous()
            store = model_self.__dict__.get(KEPT_ATTR)  # attach(logprobs="processed"): the step's kept sets
            kept = store.last.to(new.device) if store is not None and store.last is not None else None
            lp = token_logprobs(torch.stack(out.logits, 1).float().contiguous(), new, temperature=T, kept=kept)
            monitor._rollout = {}
            for b in range(ids.shape[0]):
                monitor._rollout.setdefault(_key(ids[b], mask[b], new[b], new.shape[1]), lp[b].detach().cpu())
            return out.sequences

        def per_token_logps(trainer_self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            res = logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if model is monitor.model or getattr(model, "module", None) is monitor.model:
                monitor._captured.append((input_ids.detach().cpu(), attention_mask.detach().cpu(), int(logits_to_keep),
                                          res[0].detach().float().cpu()))
            return res

        self.model.generate = types.MethodType(generate, self.model)
        trainer._get_per_token_logps_and_entropies = types.MethodType(per_token_logps, trainer)

        class _Callback(TrainerCallback):
            def on_step_end(self_cb, args, state, control, **kw):
                monitor._check(state.global_step)

        self.callback = _Callback()
        trainer.add_callback(self.callback)

    def _check(self, step: int) -> None:
        from rl_engine.utils.bits import same_bits

        compared = mismatched = 0
        max_abs = 0.0
        unmatched = 0
        for ids, mask, keep, lp in self._captured:
            P = ids.shape[1] - keep
            for b in range(ids.shape[0]):
                cmask = mask[b, P:].bool()
                n = int(cmask.sum())
                full = self._find(ids[b, :P], mask[b, :P], ids[b, P:], n)
                if full is None:
                    unmatched += 1
                    continue
                d = same_bits(full[:n].contiguous(), lp[b, :n].contiguous())
                compared += n
                mismatched += d.mismatched
                if n:
                    max_abs = max(max_abs, float((full[:n] - lp[b, :n]).abs().max()))
        self._captured = []
        self.history.append({"step": step, "compared": compared, "mismatched": mismatched,
                             "max_abs_diff": max_abs, "unmatched_rows": unmatched})

    def _find(self, prompt, pmask, completion, n):
        key_p = tuple(prompt[pmask.bool()].tolist())
        key_c = tuple(completion[:n].tolist())
        for (kp, kc), lp in self._rollout.items():
            if kp == key_p and kc[:n] == key_c:
                return lp
        return None

    def close(self) -> None:
        if self._orig_generate is None:
            self.model.__dict__.pop("generate", None)
        else:
            self.model.generate = self._orig_generate
        if self._orig_logps is None:
            self.trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
        else:
            self.trainer._get_per_token_logps_and_entropies = self._orig_logps
        self.trainer.remove_callback(self.callback)


def _make_trainer_class():
    from trl import GRPOTrainer

    class RLKGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` whose policy loss is computed by :mod:`rl_engine.ops.loss`.

        Supported: ``loss_type`` in ``grpo`` (seq-mean-token-mean), ``dapo`` (token-mean over the
        generation batch's active tokens), ``dr_grpo`` (token-sum / ``max_completion_length``),
        token-level importance sampling, ``beta`` (k3 KL to the reference model, with
        ``use_bias_correction_kl=False``). Anything else raises (in ``__init__`` or at the first loss).
        """

        SUPPORTED = ("grpo", "dapo", "dr_grpo")

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bad = []
            if self.loss_type not in self.SUPPORTED:
                bad.append(f"loss_type={self.loss_type!r} (supported: {self.SUPPORTED})")
            if self.importance_sampling_level != "token":
                bad.append(f"importance_sampling_level={self.importance_sampling_level!r}")
            if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None or self.use_vllm:
                bad.append("top_entropy_quantile/off_policy_mask_threshold/use_vllm")
            if getattr(self, "_entropy_bonus_enabled", False) or self.args.delta is not None:
                bad.append("entropy bonus / delta")
            if bad:
                raise ValueError("args: RLKGRPOTrainer does not support " + ", ".join(bad))

        def _compute_loss(self, model, inputs):
            from rl_engine.ops import loss as L

            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            logits_to_keep = completion_ids.size(1)
            mask = completion_mask.bool()
            logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            adv = inputs["advantages"]
            adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(logps).float().contiguous()
            mode = "train" if self.model.training else "eval"
            accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            eps_low, eps_high = self.epsilon_low, self.epsilon_high
            logps_c, old_c, mask_c = logps.contiguous(), old.float().contiguous(), mask.contiguous()
            if self.loss_type == "grpo":
                red = dict(reduction="seq-mean-token-mean")
                out = L.grpo_loss(logps_c, old_c, adv, mask_c, eps_low=eps_low, eps_high=eps_high, **red)
                scale = 1.0 / accum
            elif self.loss_type == "dr_grpo":
                red = dict(reduction="seq-mean-token-sum-norm", loss_scale_factor=float(self.max_completion_length))
                out = L.dr_grpo_loss(logps_c, old_c, adv, mask_c, eps_low=eps_low, eps_high=eps_high, **red)
                scale = 1.0 / accum
            else:  # dapo: token-mean over the whole generation batch (TRL's num_items_in_batch)
                den = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
                if mode == "train":
                    den = den * accum / self.args.steps_per_generation
                red = dict(reduction="token-mean", denominator=den)
                out = L.dapo_loss(logps_c, old_c, adv, mask_c, eps_low=eps_low, eps_high=eps_high, **red)
                scale = 1.0
            loss = out.loss
            if self.beta != 0.0 and getattr(self.args, "use_bias_correction_kl", False):
                raise ValueError("args: use_bias_correction_kl=True (KL weighted by the importance ratio) is not "
                                 "supported by RLKGRPOTrainer; set it to False")
            if self.beta != 0.0:  # TRL adds beta * k3 per token before reducing: same reduction here
                kl = L.kl_penalty(logps_c, inputs["ref_per_token_logps"].float().contiguous(), mask_c, estimator="k3", **red)
                loss = loss + self.beta * kl.loss
                self._metrics[mode]["kl"].append(float(kl.loss.detach()))
            for name, value in out.metrics.items():
                if value.numel() == 1 and torch.isfinite(value):
                    self._metrics[mode][f"rlk/{name}"].append(float(value))
            return loss * scale

    return RLKGRPOTrainer


def __getattr__(name: str):
    if name == "RLKGRPOTrainer":  # trl is imported only when the trainer class is asked for
        cls = _make_trainer_class()
        globals()["RLKGRPOTrainer"] = cls
        return cls
    raise AttributeError(name)
