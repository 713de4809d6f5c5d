"""rl_engine's KV cache behind transformers' ``Cache`` interface (``RlkCache``), the packed
training layout, and ``torch.compile`` of the installed model.

Each parity check compares raw bits (``same_bits``) and has a negative control: plain
transformers, or the path the feature replaces, fails the same check.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rl_engine.integrations.hf.install import install, is_installed
from rl_engine.integrations.hf.rollout import generate_with_logprobs
from rl_engine.integrations.hf.train import train_token_logprobs
from rl_engine.utils.bits import same_bits
from tests.helpers.qwen3 import TINY_CONFIGS, build_hf_model

CONFIG = "h16-gqa2-tied-2l"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PAD = 0


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), PAD, dtype=torch.int64)
    mask = torch.zeros(len(lengths), P, dtype=torch.int64)
    for i, n in enumerate(lengths):
        ids[i, P - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, P - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def models():
    base = build_hf_model(TINY_CONFIGS[CONFIG])
    base.generation_config.pad_token_id = PAD
    return {name: copy.deepcopy(base).to(dt) for name, dt in DTYPES.items()}


def _check(model, lengths=(7, 3, 5), *, n=5, do_sample=False, seed=0, **kw):
    ids, mask = _prompts(model.config.vocab_size, list(lengths), seed)
    T = 0.7 if do_sample else 1.0
    r = generate_with_logprobs(model, ids, mask, max_new_tokens=n, do_sample=do_sample, temperature=T, seed=seed, **kw)
    with torch.no_grad():
        t = train_token_logprobs(model, r.sequences, r.attention_mask, r.prompt_len, temperature=T)
    return r, same_bits(r.logprobs, t)


def _returned_cache(model, **kw):
    ids, mask = _prompts(model.config.vocab_size, [4, 2])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             return_dict_in_generate=True, eos_token_id=None, **kw)
    return getattr(out, "cache", None) or out.past_key_values


class _Count:
    """Counts ``ContiguousKVCache`` constructions (the rebuilding fallback makes one per layer and step)."""

    def __init__(self, monkeypatch):
        from rl_engine.ops.attention import cache as cache_mod

        self.n = 0
        init = cache_mod.ContiguousKVCache.__init__

        def counted(obj, *a, **k):
            self.n += 1
            init(obj, *a, **k)

        monkeypatch.setattr(cache_mod.ContiguousKVCache, "__init__", counted)


# --------------------------------------------------------------------------------------------- the cache in generate


def test_generate_uses_rlk_cache_by_default_and_unapply_restores(models):
    from transformers import DynamicCache

    from rl_engine.integrations.hf.cache import RlkCache

    model = models["float32"]
    with install(model):
        dyn = _returned_cache(model)
        static = _returned_cache(model, cache_implementation="static")
    assert isinstance(dyn, RlkCache) and not dyn.static and not dyn.is_compileable
    assert isinstance(static, RlkCache) and static.static and static.is_compileable
    # prompts of 4 and 2 tokens + 2 decoded tokens fed back (the 3rd is never fed): pads are not stored
    assert all(layer.lens.tolist() == [6, 4] for layer in dyn.layers + static.layers)
    assert "_prepare_cache_for_generation" not in model.__dict__ and not is_installed(model)
    assert type(_returned_cache(model)) is DynamicCache  # plain transformers again


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rlk_cache_generate_vs_train_raw_bit_equal(models, dtype, static):
    model = models[dtype]
    kw = {"cache_implementation": "static"} if static else {}
    with install(model):
        for lengths, do_sample in (((7, 3, 5), False), ((2, 9, 4, 6), True)):
            r, d = _check(model, lengths, do_sample=do_sample, **kw)
            assert r.logprobs.numel() == len(lengths) * 5 and d.equal, (dtype, static, lengths, d)


def test_negative_control_plain_static_cache_mismatches(models):
    """The same check on plain transformers with its StaticCache finds mismatching tokens."""
    model = models["float32"]
    assert not is_installed(model)
    assert _check(model, cache_implementation="static")[1].mismatched > 0


def test_decode_appends_in_place_without_rebuilding(models, monkeypatch):
    """Decode writes into the same storage every step (no copy of the past), and builds no
    temporary cache; the fallback for a transformers DynamicCache (negative control) rebuilds one
    per layer and step."""
    from rl_engine.integrations.hf.cache import RlkCache

    model = models["float32"]
    ids, mask = _prompts(model.config.vocab_size, [5, 2])
    count = _Count(monkeypatch)
    with install(model), torch.no_grad():
        cache = RlkCache(model.config, max_cache_len=16)
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(3):
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(input_ids=nxt, attention_mask=mask, cache=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == ptrs
        assert all(layer.lens.tolist() == [8, 5] for layer in cache.layers)
        assert cache.get_seq_length() == 8 and count.n == 0
        _check(model, (5, 2), n=3, cache=__import__("transformers").DynamicCache())
    assert count.n >= model.config.num_hidden_layers * 2


def test_transformers_dynamic_cache_falls_back_with_the_same_bits(models):
    from transformers import DynamicCache

    model = models["bfloat16"]
    with install(model):
        r, d = _check(model, (6, 2, 4), do_sample=True, cache=DynamicCache())
        rlk, _ = _check(model, (6, 2, 4), do_sample=True)
    assert d.equal, d
    assert torch.equal(r.sequences, rlk.sequences) and same_bits(r.logprobs, rlk.logprobs).equal


def test_cache_errors(models):
    from transformers import StaticCache

    from rl_engine.integrations.hf.cache import RlkCache

    model = models["float32"]
    cfg = model.config
    with install(model):
        with pytest.raises(ValueError, match="cache: a transformers StaticCache is not supported"):
            _check(model, cache=StaticCache(config=cfg, max_cache_len=32))
        with pytest.raises(ValueError, match=r"cache: 8 tokens per row seen \(pads included\) \+ 1 new exceed max_cache_len=8"):
            _check(model, (7, 3), n=4, cache=RlkCache(cfg, max_cache_len=8, static=True))
        with torch.no_grad():
            cache = RlkCache(cfg)
            ids, mask = _prompts(cfg.vocab_size, [3, 2])
            model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            with pytest.raises(ValueError, match=r"cache: holds \(batch, kv heads"):
                model(input_ids=ids[:1], attention_mask=mask[:1], cache=cache, use_cache=True)
    with pytest.raises(TypeError, match="cache: an RlkCache keeps keys at logical positions"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)
    with pytest.raises(ValueError, match="tokens_to_remove: an RlkCache cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="max_cache_len: a static cache needs"):
        RlkCache(cfg, static=True)
    with pytest.raises(ValueError, match="max_cache_len: expected a positive int"):
        RlkCache(cfg, max_cache_len=0)
    sliding = copy.deepcopy(cfg)
    sliding.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="config: an RlkCache serves full-attention layers only"):
        RlkCache(sliding)


def test_dynamic_layer_grows_and_keeps_its_rows(models):
    from rl_engine.integrations.hf.cache import RlkCache

    model = models["float32"]
    with install(model):
        r, d = _check(model, (6, 3), n=6, cache=RlkCache(model.config, max_cache_len=4))  # grows 4 -> 8 -> 16
        ref, _ = _check(model, (6, 3), n=6)
    assert d.equal and same_bits(r.logprobs, ref.logprobs).equal


def test_reorder_and_reset():
    from transformers import Qwen3Config

    from rl_engine.integrations.hf.cache import RlkCache

    cache = RlkCache(Qwen3Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                 hidden_size=8), max_cache_len=4)
    layer = cache.layers[0]
    layer.prepare(3, 1, 4, torch.float32, "cpu", 2)
    layer.keys.copy_(torch.arange(layer.keys.numel(), dtype=torch.float32).view_as(layer.keys))
    layer.lens.copy_(torch.tensor([1, 2, 3]))
    keys = layer.keys.clone()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer.keys, keys[[2, 0, 1]]) and layer.lens.tolist() == [3, 1, 2]
    cache.reset()
    assert layer.lens.tolist() == [0, 0, 0] and cache.get_seq_length() == 0


def test_decode_plan_is_the_validated_plan():
    """The decode step's plan, built on the device, equals what ``plan_paged_attention``
    validates for the same step."""
    from rl_engine.integrations.hf.attention import decode_plan
    from rl_engine.ops.attention import plan_paged_attention

    lens, R = torch.tensor([3, 0, 7, 5]), 9
    B = lens.shape[0]
    ours = decode_plan(lens, R)
    ref = plan_paged_attention(torch.arange(B) * R + lens, torch.arange(B)[:, None], R, torch.arange(B + 1), lens + 1,
                               num_blocks=B)
    for f in ("num_tokens", "num_seqs", "block_size", "num_blocks", "decode_only"):
        assert getattr(ours, f) == getattr(ref, f), f
    for f in ("slot_mapping", "page_rows", "q_seq", "q_pos"):
        assert torch.equal(getattr(ours, f), getattr(ref, f)), f


# --------------------------------------------------------------------------------------------- packed training layout


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_rows_equal_padded_rows(models, dtype):
    """Sequences packed into one row (``position_ids`` restarting, transformers' padding-free
    format) get the log-probs they get in a left-padded batch, bit for bit; plain transformers
    does not (negative control)."""
    from rl_engine.ops.logprob import token_logprobs

    model = models[dtype]
    lengths = [9, 4, 6]
    ids, mask = _prompts(model.config.vocab_size, lengths, seed=3)
    flat = torch.cat([ids[b, -n:] for b, n in enumerate(lengths)])[None]
    pid = torch.cat([torch.arange(n) for n in lengths])[None]

    def mismatches():
        with torch.no_grad():
            padded = train_token_logprobs(model, ids, mask, 1)
            z = model(input_ids=flat, position_ids=pid, use_cache=False).logits[0].float()
        total, off = 0, 0
        for b, n in enumerate(lengths):
            lp = token_logprobs(z[off : off + n - 1].contiguous(), flat[0, off + 1 : off + n].contiguous())
            total += same_bits(lp, padded[b, -(n - 1):].contiguous()).mismatched
            off += n
        return total

    with install(model):
        assert mismatches() == 0
    assert mismatches() > 0


def test_sequence_ids_and_positions():
    from rl_engine.integrations.hf.attention import segment_positions, sequence_ids

    pid = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 2, 3]])
    seg = sequence_ids(pid, 2, 6)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    assert segment_positions(valid, seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 2, 3]]
    assert sequence_ids(None, 2, 6) is None
    with pytest.raises(ValueError, match="position_ids: expected"):
        sequence_ids(pid[:, :3], 2, 6)


# --------------------------------------------------------------------------------------------- torch.compile


def _compile_config(backend="aot_eager"):
    from transformers import CompileConfig

    cc = CompileConfig(backend=backend, mode=None if backend != "inductor" else "default")
    cc._compile_all_devices = True
    return cc


def test_compiled_forward_same_bits_one_graph(models):
    """``torch.compile`` of the installed model (no gradients): one graph, no break, the eager bits."""
    from torch._dynamo.utils import counters

    model = models["bfloat16"]
    ids, mask = _prompts(model.config.vocab_size, [9, 4, 6], seed=2)
    torch._dynamo.reset()
    counters.clear()
    with install(model), torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        got = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask).logits
    assert same_bits(ref, got).equal
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def _train_step(model, ids, mask, compiled: bool):
    """Loss and every parameter's gradient of one weighted-logits training step."""
    model.zero_grad(set_to_none=True)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    logits = run(input_ids=ids, attention_mask=mask).logits.float()
    w = torch.linspace(-1.0, 1.0, logits.numel()).reshape(logits.shape)
    loss = (logits * w * mask[..., None]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_training_step_same_bits(models, dtype):
    """``torch.compile`` of the installed model with gradients: the loss and every parameter
    gradient equal the eager installed step's raw bits (each node's backward is the public op's)."""
    model = models[dtype]
    ids, mask = _prompts(model.config.vocab_size, [7, 3, 5], seed=3)
    torch._dynamo.reset()
    model.train()
    try:
        with install(model):
            ref_loss, ref = _train_step(model, ids, mask, compiled=False)
            loss, got = _train_step(model, ids, mask, compiled=True)
        assert same_bits(ref_loss, loss).equal
        assert ref.keys() == got.keys() and all(same_bits(ref[n], got[n]).equal for n in ref), \
            [n for n in ref if not same_bits(ref[n], got[n]).equal]
        # negative control: the uninstalled model's step differs in some gradient
        _, plain = _train_step(model, ids, mask, compiled=False)
        assert any(not same_bits(ref[n], plain[n]).equal for n in ref)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_cache_compiled_generate_same_bits(models, dtype):
    """``generate`` with the static RlkCache and a compiled decode step (aot_eager backend:
    dynamo, the fake implementations, functionalisation of the cache writes)."""
    model = models[dtype]
    torch._dynamo.reset()
    with install(model):
        for do_sample in (False, True):
            r, d = _check(model, (6, 2, 4), do_sample=do_sample, cache_implementation="static",
                          compile_config=_compile_config())
            assert d.equal, (dtype, do_sample, d)
        assert "_compiled_call" in model.__dict__  # transformers really ran the compiled decode step
        eager, _ = _check(model, (6, 2, 4), do_sample=True, cache_implementation="static")
    assert same_bits(r.logprobs, eager.logprobs).equal
    del model.__dict__["_compiled_call"]


@pytest.mark.slow
def test_static_cache_inductor_generate_same_bits(models):
    """The same with the inductor backend (the glue compiled to C++ on the CPU)."""
    model = models["bfloat16"]
    torch._dynamo.reset()
    with install(model):
        r, d = _check(model, (6, 2, 4), do_sample=True, cache_implementation="static",
                      compile_config=_compile_config("inductor"))
        assert d.equal, d
    model.__dict__.pop("_compiled_call", None)


@pytest.mark.gpu
def test_cuda_graph_decode_step_replays_the_eager_bits():
    """On a GPU, ``generate`` with the static RlkCache and the decode step compiled by inductor in
    mode ``"reduce-overhead"`` (CUDA graphs: the step is captured once and replayed at every
    token) gives the eager installed model's tokens and log-probs bit for bit, and the training
    forward's log-probs (the eager run passes ``disable_compile``: on CUDA, transformers compiles a
    static cache's decode step by itself). Negative control: plain transformers' graphed decode
    step, checked against the installed training forward of its own tokens, mismatches."""
    from transformers import CompileConfig

    # head_dim 32: the GPU kernels take 32, 64, 128 and 256 (the module's model has 16)
    model = build_hf_model(TINY_CONFIGS["h32-gqa6-untied-3l"]).to(torch.bfloat16).cuda()
    model.generation_config.pad_token_id = PAD
    ids, mask = (t.cuda() for t in _prompts(model.config.vocab_size, [6, 2, 4], seed=5))
    graphs = CompileConfig(backend="inductor", mode="reduce-overhead")
    torch._dynamo.reset()
    with install(model):
        eager = generate_with_logprobs(model, ids, mask, max_new_tokens=6, cache_implementation="static",
                                       disable_compile=True)
        assert "_compiled_call" not in model.__dict__
        graphed = generate_with_logprobs(model, ids, mask, max_new_tokens=6, cache_implementation="static",
                                         compile_config=graphs)
        assert "_compiled_call" in model.__dict__  # transformers really ran the compiled decode step
        with torch.no_grad():
            train = train_token_logprobs(model, graphed.sequences, graphed.attention_mask, graphed.prompt_len)
    assert torch.equal(eager.sequences, graphed.sequences)
    assert same_bits(eager.logprobs, graphed.logprobs).equal
    assert same_bits(graphed.logprobs, train).equal
    model.__dict__.pop("_compiled_call", None)
    torch._dynamo.reset()
    plain = generate_with_logprobs(model, ids, mask, max_new_tokens=6, cache_implementation="static",
                                   compile_config=graphs)
    with install(model), torch.no_grad():
        plain_train = train_token_logprobs(model, plain.sequences, plain.attention_mask, plain.prompt_len)
    assert same_bits(plain.logprobs, plain_train).mismatched > 0
    model.__dict__.pop("_compiled_call", None)


def test_generate_hook_conflict_is_detected(models):
    import types

    from rl_engine.integrations.hf.install import InstallConflict

    model = models["float32"]
    model._prepare_cache_for_generation = types.MethodType(lambda self, *a, **k: None, model)
    try:
        with pytest.raises(InstallConflict, match="_prepare_cache_for_generation already overridden on the instance"):
            install(model)
    finally:
        del model.__dict__["_prepare_cache_for_generation"]
    assert not is_installed(model)


def test_decode_step_reads_nothing_back_in_rl_engine(models, gpu_branches):
    """A decode step of the installed model over rl_engine's cache, with host tensors taking the
    default GPU path's branches, runs no operation of rl_engine's that would make a GPU wait
    (``tests/helpers/host_reads.py``; transformers' own reads, such as its causal-mask shortcut's
    look at the padding mask, are plain transformers' too). Negative control: under
    ``nan_policy("raise")`` the scans of rl_engine's entry points are seen."""
    from rl_engine.integrations.hf.cache import RlkCache
    from rl_engine.utils.checks import nan_policy
    from tests.helpers.host_reads import CPU_ONLY, HostReads

    model = models["bfloat16"]
    ids, mask = _prompts(model.config.vocab_size, [5, 3])
    with install(model), torch.no_grad():
        cache = RlkCache(model.config, max_cache_len=16)
        nxt = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        recs = []
        for policy in ("auto", "raise"):
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            with nan_policy(policy), HostReads(CPU_ONLY) as rec:
                nxt = model(input_ids=nxt, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            recs.append(rec)
    assert [w for w in recs[0].where if w.startswith("rl_engine")] == []
    assert any(w == "rl_engine.utils.checks:_has_nan" for w in recs[1].where)


def test_per_forward_keeps_a_value_for_the_same_unchanged_tensors():
    """``PerForward`` hands back its value for the same tensor objects at the same versions, and
    makes it anew for another object, an in-place change, other extra keys, inference tensors and
    while tracing for torch.compile (each a negative control of the reuse)."""
    from rl_engine.integrations.hf.attention import PerForward

    memo, made = PerForward(), []

    def make():
        made.append(1)
        return len(made)

    m, p = torch.ones(2, 3), None
    assert memo.get((m, p), 1, make) == 1 and memo.get((m, p), 1, make) == 1
    assert memo.get((m, p), 2, make) == 2                    # other extra keys
    assert memo.get((m.clone(), p), 2, make) == 3            # another object
    m2 = m.clone()
    assert memo.get((m2, p), 2, make) == 4 and memo.get((m2, p), 2, make) == 4
    m2.add_(1)
    assert memo.get((m2, p), 2, make) == 5                   # changed in place
    with torch.inference_mode():
        inf = torch.ones(2)
    assert memo.get((inf,), 2, make) == 6 and memo.get((inf,), 2, make) == 7

    @torch.compile(backend="eager", fullgraph=False)
    def traced(x):
        return x + memo.get((m2, p), 2, make)

    traced(torch.zeros(1))
    assert len(made) == 8


@pytest.mark.parametrize("layers", [2, 4])
def test_training_forward_packs_once_per_forward(layers, gpu_branches):
    """A training forward of the installed model packs its valid tokens once (one data-sized
    ``nonzero``, the one read of the mask), not once per layer, whatever the depth; the next
    forward with a new mask packs again (negative control)."""
    from tests.helpers.host_reads import CPU_ONLY, HostReads

    cfg = dict(TINY_CONFIGS[CONFIG], num_hidden_layers=layers)
    model = build_hf_model(cfg).to(torch.float32)
    ids, mask = _prompts(model.config.vocab_size, [5, 3, 6])
    with install(model):
        counts = []
        for _ in range(2):
            with HostReads(CPU_ONLY) as rec:
                model(input_ids=ids, attention_mask=mask.clone(), use_cache=False).logits.float().sum().backward()
            counts.append(rec.found.count("nonzero"))
    assert counts == [1, 1]
