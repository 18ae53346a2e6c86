"""What a request's context costs in memory: bytes per token of context for the target's K/V and the drafter's
K/V, and bytes per request for the recurrent states of a hybrid target (Qwen3.5's Gated DeltaNet layers), as
model.allocate_kv_caches and GatedDeltaNet.allocate size their buffers. The weights are not counted: they do not
grow with the context. The command line prints it with --memory."""

import torch

from model import compute_dtype


def kv_bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
    """One K and one V row per attention layer for one token of one request ([kv_heads, head_dim] each)."""
    item = element_size(dtype or model.dtype)
    return sum(2 * layer.self_attn.kv_heads * layer.self_attn.head_dim * item
               for layer in model.layers if hasattr(layer, "self_attn"))


def recurrent_bytes_per_request(target, dtype: torch.dtype | None = None) -> int:
    """Per recurrent layer the conv state [C, K - 1] (in the model's dtype) and the state [Hv, Dk, Dv] (float32;
    float64 for a float64 model), whatever the context's length; 0 for a target without recurrent layers."""
    dtype = dtype or target.dtype
    return sum(m.channels * (m.kernel - 1) * element_size(dtype) +
               m.value_heads * m.key_dim * m.value_dim * element_size(compute_dtype(dtype))
               for m in getattr(target, "recurrent_layers", ()))


def memory_per_token(target, drafter=None, dtype: torch.dtype | None = None) -> dict:
    """Bytes per token of context (target_kv, drafter_kv: 0 without a drafter) and per request (recurrent) for a
    pair in `dtype` (default: the target's)."""
    dtype = dtype or target.dtype
    return dict(target_kv=kv_bytes_per_token(target, dtype),
                drafter_kv=0 if drafter is None else kv_bytes_per_token(drafter, dtype),
                recurrent=recurrent_bytes_per_request(target, dtype))


def memory_line(m: dict, tokens: int) -> str:
    """The command line's summary: the rates, and what `tokens` of context cost in the caches of one request."""
    total = (m["target_kv"] + m["drafter_kv"]) * tokens + m["recurrent"]
    return (f"memory: target K/V {m['target_kv']:,} bytes/token, drafter K/V {m['drafter_kv']:,} bytes/token, "
            f"recurrent states {m['recurrent']:,} bytes/request; {tokens:,} tokens of context: "
            f"{total / 2**20:,.1f} MiB per request")


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
