"""DFlash block-diffusion drafter (z-lab checkpoint format) in our own modules.

A round drafts one block `[bonus, MASK x (block_size - 1)]` at absolute positions start .. start + block_size - 1.
Every layer is a Qwen3 layer whose keys/values are those of the context (the target's chosen-layer outputs of the
committed tokens, fused by `fc` + `hidden_norm`) followed by those of the block; the block attends to all of the
context and bidirectionally to itself. Output k >= 1 is the distribution of the token at start + k, so one
forward gives block_size - 1 per-position distributions. The embedding and lm_head are the target's.

Only the context's K/V persist between rounds (one cache buffer per layer, like the target's); the block's K/V
are written into the slots just after the context and overwritten by the next round. Context features are
appended with a fixed width so every round has the same shapes and compiles once.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import (Block, Qwen3Config, RMSNorm, allocate_kv_caches, default_device, kv_cache_length, load_weights,
                   parse_dtype, read_json, resolve_checkpoint, rope_cos_sin, rope_inv_freq)
import tree_attn


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: spread the ids evenly over [1, num_target_layers - 3] (one layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    model: Qwen3Config  # the drafter's own layers (hidden size equal to the target's)
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        archs = d.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ValueError(f"{where}: not a DFlash drafter (architectures={archs}, expected DFlashDraftModel)")
        model = Qwen3Config.from_dict(d, where)
        dflash = d.get("dflash_config") or {}
        for key, value in (("block_size", d.get("block_size")), ("num_target_layers", d.get("num_target_layers")),
                           ("dflash_config.mask_token_id", dflash.get("mask_token_id"))):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
        if d["block_size"] < 2:
            raise ValueError(f"{where}: block_size must be >= 2, got {d['block_size']}")
        ids = dflash.get("target_layer_ids") or default_target_layer_ids(d["num_target_layers"],
                                                                         model.num_hidden_layers)
        return cls(model=model, block_size=d["block_size"], num_target_layers=d["num_target_layers"],
                   target_layer_ids=list(ids), mask_token_id=dflash["mask_token_id"])


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        c = config.model
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(c.head_dim, c.rope_theta, None), persistent=False)
        self.target_parts = None  # (embed_tokens, lm_head) of the bound target: used, not owned (no state_dict)
        self.path: str | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def device(self):
        return self.fc.weight.device

    @property
    def dtype(self):
        return self.fc.weight.dtype

    def bind(self, target) -> "DFlashDrafter":
        """Check that this drafter fits `target` and use the target's embedding and lm_head."""
        check_pair(target, self)
        self.target_parts = (target.embed_tokens, target.lm_head)
        return self

    @property
    def cache_len(self) -> int:
        return kv_cache_length(self.layers)

    def setup_cache(self, length: int):
        allocate_kv_caches(self.layers, length, self.dtype, self.device)

    def append_context(self, features, positions, cache_pos):
        """Write the context K/V of committed tokens: features [W, len(ids) * hidden] (the target's chosen-layer
        outputs), at RoPE positions and cache slots [W]. No attention: context rows are keys, never queries."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = rope_cos_sin(positions, self.inv_freq, ctx.dtype)
        for layer in self.layers:
            layer.self_attn.write_kv(ctx, cos, sin, cache_pos)

    def forward(self, block_tokens, positions, cache_pos, block_mask):
        """One denoising pass over a block [block_size] -> float32 logits [block_size, vocab] (row k predicts the
        token at position start + k; row 0 is the bonus's own row and is not a prediction)."""
        embed, lm_head = self.target_parts
        x = embed(block_tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        mask = tree_attn.attention_mask(block_mask)
        for layer in self.layers:
            x = layer(x, cos, sin, cache_pos, mask)
        return lm_head(self.norm(x)).float()

    def draft(self, bonus, start, block_mask, denoise_steps: int = 1):
        """Per-position draft logits [block_size - 1, vocab] for the positions after the bonus at `start`.

        `block_mask` must let the block see slots [0, start + block_size) (tree_attn.PrefixMask with all-ones
        allow). With denoise_steps T > 1, each pass unmasks the most confident still-masked positions (their
        argmax) and the next pass conditions on them; each position keeps the logits of the pass that decided
        it (the last pass for those still masked), so the draft is the same per-position form as with T = 1.
        """
        bs = self.block_size
        pos = start + torch.arange(bs, device=bonus.device)
        masks = torch.full((bs - 1,), self.config.mask_token_id, dtype=torch.long, device=bonus.device)
        tokens = torch.cat([bonus.view(1), masks])
        logits = self(tokens, pos, pos, block_mask)[1:]
        if denoise_steps == 1:
            return logits
        masked = torch.ones(bs - 1, dtype=torch.bool, device=bonus.device)

        def decided_after(passes):  # an equal share of the block is decided by each pass
            return -(-(bs - 1) * passes // denoise_steps)

        for step in range(1, denoise_steps):
            count = decided_after(step) - decided_after(step - 1)
            confidence = logits.log_softmax(-1).amax(-1).masked_fill(~masked, -float("inf"))
            chosen = torch.zeros_like(masked).scatter(0, confidence.topk(count).indices, True) & masked
            tokens = torch.cat([tokens[:1], torch.where(chosen, logits.argmax(-1), tokens[1:])])
            masked = masked & ~chosen
            new = self(tokens, pos, pos, block_mask)[1:]
            logits = torch.where(masked[:, None], new, logits)
        return logits

    @classmethod
    def from_pretrained(cls, path_or_repo: str, device=None, dtype=None) -> "DFlashDrafter":
        path = resolve_checkpoint(path_or_repo, "drafter")
        where = os.path.join(path, "config.json")
        config = DFlashConfig.from_dict(read_json(where), where)
        device = device or default_device()
        dtype = parse_dtype(dtype, device)
        with torch.device("meta"):
            drafter = cls(config)
        load_weights(drafter, path, strip_prefix="", device=device, dtype=dtype)
        drafter.inv_freq = rope_inv_freq(config.model.head_dim, config.model.rope_theta, device)
        drafter.path = path
        return drafter.eval()


def check_pair(target, drafter: DFlashDrafter):
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


# ----------------------------------------------------------------------------------------------------------------
# Training
#
# A training batch holds B sequences of C tokens, the frozen target's chosen-layer features of all C positions,
# and n random anchors per sequence. Block j of sequence b is [token at anchor, MASK x (block_size - 1)] at
# positions anchor .. anchor + block_size - 1 (or, for the diffusion objective, the clean labels with a random
# subset masked). All n blocks of a sequence are query rows of one attention whose keys are
# [context positions 0 .. C-1 ; the n blocks], and block j may see the context strictly before its anchor and
# its whole block, nothing else (article §5.3: bidirectional within a block, causal across). That rule is written
# once, as a mask_mod: FlexAttention runs it where it has a backward (CUDA), and on CPU it is materialized as the
# same boolean mask for SDPA. Each layer's K/V are exactly those of inference (DFlashDrafter.append_context and
# Block.forward): the context's are k_norm(k_proj(hidden_norm(fc(features)))) without input_layernorm, the block's
# come from input_layernorm(x); both roped at absolute positions. tests/test_training.py checks the logits against
# DFlashDrafter.draft.


def block_mask_mod(anchors: torch.Tensor, context_len: int, block_size: int):
    """mask_mod(b, h, q, kv) for query rows = n blocks of block_size per sequence (anchors [B, n]) and keys =
    [context_len context positions ; n * block_size block rows]."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        sees_context = kv_idx < anchors[b, block]  # context positions before the anchor (kv < anchor < C)
        same_block = (kv_idx - context_len) // block_size == block  # negative for context keys: never equal
        return sees_context | same_block

    return mask_mod


def dense_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """The mask_mod as a boolean [B, 1, Q, C + Q] tensor (True = may attend), for SDPA."""
    from torch.nn.attention.flex_attention import create_mask
    q_len = anchors.shape[1] * block_size
    return create_mask(block_mask_mod(anchors, context_len, block_size), anchors.shape[0], 1, q_len,
                       context_len + q_len, device=anchors.device)


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """The mask_mod as a FlexAttention BlockMask (for training on CUDA, where FlexAttention has a backward)."""
    from torch.nn.attention.flex_attention import create_block_mask
    q_len = anchors.shape[1] * block_size
    return create_block_mask(block_mask_mod(anchors, context_len, block_size), anchors.shape[0], None, q_len,
                             context_len + q_len, device=anchors.device)


def training_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """What training_logits takes: a BlockMask on CUDA, the dense boolean mask elsewhere."""
    if anchors.device.type == "cuda":
        return flex_block_mask(anchors, context_len, block_size)
    return dense_block_mask(anchors, context_len, block_size)


def training_logits(drafter: "DFlashDrafter", embed, lm_head, features, block_tokens, block_positions, mask):
    """Batched drafter forward with autograd. features [B, C, len(ids) * hidden] (the target's chosen-layer
    outputs at positions 0..C-1), block_tokens / block_positions [B, Q] (n blocks of block_size), mask from
    training_mask. Returns float32 logits [B, Q, vocab]; row k of a block predicts the token at anchor + k."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from torch.nn import functional as F
    from model import apply_rope
    B, C, _ = features.shape
    Q = block_tokens.shape[1]
    x = embed(block_tokens)
    ctx = drafter.hidden_norm(drafter.fc(features.to(x.dtype)))
    ctx_cos, ctx_sin = rope_cos_sin(torch.arange(C, device=x.device), drafter.inv_freq, ctx.dtype)
    cos, sin = rope_cos_sin(block_positions.reshape(-1), drafter.inv_freq, x.dtype)
    cos, sin = cos.view(B, 1, Q, -1), sin.view(B, 1, Q, -1)
    for layer in drafter.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(h).view(B, Q, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
        k_blk = apply_rope(a.k_norm(a.k_proj(h).view(B, Q, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
        v_blk = a.v_proj(h).view(B, Q, a.kv_heads, a.head_dim).transpose(1, 2)
        k_ctx = a.k_norm(a.k_proj(ctx).view(B, C, a.kv_heads, a.head_dim)).transpose(1, 2)
        k_ctx = apply_rope(k_ctx, ctx_cos, ctx_sin)
        v_ctx = a.v_proj(ctx).view(B, C, a.kv_heads, a.head_dim).transpose(1, 2)
        k, v = torch.cat([k_ctx, k_blk.to(k_ctx.dtype)], dim=2), torch.cat([v_ctx, v_blk.to(v_ctx.dtype)], dim=2)
        q = q.to(k.dtype)
        gqa = a.heads != a.kv_heads
        if isinstance(mask, BlockMask):
            out = flex_attention(q, k, v, block_mask=mask, scale=a.head_dim ** -0.5, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.head_dim ** -0.5, enable_gqa=gqa)
        x = x + a.o_proj(out.transpose(1, 2).reshape(B, Q, a.heads * a.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return lm_head(drafter.norm(x)).float()


def sample_anchors(batch: int, n: int, low: int, high: int, generator=None, device=None) -> torch.Tensor:
    """n distinct anchors per sequence, uniform in [low, high] (sorted), as [batch, n] int64."""
    span = high - low + 1
    if n > span:
        raise ValueError(f"cannot place {n} distinct anchors in [{low}, {high}]")
    keys = torch.rand(batch, span, generator=generator)
    return (keys.topk(n, dim=1).indices.sort(dim=1).values + low).to(device)


def block_labels(tokens, greedy, anchors, block_size: int):
    """The drafter's targets for every block: labels [B, n, block_size - 1], the target's greedy token at
    anchor + k (greedy[:, p] = argmax of the target's logits at p - 1, i.e. greedy[:, p] follows tokens[:, :p]),
    and valid [B, n, block_size - 1]: position k is a label only while the sequence follows the target's greedy
    path from the anchor (tokens at anchor + 1 .. anchor + k - 1 equal the greedy tokens there), so the label is
    what the target's own greedy decoding from the anchor would produce. tokens [B, C]; greedy [B, C + 1]."""
    B, C = tokens.shape
    k = torch.arange(1, block_size, device=tokens.device)
    pos = anchors[:, :, None] + k  # [B, n, L]
    inside = pos <= C  # greedy has C + 1 entries: a label exists up to position C
    labels = torch.gather(greedy, 1, pos.clamp(max=C).flatten(1)).view_as(pos)
    tok = torch.gather(tokens, 1, pos.clamp(max=C - 1).flatten(1)).view_as(pos)
    on_path = (tok == labels) & (pos <= C - 1)  # the sequence takes the greedy token at anchor + k
    # position k is valid iff every earlier block position (1 .. k-1) was on the path
    before = torch.cat([torch.ones_like(on_path[..., :1]), on_path[..., :-1]], dim=-1).cumprod(-1).bool()
    return labels, before & inside


def block_inputs(tokens, anchors, block_size: int, mask_token_id: int, clean=None, masked=None):
    """Block tokens and positions [B, n * block_size]: [token at anchor, then MASK] (or, with clean labels
    [B, n, L] and masked [B, n, L] bool, the clean label where not masked)."""
    B, n = anchors.shape
    first = torch.gather(tokens, 1, anchors)
    rest = torch.full((B, n, block_size - 1), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    if clean is not None:
        rest = torch.where(masked, rest, clean)
    blocks = torch.cat([first[..., None], rest], dim=-1)
    positions = anchors[..., None] + torch.arange(block_size, device=tokens.device)
    return blocks.flatten(1), positions.flatten(1)


def _block_predictions(logits, labels):
    B, n, L = labels.shape
    return logits.view(B, n, L + 1, -1)[:, :, 1:].float().log_softmax(-1)  # row 0 (the anchor's) is no prediction


def _kl(logq, target_logits):
    """KL(target || drafter) per position."""
    logp = target_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def dflash_loss(logits, labels, valid, gamma: float, target_logits=None, kl_weight: float = 0.0):
    """DFlash's hard cross-entropy on the target's greedy tokens, block position k weighted exp(-(k - 1) / gamma),
    averaged over valid positions with those weights (+ kl_weight x the same average of KL(target || drafter)).
    logits [B, n * bs, V] (block rows); labels / valid [B, n, bs - 1]; target_logits [B, n, bs - 1, V]: the
    target's logits for each block position (taken at the position before it)."""
    logq = _block_predictions(logits, labels)
    L = labels.shape[-1]
    w = torch.exp(-torch.arange(L, device=logits.device, dtype=torch.float32) / gamma) * valid
    ce = -torch.gather(logq, -1, labels[..., None])[..., 0]
    total = w.sum().clamp(min=1e-6)
    loss = (ce * w).sum() / total
    if kl_weight and target_logits is not None:
        loss = loss + kl_weight * (_kl(logq, target_logits) * w).sum() / total
    return loss


def diffusion_loss(logits, labels, valid, masked, t, target_logits=None, kl_weight: float = 0.0):
    """The block-diffusion masked ELBO (article §5.2): cross-entropy on masked positions weighted 1/t (t [B, n],
    the block's masking rate), summed and divided by the number of valid positions, so that its expectation over
    the masking is the mean per-position loss; plus kl_weight x KL(target || drafter) on the same positions with
    the same weights (§5.6). Shapes as dflash_loss; masked [B, n, bs - 1] bool."""
    logq = _block_predictions(logits, labels)
    w = (masked & valid).float() / t[..., None]
    ce = -torch.gather(logq, -1, labels[..., None])[..., 0]
    total = valid.float().sum().clamp(min=1)
    loss = (ce * w).sum() / total
    if kl_weight and target_logits is not None:
        loss = loss + kl_weight * (_kl(logq, target_logits) * w).sum() / total
    return loss


def zlab_config(target_config: dict, layers: int, block_size: int, mask_token_id: int, target_layer_ids,
                intermediate_size: int | None = None) -> dict:
    """config.json of a drafter for a Qwen3 target (its config.json as a dict), in z-lab's layout."""
    c = {k: target_config[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "head_dim", "rms_norm_eps", "max_position_embeddings") if k in target_config}
    theta = target_config.get("rope_theta", (target_config.get("rope_parameters") or {}).get("rope_theta", 1e6))
    c.update(architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=layers,
             intermediate_size=intermediate_size or target_config["intermediate_size"], rope_theta=theta,
             tie_word_embeddings=False, attention_bias=False, block_size=block_size,
             num_target_layers=target_config["num_hidden_layers"],
             dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)})
    return c


def zlab_weights(drafter: "DFlashDrafter", dtype=torch.float32) -> dict:
    """The drafter's tensors under z-lab's names (layers.{i}.*, fc.weight, hidden_norm.weight, norm.weight)."""
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in drafter.state_dict().items()}
