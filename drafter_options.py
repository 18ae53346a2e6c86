"""A DFlash drafter's options beyond the Qwen3 drafter's plain layers, which z-lab's Gemma 4 drafters set: how each
layer's block rows attend (sliding windows, causal rows) and the scales of its logits and embeddings. families.py
reads them only for a config.json that sets any (docs/checkpoints.md, "How block rows attend")."""

import math

from loading import dflash_setting


def fields(d: dict, where: str) -> dict:
    """drafter.DFlashConfig's option fields from a DFlash config.json, checked."""
    scales = {}
    for key in ("output_multiplier", "input_embedding_scale"):
        scales[key] = dflash_setting(d, key, 1.0)
        if not isinstance(scales[key], (int, float)) or isinstance(scales[key], bool) or \
                not math.isfinite(scales[key]) or scales[key] == 0:
            raise ValueError(f"{where}: {key} must be a finite nonzero number, got {scales[key]!r}")
    softcap = dflash_setting(d, "final_logit_softcapping")
    if softcap is not None and (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
                                or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"{where}: final_logit_softcapping must be a non-negative number or null, got {softcap!r}")
    return dict(attention=attention_kinds(d, where), output_multiplier=float(scales["output_multiplier"]),
                input_embedding_scale=float(scales["input_embedding_scale"]),
                logit_softcap=float(softcap) if softcap else None)


def attention_kinds(d: dict, where: str) -> tuple:
    """Per drafter layer, how its block rows attend: (window or None, causal), as z-lab's `dflash` reads
    layer_types, use_sliding_window, sliding_window and is_causal (docs/checkpoints.md); () when every layer sees
    the whole block and context."""
    kinds = d.get("layer_types")
    is_causal = d.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise ValueError(f"{where}: is_causal must be true, false or null, got {is_causal!r}")
    layers = d.get("num_hidden_layers")
    if kinds is None:
        if d.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true without layer_types is not supported")
        kinds = ["full_attention"] * (layers if isinstance(layers, int) else 0)
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' for each of the "
                         f"{layers} layers, got {kinds!r}")
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    out = tuple((window, kind == "sliding_attention" if is_causal is None else is_causal) if kind ==
                "sliding_attention" else (None, bool(is_causal)) for kind in kinds)
    return () if all(kind == (None, False) for kind in out) else out
