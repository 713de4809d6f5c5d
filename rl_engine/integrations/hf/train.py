"""HF transformers as the training engine: teacher-forced token log-probs with gradients.

Use with :func:`rl_engine.integrations.hf.install.install` for raw-bit parity with
``generate`` (:mod:`rl_engine.integrations.hf.rollout`).
"""

from __future__ import annotations

import torch

from rl_engine.integrations.hf.install import logical_positions

__all__ = ["train_token_logprobs"]


def train_token_logprobs(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    *,
    temperature: float = 1.0,
    kept=None,
) -> torch.Tensor:
    r"""Log-probs of the response tokens of ``sequences`` under one training forward.

    ``lp[b, t] = log softmax(z_{b, P+t-1} / T)[sequences[b, P+t]]`` with ``P = prompt_len``,
    renormalised over each token's kept set when ``kept`` (the rollout's records ``[B, N]``,
    :attr:`~rl_engine.integrations.hf.rollout.Rollout.kept`) is given — the processed log-probs,
    computed by :func:`rl_engine.ops.logprob.token_logprobs` on the fp32 logits (a bf16 model's
    logits widen exactly). ``position_ids`` are the logical positions of the mask (left padding
    does not shift them), as ``generate`` uses. Gradients flow when enabled.

    Shapes:
        sequences: ``[B, P + N]`` int64 (left-padded prompt then response); attention_mask:
        ``[B, P + N]`` (1 = token, 0 = pad); kept: records ``[B, N]``; returns ``[B, N]`` float32.

    Raises:
        ValueError: shapes disagree or ``prompt_len`` is not in ``[1, P + N)``.
    """
    from rl_engine.ops.logprob import token_logprobs

    if sequences.dim() != 2 or attention_mask.shape != sequences.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(sequences.shape)} (sequences'), got {tuple(attention_mask.shape)}")
    L = sequences.shape[1]
    if not 1 <= prompt_len < L:
        raise ValueError(f"prompt_len: expected an int in [1, {L}), got {prompt_len}")
    pos = logical_positions(attention_mask.bool())
    logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=pos).logits
    z = logits[:, prompt_len - 1 : -1].float().contiguous()
    return token_logprobs(z, sequences[:, prompt_len:].contiguous(), temperature=temperature, kept=kept)
