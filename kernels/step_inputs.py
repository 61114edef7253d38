"""A captured step's first kernel: its inputs made ready on the device, then embedded.

A pipelined decode step's input ids are mostly the tokens the step before it sampled, still on the
device, and each new token's KV slot must enter the request table that attention reads in place.
Done from the host, those are two more launches before every replay (a gather of the sampled ids,
a scatter into the table), each costing the host more than the kernels cost the device. Here one
kernel, the first of the step's graph, does both and gathers the embeddings.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton


def embed_step_inputs_ref(
    ids: torch.Tensor,
    prev_tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table_rows: torch.Tensor,
    table: torch.Tensor,
    pad_slot: int,
    embed: torch.Tensor,
) -> torch.Tensor:
    """Each token's embedding ``[T, hidden]``, after two writes in place:

    - ``ids[i] < 0`` marks an id still on the device: it becomes ``prev_tokens[-ids[i] - 1]``;
    - ``table[table_rows[i], positions[i]] = slots[i]`` for every token whose slot is not
      ``pad_slot`` (padding writes nothing).
    """
    pending = ids < 0
    if bool(pending.any()):
        ids[pending] = prev_tokens[(-ids[pending] - 1)]
    real = slots != pad_slot
    table[table_rows[real], positions[real]] = slots[real].to(table.dtype)
    return embed.index_select(0, ids)


@triton.jit
def _embed_step_inputs_kernel(
    ids_ptr,
    prev_ptr,
    pos_ptr,
    slots_ptr,
    rows_ptr,
    table_ptr,
    embed_ptr,
    out_ptr,
    pad_slot,
    hidden,
    stride_table,
    stride_embed,
    stride_out,
    BLOCK: tl.constexpr,
):
    # Program per token. Not a dependent launch: the kernels after it read the table before their
    # own waits, so it must have ended before they start.
    tok = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + tok)
    if token < 0:
        token = tl.load(prev_ptr + (-token - 1))
        tl.store(ids_ptr + tok, token)
    slot = tl.load(slots_ptr + tok)
    if slot != pad_slot:
        row = tl.load(rows_ptr + tok)
        position = tl.load(pos_ptr + tok)
        tl.store(table_ptr + row * stride_table + position, slot)
    cols = tl.arange(0, BLOCK)
    for start in range(0, hidden, BLOCK):
        c = start + cols
        ok = c < hidden
        tl.store(out_ptr + tok * stride_out + c, tl.load(embed_ptr + token * stride_embed + c, mask=ok), mask=ok)


def embed_step_inputs_triton(
    ids: torch.Tensor,
    prev_tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table_rows: torch.Tensor,
    table: torch.Tensor,
    pad_slot: int,
    embed: torch.Tensor,
) -> torch.Tensor:
    """Triton version of :func:`embed_step_inputs_ref` (int64 ids, positions, slots and rows)."""
    require_triton()
    if embed.stride(-1) != 1 or table.stride(-1) != 1:
        raise ValueError("the embedding and the request table must be contiguous along their last dimension")
    for name, t in (("ids", ids), ("positions", positions), ("slots", slots), ("table_rows", table_rows),
                    ("prev_tokens", prev_tokens), ("table", table)):
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}")
    num_tokens, hidden = ids.shape[0], embed.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=embed.dtype, device=embed.device)
    if num_tokens == 0:
        return out
    block = min(next_pow2(hidden), 1024)
    _embed_step_inputs_kernel[(num_tokens,)](
        ids, prev_tokens, positions, slots, table_rows, table, embed, out, pad_slot, hidden,
        table.stride(0), embed.stride(0), out.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1,
    )
    return out


def embed_step_inputs(
    ids: torch.Tensor,
    prev_tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table_rows: torch.Tensor,
    table: torch.Tensor,
    pad_slot: int,
    embed: torch.Tensor,
) -> torch.Tensor:
    """Triton on CUDA tensors when Triton is installed, else :func:`embed_step_inputs_ref`."""
    if use_triton(ids, table, embed):
        return embed_step_inputs_triton(ids, prev_tokens, positions, slots, table_rows, table, pad_slot, embed)
    return embed_step_inputs_ref(ids, prev_tokens, positions, slots, table_rows, table, pad_slot, embed)
