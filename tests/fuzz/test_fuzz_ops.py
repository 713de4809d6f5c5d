"""Fuzz every public operator with malformed inputs (hypothesis, derandomized, small budget).

Each case takes a valid call, corrupts one argument (wrong type, dtype, rank, layout, NaN, inf,
an empty or float index tensor, an out-of-range index) and requires one of two endings:

* a ``TypeError`` / ``ValueError`` whose message starts with the name of one of the operator's
  arguments (``"<name>: ..."``), and every input tensor and KV cache unchanged afterwards;
* a result without NaN when every float input is finite.

Never a crash, another exception type, or a silent NaN.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_engine.ops.loss as L
from rl_engine.ops import activation, attention, embedding, gemm, logprob, norm, packing, rope


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Case:
    fn: Callable
    args: dict  # name -> value, passed by keyword except the names in ``positional``
    positional: tuple[str, ...]
    index_args: tuple[str, ...] = ()  # integer tensors (offsets, ids, positions)
    extra_names: tuple[str, ...] = ()  # other prefixes an error may name (e.g. "cache")
    cache: object | None = None


def _cases() -> dict[str, Callable[[], Case]]:
    g = _g()
    lp = lambda: -torch.rand(2, 5, generator=_g(1)) * 2  # noqa: E731
    mask = lambda: torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # noqa: E731

    def cached():
        cache = attention.PagedKVCache(8, 2, 1, 4, max_seqs=2)
        cache.extend(0, torch.randn(3, 1, 4, generator=_g(2)), torch.randn(3, 1, 4, generator=_g(3)))
        return Case(attention.cached_attention,
                    {"q": torch.randn(3, 2, 4, generator=_g(4)), "k_new": torch.randn(3, 1, 4, generator=_g(5)),
                     "v_new": torch.randn(3, 1, 4, generator=_g(6)), "cache": cache, "seq_ids": [0, 1],
                     "cu_seqlens_q": torch.tensor([0, 1, 3])},
                    ("q", "k_new", "v_new", "cache", "seq_ids", "cu_seqlens_q"), ("cu_seqlens_q",), ("cache",), cache)

    def extend():
        cache = attention.ContiguousKVCache(2, 6, 1, 4)
        cache.extend(1, torch.ones(2, 1, 4), torch.ones(2, 1, 4))
        return Case(cache.extend, {"seq_id": 1, "k": torch.randn(3, 1, 4, generator=_g(7)),
                                   "v": torch.randn(3, 1, 4, generator=_g(8))},
                    ("seq_id", "k", "v"), (), ("cache",), cache)

    def paged():
        return Case(attention.paged_attention,
                    {"q": torch.randn(3, 2, 4, generator=_g(9)), "k_new": torch.randn(3, 1, 4, generator=_g(10)),
                     "v_new": torch.randn(3, 1, 4, generator=_g(11)), "k_cache": torch.zeros(4, 2, 1, 4),
                     "v_cache": torch.zeros(4, 2, 1, 4), "slot_mapping": torch.tensor([0, 1, 2]),
                     "block_table": torch.tensor([[0, 1]]), "block_size": 2, "cu_seqlens_q": torch.tensor([0, 3]),
                     "seq_lens": torch.tensor([3])},
                    ("q", "k_new", "v_new", "k_cache", "v_cache", "slot_mapping", "block_table", "block_size",
                     "cu_seqlens_q", "seq_lens"), ("slot_mapping", "block_table", "cu_seqlens_q", "seq_lens"))

    return {
        "gemm.linear": lambda: Case(gemm.linear, {"x": torch.randn(3, 4, generator=g), "weight": torch.randn(5, 4, generator=g),
                                                  "bias": torch.randn(5, generator=g)}, ("x", "weight", "bias")),
        "norm.rms_norm": lambda: Case(norm.rms_norm, {"x": torch.randn(3, 8, generator=g), "weight": torch.rand(8, generator=g),
                                                      "eps": 1e-6}, ("x", "weight", "eps")),
        "activation.silu_and_mul": lambda: Case(activation.silu_and_mul, {"x": torch.randn(3, 8, generator=g)}, ("x",)),
        "rope.apply_rope": lambda: Case(rope.apply_rope, {"x": torch.randn(3, 2, 8, generator=g),
                                                          "positions": torch.tensor([0, 1, 5])}, ("x", "positions"),
                                        ("positions",)),
        "embedding.embedding": lambda: Case(embedding.embedding, {"ids": torch.tensor([0, 3, 1]),
                                                                  "weight": torch.randn(4, 6, generator=g)},
                                            ("ids", "weight"), ("ids",)),
        "logprob.log_softmax": lambda: Case(logprob.log_softmax, {"logits": torch.randn(3, 7, generator=g)}, ("logits",)),
        "logprob.token_logprobs": lambda: Case(logprob.token_logprobs, {"logits": torch.randn(3, 7, generator=g),
                                                                        "targets": torch.tensor([0, 6, 2])},
                                               ("logits", "targets"), ("targets",)),
        "logprob.entropy": lambda: Case(logprob.entropy, {"logits": torch.randn(3, 7, generator=g)}, ("logits",)),
        "logprob.linear_token_logprobs": lambda: Case(
            logprob.linear_token_logprobs, {"hidden": torch.randn(3, 4, generator=g), "weight": torch.randn(7, 4, generator=g),
                                            "targets": torch.tensor([1, 2, 6])}, ("hidden", "weight", "targets"), ("targets",)),
        "attention.varlen_attention": lambda: Case(
            attention.varlen_attention, {"q": torch.randn(5, 2, 4, generator=g), "k": torch.randn(5, 1, 4, generator=g),
                                         "v": torch.randn(5, 1, 4, generator=g), "cu_seqlens": torch.tensor([0, 2, 5])},
            ("q", "k", "v", "cu_seqlens"), ("cu_seqlens",)),
        "attention.cached_attention": cached,
        "attention.paged_attention": paged,
        "KVCache.extend": extend,
        "packing.pack": lambda: Case(packing.pack, {"padded": torch.randn(2, 4, generator=g),
                                                    "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])},
                                     ("padded", "attention_mask"), ("attention_mask",)),
        "packing.unpack": lambda: Case(packing.unpack, {"values": torch.randn(5, generator=g),
                                                        "cu_seqlens": torch.tensor([0, 2, 5])},
                                       ("values", "cu_seqlens"), ("cu_seqlens",)),
        "packing.position_ids": lambda: Case(packing.position_ids, {"cu_seqlens": torch.tensor([0, 2, 5])},
                                             ("cu_seqlens",), ("cu_seqlens",)),
        "packing.padding_mask": lambda: Case(packing.padding_mask, {"lengths": torch.tensor([2, 0, 3]), "max_len": 3},
                                             ("lengths", "max_len"), ("lengths",)),
        "loss.ppo_clip_loss": lambda: Case(L.ppo_clip_loss, {"log_probs": lp(), "old_log_probs": lp() - 0.1,
                                                             "advantages": torch.randn(2, 5, generator=g), "mask": mask()},
                                           ("log_probs", "old_log_probs", "advantages", "mask")),
        "loss.kl_penalty": lambda: Case(L.kl_penalty, {"log_probs": lp(), "ref_log_probs": lp() - 0.2, "mask": mask()},
                                        ("log_probs", "ref_log_probs", "mask")),
        "loss.rollout_correction": lambda: Case(L.rollout_correction, {"log_probs": lp(), "rollout_log_probs": lp() - 0.1,
                                                                       "mask": mask()},
                                                ("log_probs", "rollout_log_probs", "mask")),
        "loss.masked_aggregate": lambda: Case(L.masked_aggregate, {"values": torch.randn(2, 5, generator=g), "mask": mask()},
                                              ("values", "mask")),
        "loss.grpo_advantages": lambda: Case(L.grpo_advantages, {"scores": torch.randn(4, generator=g),
                                                                 "group_ids": torch.tensor([0, 0, 1, 1]),
                                                                 "mask": torch.ones(4, 3, dtype=torch.bool)},
                                             ("scores", "group_ids", "mask"), ("group_ids",)),
    }


CASES = _cases()
KINDS = ("type_list", "type_none", "dtype_f16", "dtype_f64", "dtype_int", "rank_up", "rank_down", "non_contiguous",
         "nan", "inf", "neg_inf", "empty", "float_index", "negative_index", "huge_index")


def _corrupt(value, kind: str, is_index: bool):
    """The corrupted argument, or ``None`` when the corruption does not apply to it."""
    if not isinstance(value, torch.Tensor):
        return {"type_list": [1, 2], "type_none": None, "dtype_f16": 1.5, "dtype_int": -3, "nan": float("nan"),
                "inf": float("inf")}.get(kind, "skip")
    t = value.clone()
    if kind == "type_list":
        return t.tolist()
    if kind == "type_none":
        return None
    if kind == "dtype_f16":
        return t.to(torch.float16)
    if kind == "dtype_f64":
        return t.to(torch.float64)
    if kind == "dtype_int":
        return t.to(torch.int64) if t.is_floating_point() else t.to(torch.int16)
    if kind == "rank_up":
        return t.unsqueeze(0)
    if kind == "rank_down":
        return t.reshape(-1)[:1].reshape(()) if t.dim() <= 1 else t.flatten()
    if kind == "non_contiguous":
        return t.t().contiguous().t() if t.dim() == 2 and min(t.shape) > 1 else "skip"
    if kind in ("nan", "inf", "neg_inf"):
        if not t.is_floating_point() or t.numel() == 0:
            return "skip"
        t.view(-1)[t.numel() // 2] = {"nan": float("nan"), "inf": float("inf"), "neg_inf": -float("inf")}[kind]
        return t
    if kind == "empty":
        return t[:0]
    if kind == "float_index":
        return t.to(torch.float32) + 0.5 if is_index else "skip"
    if kind == "negative_index":
        return t - 100 if is_index else "skip"
    if kind == "huge_index":
        return t + 10**6 if is_index else "skip"
    return "skip"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().clone()
    return t.view(torch.uint8) if t.is_floating_point() and t.dim() else t


def _cache_state(cache):
    if cache is None:
        return None
    k, v = cache.rows()
    return cache.snapshot(), _bits(k), _bits(v)


def _same_cache(a, b) -> bool:
    if a is None:
        return True
    return a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def _finite_inputs(args: dict) -> bool:
    return all(torch.isfinite(v).all() for v in args.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    if hasattr(out, "loss"):
        return [out.loss, out.seq_terms]
    if hasattr(out, "is_weights"):
        return [out.is_weights] if out.is_weights is not None else []
    return []


@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data())
@pytest.mark.parametrize("op", sorted(CASES))
def test_malformed_arguments_end_in_a_named_error_or_a_correct_result(op, data):
    case = CASES[op]()
    name = data.draw(st.sampled_from(case.positional), label="argument")
    kind = data.draw(st.sampled_from(KINDS), label="corruption")
    bad = _corrupt(case.args[name], kind, name in case.index_args)
    if isinstance(bad, str) and bad == "skip":
        return
    args = dict(case.args)
    args[name] = bad
    before = {k: _bits(v) for k, v in args.items() if isinstance(v, torch.Tensor)}
    cache_before = _cache_state(case.cache)
    allowed = "|".join(re.escape(n) for n in (*case.positional, *case.extra_names))
    try:
        out = case.fn(**args)
    except (TypeError, ValueError) as exc:
        assert re.match(rf"^({allowed})\b", str(exc)), f"{op}({name}={kind}): error does not name an argument: {exc}"
        for k, v in args.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(_bits(v), before[k]), f"{op}: rejected call changed {k}"
        assert _same_cache(cache_before, _cache_state(case.cache)), f"{op}: rejected call changed the cache"
        return
    if _finite_inputs(args):
        for o in _outputs(out):
            if o.is_floating_point():
                assert not bool(torch.isnan(o).any()), f"{op}({name}={kind}): NaN from finite inputs"
