"""Which quantized checkpoints load as published: a config.json ``quantization_config`` checked.

Two FP8 formats are served: ``compressed-tensors`` in its float format (8-bit float weights with
a ``weight_scale`` per output channel or per tensor) and ``fbgemm_fp8`` (Meta's Llama-3.1 FP8
releases: float8 weights with a per-channel ``weight_scale``; the modules it leaves out stay in
the checkpoint's dtype). The loader tells quantized matrices by their ``weight_scale`` tensor;
activation scales in the files (``input_scale``, ``input_scale_ub``) are not used: activations
are quantized per token as they come. A ``kv_cache_scheme`` (an "FP8-KV" release: a static scale
a layer for its keys and one for its values) loads too, its scales unused: the KV cache stores
what the node's ``--kv-cache-dtype`` says, quantized with a scale per token and KV head, which
follows each row's own range where one scale a layer must cover the largest. Any other method
or scheme is refused naming its field.
"""

from __future__ import annotations

#: ``quant_method`` values whose weights load as published.
CHECKPOINT_METHODS = ("compressed-tensors", "fbgemm_fp8")
#: Tensor-name suffixes of a quantized projection besides its weight, read with it or skipped.
SCALE_SUFFIX = "weight_scale"
ACTIVATION_SCALE_SUFFIXES = ("input_scale", "input_scale_ub")
#: Tensor-name suffixes of the static KV scales FP8-KV releases carry, skipped: the attention
#: module's (and its one older scale for both), ModelOpt's on the k and v projections, and the
#: older form on those projections' outputs.
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale", "self_attn.q_scale",
                     "self_attn.prob_scale", "k_proj.k_scale", "v_proj.v_scale", "k_proj.output_scale",
                     "v_proj.output_scale")


def checkpoint_quantization(raw: dict | None) -> str | None:
    """The ``quant_method`` of a supported ``quantization_config`` (None when there is none);
    ValueError naming the field of any other."""
    if not raw:
        return None
    method = raw.get("quant_method", "?")
    if method == "fbgemm_fp8":
        return method
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config ({method}) is not supported: serve unquantized weights or an FP8 "
                         f"checkpoint ({', '.join(CHECKPOINT_METHODS)})")
    fmt = raw.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config: compressed-tensors format {fmt!r} is not supported "
                         "(float-quantized only)")
    for name, group in (raw.get("config_groups") or {}).items():
        _check_weights(name, group.get("weights") or {})
    return method


def _check_weights(group: str, weights: dict) -> None:
    """8-bit symmetric float weights, one scale a channel or a tensor."""
    wanted = {"num_bits": 8, "type": "float", "symmetric": True}
    for key, value in wanted.items():
        if weights.get(key, value) != value:
            raise ValueError(f"quantization_config: config_groups.{group}.weights.{key} {weights.get(key)!r} is not "
                             f"supported ({value!r} only)")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"quantization_config: config_groups.{group}.weights.strategy {strategy!r} is not supported "
                         "(channel or tensor)")
