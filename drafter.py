"""The DFlash block-diffusion drafter (z-lab's checkpoint format; DFlash 2: dflash2.py) in our own modules. A round
drafts one block `[bonus, MASK x (block_size - 1)]` per request at positions start.. through Qwen3 layers whose
keys/values are the context's (the target's chosen-layer outputs of committed tokens, fused by `fc` + `hidden_norm`,
cached between rounds) then the block's; output k >= 1 is the token at start + k. Embedding, lm_head: the target's."""

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from loading import (check_layer_count, check_pair, dflash_config_fields, load_weights,
                     on_meta, parse_device, parse_dtype, read_json, resolve_checkpoint)
import families
from regions import run_layer
from model import (Block, Linear, Qwen3Config, RMSNorm, allocate_kv_caches, compute_dtype, rope_cos_sin,
                   rope_frequencies)


@dataclass
class DFlashConfig:
    model: Qwen3Config  # the drafter's own layers (hidden size equal to the target's)
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    # per layer (sliding window or None, causal) of its block rows (drafter_options.py); (): all (None, False)
    attention: tuple = ()
    output_multiplier: float = 1.0  # logits = lm_head(h) * output_multiplier, then the softcap
    logit_softcap: float | None = None  # final_logit_softcapping: logits = c * tanh(logits / c)
    input_embedding_scale: float = 1.0  # the block's embeddings are scaled by it

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlashConfig":
        """The drafter's config.json, checked (loading.dflash_config_fields)."""
        fields = dflash_config_fields(d, where, families.rope_reader(d))
        fields.update(families.drafter_options(d, where))
        return cls(model=Qwen3Config(**fields.pop("model")), **fields)

    def attention_of(self, layer: int) -> tuple:
        return self.attention[layer] if self.attention else (None, False)

    @property
    def mask_kinds(self) -> list:
        """The distinct (window, causal) of the layers: one block mask each (ddtree.Engine)."""
        return sorted({self.attention_of(i) for i in range(self.model.num_hidden_layers)}, key=str)


class DFlashDrafter(nn.Module):
    config_type = DFlashConfig  # what from_pretrained reads config.json into
    weight_aliases = None  # load_weights' aliases: other names a checkpoint may store a tensor under
    candidates_per_depth: int | None = None  # None: each depth's top min(budget, vocab) (settings.check_orderable)

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config, self.block_size = config, config.block_size
        c = config.model
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        for i, layer in enumerate(self.layers):  # which of draft()'s masks each layer takes
            layer.mask_kind = config.attention_of(i)
        self.fc = Linear(len(config.target_layer_ids) * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv_freq, self.rope_attention_factor = rope_frequencies(c)  # a Qwen3 config's RoPE, scaling included
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.target_parts = None  # (embed_tokens, lm_head) of the bound target: used, not owned (no state_dict)
        self.path: str | None = None

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

    def setup_cache(self, length: int, batch: int = 1):
        allocate_kv_caches(self.layers, length, self.dtype, self.device, batch)

    def kv_caches(self):
        return [c for layer in self.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]

    def append_context(self, features, positions, cache_pos):
        """Write the context K/V of committed tokens' features [N, W, len(ids) * hidden] at RoPE positions and cache
        slots [N, W]; context rows are keys, never queries."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor, ctx.dtype))
        for layer in self.layers:
            layer.self_attn.store_kv(*layer.self_attn.kv_proj(ctx), cos, sin, cache_pos)

    def forward(self, block_tokens, positions, cache_pos, masks: dict, rows: slice = slice(None)):
        """One denoising pass over blocks [N, block_size] -> the final normed hidden states [N, rows, H] of the
        block's `rows` (row k predicts position start + k). Each layer attends under masks[its mask_kind]."""
        embed = self.target_parts[0]
        x = embed(block_tokens)
        if self.config.input_embedding_scale != 1:
            x = x * self.config.input_embedding_scale
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor, x.dtype))
        for layer in self.layers:
            x = run_layer(layer, x, cos, sin, cache_pos, masks[layer.mask_kind])
        return self.norm(x[:, rows])

    def logits(self, hidden, lm_head=None):
        """Logits of hidden states in float32 (float64 for a float64 model): the target's lm_head (or `lm_head`),
        times output_multiplier, softcapped."""
        logits = (lm_head or self.target_parts[1])(hidden).to(compute_dtype(hidden.dtype))
        c = self.config
        if c.output_multiplier != 1:
            logits = logits * c.output_multiplier
        if c.logit_softcap:
            logits = torch.tanh(logits / c.logit_softcap) * c.logit_softcap
        return logits

    def draft(self, bonus, start, masks: dict, denoise_steps: int = 1, length: int | None = None):
        """Per-position draft logits [N, length, vocab] for the first `length` (at most block_size - 1) positions
        after each request's bonus [N] at start [N]; masks: one per config.mask_kinds. With denoise_steps > 1, each
        pass unmasks the most confident masked positions (their argmax) for the next; each keeps its deciding logits."""
        bs, n = self.block_size, bonus.shape[0]
        length = length or bs - 1
        tokens, pos = self.block(bonus, start)
        if denoise_steps == 1:
            return self.logits(self(tokens, pos, pos, masks, rows=slice(1, 1 + length)))
        logits = self.logits(self(tokens, pos, pos, masks))[:, 1:]
        masked = torch.ones(n, bs - 1, dtype=torch.bool, device=bonus.device)

        def decided_after(passes):  # an equal share of the block is decided by each pass
            return -(-(bs - 1) * passes // denoise_steps)

        for step in range(1, denoise_steps):
            count = decided_after(step) - decided_after(step - 1)
            confidence = logits.log_softmax(-1).amax(-1).masked_fill(~masked, -float("inf"))
            chosen = torch.zeros_like(masked).scatter(1, confidence.topk(count, dim=-1).indices, True) & masked
            tokens = torch.cat([tokens[:, :1], torch.where(chosen, logits.argmax(-1), tokens[:, 1:])], dim=1)
            masked = masked & ~chosen
            new = self.logits(self(tokens, pos, pos, masks))[:, 1:]
            logits = torch.where(masked[..., None], new, logits)
        return logits[:, :length]

    def block(self, bonus, start):
        """Each request's block [bonus, MASK x (block_size - 1)] [N, block_size] and its positions from start [N]."""
        pos = start[:, None] + torch.arange(self.block_size, device=bonus.device)
        mask_tokens = torch.full((bonus.shape[0], self.block_size - 1), self.config.mask_token_id, dtype=torch.long,
                                 device=bonus.device)
        return torch.cat([bonus[:, None], mask_tokens], dim=1), pos

    @classmethod
    def from_pretrained(cls, path_or_repo: str, device=None, dtype=None) -> "DFlashDrafter":
        path = resolve_checkpoint(path_or_repo, "drafter")
        where = os.path.join(path, "config.json")
        d = read_json(where)
        family = families.drafter_class(d, where, DFlashDrafter)  # DFlash 2: its own module's class
        if family is not cls:
            return family.from_pretrained(path, device, dtype)
        config = cls.config_type.from_dict(d, where)
        check_layer_count(path, config.model.num_hidden_layers, where)
        device = families.parallel_device(parse_device(device))[0]
        dtype = parse_dtype(dtype, device)
        drafter = on_meta(lambda: cls(config), where)
        load_weights(drafter, path, strip_prefix="", device=device, dtype=dtype, aliases=cls.weight_aliases)
        drafter.inv_freq = rope_frequencies(config.model, device)[0]
        drafter.path = path
        return drafter.eval()
