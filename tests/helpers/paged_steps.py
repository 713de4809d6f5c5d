"""A minimal engine for the model's paged-cache steps: per-layer block pools, block tables, and the
host metadata of prefill and decode steps (what an engine's attention metadata builder makes)."""

from __future__ import annotations

import torch

from rl_engine.ops.attention import plan_paged_attention


class PagedEngine:
    """Per-layer ``[num_blocks, block_size, Hkv, D]`` caches and one block table per sequence;
    blocks are handed out in a scattered order so tables are not contiguous."""

    def __init__(self, model, *, num_seqs: int, max_len: int, block_size: int = 4, device="cpu"):
        s = model.spec
        self.bs, self.device = block_size, torch.device(device)
        per_seq = -(-max_len // block_size)
        self.num_blocks = num_seqs * per_seq + 1
        order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
        self.tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)]
        shape = (self.num_blocks, block_size, s.num_key_value_heads, s.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(s.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(s.num_hidden_layers)]
        self.lens = [0] * num_seqs

    def metadata(self, n_new: list[int]) -> tuple[torch.Tensor, ...]:
        """Host ``(slot_mapping, block_table, cu_seqlens_q, seq_lens, positions)`` of a step that
        adds ``n_new[i]`` tokens to sequence ``i`` (does not advance the lengths)."""
        slots, pos = [], []
        for i, n in enumerate(n_new):
            for p in range(self.lens[i], self.lens[i] + n):
                slots.append(self.tables[i][p // self.bs] * self.bs + p % self.bs)
                pos.append(p)
        cu = torch.tensor([0, *torch.tensor(n_new).cumsum(0).tolist()], dtype=torch.int64)
        seq_lens = torch.tensor([l + n for l, n in zip(self.lens, n_new)], dtype=torch.int64)
        return (torch.tensor(slots, dtype=torch.int64), torch.tensor(self.tables, dtype=torch.int64), cu, seq_lens,
                torch.tensor(pos, dtype=torch.int64))

    def plan(self, n_new: list[int], **kw):
        slots, bt, cu, seq_lens, pos = self.metadata(n_new)
        if self.device.type != "cpu":  # pinned, so the copy is asynchronous like the plan's own
            pos = pos.pin_memory().to(self.device, non_blocking=True)
        return plan_paged_attention(slots, bt, self.bs, cu, seq_lens, num_blocks=self.num_blocks, device=self.device,
                                    **kw), pos

    def advance(self, n_new: list[int]) -> None:
        self.lens = [l + n for l, n in zip(self.lens, n_new)]
