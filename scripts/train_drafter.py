"""Distil a DFlash block-diffusion drafter from a Qwen3 target (the bundled tiny one on a CPU; a real one on a GPU
by the same command).

    python scripts/train_drafter.py --target runs/target/final --out runs/draft --steps 550
    cp runs/draft/final/* assets/tiny-draft/

The target is frozen: its chosen-layer features are the drafter's context, its embedding embeds the block and its
lm_head reads the drafter's output. Each step takes B sequences, half windows of real code and half the target's
own greedy continuations of real prompts (generated once and cached in --out; a quarter of those prompts end right
after a chat template's assistant header, which is what the CLI feeds), runs the target over them, and places
random anchors; block j is [token at anchor, MASK ...] at positions anchor .. anchor + block_size - 1, sees the
context strictly before its anchor and its whole block (block_mask_mod). Its labels are the target's greedy
tokens, kept only while the sequence follows the target's greedy path from the anchor (block_labels), so
every label is what the target's greedy decoding from that anchor produces.

Objectives (--objective):
  dflash     DFlash's hard cross-entropy on the greedy labels, all block positions masked (the inference form),
             position k weighted exp(-(k - 1) / gamma) (+ --kl-weight x KL to the target, default 0);
  diffusion  the block-diffusion masked ELBO: per block t ~ U(0, 1] (stratified over the batch), each position
             k >= 1 masked with probability t, cross-entropy on masked positions weighted 1/t, plus --kl-weight
             (default 1) x KL(target || drafter) on the same positions.

Every --eval-every steps: held-out acceptance one step from real held-out contexts (contexts cut from held-out
files, the target's greedy bonus and rollout as labels): per-position accuracy of the drafter's argmax and the
chain's expected tokens per round (tau = 1 + accepted drafts). Resumable: --out holds the latest state
(safetensors + json); rerunning the command continues. The result (--out/final) is in z-lab's layout, loadable
by drafter.DFlashDrafter.from_pretrained. docs/training.md explains the recipe; the functions below hold it in
reading order: the mask rule, the batched forward, anchors / labels / inputs, the losses, then data, the training
step and evaluation, and main.
"""

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from checkpoints import (add_training_options, as_dflash2, load_train_state, save_checkpoint,  # noqa: E402
                         save_train_state, stdlib_files, zlab_config, zlab_weights, atomic_write, write_json_file)
from dflash2 import DFlash2Config, DFlash2Drafter, walk_lattice  # noqa: E402
from drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from loading import check_pair  # noqa: E402
from loading import read_json  # noqa: E402
from model import Qwen3, apply_rope, rope_cos_sin  # noqa: E402
from train_target import HELD_OUT_EVERY, build_stream, forward_batch, greedy_continue, init_weights, lr_at  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# The training batch: the mask rule, the batched forward, anchors / labels / inputs, the losses (docs/training.md)
#
# A training batch holds B sequences of C tokens, the frozen target's chosen-layer features of all C positions,
# and n random anchors per sequence. Block j of sequence b is [token at anchor, MASK x (block_size - 1)] at
# positions anchor .. anchor + block_size - 1 (or, for the diffusion objective, the clean labels with a random
# subset masked). All n blocks of a sequence are query rows of one attention whose keys are
# [context positions 0 .. C-1 ; the n blocks], and block j may see the context strictly before its anchor and
# its whole block, nothing else (docs/training.md: bidirectional within a block, causal across). That rule is written
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
    q_len = anchors.shape[1] * block_size
    return create_mask(block_mask_mod(anchors, context_len, block_size), anchors.shape[0], 1, q_len,
                       context_len + q_len, device=anchors.device)


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """The mask_mod as a FlexAttention BlockMask (for training on CUDA, where FlexAttention has a backward)."""
    q_len = anchors.shape[1] * block_size
    return create_block_mask(block_mask_mod(anchors, context_len, block_size), anchors.shape[0], None, q_len,
                             context_len + q_len, device=anchors.device)


def training_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """What training_logits takes: a BlockMask on CUDA, the dense boolean mask elsewhere."""
    if anchors.device.type == "cuda":
        return flex_block_mask(anchors, context_len, block_size)
    return dense_block_mask(anchors, context_len, block_size)


def training_logits(drafter: DFlashDrafter, embed, lm_head, features, block_tokens, block_positions, mask):
    """Batched drafter forward with autograd. features [B, C, len(ids) * hidden] (the target's chosen-layer
    outputs at positions 0..C-1), block_tokens / block_positions [B, Q] (n blocks of block_size), mask from
    training_mask. Returns float32 logits [B, Q, vocab]; row k of a block predicts the token at anchor + k."""
    return training_forward(drafter, embed, lm_head, features, block_tokens, block_positions, mask)[0]


def per_block(conv, block_size: int):
    """A DFlash 2 convolution's prepare / finish over each block's own rows of [B, n * block_size, H] (a block
    never convolves its neighbour's rows, as at inference where it is alone)."""
    def run(fn, x, *dynamic):
        B, Q, H = x.shape
        blocks = x.reshape(B * (Q // block_size), block_size, H)
        dynamic = [d.reshape(B * (Q // block_size), block_size, *d.shape[2:]) for d in dynamic]
        out = fn(blocks, *dynamic)
        if isinstance(out, tuple):
            return out[0].reshape(B, Q, H), out[1].reshape(B, Q, *out[1].shape[2:])
        return out.reshape(B, Q, H)
    return lambda h: run(conv.prepare, h), lambda out, dynamic: run(conv.finish, out, dynamic)


def training_forward(drafter: DFlashDrafter, embed, lm_head, features, block_tokens, block_positions, mask):
    """training_logits' forward, returning (float32 logits [B, Q, vocab], the final normed hidden states
    [B, Q, H]); a DFlash 2 drafter's layers convolve each block around attention and MLP as DFlash2Block does."""
    B, C, _ = features.shape
    Q = block_tokens.shape[1]
    x = embed(block_tokens)
    ctx = drafter.hidden_norm(drafter.fc(features.to(x.dtype)))
    inv_freq, factor = drafter.inv_freq, drafter.rope_attention_factor
    ctx_cos, ctx_sin = rope_cos_sin(torch.arange(C, device=x.device), inv_freq, factor, ctx.dtype)
    cos, sin = rope_cos_sin(block_positions.reshape(-1), inv_freq, factor, x.dtype)
    cos, sin = cos.view(B, 1, Q, -1), sin.view(B, 1, Q, -1)
    bs = drafter.block_size
    for layer in drafter.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        convs = hasattr(layer, "attention_conv")
        if convs:
            prepare, finish = per_block(layer.attention_conv, bs)
            h, dynamic = prepare(h)
        q, k_blk, v_blk = a.qkv_proj.split(a.qkv_proj(h))
        q = apply_rope(a.q_norm(q.reshape(B, Q, a.heads, a.head_dim)).transpose(1, 2), cos, sin)
        k_blk = apply_rope(a.k_norm(k_blk.reshape(B, Q, a.kv_heads, a.head_dim)).transpose(1, 2), cos, sin)
        v_blk = v_blk.reshape(B, Q, a.kv_heads, a.head_dim).transpose(1, 2)
        k_ctx, v_ctx = a.kv_proj(ctx)  # context rows: K/V alone
        k_ctx = apply_rope(a.k_norm(k_ctx.reshape(B, C, a.kv_heads, a.head_dim)).transpose(1, 2), ctx_cos, ctx_sin)
        v_ctx = v_ctx.reshape(B, C, a.kv_heads, a.head_dim).transpose(1, 2)
        k, v = torch.cat([k_ctx, k_blk.to(k_ctx.dtype)], dim=2), torch.cat([v_ctx, v_blk.to(v_ctx.dtype)], dim=2)
        q = q.to(k.dtype)
        gqa = a.heads != a.kv_heads
        if isinstance(mask, BlockMask):
            out = flex_attention(q, k, v, block_mask=mask, scale=a.head_dim ** -0.5, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.head_dim ** -0.5, enable_gqa=gqa)
        out = a.o_proj(out.transpose(1, 2).reshape(B, Q, a.heads * a.head_dim))
        x = x + (finish(out, dynamic) if convs else out)
        h = layer.post_attention_layernorm(x)
        if convs:
            prepare, finish = per_block(layer.mlp_conv, bs)
            h, dynamic = prepare(h)
            x = x + finish(layer.mlp(h), dynamic)
        else:
            x = x + layer.mlp(h)
    hidden = drafter.norm(x)
    return drafter.logits(hidden, lm_head).float(), hidden


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


def selector_loss(selector, hidden, logits, anchor_tokens, labels, valid, gamma: float):
    """DFlash 2's candidate selector, taught by teacher forcing: at block position k, among the top-K tokens of the
    drafter's logits, the cross-entropy of the label under the selector's scores after the true token before it
    (the anchor's for k = 1, label k - 1 after), position k weighted exp(-(k - 1) / gamma) as dflash_loss, over
    valid positions whose label is a candidate. hidden / logits [B, n * bs, ...]; anchor_tokens [B, n]; labels /
    valid [B, n, bs - 1]."""
    B, n, L = labels.shape
    rows = lambda t: t.view(B, n, L + 1, -1)[:, :, 1:]  # row 0 (the anchor's) is no prediction
    logits, hidden = rows(logits), rows(hidden)
    before = torch.cat([anchor_tokens[..., None], labels[..., :-1]], dim=-1)  # [B, n, L]
    unary, candidates = logits.float().topk(selector.top_k, dim=-1)
    scores = selector.scores(hidden, before[..., None], candidates, unary)[..., 0, :]  # [B, n, L, K]
    hit = candidates == labels[..., None]
    w = torch.exp(-torch.arange(L, device=logits.device, dtype=torch.float32) / gamma) * (valid & hit.any(-1))
    ce = torch.logsumexp(scores, -1) - (scores * hit).sum(-1)
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


def diffusion_loss(logits, labels, valid, masked, t, target_logits=None, kl_weight: float = 0.0):
    """The block-diffusion masked ELBO (docs/training.md): cross-entropy on masked positions weighted 1/t (t [B, n],
    the block's masking rate), summed and divided by the number of valid positions, so that its expectation over
    the masking is the mean per-position loss; plus kl_weight x KL(target || drafter) on the same positions with
    the same weights. Shapes as dflash_loss; masked [B, n, bs - 1] bool."""
    logq = _block_predictions(logits, labels)
    w = (masked & valid).float() / t[..., None]
    ce = -torch.gather(logq, -1, labels[..., None])[..., 0]
    total = valid.float().sum().clamp(min=1)
    loss = (ce * w).sum() / total
    if kl_weight and target_logits is not None:
        loss = loss + kl_weight * (_kl(logq, target_logits) * w).sum() / total
    return loss



# ----------------------------------------------------------------------------------------------------------------
# Data: greedy continuations of the target and held-out evaluation contexts (computed once, cached in --out)


def find_after(stream: torch.Tensor, pattern: list[int]) -> torch.Tensor:
    """Positions just after each occurrence of `pattern` in the stream."""
    n = len(pattern)
    windows = stream.unfold(0, n, 1)
    hits = (windows == torch.tensor(pattern)).all(-1).nonzero().flatten()
    return hits + n


def greedy_sequences(target, stream, count: int, seq: int, prompt_len: int, chat_starts, chat_share: float,
                     seed: int, batch: int = 64):
    """`count` sequences of `seq` tokens: a real prompt of `prompt_len` tokens (a share of them ending just after
    a chat assistant header) followed by the target's greedy continuation."""
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - prompt_len, (count,), generator=g)
    ok = chat_starts[chat_starts >= prompt_len]
    n_chat = int(count * chat_share) if ok.numel() else 0
    if n_chat:
        ends = ok[torch.randint(0, ok.numel(), (n_chat,), generator=g)]
        starts[:n_chat] = ends - prompt_len
    prompts = torch.stack([stream[s:s + prompt_len] for s in starts.tolist()])
    out = []
    for i in tqdm(range(0, count, batch), desc="greedy data", dynamic_ncols=True, mininterval=10):
        p = prompts[i:i + batch]
        out.append(torch.cat([p, greedy_continue(target, p, seq - prompt_len)], dim=1))
    return torch.cat(out)


def eval_contexts(target, stream, count: int, block_size: int, seed: int, lengths=(64, 128, 192, 256)):
    """Held-out contexts ending at a random place, each followed by the target's greedy bonus and rollout:
    tokens [count, max(lengths) + block_size] (padding after the rollout) and anchors [count] (the bonus's
    position). Labels are then the rollout, all valid."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + block_size
    tokens, anchors = [], []
    per = -(-count // len(lengths))
    for length in lengths:
        starts = torch.randint(0, stream.numel() - length, (per,), generator=g)
        ctx = torch.stack([stream[s:s + length] for s in starts.tolist()])
        roll = greedy_continue(target, ctx, block_size)  # bonus + block_size - 1 greedy tokens
        seqs = torch.cat([ctx, roll], dim=1)
        tokens.append(torch.nn.functional.pad(seqs, (0, width - seqs.shape[1])))
        anchors.append(torch.full((per,), length))
    return torch.cat(tokens)[:count], torch.cat(anchors)[:count]


def prepare_data(a, target, tok, block_size):
    path = os.path.join(a.out, "data.safetensors")
    if os.path.isfile(path):
        return load_file(path)
    train_files, held_files = stdlib_files(HELD_OUT_EVERY)
    if a.files:
        train_files, held_files = train_files[:a.files], held_files[:max(1, a.files // 10)]
    stream, _ = build_stream(tok, train_files, a.chat_fraction, a.seed)
    held, _ = build_stream(tok, held_files, a.chat_fraction, a.seed + 1)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    t0 = time.time()
    chat_starts = find_after(stream, header)
    greedy = greedy_sequences(target, stream, a.greedy_seqs, a.seq, a.prompt_len, chat_starts,
                              a.chat_prompt_share, a.seed)
    ev_tokens, ev_anchors = eval_contexts(target, held, a.eval_contexts, block_size, a.seed + 2,
                                           [int(x) for x in a.eval_lengths.split(",")])
    data = dict(stream=stream, greedy=greedy, eval_tokens=ev_tokens, eval_anchors=ev_anchors)
    atomic_write(path, lambda p: save_file(data, p))
    print(f"data: {stream.numel():,} real tokens, {greedy.shape[0]} greedy sequences of {greedy.shape[1]}, "
          f"{ev_tokens.shape[0]} eval contexts; {chat_starts.numel()} chat starts in the stream "
          f"({time.time() - t0:.0f} s)", flush=True)
    return data


# ----------------------------------------------------------------------------------------------------------------
# Target pass, loss, evaluation


@torch.no_grad()
def target_pass(target, tokens, layer_ids):
    """(features [B, C, len(ids) * hidden], logits [B, C, V], greedy [B, C + 1]: greedy[:, p] is the target's
    argmax after tokens[:, :p])."""
    logits, features = forward_batch(target, tokens, feature_layers=tuple(layer_ids))
    greedy = torch.cat([torch.zeros_like(tokens[:, :1]), logits.argmax(-1)], dim=1)
    return features, logits, greedy


def batch_loss(a, drafter, target, tokens, generator, block_size, mask_id):
    features, t_logits, greedy = target_pass(target, tokens, drafter.config.target_layer_ids)
    B, C = tokens.shape
    anchors = sample_anchors(B, a.anchors, 1, C - 2, generator)
    labels, valid = block_labels(tokens, greedy, anchors, block_size)
    L = block_size - 1
    pos = anchors[..., None] + torch.arange(1, block_size)
    mask = training_mask(anchors, C, block_size)
    embed, lm_head = target.embed_tokens, target.lm_head
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        rows = (pos - 1).clamp(max=C - 1).flatten(1)  # the target's logits for each block position
        tl = torch.gather(t_logits, 1, rows[..., None].expand(-1, -1, t_logits.shape[-1])).view(B, a.anchors, L, -1)
        if a.objective == "dflash":
            blocks, positions = block_inputs(tokens, anchors, block_size, mask_id)
            logits, hidden = training_forward(drafter, embed, lm_head, features, blocks, positions, mask)
            loss = dflash_loss(logits, labels, valid, a.gamma, tl, a.kl_weight)
            if isinstance(drafter, DFlash2Drafter):
                anchor_tokens = torch.gather(tokens, 1, anchors)
                loss = loss + a.selector_weight * selector_loss(drafter.candidate_selector, hidden, logits,
                                                                anchor_tokens, labels, valid, a.gamma)
        else:
            n = B * a.anchors  # stratified t in (0, 1]: one per block, spread evenly, shuffled
            t = ((torch.randperm(n, generator=generator) + 1 - torch.rand(n, generator=generator)) / n).view(B, -1)
            masked = torch.rand(B, a.anchors, L, generator=generator) < t[..., None]
            x = torch.gather(tokens, 1, pos.clamp(max=C - 1).flatten(1)).view_as(pos)
            clean = torch.where(valid, labels, x)
            blocks, positions = block_inputs(tokens, anchors, block_size, mask_id, clean, masked)
            logits = training_logits(drafter, embed, lm_head, features, blocks, positions, mask)
            loss = diffusion_loss(logits, labels, valid, masked, t, tl, a.kl_weight)
    return loss, valid.float().mean().item()


def chain_drafts(drafter, logits, hidden, anchor):
    """The drafter's greedy chain [B, L] from block logits [B, L, V] (rows 1..): the argmax per position, or for
    DFlash 2 the selector's walk from the anchor [B]."""
    if not isinstance(drafter, DFlash2Drafter):
        return logits.argmax(-1)
    L = logits.shape[1]
    lattice = drafter.candidate_selector.lattice(hidden.view(hidden.shape[0], L + 1, -1)[:, 1:], logits, anchor)
    return walk_lattice(lattice, L, logits.shape[-1])[0]


class Evaluator:
    """One-step acceptance from held-out real contexts, with the target's features computed once."""

    def __init__(self, target, drafter, tokens, anchors, block_size, mask_id, batch=32):
        self.chunks = []
        for i in range(0, tokens.shape[0], batch):
            tk, an = tokens[i:i + batch], anchors[i:i + batch, None]
            features, _, _ = target_pass(target, tk, drafter.config.target_layer_ids)  # (its rollout's labels)
            labels = torch.gather(tk, 1, an + torch.arange(1, block_size))[:, None]  # the rollout
            self.chunks.append((tk, an, features, labels))
        self.block_size, self.mask_id = block_size, mask_id
        self.embed, self.lm_head = target.embed_tokens, target.lm_head

    @torch.no_grad()
    def __call__(self, drafter):
        correct, losses = [], []
        for tk, an, features, labels in self.chunks:
            blocks, positions = block_inputs(tk, an, self.block_size, self.mask_id)
            mask = training_mask(an, tk.shape[1], self.block_size)
            logits, hidden = training_forward(drafter, self.embed, self.lm_head, features, blocks, positions, mask)
            lg = logits.view(tk.shape[0], 1, self.block_size, -1)[:, :, 1:]
            correct.append((chain_drafts(drafter, lg[:, 0], hidden, tk.gather(1, an)[:, 0]) == labels[:, 0]))
            losses.append(torch.nn.functional.cross_entropy(lg.flatten(0, 2), labels.flatten()).item())
        c = torch.cat(correct).float()
        return dict(acc=[round(x, 3) for x in c.mean(0).tolist()],
                    tau=round(1 + c.cumprod(-1).sum(-1).mean().item(), 3),
                    eval_ce=round(sum(losses) / len(losses), 4))


# ----------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="runs/target/final", help="Qwen3 target directory (with tokenizer.json)")
    p.add_argument("--out", default="runs/draft")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--inter", type=int, default=0, help="drafter MLP width (default: the target's)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--target-layers", default="1,2", help="target layer ids whose outputs feed the drafter")
    p.add_argument("--objective", default="dflash", choices=["dflash", "diffusion"])
    p.add_argument("--gamma", type=float, default=0.0, help="dflash position decay (default block_size / 2)")
    p.add_argument("--kl-weight", type=float, default=None, help="default 0 (dflash) / 1 (diffusion)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (half real, half greedy)")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--greedy-share", type=float, default=0.5)
    p.add_argument("--greedy-seqs", type=int, default=768)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--chat-fraction", type=float, default=0.2, help="as the target's training stream")
    p.add_argument("--chat-prompt-share", type=float, default=0.25)
    p.add_argument("--eval-contexts", type=int, default=128)
    p.add_argument("--eval-lengths", default="64,128,192,256", help="held-out context lengths for evaluation")
    p.add_argument("--steps", type=int, default=550, help="length of the run (the LR schedule)")
    p.add_argument("--stop-at", type=int, default=0, help="stop (save, export) at this step; rerun to continue")
    p.add_argument("--init", default="", help="start from this drafter's weights and shape (a z-lab-layout directory), "
                   "with a fresh optimizer and LR schedule; --layers, --inter, --block-size, --target-layers are "
                   "then the checkpoint's")
    p.add_argument("--dflash2", action="store_true", help="a DFlash 2 drafter (convolutions and a candidate "
                   "selector); with --init naming a DFlash 1 drafter, its layers start from that one's")
    p.add_argument("--conv-kernel", type=int, default=3, help="DFlash 2: the convolutions' taps")
    p.add_argument("--conv-group", type=int, default=16, help="DFlash 2: channels per dynamic-kernel group")
    p.add_argument("--selector-rank", type=int, default=32, help="DFlash 2: the selector's codebook rank")
    p.add_argument("--selector-top-k", type=int, default=8, help="DFlash 2: candidates per position")
    p.add_argument("--selector-weight", type=float, default=1.0, help="DFlash 2: the selector loss's weight")
    add_training_options(p, lr=2e-3, weight_decay=0.01)
    return p.parse_args(argv)


def upgraded_to_dflash2(a, config: dict, drafter: DFlashDrafter) -> tuple[dict, DFlashDrafter]:
    """A DFlash 2 drafter whose layers, fc and norms are `drafter`'s, its convolutions the identity (base kernel 1
    at the current row, 0 elsewhere; no dynamic part yet) and its selector small random (so it first ranks the
    candidates by their logits): the training starts from the DFlash 1 drafter's drafts."""
    config = as_dflash2(config, dict(conv_kernel_size=a.conv_kernel, conv_group_size=a.conv_group,
                                     selector_rank=a.selector_rank, selector_top_k=a.selector_top_k))
    two = DFlash2Drafter(DFlash2Config.from_dict(config))
    init_weights(two, a.seed)
    missing, unexpected = two.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in two.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
    return config, two


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from tokenizers import Tokenizer
    from tqdm import tqdm
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    bs = a.block_size
    if a.kl_weight is None:
        a.kl_weight = 1.0 if a.objective == "diffusion" else 0.0
    if a.dflash2 and a.objective != "dflash":
        raise SystemExit("error: --dflash2 trains with --objective dflash (the selector learns the greedy labels)")
    target = Qwen3.from_pretrained(a.target, device="cpu", dtype=torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    tok = Tokenizer.from_file(os.path.join(a.target, "tokenizer.json"))
    mask_id = tok.token_to_id("<|mask|>")
    if mask_id is None:
        raise SystemExit(f"{a.target}: the tokenizer has no <|mask|> token")
    target_cfg = read_json(os.path.join(a.target, "config.json"))
    if a.init:
        config = read_json(os.path.join(a.init, "config.json"))
        drafter = DFlashDrafter.from_pretrained(a.init, device="cpu", dtype=torch.float32)
        bs = a.block_size = drafter.block_size
        a.layers, a.inter = len(drafter.layers), drafter.config.model.intermediate_size
        a.target_layers = ",".join(str(i) for i in drafter.config.target_layer_ids)
        if drafter.config.mask_token_id != mask_id:
            raise SystemExit(f"{a.init}: mask token {drafter.config.mask_token_id} is not the target tokenizer's "
                             f"<|mask|> ({mask_id})")
    else:
        layer_ids = [int(x) for x in a.target_layers.split(",")]
        config = zlab_config(target_cfg, a.layers, bs, mask_id, layer_ids, a.inter or None)
        drafter = DFlashDrafter(DFlashConfig.from_dict(config))
        init_weights(drafter, a.seed)
    if a.dflash2 and not isinstance(drafter, DFlash2Drafter):
        config, drafter = upgraded_to_dflash2(a, config, drafter)
    a.gamma = a.gamma or bs / 2
    drafter.inv_freq = drafter.inv_freq.to(torch.float32)
    drafter.bind(target)
    try:
        check_pair(target, drafter)
    except ValueError as e:
        raise SystemExit(f"{a.init or 'the drafter'}: {e}")
    data = prepare_data(a, target, tok, bs)
    evaluator = Evaluator(target, drafter, data["eval_tokens"], data["eval_anchors"], bs, mask_id)
    stream, greedy = data["stream"], data["greedy"]
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95))
    state = load_train_state(a.out, drafter, opt)
    step, log = (state["step"], state["log"]) if state else (0, [])
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter params {n_params:,}; {'resumed at step %d' % step if state else 'from scratch'}; "
          f"objective {a.objective} gamma {a.gamma} kl {a.kl_weight}", flush=True)
    if not state:
        log.append(dict(step=0, **evaluator(drafter)))
        print(json.dumps(log[-1]), flush=True)
    n_greedy = int(round(a.batch * a.greedy_share))
    bar = tqdm(total=a.steps, initial=step, desc=f"drafter ({a.objective})", dynamic_ncols=True, mininterval=10)
    losses, t_last = [], time.time()
    drafter.train()
    stop = min(a.steps, a.stop_at or a.steps)
    while step < stop:
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)  # the batch is a function of (seed, step)
        rows = []
        if a.batch - n_greedy:
            starts = torch.randint(0, stream.numel() - a.seq, (a.batch - n_greedy,), generator=g)
            rows += [stream[s:s + a.seq] for s in starts.tolist()]
        if n_greedy:
            rows += list(greedy[torch.randint(0, greedy.shape[0], (n_greedy,), generator=g)])
        tokens = torch.stack(rows)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        loss, valid_share = batch_loss(a, drafter, target, tokens, g, bs, mask_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % a.eval_every == 0 or step == stop:
            drafter.eval()
            entry = dict(step=step, loss=round(sum(losses) / len(losses), 4), valid=round(valid_share, 3),
                         s_per_step=round((time.time() - t_last) / len(losses), 2),
                         minutes=round((time.time() - t_start) / 60, 2), **evaluator(drafter))
            drafter.train()
            log.append(entry)
            bar.write(json.dumps(entry))
            losses, t_last = [], time.time()
        if step % a.save_every == 0 or step == stop:
            save_train_state(a.out, drafter, opt, dict(step=step, log=log, args=vars(a)))
    bar.close()
    final_dir = os.path.join(a.out, "final")
    dtype = torch.bfloat16 if a.save_dtype == "bfloat16" else torch.float32
    config["torch_dtype"] = a.save_dtype
    save_checkpoint(final_dir, config, zlab_weights(drafter, dtype))
    write_json_file(os.path.join(final_dir, "training_log.json"), dict(args=vars(a), params=n_params, log=log), 1)
    print(f"wrote {final_dir} ({(time.time() - t_start) / 60:.1f} min)", flush=True)


if __name__ == "__main__":
    main()
