"""HF transformers ``generate`` as the rollout engine, with the sampled tokens' log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Rollout", "generate_with_logprobs"]


@dataclass(frozen=True)
class Rollout:
    """``sequences [B, P+N]``, ``attention_mask [B, P+N]``, ``prompt_len P``, ``logprobs [B, N]`` (fp32)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor


def generate_with_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    **generate_kwargs,
) -> Rollout:
    r"""Run ``model.generate`` (KV cache) and record each generated token's log-prob.

    The log-prob is ``log softmax(z / T)[token]`` of the **raw** logits ``z`` returned by
    ``generate(output_logits=True)`` (before any logits processor), computed with
    :func:`rl_engine.ops.logprob.token_logprobs` — the same op the training side uses
    (:func:`rl_engine.integrations.hf.train.train_token_logprobs`). Greedy decoding
    uses ``T = 1``. ``eos_token_id`` is disabled unless given, so every row has ``N`` tokens.

    Shapes:
        input_ids, attention_mask: ``[B, P]`` (left padding); returns a :class:`Rollout`.

    Raises:
        ValueError: ``input_ids`` and ``attention_mask`` disagree, or ``max_new_tokens < 1``.
    """
    from rl_engine.ops.logprob import token_logprobs

    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} (input_ids'), got {tuple(attention_mask.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    generate_kwargs.setdefault("eos_token_id", None)
    if do_sample:
        generate_kwargs.setdefault("top_k", 0)
        generate_kwargs.setdefault("top_p", 1.0)
        generate_kwargs["temperature"] = temperature
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             do_sample=do_sample, output_logits=True,
                             return_dict_in_generate=True, **generate_kwargs)
    P = input_ids.shape[1]
    new = out.sequences[:, P:].contiguous()
    z = torch.stack(out.logits, 1).float().contiguous()
    lp = token_logprobs(z, new, temperature=temperature if do_sample else 1.0)
    mask = torch.cat([attention_mask, torch.ones_like(new, dtype=attention_mask.dtype)], 1)
    return Rollout(out.sequences, mask, P, lp)
