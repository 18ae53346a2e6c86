"""Which family modules a target needs, and their application after the dense Qwen3 is built (docs/families.md).

The one place that reads config.json (and torchrun's environment) to decide what goes beyond the dense core, the way
gpt-fast applies its tp.py after load from the entry point: Qwen3-MoE (moe.py: the sparse MLP of sparse layers), the
Qwen3.5 / 3.6 hybrids (hybrid.py: Gated DeltaNet layers, zero-centred norms, the gated attention, partial RoPE),
RoPE scaling (rope.py: the frequencies and attention factor), tensor parallel (tp.py: each rank's shard, read as
slices). Each module is imported only when a config or the environment needs it; none is imported by the core.
"""

import importlib
import os
import warnings

from loading import dense_fields, dflash_architecture, plain_rope_given, text_config


def family(name: str):
    """The family module `name`, imported now that a config or the environment asks for it. By name: a family
    module imports the core it builds on, and the core reaches it only through this hand-over, so no import
    statement leads from the core back to a family (scripts/core_size.py lists these hand-overs apart)."""
    return importlib.import_module(name)


HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                        "Qwen3_5MoeForCausalLM")


def hybrid_kind(d: dict) -> str | None:
    """"dense" or "moe" for a Qwen3.5 / Qwen3.6 hybrid config (transformers' qwen3_5, qwen3_5_moe and their text
    configs), None for anything else."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    if model_type in HYBRID_TYPES or set(HYBRID_ARCHITECTURES) & set(archs if isinstance(archs, list) else []):
        moe = (model_type or "").startswith("qwen3_5_moe") or any("Moe" in a for a in archs if isinstance(a, str))
        return "moe" if moe else "dense"
    return None


def is_moe(d: dict, moe: bool | None = None) -> bool:
    """Whether a Qwen3 config is Qwen3-MoE's (moe: the caller's say, when not None)."""
    if moe is not None:
        return moe
    return d.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (d.get("architectures") or [])


def other_loader(d: dict, where: str):
    """The from_pretrained(path, device, dtype) of another family's own target class when config.json names one;
    None for the Qwen3 families, which Qwen3.from_pretrained builds; an error for anything else. A family with a
    target class of its own is recognized here, from config.json alone, and its module imported only then."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    if hybrid_kind(d) or model_type in ("qwen3", "qwen3_moe") or \
            {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} & set(archs):
        return None
    if model_type in ("gemma4", "gemma4_text") or {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"} & set(archs):
        return family("gemma4").from_pretrained
    raise ValueError(f"{where}: not a Qwen3, Qwen3.5 or Gemma 4 checkpoint (model_type={model_type!r}, "
                     f"architectures={archs})")


def drafter_class(d: dict, where: str, dense_class):
    """The drafter class for a drafter's config.json: the core's DFlash drafter, or DFlash 2's (dflash2.py)."""
    if dflash_architecture(d, where) == "DFlash2DraftModel":
        return family("dflash2").DFlash2Drafter
    return dense_class


def config_fields(d: dict, where: str = "config.json", moe: bool | None = None) -> dict:
    """model.Qwen3Config's fields from a config.json dict: the dense fields (loading.dense_fields), then each
    family's own, read and checked by its module. moe: read the MoE fields (default: when the file says
    qwen3_moe)."""
    if hybrid_kind(d):
        text, text_where = text_config(d, where)
        return family("hybrid").config_fields(text, text_where, hybrid_kind(text) or hybrid_kind(d), rope_reader(text))
    if is_moe(d, moe):
        moe_module = family("moe")
        fields = dense_fields(d, where, "qwen3_moe", moe_module.DEFAULTS, rope_reader=rope_reader(d))
        return dict(fields, moe=moe_module.MoEConfig(**moe_module.moe_fields(d, where)))
    return dense_fields(d, where, "qwen3", rope_reader=rope_reader(d))


def rope_reader(d: dict):
    """What reads the config's RoPE for loading.dense_fields: rope.rope_fields when the file names more than plain
    RoPE (loading.plain_rope_given), else None (plain RoPE, the core's)."""
    if plain_rope_given(d):
        return None
    return family("rope").rope_fields


def checkpoint_prefixes(d: dict) -> tuple[tuple, tuple]:
    """(prefixes stripped from tensor names, prefixes of tensors skipped) for a target's config."""
    if hybrid_kind(d):
        return family("hybrid").CHECKPOINT_PREFIXES
    return ("model.",), ()


def build(dense_class, config):
    """The target for `config`: the dense class, or the hybrid's own (hybrid.Qwen3_5, which swaps its layers), then
    the MoE's sparse MLPs swapped in (moe.apply)."""
    with warnings.catch_warnings():
        # A MoE target whose every layer is sparse (intermediate_size 0) builds zero-width dense MLPs first, which
        # moe.apply replaces: torch's warning that it cannot initialize them says nothing here.
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        if config.hybrid is not None:
            model = family("hybrid").Qwen3_5(config)
        else:
            model = dense_class(config)
    if config.moe is not None:
        family("moe").apply(model, config.moe)
    return model


def scaled_rope(config, device=None):
    """(inv_freq, attention factor) of a RoPE scaling (rope.rope_frequencies)."""
    return family("rope").rope_frequencies(config, device)


def position_limit(config) -> tuple[int, str]:
    """The most positions (prompt + new tokens) a request may reach and where that number comes from:
    max_position_embeddings, or the longer window a RoPE scaling is for (rope.position_limit)."""
    if config.rope_scaling["rope_type"] == "default":
        return config.max_position_embeddings, "the target's max_position_embeddings"
    return family("rope").position_limit(config)


def parallel() -> bool:
    """Whether torchrun launched this process as one of 2 ranks or more (tp.py decides whether to shard)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def parallel_device(device):
    """(this rank's device, a function giving a model built on meta its shard's take(name, stored) for
    loading.load_weights, or None): under torchrun tensor parallel (tp.py), else (device, None)."""
    if not parallel():
        return device, None
    tp = family("tp")
    if not tp.enabled():
        return device, None
    return tp.setup(device), tp.taker
