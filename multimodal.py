"""Multimodal hub checkpoints (Qwen3.5, Gemma 4): the text model's fields nested in config.json's `text_config`.
families.text_config reads them through this module only for a config that nests them."""


def text_config(d: dict, where: str) -> tuple[dict, str]:
    """(the text model's fields, where) of a config that nests them in `text_config`: the outer tie_word_embeddings
    is the one transformers ties by, and the outer eos_token_id fills an absent inner one."""
    inner = d["text_config"]
    if not isinstance(inner, dict):
        raise ValueError(f"{where}: text_config must be a JSON object, got {type(inner).__name__}")
    ignored = [k for k in ("rope_scaling", "rope_parameters", "rope_theta") if d.get(k) and d[k] != inner.get(k)]
    if ignored:  # transformers builds the text model's RoPE from text_config alone
        raise ValueError(f"{where}: {', '.join(ignored)} at the top level would be ignored (transformers reads the "
                         f"text model's RoPE from text_config): move it into text_config")
    merged = dict(inner)
    merged["tie_word_embeddings"] = d.get("tie_word_embeddings", False)
    if merged.get("eos_token_id") is None and d.get("eos_token_id") is not None:
        merged["eos_token_id"] = d["eos_token_id"]
    merged.setdefault("model_type", (d.get("model_type") or "qwen3_5") + "_text")
    return merged, f"{where} (text_config)"
