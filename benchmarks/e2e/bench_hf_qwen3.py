"""End to end through HF transformers: Qwen3 at 8B dimensions, plain transformers against rl_engine installed.

What a user of :func:`rl_engine.integrations.hf.install.install` runs, timed side by side with
the same model without the install (both share the weights: the installed model is a copy of
the module tree holding the same parameters):

* ``train_step`` — forward + backward of the mean next-token negative log-prob over a batch
  of ``--train-batch`` sequences of at most ``--train-len`` tokens, in two layouts: ``padded``
  (``[B, L]``, left padding, logical ``position_ids``) and ``packed`` (one row, ``position_ids``
  restarting per sequence, ``use_cache=False`` — transformers' padding-free format). Log-probs:
  ``log_softmax`` + ``gather`` on the fp32 logits for transformers,
  :func:`rl_engine.ops.logprob.token_logprobs` for rl_engine. Gradient checkpointing on both
  sides unless ``--no-grad-checkpointing``. The row's ``layout_mismatched`` counts the tokens
  whose no-grad log-prob differs in any bit between the packed and the padded layout (rl_engine:
  0 by contract; transformers: the negative control, > 0).
* ``generate`` — ``--gen-batch`` left-padded prompts of ``--prompt-len`` slots, ``--new-tokens``
  new tokens, greedy and sampled (T = 0.7), end-of-sequence off; mode ``eager`` (the default
  dynamic cache: rl_engine's ``RlkCache`` on the installed model) and ``static-compiled``
  (``cache_implementation="static"`` + ``torch.compile`` of the decode step through
  transformers' ``CompileConfig``). An extra ``eager`` row times the installed model over a
  transformers ``DynamicCache`` passed by the caller (the install's rebuilding fallback). Every
  generate row carries ``mismatched`` / ``compared``: tokens whose log-prob from ``generate``'s
  raw logits differs in any bit from the training forward's log-prob of the same token
  (:func:`rl_engine.integrations.hf.rollout.generate_with_logprobs` vs
  :func:`rl_engine.integrations.hf.train.train_token_logprobs`).
* ``--trl`` — a short TRL GRPO run with and without rl_engine (``RLKGRPOTrainer`` + ``attach``
  against ``GRPOTrainer``): per-step time (the first steps are warm-up) and the train↔rollout
  mismatch count of :class:`rl_engine.integrations.trl.LogprobParityMonitor`.

The bit checks are asserted in the run: every rl_engine row must have 0 mismatches, and the
transformers rows of each operation together more than 0 (the negative control: the same check
finds mismatches without the install; a single row may find none, e.g. a tiny model's compiled
decode). The report is written first, then the script exits 1 listing every failed check.
``--negative-control`` runs the rl_engine rows without the install, to see the checks fail. Timings: :func:`benchmarks.common.harness.measure_interleaved` (the two
implementations round-robin, warm-up calls — compilation included — excluded), JSON rows by
:func:`benchmarks.common.harness.make_row`, ``ratio_vs_baseline`` = rl_engine median /
transformers median of the same interleaved run. The report is rewritten after every section,
so a run stopped by a time limit keeps what it finished.

Usage::

    python benchmarks/e2e/bench_hf_qwen3.py --out bench_hf_qwen3.json            # CUDA if available, 36 layers, bf16
    python benchmarks/e2e/bench_hf_qwen3.py --layers 4 --out bench_hf_qwen3.json # fewer layers
    python benchmarks/e2e/bench_hf_qwen3.py --sections generate --modes eager --samplings sampled \
        --out bench_hf_qwen3.json     # one setting per device call (record_gpu_report.py --merge joins them)
    python benchmarks/e2e/bench_hf_qwen3.py --tiny --out /tmp/bench_hf_tiny.json # CPU dry run in seconds
    python benchmarks/e2e/bench_hf_qwen3.py --tiny --trl --out /tmp/bench_hf_trl.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.common import harness  # noqa: E402

BENCH = "bench_hf_qwen3"
#: Qwen3-8B's dimensions (random weights; ``--layers`` overrides the depth).
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rms_norm_eps=1e-6, initializer_range=0.02)
#: The ``--tiny`` model (the CPU dry run and the test).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6, initializer_range=0.2)
FULL_SHAPES = dict(train_batch=8, train_len=2048, gen_batch=32, prompt_len=256, new_tokens=256, trl_layers=2,
                   trl_steps=4, trl_generations=8, trl_completion=64)
TINY_SHAPES = dict(train_batch=2, train_len=48, gen_batch=4, prompt_len=12, new_tokens=8, trl_layers=2,
                   trl_steps=3, trl_generations=4, trl_completion=8)
PAD = 0
TEMPERATURE = 0.7


# --------------------------------------------------------------------------------------------- model and data


def build_model(cfg: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """A transformers ``Qwen3ForCausalLM`` with random weights (normal, ``initializer_range``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**cfg, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, pad_token_id=PAD,
                         eos_token_id=1, bos_token_id=1, use_cache=True)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = PAD
    return model


def installed_copy(model, *, install_rl_engine: bool = True):
    """The same module tree with its own modules and config but the **same** parameter tensors,
    with rl_engine installed (so both sides time the same weights without doubling memory).
    ``install_rl_engine=False`` leaves the copy plain (``--negative-control``)."""
    from rl_engine.integrations.hf.install import install

    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    twin = copy.deepcopy(model, memo)
    if install_rl_engine:
        install(twin)
    return twin


def lengths(n: int, longest: int, seed: int) -> list[int]:
    """``n`` sequence lengths in ``[longest // 2, longest]``, the first one ``longest``."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(max(1, longest // 2), longest + 1, (n,), generator=g).tolist()
    out[0] = longest
    return out


def left_padded(vocab: int, lens: list[int], width: int, seed: int, device: str):
    """``input_ids, attention_mask`` ``[B, width]``, row ``b`` holding ``lens[b]`` random tokens
    at its right end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lens), width), PAD, dtype=torch.int64)
    mask = torch.zeros(len(lens), width, dtype=torch.int64)
    for b, n in enumerate(lens):
        ids[b, width - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids.to(device), mask.to(device)


def train_batches(vocab: int, B: int, L: int, seed: int, device: str) -> dict:
    """The same ``B`` sequences padded (``[B, L]``) and packed (``[1, sum]``), with the targets
    of every next-token prediction in both layouts."""
    from rl_engine.integrations.hf.install import logical_positions

    lens = lengths(B, L, seed)
    ids, mask = left_padded(vocab, lens, L, seed, device)
    flat = torch.cat([ids[b, L - n:] for b, n in enumerate(lens)])[None]
    pos = torch.cat([torch.arange(n, device=device) for n in lens])[None]
    # next-token pairs: padded (row b, slot i -> i+1 inside the row's tokens) and packed (same tokens)
    pad_b = torch.cat([torch.full((n - 1,), b) for b, n in enumerate(lens)]).to(device)
    pad_i = torch.cat([torch.arange(L - n, L - 1) for n in lens]).to(device)
    starts = torch.tensor([0] + lens[:-1]).cumsum(0).tolist()
    pack_i = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(starts, lens)]).to(device)
    return {"lens": lens, "padded": dict(input_ids=ids, attention_mask=mask, position_ids=logical_positions(mask.bool())),
            "packed": dict(input_ids=flat, position_ids=pos), "pad_index": (pad_b, pad_i), "pack_index": pack_i,
            "targets": ids[pad_b, pad_i + 1]}


def _token_logprobs(model, batch: dict, layout: str, rlk: bool) -> torch.Tensor:
    """``[N]`` fp32 log-probs of every next-token target, in the order of ``batch["targets"]``."""
    from rl_engine.ops.logprob import token_logprobs

    logits = model(**batch[layout], use_cache=False).logits
    z = logits[batch["pad_index"]] if layout == "padded" else logits[0, batch["pack_index"]]
    z = z.float().contiguous()
    if rlk:
        return token_logprobs(z, batch["targets"])
    return torch.log_softmax(z, -1).gather(-1, batch["targets"][:, None])[:, 0]


# --------------------------------------------------------------------------------------------- sections


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _row(ctx: dict, op: str, impl: str, config: dict, stats, peak, extra: dict, baseline_ms: float | None) -> dict:
    extra = dict(extra)
    if impl != "transformers" and baseline_ms:
        extra["ratio_vs_baseline"] = stats.median / baseline_ms
    return harness.make_row(benchmark=BENCH, op=op, implementation=impl, config={**ctx["config"], **config},
                            stats=stats, warmup=ctx["warmup"], device=ctx["device_info"], versions=ctx["versions"],
                            peak_memory_bytes=peak[0], peak_memory_method=peak[1],
                            baseline=None if impl == "transformers" else "transformers", extra=extra)


def _expect(ctx: dict, what: str, impl: str, mismatched: int) -> str:
    """An rl_engine row must have 0 mismatches (``"pass"`` / ``"FAIL"``); a transformers row is the
    negative control (``"control"``), checked per operation by :func:`negative_controls`."""
    if not impl.startswith("rl_engine"):
        return "control"
    if mismatched:
        ctx["failures"].append(f"{what} [{impl}]: {mismatched} mismatched tokens, expected 0")
    return "pass" if mismatched == 0 else "FAIL"


def negative_controls(rows: list[dict]) -> list[str]:
    """For each operation, the transformers rows together must show mismatches: the check that
    finds none for rl_engine finds some without it. (One row may find none — e.g. a tiny model's
    compiled decode — the operation as a whole must.)"""
    out = []
    for op, key in (("train_step", "layout_mismatched"), ("generate", "mismatched"), ("trl_grpo_step", "mismatched")):
        base = [r for r in rows if r["op"] == op and r["implementation"] == "transformers"]
        if base and sum(r[key] for r in base) == 0:
            out.append(f"{op} [transformers]: 0 mismatched tokens in every row, expected > 0 (negative control)")
    return out


def train_section(ctx: dict, models: dict, shapes: dict) -> list[dict]:
    """Training step rows (padded and packed, transformers and rl_engine)."""
    dev = ctx["device"]
    batch = train_batches(ctx["config"]["vocab_size"], shapes["train_batch"], shapes["train_len"], 1, dev)
    n_tok = len(batch["targets"])
    rows = []
    with torch.no_grad():  # layout invariance of the training forward, both implementations
        layout_mm = {}
        for impl, m in models.items():
            lp = {lay: _token_logprobs(m, batch, lay, impl == "rl_engine") for lay in ("padded", "packed")}
            from rl_engine.utils.bits import same_bits

            layout_mm[impl] = same_bits(lp["padded"], lp["packed"]).mismatched
    for layout in ("padded", "packed"):
        def step(m, rlk, layout=layout):
            m.zero_grad(set_to_none=True)
            loss = -_token_logprobs(m, batch, layout, rlk).mean()
            loss.backward()
            return loss

        fns = {impl: (lambda m=m, r=(impl == "rl_engine"): step(m, r)) for impl, m in models.items()}
        stats = harness.measure_interleaved(fns, warmup=ctx["warmup"], repeats=ctx["repeats"], device=dev)
        for impl, m in models.items():
            peak = harness.peak_memory(fns[impl], device=dev) if ctx["memory"] else (None, None)
            m.zero_grad(set_to_none=True)
            cfg = {"layout": layout, "sequences": shapes["train_batch"], "max_len": shapes["train_len"],
                   "tokens": sum(batch["lens"]), "grad_checkpointing": ctx["grad_checkpointing"],
                   "logprob": "rl_engine.ops.logprob.token_logprobs" if impl == "rl_engine" else "torch.log_softmax+gather"}
            extra = {"layout_mismatched": layout_mm[impl], "layout_compared": n_tok,
                     "bits_check": _expect(ctx, f"train {layout} vs packed", impl, layout_mm[impl])}
            rows.append(_row(ctx, "train_step", impl, cfg, stats[impl], peak, extra,
                             stats["transformers"].median))
            print(f"train_step {layout:7s} {impl:13s} {stats[impl].median:10.2f} ms  layout mismatches "
                  f"{layout_mm[impl]}/{n_tok}", flush=True)
    return rows


def _compile_config(ctx: dict):
    from transformers import CompileConfig

    backend = ctx["compile_backend"]
    cc = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" and ctx["device"].startswith("cuda")
                       else None, fullgraph=False)
    cc._compile_all_devices = True  # transformers compiles on CUDA by itself; this lets the CPU run compile too
    return cc


def generate_section(ctx: dict, models: dict, shapes: dict) -> list[dict]:
    """``generate`` rows: mode x sampling x implementation (+ the fallback row in eager mode)."""
    from transformers import DynamicCache

    from rl_engine.integrations.hf.rollout import generate_with_logprobs
    from rl_engine.integrations.hf.train import train_token_logprobs
    from rl_engine.utils.bits import same_bits

    dev = ctx["device"]
    lens = lengths(shapes["gen_batch"], shapes["prompt_len"], 2)
    ids, mask = left_padded(ctx["config"]["vocab_size"], lens, shapes["prompt_len"], 2, dev)
    N = shapes["new_tokens"]
    rows = []
    for mode in ctx["modes"]:
        for sampled in (s == "sampled" for s in ctx["samplings"]):
            kw = dict(max_new_tokens=N, do_sample=sampled, temperature=TEMPERATURE if sampled else 1.0, seed=3)
            if mode == "static-compiled":
                kw.update(cache_implementation="static", compile_config=_compile_config(ctx))
            runs = {impl: (models[impl], dict(kw)) for impl in models}
            if mode == "eager" and ctx["fallback"]:
                runs["rl_engine (transformers DynamicCache)"] = (models["rl_engine"], dict(kw, fallback=True))

            def call(m, k):
                k = dict(k)
                if k.pop("fallback", False):
                    k["cache"] = DynamicCache()
                return generate_with_logprobs(m, ids, mask, **k)

            fns = {impl: (lambda m=m, k=k: call(m, k)) for impl, (m, k) in runs.items()}
            stats = harness.measure_interleaved(fns, warmup=ctx["warmup"], repeats=ctx["repeats"], device=dev)
            for impl, (m, k) in runs.items():
                box = {}
                peak = harness.peak_memory(lambda: box.setdefault("r", call(m, k)), device=dev) if ctx["memory"] \
                    else (None, None)
                r = box.get("r") or call(m, k)
                with torch.no_grad():
                    t = train_token_logprobs(m, r.sequences, r.attention_mask, r.prompt_len,
                                             temperature=TEMPERATURE if sampled else 1.0)
                mm = same_bits(r.logprobs, t).mismatched
                cfg = {"mode": mode, "sampling": "sampled" if sampled else "greedy", "prompts": len(lens),
                       "prompt_len": shapes["prompt_len"], "new_tokens": N,
                       "cache": ("transformers DynamicCache (fallback)" if k.get("fallback") else
                                 "RlkCache" if impl == "rl_engine" else "transformers") +
                                (" static" if mode == "static-compiled" else " dynamic"),
                       "compile": None if mode == "eager" else {"backend": ctx["compile_backend"],
                                                                 "mode": _compile_config(ctx).mode}}
                extra = {"mismatched": mm, "compared": r.logprobs.numel(),
                         "bits_check": _expect(ctx, f"generate {mode} {cfg['sampling']}", impl, mm),
                         "tokens_per_s": len(lens) * N / (stats[impl].median / 1e3)}
                rows.append(_row(ctx, "generate", impl, cfg, stats[impl], peak, extra, stats["transformers"].median))
                print(f"generate {mode:15s} {cfg['sampling']:7s} {impl:38s} {stats[impl].median:10.2f} ms  "
                      f"mismatches {mm}/{r.logprobs.numel()}", flush=True)
            ctx.get("flush", lambda part: None)(rows)  # a time limit keeps the finished settings
    return rows


def build_tokenizer(vocab: int):
    """A word-level tokenizer over ``<pad> <eos> w2 .. w{vocab-1}`` (whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def _reward(completions, **kwargs):
    """Toy reward: the fraction of completion words with an id below 64."""
    return [sum(1 for w in c.split() if w.startswith("w") and int(w[1:]) < 64) / max(1, len(c.split()))
            for c in completions]


def trl_section(ctx: dict, shapes: dict) -> list[dict]:
    """TRL GRPO with and without rl_engine: step time and train↔rollout mismatches."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_engine.integrations import trl as rlk_trl

    dev = ctx["device"]
    cfg = dict(ctx["model_cfg"], num_hidden_layers=shapes["trl_layers"])
    vocab = cfg["vocab_size"]
    tok = build_tokenizer(vocab)
    g = torch.Generator().manual_seed(5)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(2, vocab, (int(n),), generator=g))
               for n in torch.randint(4, 17, (2 * shapes["trl_generations"],), generator=g)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            _sync(dev)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(dev)
            self.times.append(time.perf_counter() - self._t0)

    rows, base = [], None
    for impl in ("transformers", "rl_engine"):
        model = build_model(cfg, ctx["dtype"], dev, seed=0)
        args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlk-bench-grpo-"), use_cpu=dev == "cpu",
                          per_device_train_batch_size=shapes["trl_generations"], num_generations=shapes["trl_generations"],
                          max_completion_length=shapes["trl_completion"], max_steps=shapes["trl_steps"], report_to="none",
                          logging_steps=1, save_strategy="no", seed=0, loss_type="dapo", bf16=False)
        cls = rlk_trl.RLKGRPOTrainer if impl == "rl_engine" else GRPOTrainer
        trainer = cls(model=model, reward_funcs=_reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                      processing_class=tok)
        attachment = rlk_trl.attach(trainer) if impl == "rl_engine" else None
        monitor = rlk_trl.LogprobParityMonitor(trainer)
        timer = StepTimer()
        trainer.add_callback(timer)
        try:
            trainer.train()
        finally:
            monitor.close()
            if attachment is not None:
                attachment.detach()
        warm = min(ctx["warmup"], len(timer.times) - 1)
        stats = harness.summarize(timer.times[warm:]).scaled(1e3)
        mm = sum(h["mismatched"] for h in monitor.history)
        compared = sum(h["compared"] for h in monitor.history)
        base = base or stats.median
        rcfg = {"trainer": cls.__name__, "layers": cfg["num_hidden_layers"], "steps": shapes["trl_steps"],
                "generations": shapes["trl_generations"], "completion_len": shapes["trl_completion"], "loss_type": "dapo"}
        extra = {"mismatched": mm, "compared": compared, "bits_check": _expect(ctx, "trl grpo", impl, mm),
                 "step_seconds": timer.times}
        row = harness.make_row(benchmark=BENCH, op="trl_grpo_step", implementation=impl,
                               config={**ctx["config"], **rcfg, "num_hidden_layers": cfg["num_hidden_layers"]},
                               stats=stats, warmup=warm, device=ctx["device_info"], versions=ctx["versions"],
                               baseline=None if impl == "transformers" else "transformers",
                               extra=dict(extra, **({"ratio_vs_baseline": stats.median / base} if impl != "transformers"
                                                    else {})))
        rows.append(row)
        print(f"trl_grpo_step {impl:13s} {stats.median:10.2f} ms  mismatches {mm}/{compared}", flush=True)
        del trainer, model
    return rows


# --------------------------------------------------------------------------------------------- main


def _versions() -> dict:
    v = harness.versions()
    for name in ("transformers", "trl"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            v[name] = None
    return v


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 and small shapes on the CPU (a dry run in seconds)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (--tiny: cpu)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 36; --tiny 2)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--sections", default="train,generate", help="comma-separated: train, generate")
    p.add_argument("--modes", default="eager,static-compiled", help="generate modes: eager, static-compiled")
    p.add_argument("--samplings", default="greedy,sampled",
                   help="generate settings: greedy, sampled (one per device call when a full run does not fit)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the static-compiled mode (default: inductor on CUDA, aot_eager on CPU)")
    p.add_argument("--no-fallback", action="store_true", help="skip the transformers-DynamicCache fallback row")
    p.add_argument("--no-grad-checkpointing", action="store_true")
    p.add_argument("--memory", action="store_true", help="also measure peak memory (one more call per row)")
    p.add_argument("--negative-control", action="store_true",
                   help="run the rl_engine rows WITHOUT the install: the bit checks must then fail (exit 1)")
    p.add_argument("--trl", action="store_true", help="add the TRL GRPO section")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 3; --tiny 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (compilation happens there)")
    for k in FULL_SHAPES:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; on a shared CPU 1 avoids oversubscription)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    if a.threads:
        torch.set_num_threads(a.threads)
    model_cfg = dict(TINY if a.tiny else QWEN3_8B)
    if a.layers is not None:
        model_cfg["num_hidden_layers"] = a.layers
    shapes = dict(TINY_SHAPES if a.tiny else FULL_SHAPES)
    for k in shapes:
        if getattr(a, k) is not None:
            shapes[k] = getattr(a, k)
    dtype = getattr(torch, a.dtype)
    sections = [s for s in a.sections.split(",") if s]
    modes = [m for m in a.modes.split(",") if m]
    samplings = [s for s in a.samplings.split(",") if s]
    bad = ([s for s in sections if s not in ("train", "generate")] + [m for m in modes if m not in ("eager", "static-compiled")]
           + [s for s in samplings if s not in ("greedy", "sampled")])
    if bad:
        raise SystemExit(f"--sections/--modes/--samplings: unknown {bad}")
    ctx = {"device": device, "dtype": dtype, "model_cfg": model_cfg, "modes": modes, "samplings": samplings, "warmup": a.warmup,
           "repeats": a.repeats or 3, "memory": a.memory, "fallback": not a.no_fallback,
           "grad_checkpointing": not a.no_grad_checkpointing,
           "compile_backend": a.compile_backend or ("inductor" if device.startswith("cuda") else "aot_eager"),
           "config": {**{k: model_cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size",
                                                    "num_attention_heads", "num_key_value_heads", "head_dim")},
                      "dtype": a.dtype, "weights": "random"},
           "device_info": harness.device_info(device), "versions": _versions(), "failures": []}
    rows: list[dict] = []
    meta = {"shapes": shapes, "machine_load": harness.machine_load(), "negative_control": a.negative_control}

    def write(pending: list[dict] | None = None):
        """Rewrite the report with the finished rows (``pending``: those of the section still running)."""
        meta["failures"] = ctx["failures"]
        harness.write_report(rows + (pending or []), a.out, meta=meta)

    ctx["flush"] = write

    if sections:
        base = build_model(model_cfg, dtype, device)
        models = {"transformers": base, "rl_engine": installed_copy(base, install_rl_engine=not a.negative_control)}
        if "train" in sections:
            for m in models.values():
                m.train()
                if ctx["grad_checkpointing"]:
                    m.gradient_checkpointing_enable()
            rows += train_section(ctx, models, shapes)
            for m in models.values():
                if ctx["grad_checkpointing"]:
                    m.gradient_checkpointing_disable()
                m.zero_grad(set_to_none=True)
                m.eval()
            write()
        if "generate" in sections:
            for mode in modes:  # one mode at a time, the report rewritten after each
                rows += generate_section(dict(ctx, modes=[mode]), models, shapes)
                write()
        del models, base
    if a.trl:
        rows += trl_section(ctx, shapes)
    ctx["failures"] += negative_controls(rows)
    write()
    for f in ctx["failures"]:
        print("FAILED:", f, file=sys.stderr)
    return 1 if ctx["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
