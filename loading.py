"""Loading: checkpoint files, config.json checked field by field, safetensors weights checked from their headers and
streamed one tensor at a time into the requested dtype and device (docs/checkpoints.md)."""

import json
import os
import re
import reprlib
import warnings

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open


def dense_fields(d: dict, where: str = "config.json", family: str = "qwen3", defaults: dict | None = None,
                 mlp: bool = True, partial_default: float | None = None, rope_reader=None) -> dict:
    """model.Qwen3Config's fields from config.json, every field that changes the computation read or refused. A family
    passes its name, `defaults` (head_dim, num_key_value_heads), mlp=False (not every layer has a dense MLP),
    partial_default (it checks its own partial RoPE and layer kinds) and a rope_reader (families.rope_reader)."""
    defaults = defaults or DENSE_DEFAULTS
    needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") + \
        (("intermediate_size",) if mlp else ())
    missing = [k for k in needed if k not in d]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    sizes = {k: positive(where, d, k) for k in needed}
    if sizes["num_hidden_layers"] > MAX_LAYERS:  # a family's and the drafter's per-layer lists
        raise ValueError(f"{where}: num_hidden_layers={sizes['num_hidden_layers']} is past {MAX_LAYERS}")
    if not mlp:
        sizes["intermediate_size"] = positive(where, d, "intermediate_size", default=1) if \
            d.get("intermediate_size") is not None else 0
    heads = sizes["num_attention_heads"]
    # An absent field takes transformers' default (a null num_key_value_heads: as many as the heads); `defaulted`
    # names them for a later shape error.
    kv_heads = positive(where, d, "num_key_value_heads") if d.get("num_key_value_heads") is not None else \
        heads if "num_key_value_heads" in d else defaults["num_key_value_heads"]
    if d.get("head_dim") is not None:
        head_dim = positive(where, d, "head_dim")
    elif defaults["head_dim"] is not None:
        head_dim = defaults["head_dim"]
    elif sizes["hidden_size"] % heads:
        raise ValueError(f"{where}: no head_dim, and hidden_size={sizes['hidden_size']} is not a multiple of "
                         f"num_attention_heads={heads}")
    else:
        head_dim = sizes["hidden_size"] // heads
    defaulted = tuple(f"{k}={v}" for k, v in (("head_dim", head_dim), ("num_key_value_heads", kv_heads))
                      if d.get(k) is None)
    note = f" ({defaulted_note(defaulted, family)})" if defaulted else ""
    if "tie_word_embeddings" in d and not isinstance(d["tie_word_embeddings"], bool):
        raise ValueError(f"{where}: tie_word_embeddings must be true or false, got {d['tie_word_embeddings']!r}")
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
                         f"{note}")
    eps = positive(where, d, "rms_norm_eps", float, default=1e-6)
    max_positions = positive(where, d, "max_position_embeddings", default=32768)
    rope = (rope_reader or plain_rope)(d, where, partial_default, max_positions)
    theta = positive(where, rope, "rope_theta", float)
    if d.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported")
    if d.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported (Qwen3 has no attention biases)")
    if d.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported (Qwen3 has no MLP biases)")
    act = d.get("hidden_act", "silu")
    if act != "silu":  # every MLP here (and the drafter's) is SiLU-gated, as Qwen3's
        raise ValueError(f"{where}: hidden_act={act!r} is not supported (only 'silu', Qwen3's)")
    common = dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=eps, rope_theta=theta, max_position_embeddings=max_positions,
        rope_scaling=rope["scaling"],
        tie_word_embeddings=d.get("tie_word_embeddings", False), defaulted=defaulted)
    if partial_default is not None:
        return dict(common, partial_rotary_factor=rope.get("partial_rotary_factor", 1.0))
    kinds = d.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) - {"full_attention"}):
        raise ValueError(f"{where}: layer_types other than full_attention are not supported "
                         f"(got {sorted(set(map(str, kinds))) if isinstance(kinds, list) else kinds!r})")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1:
        raise ValueError(f"{where}: partial_rotary_factor={partial!r} is not supported (Qwen3 ropes every "
                         f"dimension)")
    return common


DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta: a file with no rope_theta


def plain_rope_given(d: dict) -> bool:
    """Whether a config's RoPE is plain (no rope_scaling, rope type "default"); any other is rope.py's to read."""
    scaling, given = d.get("rope_scaling"), d.get("rope_parameters")
    if scaling is not None and scaling != {}:
        return False
    return given is None or (isinstance(given, dict) and given.get("rope_type", given.get("type", "default")) ==
                             "default")


def plain_rope(d: dict, where: str, partial_default: float | None, max_positions: int) -> dict:
    """A plain RoPE's parameters as transformers settles them; "scaling": Qwen3Config.rope_scaling."""
    params = dict(d.get("rope_parameters") or {})
    params.setdefault("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA))
    partial = d.get("partial_rotary_factor", partial_default)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    params["scaling"] = {"rope_type": "default"}
    return params


def defaulted_note(defaulted: tuple, family: str = "") -> str:
    """What a shape error adds when config.json left fields to their defaults."""
    return (f"config.json gives no {', '.join(f.split('=')[0] for f in defaulted)}: transformers' default"
            f"{' for ' + family if family else ''} is taken, {', '.join(defaulted)}")


# What transformers 5.24 takes for a Qwen3 config.json without head_dim / num_key_value_heads.
DENSE_DEFAULTS = dict(head_dim=128, num_key_value_heads=32)


# Past these (no model comes near) a config.json is refused before anything is sized by it.
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 2**20


def positive(where: str, d: dict, key: str, kind=int, default=None):
    """d[key] (or `default`) checked to be a positive `kind` (int at most MAX_SIZE, or float)."""
    value = d.get(key, default)
    ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not ok or not value > 0 or value == float("inf"):
        raise ValueError(f"{where}: {key} must be a positive {'integer' if kind is int else 'number'}, "
                         f"got {value!r}")
    if kind is int and value > MAX_SIZE:
        raise ValueError(f"{where}: {key}={reprlib.repr(value)} is past {MAX_SIZE}, beyond any model")
    return kind(value)


HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def resolve_checkpoint(path_or_repo: str, what: str = "checkpoint") -> str:
    """A local directory, or a Hugging Face repo id fetched into the cache."""
    if os.path.isdir(path_or_repo):
        if not os.path.isfile(os.path.join(path_or_repo, "config.json")):
            raise ValueError(f"{what} directory {path_or_repo!r} has no config.json")
        return path_or_repo
    looks_like_repo = path_or_repo.count("/") == 1 and not path_or_repo.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise ValueError(f"{what} {path_or_repo!r}: no such directory (and not a Hugging Face repo id 'org/name')")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path_or_repo, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        raise ValueError(f"{what} {path_or_repo!r}: not a local directory and could not be fetched from the "
                         f"Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def read_json(path: str) -> dict:
    """A JSON object from `path`; anything else is an error naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except RecursionError:  # arrays or objects nested deeper than Python's recursion limit
        raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # bad JSON or bytes, or JSON Python will not read (an integer of over 4,300 digits)
        raise ValueError(f"{path}: not valid JSON ({str(e).split(';')[0]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def parse_dtype(dtype, device) -> torch.dtype:
    """bf16 on CUDA and fp32 elsewhere unless asked; accepts floating torch dtypes and their names."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"dtype {dtype} is not one the engine computes in; use float32, bfloat16, float16 or "
                             f"float64")
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return names[dtype]


def parse_device(device) -> torch.device:
    """CUDA when available, else the CPU, unless asked; a device that cannot hold weights here is an error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
        if device.type == "meta":
            raise RuntimeError("the meta device holds no data")
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, TypeError) as e:
        raise ValueError(f"device {str(device)!r} is not usable here ({str(e).splitlines()[0]})") from None
    return device


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no weight_map of tensor names to shard files")
        for name in sorted(set(weight_map.values())):
            check_inside(name, index)
            if not os.path.isfile(os.path.join(path, name)):
                raise ValueError(f"{path}: model.safetensors.index.json lists {name}, which is missing")
        return [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors is loaded)")


def check_inside(name: str, index: str):
    """A shard the index names lies inside the checkpoint's directory: judged by the name, not where it resolves to
    (the Hub's cache links each file to its blob)."""
    parts = name.replace("\\", "/").split("/")
    if not name or "\0" in name or os.path.isabs(name) or ".." in parts or os.path.splitdrive(name)[0]:
        raise ValueError(f"{index}: weight_map names {name!r}, which is not a file inside the checkpoint's "
                         f"directory")


def stacked_parts(model: nn.Module) -> dict:
    """{checkpoint tensor name: (parameter name, first row, last row + 1)} of each projection a Linear stacks
    (model.Linear's `parts`): k_proj.weight is rows [q, q + kv) of qkv_proj.weight."""
    out = {}
    for name, m in model.named_modules():
        if getattr(m, "parts", None):
            parent = name.rpartition(".")[0]
            row = 0
            for part, rows in m.parts.items():
                out[f"{parent}.{part}.weight".lstrip(".")] = (f"{name}.weight", row, row + rows)
                row += rows
    return out


def load_weights(model: nn.Module, path: str, strip_prefix: str | tuple, device, dtype, optional=frozenset(),
                 skip_prefixes: tuple = (), take=None, aliases=None):
    """Stream every tensor into `dtype` on `device`, one host copy at a time, into a model built on meta, all checked
    from the headers first (place_tensors; docs/checkpoints.md, "Tensor names"). strip_prefix: the first of these
    prefixes the names use (`lm_head.weight` is read unprefixed only). optional: read when present; skip_prefixes:
    not read. take(name, stored): the part of a safetensors slice to read (tp.take). aliases: {file's name: ours}."""
    files = safetensors_files(path)
    header = read_header(files, skip_prefixes)
    prefixes = (strip_prefix,) if isinstance(strip_prefix, str) else tuple(strip_prefix)
    prefix = next((p for p in prefixes if any(k.startswith(p) for k in header)), "")  # the first the names use

    def stripped(key):
        name = key[len(prefix):] if prefix and key.startswith(prefix) and key != prefix + "lm_head.weight" else key
        return (aliases or {}).get(name, name)

    places = place_tensors(model, path, header, stripped, optional, take)
    loaded = {}
    read = None if take is None else (lambda key, stored: take(stripped(key), stored))
    for file in files:
        for key, t in read_tensors(file, [k for k in places if header[k][0] == file], read):
            for name, index, part in places[key]:
                piece = t if part is None else t[part]
                if index is None:
                    loaded[name] = piece.to(device=device, dtype=dtype)
                    continue
                if name not in loaded:  # a stacked weight, filled part by part as its tensors are read
                    loaded[name] = torch.empty(model.get_parameter(name).shape, device=device, dtype=dtype)
                loaded[name][index].copy_(piece)
            del t
    model.load_state_dict(loaded, strict=False, assign=True)
    # (remove_duplicate=False: a tied lm_head still points at the meta tensor until the caller re-ties it)
    if any(p.is_meta for n, p in model.named_parameters(remove_duplicate=False) if n not in optional):
        raise ValueError(f"{path}: some weights were not loaded")


def place_tensors(model: nn.Module, path: str, header: dict, stripped, optional, take) -> dict:
    """{checkpoint tensor name: [(the model's tensor, index into it or None: all, part of the stored tensor or None)]}
    from the headers alone; an unplaced tensor, a shape config.json contradicts, non-float weights, two tensors for
    one place and missing ones raise, naming the file. A `checkpoint_places` hook (moe.py) places what it knows."""
    parts = stacked_parts(model)
    stacked = {name for name, _, _ in parts.values()}
    # (remove_duplicate=False: a tied lm_head is the embeddings' parameter, and still a tensor the file may hold)
    wanted = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False) if name not in stacked}
    wanted.update((name, b.shape) for name, b in model.named_buffers() if name != "inv_freq")
    names = {stripped(key): (file, key) for key, (file, _, _) in header.items()}
    hooked, complete = model.checkpoint_places(names, wanted, path) if hasattr(model, "checkpoint_places") else \
        ({}, set)
    places, given = {}, {}
    for key, (file, stored_shape, stored_dtype) in header.items():
        name = stripped(key)
        if name.endswith("rotary_emb.inv_freq"):
            continue
        puts, shape, covers = hooked.get(name) or tensor_place(name, wanted, parts, model)
        if puts is None:
            raise ValueError(f"{file}: unexpected tensor {key!r} (is this the right kind of checkpoint?)")
        try:  # the shape take reads of it, found on the meta device
            read_shape = stored_shape if take is None else take(name, torch.empty(stored_shape, device="meta")).shape
        except ValueError as e:  # a shape config.json contradicts, found while slicing
            raise ValueError(f"{file}: {e}") from None
        if tuple(read_shape) != tuple(shape):
            raise ValueError(f"{file}: tensor {key!r} has shape {tuple(read_shape)}, config.json implies "
                             f"{tuple(shape)}")
        if not stored_dtype.startswith(("F", "BF")):  # F64, F32, F16, BF16, F8_*
            raise ValueError(f"{file}: tensor {key!r} holds {stored_dtype}, not floating-point weights")
        for c in covers:
            if c in given:
                raise ValueError(f"{path}: tensors {given[c]!r} and {key!r} both hold {c}")
            given[c] = key
        places[key] = puts
    missing = sorted(n for n in (set(wanted) - complete()) | set(parts) if n not in given and n not in optional)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return places


def tensor_place(name: str, wanted: dict, parts: dict, model: nn.Module) -> tuple:
    """(places as place_tensors gives them, the shape config.json implies, the names it fills) of the checkpoint
    tensor `name`, or (None, None, ()) when the model has no place for it."""
    if name in parts:  # rows [start, stop) of a stacked weight
        whole, start, stop = parts[name]
        return [(whole, slice(start, stop), None)], (stop - start, model.get_parameter(whole).shape[1]), (name,)
    if name in wanted:
        return [(name, None, None)], wanted[name], (name,)
    return None, None, ()


def read_header(files: list[str], skip_prefixes: tuple = ()) -> dict:
    """{tensor name: (file, shape, safetensors dtype name)} from the files' headers, less skip_prefixes; a name
    stored twice or an unreadable file is an error naming the file."""
    header = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if skip_prefixes and key.startswith(skip_prefixes):
                        continue
                    if key in header:
                        raise ValueError(f"{file}: tensor {key!r} is also stored in {header[key][0]}")
                    stored = f.get_slice(key)
                    header[key] = (file, stored.get_shape(), stored.get_dtype())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    return header


def on_meta(build, where: str):
    """build() on the meta device; sizes whose product passes torch's int64 are an error naming the config."""
    try:
        with torch.device("meta"):
            return build()
    except (RuntimeError, TypeError) as e:
        if "overflow" not in str(e).lower():
            raise
        raise ValueError(f"{where}: its sizes make tensors too large for any machine ({str(e).splitlines()[0][:200]})"
                         ) from None


LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")


def check_layer_count(path: str, layers: int, where: str, skip_prefixes: tuple = ()):
    """config.json's num_hidden_layers against the distinct layers.{i}. of the headers' names: a module is built
    per claimed layer before any weight is read."""
    files = safetensors_files(path)
    held = {m[1] for key in read_header(files, skip_prefixes) if (m := LAYER_INDEX.search(key))}
    if layers > len(held):
        holder = os.path.basename(files[0]) if len(files) == 1 else "the shards of model.safetensors.index.json"
        raise ValueError(f"{where}: num_hidden_layers={layers}, but {holder} holds {len(held)} layers")


def read_tensors(file: str, keys: list[str], take=None):
    """(name, tensor) pairs of one safetensors file, one at a time; take(name, stored): the part to read."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in keys:
                if take is None:
                    yield key, f.get_tensor(key)
                    continue
                try:
                    part = take(key, f.get_slice(key))
                except ValueError as e:  # a shape config.json contradicts, found while slicing
                    raise ValueError(f"{file}: {e}") from None
                yield key, part
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None


def tie_or_keep_head(model, path: str):
    """tie_word_embeddings: the lm_head is the embedding matrix, unless the file stores a different lm_head.weight,
    which transformers uses, and so do we, with a warning."""
    head, embed = model.lm_head.weight, model.embed_tokens.weight
    if head is embed or head.is_meta or torch.equal(head, embed):
        model.lm_head.weight = embed
        return
    warnings.warn(f"{path}: config.json ties the lm_head to the embeddings (tie_word_embeddings: true), but the file "
                  f"stores an lm_head.weight that differs from them: the stored lm_head is used, as transformers "
                  f"uses it")


def eos_ids_of(path: str, config: dict, vocab: int) -> list[int]:
    """Stop ids: generation_config.json's, then config's; one not below vocab is left out with a warning."""
    generation = os.path.join(path, "generation_config.json")
    ids = []
    for source, d in ((generation, read_json(generation) if os.path.isfile(generation) else {}),
                      (os.path.join(path, "config.json"), config)):
        eos = d.get("eos_token_id")
        eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise ValueError(f"{source}: eos_token_id must be a token id or a list of them, got "
                             f"{reprlib.repr(d.get('eos_token_id'))}")
        outside = [i for i in eos if i >= vocab]
        if outside:
            warnings.warn(f"{source}: eos_token_id {reprlib.repr(outside)} not below vocab_size {vocab} (the target "
                          f"never produces such a token): left out of the stop ids")
        ids += [i for i in eos if i < vocab]
    return list(dict.fromkeys(ids))


DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def dflash_architecture(d: dict, where: str = "config.json") -> str:
    """Which DFlash drafter a config.json describes (one of DFLASH_ARCHITECTURES), or a ValueError."""
    archs = d.get("architectures") or []
    kind = next((a for a in DFLASH_ARCHITECTURES if a in archs), None) if isinstance(archs, list) else None
    if kind is None:
        raise ValueError(f"{where}: not a DFlash drafter (architectures={archs}, expected one of "
                         f"{', '.join(DFLASH_ARCHITECTURES)})")
    return kind


def dflash_setting(d: dict, key: str, default=None):
    """A DFlash setting, as z-lab's `dflash` reads it: from `dflash_config`, else the top level."""
    return (d.get("dflash_config") or {}).get(key, d.get(key, default))


def dflash_config_fields(d: dict, where: str = "config.json", rope_reader=None) -> dict:
    """drafter.DFlashConfig's fields from a z-lab DFlash config.json, its layers' Qwen3 fields as "model"."""
    dflash_architecture(d, where)
    if not isinstance(d.get("dflash_config") or {}, dict):
        raise ValueError(f"{where}: dflash_config must be a JSON object")

    def value(key, default=None):
        return dflash_setting(d, key, default)

    rest = {k: v for k, v in d.items() if k not in ("layer_types", "sliding_window", "use_sliding_window",
                                                    "is_causal")}
    model = dense_fields(rest, where, rope_reader=rope_reader)
    for key in ("block_size", "num_target_layers", "mask_token_id"):
        if not isinstance(value(key), int) or isinstance(value(key), bool):
            raise ValueError(f"{where}: {key} must be an integer, got {value(key)!r}")
    if value("block_size") < 2:
        raise ValueError(f"{where}: block_size must be >= 2, got {value('block_size')}")
    if value("block_size") > model["max_position_embeddings"]:  # the block's rows are positions: none would fit
        raise ValueError(f"{where}: block_size={reprlib.repr(value('block_size'))} is past max_position_embeddings="
                         f"{model['max_position_embeddings']}")
    ids = value("target_layer_ids") or default_layer_ids(where, value("num_target_layers"),
                                                         model["num_hidden_layers"])
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: dflash_config.target_layer_ids must be a list of layer indices, got {ids!r}")
    return dict(model=model, block_size=value("block_size"), num_target_layers=value("num_target_layers"),
                target_layer_ids=list(ids), mask_token_id=value("mask_token_id"))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: spread the ids evenly over [1, num_target_layers - 3] (one layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def default_layer_ids(where: str, targets: int, drafts: int) -> list[int]:
    """default_target_layer_ids for a file that gives none; below 4 target layers (an empty span) they are said,
    and refused out of range."""
    ids = default_target_layer_ids(targets, drafts)
    said = (f"{where}: dflash_config gives no target_layer_ids, and DFlash's default for a {targets}-layer target "
            f"with {drafts} drafter layer{'s' if drafts > 1 else ''} (spread over target layers 1 .. "
            f"num_target_layers - 3) is {ids}")
    if not all(0 <= i < targets for i in ids):
        raise ValueError(f"{said}: out of range; give target_layer_ids")
    if targets < 4 and drafts > 1:
        warnings.warn(f"{said}; give target_layer_ids to choose others")
    return ids


def check_pair(target, drafter):
    """Every way a drafter can fail to fit a target, each as one clear error naming both values."""
    t, d = target.config, drafter.config
    checks = [
        (d.model.hidden_size == t.hidden_size, f"drafter hidden_size {d.model.hidden_size} != target hidden_size "
                                               f"{t.hidden_size}"),
        (d.model.vocab_size == t.vocab_size, f"drafter vocab_size {d.model.vocab_size} != target vocab_size "
                                             f"{t.vocab_size}"),
        (d.num_target_layers == t.num_hidden_layers, f"drafter num_target_layers {d.num_target_layers} != target "
                                                     f"num_hidden_layers {t.num_hidden_layers}"),
        (all(0 <= i < t.num_hidden_layers for i in d.target_layer_ids),
         f"drafter target_layer_ids {d.target_layer_ids} out of range for a {t.num_hidden_layers}-layer target"),
        (0 <= d.mask_token_id < t.vocab_size, f"drafter mask_token_id {d.mask_token_id} is not below the target "
                                              f"vocab_size {t.vocab_size}"),
        (drafter.fc.weight.shape[1] == len(d.target_layer_ids) * t.hidden_size,
         f"drafter fc takes {drafter.fc.weight.shape[1]} features, the target gives "
         f"{len(d.target_layer_ids)} x {t.hidden_size}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"target and drafter do not fit: {message}")
    if drafter.device != target.device or drafter.dtype != target.dtype:
        raise ValueError(f"target and drafter do not fit: drafter on {drafter.device}/{drafter.dtype}, target on "
                         f"{target.device}/{target.dtype}")
