"""Qwen3 dense target model: Hugging Face checkpoints loaded through safetensors into our own modules.

The forward takes token ids, their RoPE positions and the cache slots their K/V go to (they differ in a tree
verify: a node at depth d sits at position start + d but in slot start + row), attends with the mask from
tree_attn.py (FlexAttention, or SDPA when the mask comes materialized), and returns float32 logits for the
requested rows plus, on request, the outputs of chosen layers (the drafter's context features). Inputs carry a
batch of independent requests (each with its own rows, positions, slots and cache row); the K/V cache is static,
one buffer per layer with a row per request. Config and modules come first, then loading (files, hub, weights).
"""

import json
import os
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch._inductor.config  # read while tracing: frozen graphs keep their layers inlined (run_layer)
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch.nn.attention.flex_attention import flex_attention

from cpu_backend import cpu_attention, cpu_kernel_applies
from moe import SparseMoE
from tree_attn import flex_kernel_options, prefix_block_mask


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen3-MoE (0 experts: dense). Layer i is sparse iff i is not in mlp_only_layers, there are experts, and
    # (i + 1) % decoder_sparse_step == 0; its MLP routes each row to num_experts_per_tok experts of width
    # moe_intermediate_size. Dense layers use intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    def sparse(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json", moe: bool | None = None) -> "Qwen3Config":
        """Reads every value from the file (transformers v4 and v5 layouts, dense or MoE); refuses what we would get
        wrong. moe: read the MoE fields (default: when the file says qwen3_moe)."""
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        sizes = {k: positive(where, d, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                      "num_hidden_layers", "num_attention_heads")}
        heads = sizes["num_attention_heads"]
        kv_heads = positive(where, d, "num_key_value_heads", default=heads) if d.get("num_key_value_heads") else heads
        if d.get("head_dim") is not None:
            positive(where, d, "head_dim")
        elif sizes["hidden_size"] % heads:
            raise ValueError(f"{where}: no head_dim, and hidden_size={sizes['hidden_size']} is not a multiple of "
                             f"num_attention_heads={heads}")
        if "tie_word_embeddings" in d and not isinstance(d["tie_word_embeddings"], bool):
            raise ValueError(f"{where}: tie_word_embeddings must be true or false, got {d['tie_word_embeddings']!r}")
        if heads % kv_heads:
            raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        rope = d.get("rope_parameters") or {}  # v5
        scaling = d.get("rope_scaling") or {}  # v4
        if not isinstance(rope, dict) or not isinstance(scaling, dict):
            raise ValueError(f"{where}: rope_parameters and rope_scaling must be JSON objects")
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"{where}: rope scaling type {rope_type!r} is not supported (only plain RoPE)")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if theta is None:
            raise ValueError(f"{where}: no rope_theta (neither rope_theta nor rope_parameters.rope_theta)")
        theta = positive(where, {"rope_theta": theta}, "rope_theta", float)
        eps = positive(where, d, "rms_norm_eps", float, default=1e-6)
        max_positions = positive(where, d, "max_position_embeddings", default=32768)
        if d.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported")
        if d.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias=true is not supported (Qwen3 has no attention biases)")
        if d.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias=true is not supported (Qwen3 has no MLP biases)")
        act = d.get("hidden_act", "silu")
        if act != "silu":  # every MLP here (and the drafter's) is SiLU-gated, as Qwen3's
            raise ValueError(f"{where}: hidden_act={act!r} is not supported (only 'silu', Qwen3's)")
        kinds = d.get("layer_types")
        if kinds is not None and (not isinstance(kinds, list) or set(kinds) - {"full_attention"}):
            raise ValueError(f"{where}: layer_types other than full_attention are not supported "
                             f"(got {sorted(set(map(str, kinds))) if isinstance(kinds, list) else kinds!r})")
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        if partial != 1:
            raise ValueError(f"{where}: partial_rotary_factor={partial!r} is not supported (Qwen3 ropes every "
                             f"dimension)")
        if moe is None:
            moe = d.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (d.get("architectures") or [])
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=eps, rope_theta=theta,
            max_position_embeddings=max_positions, tie_word_embeddings=d.get("tie_word_embeddings", False),
            **(moe_fields(d, where) if moe else {}))


def moe_fields(d: dict, where: str) -> dict:
    """The Qwen3-MoE fields of a config: transformers 4.x writes num_experts, 5.x num_local_experts."""
    key = "num_experts" if "num_experts" in d else "num_local_experts"
    experts = positive(where, d, key)
    top_k = positive(where, d, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} exceeds {key}={experts}")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {only!r}")
    if not isinstance(d.get("norm_topk_prob", False), bool):
        raise ValueError(f"{where}: norm_topk_prob must be true or false, got {d['norm_topk_prob']!r}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=positive(where, d, "moe_intermediate_size"),
                norm_topk_prob=d.get("norm_topk_prob", False),
                decoder_sparse_step=positive(where, d, "decoder_sparse_step", default=1),
                mlp_only_layers=tuple(only))


def positive(where: str, d: dict, key: str, kind=int, default=None):
    """d[key] (or `default` when absent) checked to be a positive `kind` (int, or float where ints are fine too)."""
    value = d.get(key, default)
    ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not ok or not value > 0 or value == float("inf"):
        raise ValueError(f"{where}: {key} must be a positive {'integer' if kind is int else 'number'}, "
                         f"got {value!r}")
    return kind(value)


# ----------------------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # As Qwen3: normalize in float32, cast back, then scale (the order matters in bf16).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype):
    """cos, sin [..., head_dim] for positions [...]."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE. x: [N, heads, Q, head_dim]; cos/sin: [N, 1, Q, head_dim] (or broadcastable to it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# The CPU one-row switch (docs/compile.md, "one-row Linear on CPU"). Decoding one token only streams the weights,
# and MKL's matrix-vector path streams them well below memory bandwidth, while a multiply-and-sum that inductor
# fuses into one vectorized reduction comes close to it (the README's benchmark section has the figures). So
# compiled code on the CPU computes a single row that way. Several rows stay on the matmul (inside a full layer
# inductor turns the multi-row form into loops slower than MKL), CUDA keeps cuBLAS, and eager code keeps F.linear
# (eager would materialize the product). False: plain F.linear everywhere.
CPU_ONE_ROW_REDUCTION = True


class Linear(nn.Linear):
    """nn.Linear without bias. Compiled on the CPU: one row as a fused reduction (see the switch above), and in
    frozen graphs several rows through oneDNN on the prepacked weight when `cpu_backend.prepack_linears` gave it one."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.packed = None  # the weight in oneDNN's layout (cpu_backend.prepack_linears); an attribute, not state
        self.packed_from = None  # (data_ptr, version) of the weight it was packed from

    def forward(self, x):
        if x.device.type == "cpu" and torch.compiler.is_compiling():
            rows = x.shape[:-1].numel()
            if CPU_ONE_ROW_REDUCTION and rows == 1:
                return (x[..., None, :] * self.weight).sum(-1)
            # freezing first: graphs without it never read (so never guard on) the packed copy
            if torch._inductor.config.freezing and self.packed is not None:
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), self.packed, None, "none", [], "")
                return out.view(*x.shape[:-1], -1)
        return F.linear(x, self.weight)


# Layers compiled once (docs/compile.md, "Layers compiled once"). A model's layers run the same code on the same
# shapes, but a whole-round graph traces, lowers and builds C++ kernels for each of them separately (inductor numbers
# buffers per graph, so even identical kernels differ in their text). Under torch.compile every layer call goes
# through one nested compile region instead: traced and built once per distinct layer (and shapes), then called per
# layer with that layer's weights and caches as arguments. Frozen graphs (compile="max-autotune" on the CPU) keep
# inlined layers: freezing prepacks weights that are graph constants, which a region's arguments are not.
# False: every layer inlined.
COMPILE_LAYERS_ONCE = True


@torch.compiler.nested_compile_region
def _layer_once(layer, x, cos, sin, cache_pos, mask):
    return layer(x, cos, sin, cache_pos, mask)


@torch.compiler.nested_compile_region
def _layer_once_prefix_mask(layer, x, cos, sin, cache_pos, kv_num_blocks, kv_indices, full_num, full_idx, prefix,
                            allow):
    mask = prefix_block_mask(kv_num_blocks, kv_indices, full_num, full_idx, prefix, allow,
                             layer.self_attn.k_cache.shape[2])
    return layer(x, cos, sin, cache_pos, mask)


def run_layer(layer, x, cos, sin, cache_pos, mask):
    """layer(x, ...), through the layers' one compiled region when compiling (see the switch above)."""
    if COMPILE_LAYERS_ONCE and torch.compiler.is_compiling() and not torch._inductor.config.freezing:
        if hasattr(mask, "prefix_tensors"):
            # Dynamo reuses a traced region only when every argument is a tensor, a number or a module: the
            # mask goes in as its tensors and is rebuilt inside, so each distinct layer is traced once.
            return _layer_once_prefix_mask(layer, x, cos, sin, cache_pos, *mask.prefix_tensors)
        return _layer_once(layer, x, cos, sin, cache_pos, mask)
    return layer(x, cos, sin, cache_pos, mask)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = Linear(hidden, heads * head_dim)
        self.k_proj = Linear(hidden, kv_heads * head_dim)
        self.v_proj = Linear(hidden, kv_heads * head_dim)
        self.o_proj = Linear(heads * head_dim, hidden)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        # Static K/V caches, registered as (non-persistent) buffers so CUDA graphs see fixed addresses.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        self.kv_rows = None  # the (K, V) buffers the caches are the first rows of (allocate_kv_caches)

    def project_kv(self, x, cos, sin):
        """K (normed, roped) and V of rows x [N, Q, hidden] as [N, kv_heads, Q, head_dim]."""
        n, q_len = x.shape[:2]
        k = self.k_norm(self.k_proj(x).view(n, q_len, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def write_kv(self, x, cos, sin, cache_pos):
        """Each request's K/V into its own cache row: request n's row q goes to slot cache_pos[n, q]."""
        k, v = self.project_kv(x, cos, sin)
        write_slots(self.k_cache, cache_pos, k)
        write_slots(self.v_cache, cache_pos, v)

    def forward(self, x, cos, sin, cache_pos, mask):
        n, q_len = x.shape[:2]
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        self.write_kv(x, cos, sin, cache_pos)
        scale, gqa = self.head_dim ** -0.5, self.heads != self.kv_heads
        if cpu_kernel_applies(q, self.k_cache, mask):  # compiled CPU engines only (cpu_backend.py)
            return self.o_proj(cpu_attention(q, self.k_cache, self.v_cache, mask, scale).view(n, q_len, -1))
        if isinstance(mask, torch.Tensor):  # dense, over the KV slots it covers (tree_attn.PrefixMask, dense=True)
            kv = mask.shape[-1]
            out = F.scaled_dot_product_attention(q, self.k_cache[:, :, :kv], self.v_cache[:, :, :kv], attn_mask=mask,
                                                 scale=scale, enable_gqa=gqa)
        else:
            options = flex_kernel_options(q_len, q.device.type)
            out = flex_attention(q, self.k_cache, self.v_cache, block_mask=mask, scale=scale, enable_gqa=gqa,
                                 kernel_options=options)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, self.heads * self.head_dim))


def write_slots(cache, slots, values):
    """cache [N, H, S, D][n, :, slots[n, q]] = values [N, H, Q, D][n, :, q]: one indexed write with a batch index."""
    batch = torch.arange(cache.shape[0], device=cache.device)[:, None]
    cache[batch, :, slots] = values.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter)
        self.up_proj = Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm Qwen3 decoder layer (also the DFlash drafter's layer, whose attention differs only in K/V);
    layer `index` of a Qwen3-MoE model may have the sparse MLP."""

    def __init__(self, c: Qwen3Config, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.sparse(index):
            self.mlp = SparseMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                 c.norm_topk_prob)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, cache_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def allocate_kv_caches(layers, length: int, dtype, device, batch: int = 1):
    """One K and one V buffer per layer ([batch, kv_heads, length, head_dim]: a row per request), never views of
    one stacked buffer: compiled FlexAttention reads such views wrongly (docs/compile.md, "stacked KV buffer views").
    Buffers with at least `batch` rows of that length, dtype and device are kept (compiled graphs and CUDA graphs
    hold on to them), and a smaller batch gets their first rows: a batch that shrinks as its requests end, and the
    next batch at the full size, allocate nothing."""
    with torch.inference_mode(False):  # normal tensors: usable inside and outside inference mode
        for layer in layers:
            attn = layer.self_attn
            shape = (batch, attn.kv_heads, length, attn.head_dim)
            full = attn.kv_rows
            if full is None or full[0].shape[0] < batch or full[0].shape[1:] != shape[1:] or \
                    full[0].dtype != dtype or full[0].device != torch.device(device):
                full = attn.kv_rows = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))
            if attn.k_cache is None or attn.k_cache.shape != shape or attn.k_cache.data_ptr() != full[0].data_ptr():
                # the whole buffer itself, or a view of its first rows (storage offset 0, the buffer's strides)
                attn.k_cache, attn.v_cache = (t if t.shape[0] == batch else t[:batch] for t in full)


def layer_kv_caches(layers):
    """Each layer's K and V cache, in order."""
    for layer in layers:
        yield layer.self_attn.k_cache
        yield layer.self_attn.v_cache


class Qwen3(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(c.head_dim, c.rope_theta, None), persistent=False)
        self.eos_ids: list[int] = []
        self.path: str | None = None

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def setup_cache(self, length: int, batch: int = 1):
        """Allocate (or reuse) one K and one V buffer per layer for `batch` requests of `length` slots (a multiple
        of 128)."""
        allocate_kv_caches(self.layers, length, self.dtype, self.device, batch)

    def kv_caches(self):
        return layer_kv_caches(self.layers)

    def forward(self, tokens, input_pos, cache_pos, block_mask, logits_rows=None, feature_layers=()):
        """tokens, input_pos, cache_pos: [N, Q] int64 (request n's rows, their RoPE positions and cache slots in
        cache row n), or [Q] for one request. Returns (float32 logits [N, len(logits_rows) or Q, V], features
        [N, Q, len(feature_layers) * hidden] or None): the outputs of the chosen layers, concatenated; without the
        leading N for 1-D input. logits_rows: [N, k] rows of each request to take logits of (or [k])."""
        if tokens.dim() == 1:
            rows = None if logits_rows is None else logits_rows[None]
            logits, features = self(tokens[None], input_pos[None], cache_pos[None], block_mask, rows, feature_layers)
            return logits[0], (None if features is None else features[0])
        x = self.embed_tokens(tokens)
        cos, sin = (t[:, None] for t in rope_cos_sin(input_pos, self.inv_freq, x.dtype))
        outputs, last = {}, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = run_layer(layer, x, cos, sin, cache_pos, block_mask)
            if i in feature_layers:
                # Hugging Face's hidden_states[last + 1] is taken after the final norm, and DFlash drafters that
                # read the last layer were trained on that: match it (docs/checkpoints.md, "context features").
                outputs[i] = self.norm(x) if i == last else x
        if logits_rows is not None:
            x = x.gather(1, logits_rows[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).float()
        # In the listed order, repeats included: the drafter's fc columns follow its target_layer_ids list.
        features = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        return logits, features

    @classmethod
    def from_pretrained(cls, path_or_repo: str, device=None, dtype=None) -> "Qwen3":
        path = resolve_checkpoint(path_or_repo, "target")
        raw = read_json(os.path.join(path, "config.json"))
        where = os.path.join(path, "config.json")
        check_qwen3_config(raw, where)
        config = Qwen3Config.from_dict(raw, where)
        device = parse_device(device)
        dtype = parse_dtype(dtype, device)
        with torch.device("meta"):
            model = cls(config)
        skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
        load_weights(model, path, strip_prefix="model.", device=device, dtype=dtype, skip=skip)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, device)
        model.eos_ids = eos_ids_of(path, raw)
        model.path = path
        return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# Loading: checkpoint files (local or from the hub), config checks, weights


HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def resolve_checkpoint(path_or_repo: str, what: str = "checkpoint") -> str:
    """A local directory, or a Hugging Face repo id fetched (config, weights, tokenizer only) into the cache."""
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
    """A JSON object from `path`; anything else (invalid JSON, not UTF-8, an array...) is an error naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def parse_dtype(dtype, device) -> torch.dtype:
    """bf16 on CUDA and fp32 elsewhere unless asked; accepts floating torch dtypes and their names."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating-point type; use float32, bfloat16 or float16")
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


def check_qwen3_config(d: dict, where: str):
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    if model_type not in ("qwen3", "qwen3_moe") and not {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} & set(archs):
        raise ValueError(f"{where}: not a Qwen3 checkpoint (model_type={model_type!r}, architectures={archs})")


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no weight_map of tensor names to shard files")
        shards = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
        for shard in shards:
            if not os.path.isfile(shard):
                raise ValueError(f"{path}: model.safetensors.index.json lists {os.path.basename(shard)}, which is missing")
        return shards
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors is loaded)")


def load_weights(model: nn.Module, path: str, strip_prefix: str, device, dtype, skip=frozenset()):
    """Stream every tensor from the safetensors files straight into `dtype` on `device`.

    The model was built on the meta device, so the only host copies are one tensor at a time: an 8B bf16
    checkpoint never materializes in fp32. A MoE checkpoint's per-expert tensors are copied into their slice of
    the stacked expert weights as they are read (no second copy). Missing or unexpected tensors are errors, not
    silent random weights.
    """
    wanted = {name: p for name, p in model.named_parameters()}
    wanted.update((name, b) for name, b in model.named_buffers() if name != "inv_freq")
    loaded, experts_read = {}, {}
    for file in safetensors_files(path):
        for key, t in read_tensors(file):
            name = key[len(strip_prefix):] if key.startswith(strip_prefix) else key
            if name in skip or name.endswith("rotary_emb.inv_freq"):
                continue
            expert = EXPERT_TENSOR.match(name)
            if expert:  # layers.{i}.mlp.experts.{e}.{proj}.weight -> slice e of layers.{i}.mlp.experts.{proj}
                name, index = f"{expert[1]}.{expert[3]}", int(expert[2])
            if name not in wanted:
                raise ValueError(f"{file}: unexpected tensor {key!r} (is this the right kind of checkpoint?)")
            shape = tuple(wanted[name].shape[1:] if expert else wanted[name].shape)
            if expert and index >= wanted[name].shape[0]:
                raise ValueError(f"{file}: tensor {key!r} names expert {index}, config.json has "
                                 f"{wanted[name].shape[0]} experts")
            if tuple(t.shape) != shape:
                raise ValueError(f"{file}: tensor {key!r} has shape {tuple(t.shape)}, config.json implies {shape}")
            if not t.is_floating_point():
                raise ValueError(f"{file}: tensor {key!r} holds {t.dtype}, not floating-point weights")
            if expert:
                if name not in loaded:
                    loaded[name] = torch.empty(wanted[name].shape, device=device, dtype=dtype)
                    experts_read[name] = set()
                loaded[name][index].copy_(t)
                experts_read[name].add(index)
            else:
                loaded[name] = t.to(device=device, dtype=dtype)
            del t
    for name, read in experts_read.items():
        absent = sorted(set(range(wanted[name].shape[0])) - read)
        if absent:
            raise ValueError(f"{path}: checkpoint lacks experts {absent[:8]} of {name} "
                             f"({len(absent)} of {wanted[name].shape[0]})")
    missing = sorted(set(wanted) - set(loaded) - set(skip))
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    # (remove_duplicate=False: a tied lm_head still points at the meta tensor until the caller re-ties it)
    if any(p.is_meta for n, p in model.named_parameters(remove_duplicate=False) if n not in skip):
        raise ValueError(f"{path}: some weights were not loaded")


EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def read_tensors(file: str):
    """(name, tensor) pairs of one safetensors file, one tensor at a time; a file that is not valid safetensors
    (truncated, empty, a corrupt header) is an error naming it."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None


def eos_ids_of(path: str, config: dict) -> list[int]:
    """End-of-sequence ids: generation_config.json first (Qwen3 lists <|im_end|> and <|endoftext|>), then config."""
    ids = []
    for source in (os.path.join(path, "generation_config.json"), None):
        d = read_json(source) if source and os.path.isfile(source) else (config if source is None else {})
        eos = d.get("eos_token_id")
        eos = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise ValueError(f"{source or os.path.join(path, 'config.json')}: eos_token_id must be a token id or a "
                             f"list of them, got {d.get('eos_token_id')!r}")
        ids += eos
    return list(dict.fromkeys(ids))
