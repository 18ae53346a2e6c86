"""Which family modules (moe, hybrid, rope, tp, gemma4, dflash2, drafter_options, multimodal) a checkpoint needs,
from config.json and torchrun's environment, and their application after the dense Qwen3 is built; each imported
only when needed (docs/families.md)."""

import importlib
import os
import warnings

from loading import dense_fields, dflash_architecture, plain_rope_given


def family(name: str):
    """The module `name` (a family, or an optional part such as budget), imported by name so that no import
    statement leads from the core to it."""
    return importlib.import_module(name)


HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                        "Qwen3_5MoeForCausalLM")


def hybrid_kind(d: dict) -> str | None:
    """"dense" or "moe" for a Qwen3.5 / Qwen3.6 hybrid config, None for anything else."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    if model_type in HYBRID_TYPES or set(HYBRID_ARCHITECTURES) & set(archs if isinstance(archs, list) else []):
        moe = (model_type or "").startswith("qwen3_5_moe") or any("Moe" in a for a in archs if isinstance(a, str))
        return "moe" if moe else "dense"
    return None


def other_loader(d: dict, where: str):
    """The from_pretrained(path, device, dtype) of another family's target class that config.json names; None for
    the Qwen3 families; an error for anything else."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    if hybrid_kind(d) or model_type in ("qwen3", "qwen3_moe") or \
            {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} & set(archs):
        return None
    if model_type in ("gemma4", "gemma4_text") or {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"} & set(archs):
        return family("gemma4").from_pretrained
    raise ValueError(f"{where}: not a Qwen3, Qwen3.5 or Gemma 4 checkpoint (model_type={model_type!r}, "
                     f"architectures={archs})")


def text_config(d: dict, where: str) -> tuple[dict, str]:
    """(the text model's fields, where): multimodal.text_config for a hub config that nests them (Qwen3.5, Gemma 4)."""
    if d.get("text_config") is None:
        return d, where
    return family("multimodal").text_config(d, where)


def drafter_options(d: dict, where: str) -> dict:
    """drafter_options.fields for a drafter config.json that sets more than plain layers ({} for a plain one:
    DFlashConfig's defaults)."""
    layers, kinds = d.get("num_hidden_layers"), d.get("layer_types")
    plain_layers = isinstance(layers, int) and kinds in (None, ["full_attention"] * layers) and \
        not d.get("use_sliding_window") and (d.get("is_causal") is None or d.get("is_causal") is False)
    scales = {"output_multiplier", "input_embedding_scale", "final_logit_softcapping"}
    if plain_layers and not scales & (set(d) | set(d.get("dflash_config") or {})):
        return {}
    return family("drafter_options").fields(d, where)


def drafter_class(d: dict, where: str, dense_class):
    """The drafter class for a drafter's config.json: the core's DFlash drafter, or DFlash 2's (dflash2.py)."""
    if dflash_architecture(d, where) == "DFlash2DraftModel":
        return family("dflash2").DFlash2Drafter
    return dense_class


def config_fields(d: dict, where: str = "config.json", moe: bool | None = None) -> dict:
    """model.Qwen3Config's fields from a config.json dict: the dense ones, then each family's. moe: read the MoE
    fields (default: when the file says qwen3_moe)."""
    if hybrid_kind(d):
        text, text_where = text_config(d, where)
        return family("hybrid").config_fields(text, text_where, hybrid_kind(text) or hybrid_kind(d), rope_reader(text))
    if moe or moe is None and (d.get("model_type") == "qwen3_moe" or
                               "Qwen3MoeForCausalLM" in (d.get("architectures") or [])):
        moe_module = family("moe")
        fields = dense_fields(d, where, "qwen3_moe", moe_module.DEFAULTS, rope_reader=rope_reader(d))
        return dict(fields, moe=moe_module.MoEConfig(**moe_module.moe_fields(d, where)))
    return dense_fields(d, where, "qwen3", rope_reader=rope_reader(d))


def rope_reader(d: dict):
    """rope.rope_fields when the config names more than plain RoPE, else None (the core's plain_rope)."""
    if plain_rope_given(d):
        return None
    return family("rope").rope_fields


def checkpoint_prefixes(d: dict) -> tuple[tuple, tuple]:
    """(prefixes stripped from tensor names, prefixes of tensors skipped) for a target's config."""
    if hybrid_kind(d):
        return family("hybrid").CHECKPOINT_PREFIXES
    return ("model.",), ()


def build(dense_class, config):
    """The target for `config`: the dense class or hybrid.Qwen3_5, then the MoE's sparse MLPs (moe.apply)."""
    with warnings.catch_warnings():
        # An all-sparse MoE target builds zero-width dense MLPs first, which moe.apply replaces.
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        if config.hybrid is not None:
            model = family("hybrid").Qwen3_5(config)
        else:
            model = dense_class(config)
    if config.moe is not None:
        family("moe").apply(model, config.moe)
    return model


def position_limit(config) -> tuple[int, str]:
    """(the most positions a request may reach, where that number comes from): max_position_embeddings, or a
    RoPE scaling's (rope.position_limit)."""
    if config.rope_scaling["rope_type"] == "default":
        return config.max_position_embeddings, "the target's max_position_embeddings"
    return family("rope").position_limit(config)


def parallel() -> bool:
    """Whether torchrun launched this process as one of 2 ranks or more (tp.py decides whether to shard)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def parallel_device(device):
    """(this rank's device, tp.taker or None): tensor parallel under torchrun (tp.py), else (device, None)."""
    if not parallel():
        return device, None
    tp = family("tp")
    if not tp.enabled():
        return device, None
    return tp.setup(device), tp.taker
