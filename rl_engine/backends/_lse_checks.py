"""The value checks every backend runs on a log-prob op's row log-sum-exps.

A log-prob is undefined where a row keeps no finite logit, and meaningless where the logits
overflow; both show in the row's ``lse``. These checks read ``lse`` back to the host, so they run
where :func:`rl_engine.utils.checks.reads_back` allows it (always on the host; on a GPU only under
``nan_policy("raise")`` / ``"raise_all"``), and the overflow check only where the NaN policy scans.
One definition serves the CPU and Triton backends, so their errors are the same.
"""

from __future__ import annotations

import torch

from rl_engine.utils.checks import reads_back, scans

__all__ = ["check_lse"]


def _first_rows(bad: torch.Tensor) -> list[int]:
    return torch.nonzero(bad).squeeze(1)[:8].tolist()


def check_lse(lse: torch.Tensor, what: str, source: str = "logits / temperature", *,
              kept_threshold: torch.Tensor | None = None) -> None:
    """Raise for rows of ``lse [N]`` that keep no finite logit (``-inf``), and, where the NaN policy
    scans, for rows that are ``+inf`` or NaN. With a kept-set record (``kept_threshold``), a row
    without a kept finite logit means the record does not belong to these logits."""
    if lse.numel() == 0 or not reads_back(lse):
        return
    dead = torch.isneginf(lse)
    if bool(dead.any()):
        if kept_threshold is not None:
            raise ValueError(f"kept: rows {_first_rows(dead)} keep no finite logit (a record above every logit of its "
                             "row: the records do not belong to these logits)")
        raise ValueError(f"{what}: rows {_first_rows(dead)} have no finite entry (all -inf): their log-probs are undefined")
    if scans(lse) and not bool(torch.isfinite(lse).all()):
        raise ValueError(f"{what}: rows {_first_rows(~torch.isfinite(lse))} are not finite in {source} "
                         "(+inf input or overflow)")
