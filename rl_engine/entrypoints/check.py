"""``rlk check``: do the train path and the rollout path give bit-identical token log-probs?

With no arguments: the embedded default — the ``tiny`` Qwen3 preset with seeded random weights,
fp32 on CPU, the built-in prompt set, every train layout, plan ``R/R``. ``--model DIR`` loads a
HF Qwen3 or Qwen3-MoE checkpoint directory instead (its ``config.json`` names the model);
``--preset NAME`` takes another preset's dimensions with random weights (``qwen3-0.6b``: head dim
128; ``qwen3-moe-tiny``: the Qwen3-MoE assembly, 16 experts, 4 per token). ``--extra-prompt-tokens N`` lengthens every
prompt by ``N`` tokens: with ``N = 1000`` the contexts pass position 1024, so the rollout's
decode steps take the split-parallel kernels and the train path merges KV splits. ``--kv-cache
paged`` gives the rollout 16-token pages from a shared pool instead of one buffer per sequence.
``--plan P/P`` runs native torch on both sides: the negative control, which is expected to
report mismatches. ``--logprobs processed`` (default) scores each sampled token renormalised over
the kept set its top-k / top-p step recorded — what the rollout reports; ``--logprobs full``
scores the whole vocabulary: the bias of a trainer that ignores the filter (mismatches wherever a
filter dropped mass). See docs/check.md for the JSON fields.
``--engine hf`` runs the same flow through transformers instead of the reference executors:
``generate`` is the rollout and the model's training forward the train side, with rl_engine
installed (plan ``R/R``) or unpatched (``P/P``); see docs/integrations/hf.md. ``--engine vllm``
(in the vLLM environment, ``.venv-vllm``) makes vLLM the rollout engine — with the rl_engine
vLLM plugin (rollout ``R``) or native (``P``) — and scores its samples with rl_engine's Qwen3 and
with transformers (train ``R``: rl_engine operators, ``P``: native); see docs/check.md. ``--tp N``
runs vLLM at tensor-parallel size ``N``. ``--train-engine megatron --train-tp M`` scores the train
side with Megatron-core at ``M`` ranks on gloo instead (train ``R``: rl_engine's full-K
row-parallel scheme, ``P``: Megatron's native K-shard all-reduce, the negative control); without
``--model`` or ``--preset`` it takes the ``tiny-tp`` preset, whose heads divide by 4:
``rlk check --engine vllm --tp 2 --train-engine megatron --train-tp 4``.

Exit codes: ``0`` every active token raw-bit equal on every layout; ``1`` at least one
mismatch (or nothing compared); ``2`` usage error, or a model/device that cannot be loaded or
run (no eligible rl-kernel implementation on that device under the strict policy).
"""

from __future__ import annotations

import enum
import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rl_engine.entrypoints.errors import SEED_MAX, CommandError, check_device

__all__ = ["command", "render", "EXIT_MISMATCH", "EXIT_USAGE"]

EXIT_MISMATCH = 1
EXIT_USAGE = 2
#: ``--threads 0`` (auto) runs models below this many parameters on one intra-op thread.
SMALL_MODEL_PARAMS = 50_000_000


class Engine(str, enum.Enum):
    reference = "reference"
    hf = "hf"
    vllm = "vllm"


class KVCache(str, enum.Enum):
    contiguous = "contiguous"
    paged = "paged"


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class TrainEngine(str, enum.Enum):
    default = "default"
    megatron = "megatron"


class Logprobs(str, enum.Enum):
    processed = "processed"
    full = "full"


def _fmt(v: float) -> str:
    return "0" if v == 0 else f"{v:.3e}"


def render(result: dict[str, Any], console: Console) -> None:
    """Human summary of a :func:`~rl_engine.validation.parity.run_parity` result."""
    ro = result["rollout"]
    engine = f"  engine={result['engine']}" if "engine" in result else ""
    if result.get("tp", 1) > 1:
        engine += f" (tp {result['tp']})"
    if result.get("train_engine", "default") != "default":
        engine += f"  train-engine={result['train_engine']} (tp {result['train_tp']})"
    console.print(
        f"[bold]rlk check[/bold]  model={result['model']}  dtype={result['dtype']}  device={result['device']}  "
        f"plan={result['plan']}{engine}"
    )
    steps = (f"{ro['steps']} steps, {ro['distinct_batch_compositions']} distinct batch compositions"
             if ro.get("steps") is not None else f"continuous batching of up to {ro['max_sequences_per_step']} sequences")
    context = (f", contexts up to {result['max_context']} tokens (+{result['extra_prompt_tokens']} per prompt)"
               if result.get("extra_prompt_tokens") else "")
    if result.get("kv_cache", "contiguous") != "contiguous":
        context += f", {result['kv_cache']} KV cache"
    sp = result["sampling"]
    console.print(
        f"rollout: {result['num_prompts']} prompts{context}, {ro['active_tokens']} sampled tokens, {steps} "
        f"(temperature={sp['temperature']}, top_k={sp['top_k']}, top_p={sp['top_p']}; "
        f"{sp.get('filtered_tokens', 0)} drawn from a filtered distribution)"
    )
    console.print(f"log-probs: {sp.get('logprobs', 'processed')} ({sp['logprob_distribution']})")
    table = Table(title="train layout vs rollout (active tokens, raw bits)")
    for h in ("layout", "compared", "mismatched", "max |Δ|", "K3-KL", "mean |Δp|", "result"):
        table.add_column(h, justify="right" if h not in ("layout", "result") else "left")
    for lay in result["layouts"]:
        table.add_row(
            lay["name"], str(lay["compared_tokens"]), str(lay["mismatched_tokens"]), _fmt(lay["max_abs_diff"]),
            _fmt(lay["k3_kl"]), _fmt(lay["mean_abs_prob_diff"]),
            "[green]bitwise equal[/green]" if lay["passed"] else "[red]MISMATCH[/red]",
        )
    console.print(table)
    fm = result["first_mismatch"]
    if fm:
        console.print(
            f"first mismatch: layout {fm['layout']}, sample {fm['sample_id']}, position {fm['position']}: "
            f"rollout {fm['rollout']!r} vs train {fm['train']!r}"
        )
    verdict = "[green]PASS[/green]" if result["passed"] else "[red]FAIL[/red]"
    console.print(
        f"{verdict}: {result['mismatched_tokens']} of {result['compared_tokens']} compared tokens differ "
        f"(max |Δ| {_fmt(result['max_abs_diff'])}) in {result['seconds']:.1f} s"
    )
    if result.get("bits_digest"):
        th = result.get("threads", {})
        console.print(f"bits digest {result['bits_digest']}  (rollout threads {th.get('rollout')}, train threads {th.get('train')})")


def command(
    model: str | None = typer.Option(None, "--model", help="HF Qwen3 or Qwen3-MoE checkpoint directory (config.json + safetensors). Default: tiny random Qwen3."),
    preset: str | None = typer.Option(None, "--preset", help="Without --model: the preset whose dimensions the random-weight model takes (Qwen3: tiny, tiny-tp, qwen3-0.6b, ... qwen3-32b; Qwen3-MoE: qwen3-moe-tiny, qwen3-30b-a3b, qwen3-235b-a22b). Default: tiny (tiny-tp with --train-engine megatron)."),
    dtype: DType = typer.Option(DType.float32, "--dtype", help="Model dtype."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda:0."),
    num_prompts: int = typer.Option(12, "--num-prompts", min=1, help="Prompts from the built-in set (varied lengths)."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", min=1, help="Longest response; samples ask for up to 9 fewer."),
    extra_prompt_tokens: int = typer.Option(0, "--extra-prompt-tokens", min=0, help="Tokens added to every built-in prompt (1 to 64 tokens); 1000 takes the contexts past the first 1024-key KV split."),
    kv_cache: KVCache = typer.Option(KVCache.contiguous, "--kv-cache", help="The rollout's KV cache (--engine reference): one buffer per sequence, or 16-token pages from a shared pool."),
    max_seqs: int = typer.Option(8, "--max-seqs", min=1, help="Sequences the rollout runs at once (cache slots; hf: prompts per generate batch; vllm: max_num_seqs)."),
    prefill_chunk: int = typer.Option(16, "--prefill-chunk", min=1, help="Prompt tokens a sequence feeds per rollout step (chunked prefill; --engine reference)."),
    max_step_tokens: int = typer.Option(40, "--max-step-tokens", min=1, help="Token budget of one rollout step: decode tokens first, then prefill chunks (--engine reference)."),
    seed: int = typer.Option(0, "--seed", min=0, max=SEED_MAX, help="Seed of the random weights, prompts and sampling draws (0 to 2**63 - 1)."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0, help="Sampling temperature; 0 = greedy."),
    top_k: int = typer.Option(50, "--top-k", min=0, help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Nucleus mass (1 = off)."),
    logprobs: Logprobs = typer.Option(Logprobs.processed, "--logprobs", help="What the train side scores: processed (renormalised over each token's recorded top-k/top-p kept set: what the rollout reports) or full (the whole vocabulary: mismatches wherever a filter dropped mass, the negative control)."),
    plan: str = typer.Option("R/R", "--plan", help="train/rollout implementations: R/R (rl-kernel), P/P (native torch), P/R, R/P."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch intra-op threads while checking; 0 = auto (1 for models under 50M parameters, else torch's default)."),
    rollout_threads: int | None = typer.Option(None, "--rollout-threads", min=1, help="torch intra-op threads of the rollout side (default: --threads). The bits must not depend on it (the 'threads' invariance; --engine reference)."),
    train_threads: int | None = typer.Option(None, "--train-threads", min=1, help="torch intra-op threads of the train side (default: --threads; --engine reference)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (with bits_digest: the sha256 of both sides' log-prob bits, equal on every host that passes)."),
    engine: Engine = typer.Option(Engine.reference, "--engine", help="reference: rl-kernel's executors; hf: transformers generate vs its training forward (plans R/R or P/P); vllm: vLLM generate (plugin on: rollout R, off: P) vs rl_engine/transformers scoring (needs the vLLM env: .venv-vllm/bin/rlk)."),
    tp: int = typer.Option(1, "--tp", min=1, help="--engine vllm: vLLM's tensor-parallel size (worker processes on this host)."),
    train_engine: TrainEngine = typer.Option(TrainEngine.default, "--train-engine", help="Who scores the train side: default (the engine's own train layouts) or megatron (Megatron-core at --train-tp ranks on gloo; --engine vllm)."),
    train_tp: int = typer.Option(1, "--train-tp", min=1, help="--train-engine megatron: its tensor-parallel size (a power of two dividing the model's heads)."),
) -> None:
    """Check that train and rollout log-probs of every active token are raw-bit equal.

    Exit codes: 0 pass, 1 mismatch, 2 usage or load error.
    """
    from rl_engine.models.qwen3 import ModelLoadError
    from rl_engine.runtime import NoEligibleImplementation
    from rl_engine.runtime.plan import Plan, PlanError
    from rl_engine.validation.parity import ParityConfig, load_model, run_parity

    err = Console(stderr=True)
    try:
        parsed = Plan.parse(plan)
    except PlanError as exc:
        raise typer.BadParameter(str(exc), param_hint="--plan") from exc
    if engine is Engine.hf and parsed.label not in ("R/R", "P/P"):
        raise typer.BadParameter(f"--engine hf runs one model for both sides: expected R/R or P/P, got {parsed.label}",
                                 param_hint="--plan")
    if top_p <= 0.0:
        raise typer.BadParameter("expected a value in (0, 1]", param_hint="--top-p")
    if not temperature < float("inf"):
        raise typer.BadParameter(f"expected a finite value >= 0, got {temperature}", param_hint="--temperature")
    if tp > 1 and engine is not Engine.vllm:
        raise typer.BadParameter(f"--tp sets vLLM's tensor-parallel size; --engine {engine.value} runs one process",
                                 param_hint="--tp")
    if train_engine is TrainEngine.megatron and engine is not Engine.vllm:
        raise typer.BadParameter(f"--train-engine megatron scores vLLM's rollout: use it with --engine vllm, "
                                 f"got --engine {engine.value}", param_hint="--train-engine")
    if train_tp > 1 and train_engine is not TrainEngine.megatron:
        raise typer.BadParameter("--train-tp sets Megatron's tensor-parallel size: add --train-engine megatron",
                                 param_hint="--train-tp")
    if train_engine is TrainEngine.megatron and parsed.label not in ("R/R", "P/R", "R/P", "P/P"):
        raise typer.BadParameter(f"--train-engine megatron: expected a plan of R and P, got {parsed.label}",
                                 param_hint="--plan")
    if model is not None and preset is not None:
        raise typer.BadParameter("--preset names random-weight dimensions; --model loads a checkpoint: give one",
                                 param_hint="--preset")
    if preset is None:
        preset = "tiny-tp" if train_engine is TrainEngine.megatron else "tiny"
    from rl_engine.models.qwen3 import ModelLoadError as _UnknownPreset
    from rl_engine.models.registry import preset as preset_spec

    try:
        spec = preset_spec(preset)
    except _UnknownPreset as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    if train_engine is TrainEngine.megatron and model is None:
        from rl_engine.validation.engines.megatron import check_megatron_layout

        try:
            check_megatron_layout(spec, train_tp)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--train-tp") from exc
    if engine is not Engine.reference and kv_cache is not KVCache.contiguous:
        raise typer.BadParameter(f"--engine {engine.value} keeps its own KV cache; --kv-cache applies to --engine "
                                 "reference", param_hint="--kv-cache")
    if engine is not Engine.reference and (prefill_chunk, max_step_tokens) != (16, 40):
        raise typer.BadParameter(f"--engine {engine.value} schedules its own steps; --prefill-chunk and "
                                 "--max-step-tokens apply to --engine reference", param_hint="--prefill-chunk")
    if engine is not Engine.reference and (rollout_threads or train_threads):
        raise typer.BadParameter(f"--engine {engine.value} runs both sides in one engine call; --rollout-threads and "
                                 "--train-threads apply to --engine reference", param_hint="--rollout-threads")
    import torch

    from rl_engine.utils.threads import intra_op_threads

    device = check_device(device, "check")
    cfg = ParityConfig(model=model, preset=preset, dtype=dtype.value, device=device, num_prompts=num_prompts,
                       max_new_tokens=max_new_tokens, extra_prompt_tokens=extra_prompt_tokens,
                       kv_cache=kv_cache.value, max_seqs=max_seqs, prefill_chunk=prefill_chunk,
                       max_step_tokens=max_step_tokens, seed=seed,
                       temperature=temperature, top_k=top_k, top_p=top_p, plan=plan, logprobs=logprobs.value,
                       rollout_threads=rollout_threads, train_threads=train_threads, tp=tp,
                       train_engine=train_engine.value, train_tp=train_tp)
    if engine is Engine.vllm:
        _check_vllm(cfg, threads, as_json, err)
        return
    try:
        if engine is Engine.hf:
            from rl_engine.validation.engines.hf import load_hf_model, run_hf_parity
            from rl_engine.models.qwen3 import dtype_from_name

            loaded, hf_name = load_hf_model(model, dtype_from_name(dtype.value), device, seed, preset)
            n_params = sum(p.numel() for p in loaded.parameters())
        else:
            loaded = load_model(cfg)[0]
            n_params = loaded.spec.num_parameters()
    except ImportError as exc:
        raise CommandError(f"rlk check: --engine hf needs transformers (pip install transformers): {exc}") from exc
    except (ModelLoadError, ValueError, OSError) as exc:
        raise CommandError(f"rlk check: cannot load the model: {exc}") from exc
    small = n_params < SMALL_MODEL_PARAMS
    n_threads = threads or (1 if small else torch.get_num_threads())
    # tiny models gain nothing from threads, and lose a lot under load
    with intra_op_threads(n_threads):
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("rlk check", total=1)

            def progress(stage: str, done: int, total: int) -> None:
                bar.update(task, description=stage, completed=done, total=total)

            try:
                if engine is Engine.hf:
                    result = run_hf_parity(cfg, progress=progress, model=loaded, model_name=hf_name)
                else:
                    result = run_parity(cfg, progress=progress, model=loaded)
            except NoEligibleImplementation as exc:
                raise CommandError(f"rlk check: no rl-kernel implementation can run this check here:\n{exc}") from exc
            except ValueError as exc:  # e.g. non-finite weights
                raise CommandError(f"rlk check: {exc}") from exc
    if model is not None:
        result["model"] = model
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    else:
        render(result, Console() if sys.stdout.isatty() else Console(width=110))
    if not result["passed"]:
        raise typer.Exit(EXIT_MISMATCH)


def _check_vllm(cfg, threads: int, as_json: bool, err: Console) -> None:
    """``--engine vllm``: :func:`~rl_engine.validation.engines.vllm.run_vllm_parity`."""
    from rl_engine.validation.engines.vllm import VllmUnavailable, require_vllm, run_vllm_parity
    from rl_engine.models.qwen3 import ModelLoadError
    from rl_engine.runtime import NoEligibleImplementation
    from rl_engine.utils.threads import intra_op_threads

    try:
        require_vllm()
    except VllmUnavailable as exc:
        raise CommandError(f"rlk check: {exc}") from exc
    with intra_op_threads(threads or None):
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("rlk check --engine vllm", total=1)

            def progress(stage: str, done: int, total: int) -> None:
                bar.update(task, description=stage, completed=done, total=total)

            try:
                result = run_vllm_parity(cfg, progress=progress)
            except NoEligibleImplementation as exc:
                raise CommandError(f"rlk check: no rl-kernel implementation can run this check here:\n{exc}") from exc
            except (ModelLoadError, ValueError, OSError, ImportError) as exc:  # ImportError: megatron-core missing
                raise CommandError(f"rlk check: {exc}") from exc
            except AssertionError as exc:  # ProvenanceError: a native vLLM operator ran under the plugin
                raise CommandError(f"rlk check: {exc}", EXIT_MISMATCH) from exc
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    else:
        render(result, Console() if sys.stdout.isatty() else Console(width=110))
    if not result["passed"]:
        raise typer.Exit(EXIT_MISMATCH)
