"""The engine's warm-up pieces (:meth:`pd_cluster.engine.llm_engine.LLMEngine.warm_up`): two tiny
requests that reach every kernel a served request can, and a block of KV moved as a handover
moves it, so that the first client does not wait for kernels to compile."""

from __future__ import annotations

import torch

from pd_cluster.engine.kv_pool import KVPool
from pd_cluster.engine.node_kv import NodeKV
from pd_cluster.sampling_params import SamplingParams

#: The warm-up's requests: one greedy, one sampled with every knob.
WARM_UP_IDS = ("engine-warm-up", "engine-warm-up-sampled")


def warm_up_requests(vocab_size: int, prompt_tokens: int, decode_steps: int) -> tuple[list[int], list[SamplingParams]]:
    """The prompt both requests share, and their parameters in :data:`WARM_UP_IDS`' order: greedy,
    and sampled with temperature, top-k/p, min-p, penalties, logit bias and logprobs, so the first
    client to sample does not wait a second for the sampling and penalty kernels to compile."""
    token_ids = [(7 * i + 3) % vocab_size for i in range(prompt_tokens)]
    greedy = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01, repetition_penalty=1.1,
                             frequency_penalty=0.1, presence_penalty=0.1, logit_bias={1 % vocab_size: 1.0},
                             logprobs=1, seed=0, max_tokens=decode_steps + 1, ignore_eos=True)
    return token_ids, [greedy, sampled]


def move_kv_block(pool: KVPool, node_kv: NodeKV, block_size: int, device: torch.device) -> None:
    """Gather a block of KV and scatter it back, and copy it slot to slot, as handovers do; its
    slots are free again after."""
    import kernels

    slots = pool.alloc(min(block_size, pool.num_free))
    if slots is None or not slots.numel():
        return
    try:
        device_slots = slots.to(device)
        # Every head, as a handover reads and writes them (through the ranks at TP > 1).
        node_kv.scatter(node_kv.gather(device_slots), device_slots)
        kernels.copy_kv_slots(pool.k_cache, pool.v_cache, device_slots, pool.k_cache, pool.v_cache, device_slots)
    finally:
        pool.free(slots)
