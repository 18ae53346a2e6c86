"""Training on a CPU in minutes (the bundled pair) or on a GPU by the same commands (a real target), one command
each:

    python scripts/train.py target --out runs/target --steps 1500     # the bundled tiny Qwen3 target
    cp runs/target/final/* assets/tiny-target/
    python scripts/train.py drafter --target runs/target/final --out runs/draft --steps 550   # a DFlash drafter
    cp runs/draft/final/* assets/tiny-draft/

    python scripts/train.py COMMAND --help        (what it trains, how; its options)

Both train on the Python standard library's source (every 20th file held out for evaluation) and are resumable:
--out holds the latest state (the trainable module's parameters and the optimizer's moments in safetensors, the
step, log and arguments in a json), and running the same command again continues from it; the batch of a step is a
function of (--seed, step), so a resumed run goes on as one that never stopped. The result is --out/final.
docs/training.md explains the drafter's recipe; this file holds, in reading order, the target's batched forward
and data, the loop both commands share, the target command, the drafter's batch (the mask rule, the batched
forward, anchors / labels / inputs, the losses), data and evaluation, the drafter command, and the command line.
"""

import argparse
import ast
import inspect
import json
import math
import os
import random
import shutil
import sys
import textwrap
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from checkpoints import (CHAT_TEMPLATE, add_training_options, as_dflash2, atomic_write, load_train_state,  # noqa: E402
                         checkpoint_tensors, qwen3_config, save_checkpoint, save_train_state, stdlib_files,
                         train_tokenizer, write_json_file, zlab_config, zlab_weights)
from dflash2 import DFlash2Config, DFlash2Drafter, walk_lattice  # noqa: E402
from drafter import DFlashConfig, DFlashDrafter  # noqa: E402
from loading import check_pair, read_json  # noqa: E402
from model import Qwen3, Qwen3Config, apply_rope, rope_cos_sin  # noqa: E402

HELD_OUT_EVERY = 20

# ----------------------------------------------------------------------------------------------------------------
# The batched training forward over model.Qwen3's modules (also a KV-cached batched greedy decoder)


def attention(attn, h, cos, sin, cache=None):
    """A Qwen3 attention over a batch h [B, T, hidden]: q/k norms before RoPE, GQA, scale head_dim^-0.5.
    Causal over the T rows; with `cache` (a list, [] at first) the K/V are appended to it (prefill with an empty
    cache, or one decode row at a time)."""
    B, T, _ = h.shape
    q, k, v = attn.qkv_proj.split(attn.qkv_proj(h))
    q = attn.q_norm(q.reshape(B, T, attn.heads, attn.head_dim)).transpose(1, 2)
    k = attn.k_norm(k.reshape(B, T, attn.kv_heads, attn.head_dim)).transpose(1, 2)
    v = v.reshape(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    past = 0
    if cache is not None:
        if cache:
            past = cache[0].shape[2]
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
    if past and T > 1:
        raise ValueError("forward_batch: several rows after a cached prefix are not supported")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=attn.head_dim ** -0.5,
                                         enable_gqa=attn.heads != attn.kv_heads)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, attn.heads * attn.head_dim))


def forward_batch(model: Qwen3, tokens, feature_layers=(), caches=None, start: int = 0, hidden_only=False):
    """tokens [B, T] at positions start.. -> (float32 logits [B, T, V] (or the final-normed hidden states with
    hidden_only), features [B, T, len(feature_layers) * hidden] or None). Same semantics as Qwen3.forward with a
    causal mask, including the last-layer feature being taken after the final norm."""
    x = model.embed_tokens(tokens)
    pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    cos, sin = rope_cos_sin(pos, model.inv_freq, model.rope_attention_factor, x.dtype)
    features, last = [], len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        cache = caches[i] if caches is not None else None
        x = x + attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in feature_layers:
            features.append(model.norm(x) if i == last else x)
    h = model.norm(x)
    out = h if hidden_only else model.lm_head(h).float()
    return out, (torch.cat(features, dim=-1) if features else None)


@torch.no_grad()
def greedy_continue(model: Qwen3, prompts, n_new: int, stop_ids=()):
    """Batched greedy continuation of equal-length prompts [B, P] -> new tokens [B, n_new] (KV-cached). Rows keep
    going after a stop token (callers cut there if they care)."""
    caches = [[] for _ in model.layers]
    logits, _ = forward_batch(model, prompts, caches=caches)
    out = [logits[:, -1].argmax(-1)]
    P = prompts.shape[1]
    for i in range(1, n_new):
        logits, _ = forward_batch(model, out[-1][:, None], caches=caches, start=P + i - 1)
        out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, dim=1)


def init_weights(model: Qwen3, seed: int, std: float = 0.02):
    """GPT-2 style: N(0, std) for embeddings and projections, residual outputs scaled by 1/sqrt(2 * layers)."""
    g = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * len(model.layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build_target(config: dict, seed: int = 0) -> Qwen3:
    model = Qwen3(Qwen3Config.from_dict(config))
    init_weights(model, seed)
    eos = config["eos_token_id"]
    model.eos_ids = list(eos) if isinstance(eos, list) else [eos]
    return model


def hf_weights(model: Qwen3, dtype=torch.float32) -> dict:
    """model.Qwen3's parameters under Hugging Face's names (a tied lm_head is left out, as the loader allows)."""
    tied = model.config.tie_word_embeddings
    w = {}
    for name, p in checkpoint_tensors(model).items():
        if name == "lm_head.weight":
            if not tied:
                w[name] = p.detach().to(dtype).clone()
        else:
            w["model." + name] = p.detach().to(dtype).clone()
    return w


# ----------------------------------------------------------------------------------------------------------------
# Data: source files and chat-formatted function samples, as one token stream


def chat_text(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def function_samples(source: str, max_chars: int = 1500):
    """(prompt, function source) pairs from a file: the prompt is the def line, or the docstring's first
    paragraph. Functions at any depth, dedented; decorators left out."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        body = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip() + "\n"
        if len(body) > max_chars or not body.lstrip().startswith(("def ", "async def ")):
            continue
        header_end = node.body[0].lineno - 1  # the def line(s) end before the first body statement
        header = textwrap.dedent("".join(lines[node.lineno - 1:max(header_end, node.lineno)])).strip()
        if not header.endswith(":") or len(header) > 300:
            header = body.splitlines()[0].strip()
        doc = ast.get_docstring(node)
        prompts = [header]
        if doc:
            prompts.append(doc.strip().split("\n\n")[0].strip())
        out.append((prompts, body))
    return out


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def build_stream(tok, files, chat_fraction: float, seed: int):
    """One shuffled token stream of whole files (each followed by <|endoftext|>) and chat samples, with chat
    samples making up about `chat_fraction` of the tokens."""
    rng = random.Random(seed)
    eot = tok.token_to_id("<|endoftext|>")
    texts = [read(f) for f in files]
    docs = [ids + [eot] for ids in (e.ids for e in tok.encode_batch(texts, add_special_tokens=False))]
    chats = []
    for text in texts:
        for prompts, body in function_samples(text):
            chats.append(chat_text(rng.choice(prompts), body))
    rng.shuffle(chats)
    chat_docs = [e.ids + [eot] for e in tok.encode_batch(chats, add_special_tokens=False)]
    file_tokens = sum(map(len, docs))
    want = chat_fraction / (1 - chat_fraction) * file_tokens if chat_fraction < 1 else float("inf")
    kept, n = [], 0
    for d in chat_docs:
        if n >= want:
            break
        kept.append(d)
        n += len(d)
    all_docs = docs + kept
    rng.shuffle(all_docs)
    stream = torch.tensor([t for d in all_docs for t in d], dtype=torch.long)
    return stream, dict(file_tokens=file_tokens, chat_tokens=n, chat_samples=len(kept),
                        chat_available=len(chat_docs))


def random_crops(stream, batch: int, seq: int, generator):
    """[batch, seq + 1] windows at random offsets of the stream."""
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=generator)
    return torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])


def lm_loss(model, windows):
    logits, _ = forward_batch(model, windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, stream, seq: int, batches: int, batch: int):
    """Mean loss over fixed, evenly spaced windows of a held-out stream."""
    n = batches * batch
    step = max(1, (stream.numel() - seq - 1) // n)
    windows = torch.stack([stream[i * step:i * step + seq + 1] for i in range(n)])
    return sum(lm_loss(model, windows[i:i + batch]).item() for i in range(0, n, batch)) / batches


# ----------------------------------------------------------------------------------------------------------------
# The loop both commands share: the files, the optimizer and its state, the steps, the final checkpoint


def lr_at(step: int, steps: int, lr: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_files(a) -> tuple[list, list]:
    """The standard library's files (training, held out), only the first --files of them when it is set (tests)."""
    train_files, held_files = stdlib_files(HELD_OUT_EVERY)
    if a.files:
        train_files, held_files = train_files[:a.files], held_files[:max(1, a.files // 10)]
    return train_files, held_files


def optimizer_and_state(a, module: torch.nn.Module) -> tuple[torch.optim.Optimizer, int, list]:
    """AdamW over `module` (weight decay on matrices only), and (step, log) where the state in --out left them,
    the optimizer's moments restored with it; (0, []) for a fresh run."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    state = load_train_state(a.out, module, opt)
    return (opt, state["step"], state["log"]) if state else (opt, 0, [])


def train_steps(a, module, opt, step: int, log: list, stop: int, loss_of, entry_of, desc: str, mininterval: float):
    """Steps from `step` to `stop` (--steps or earlier; the learning rate follows lr_at over --steps): loss_of(the
    step's generator, seeded by (--seed, step)) -> (loss, facts) builds a batch and its loss; the gradient is
    clipped to norm 1. Every --eval-every steps and at `stop`, entry_of(the (loss, facts) of each step since the
    last entry) adds an entry to `log`, the module in eval mode; every --save-every steps and at `stop` the state
    is saved."""
    from tqdm import tqdm
    bar = tqdm(total=a.steps, initial=step, desc=desc, dynamic_ncols=True, mininterval=mininterval)
    module.train()
    since = []
    while step < stop:
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        loss, facts = loss_of(g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        step += 1
        since.append((loss.item(), facts))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % a.eval_every == 0 or step == stop:
            module.eval()
            log.append(dict(step=step, **entry_of(since)))
            module.train()
            bar.write(json.dumps(log[-1]))
            since = []
        if step % a.save_every == 0 or step == stop:
            save_train_state(a.out, module, opt, dict(step=step, log=log, args=vars(a)))
    bar.close()


def save_final(a, config: dict, weights_in, info: dict, eos_ids=None) -> str:
    """--out/final: config.json (its torch_dtype --save-dtype), the weights weights_in(that dtype) gives, and
    training_log.json (the arguments, then `info`); returns the folder."""
    final_dir = os.path.join(a.out, "final")
    config["torch_dtype"] = a.save_dtype
    save_checkpoint(final_dir, config, weights_in(torch.bfloat16 if a.save_dtype == "bfloat16" else torch.float32),
                    eos_ids=eos_ids)
    write_json_file(os.path.join(final_dir, "training_log.json"), dict(args=vars(a), **info), 1)
    return final_dir


# ----------------------------------------------------------------------------------------------------------------
# The target command


def target_options(p):
    p.add_argument("--out", default="runs/target", help="run directory (state, logs, final checkpoint)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-pos", type=int, default=2048)
    p.add_argument("--untied", action="store_true", help="separate lm_head (default: tied to the embedding)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--chat-fraction", type=float, default=0.2, help="share of tokens from chat-formatted samples")
    add_training_options(p, lr=3e-3, weight_decay=0.1,
                         bf16_help="bf16 autocast for the matmuls (fp32 weights and optimizer)")


def train_target(a):
    """Train the bundled tiny Qwen3 target on the Python standard library's source (CPU, minutes).

        python scripts/train.py target --out runs/target --steps 1500
        cp runs/target/final/* assets/tiny-target/

    Writes a byte-level BPE tokenizer (with <|endoftext|>, the chat tokens and <|mask|>) trained on the training
    files, then a small Qwen3 trained on a token stream that mixes whole source files with chat-formatted samples
    (`<|im_start|>user\\n<def line or docstring><|im_end|>\\n<|im_start|>assistant\\n<the function><|im_end|>`), so
    the CLI's default `--chat` prompt is one the model has seen. Every 20th file is held out for evaluation. The
    result is saved in the Hugging Face layout that `model.Qwen3.from_pretrained` reads (config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json).

    The training forward (`forward_batch`) runs over `model.Qwen3`'s own modules, batched, with causal SDPA and
    autograd; our inference forward is batch-1 with a static cache and FlexAttention. tests/test_training.py checks
    that both give the same logits and features. Resumable: `--out` holds the latest state (safetensors + a json),
    and running the same command again continues from it.
    """
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    train_files, held_files = training_files(a)
    tok_dir = os.path.join(a.out, "tokenizer")
    if os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    else:
        tok = train_tokenizer(train_files, a.vocab, tok_dir, CHAT_TEMPLATE)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    config = qwen3_config(tok.get_vocab_size(), hidden=a.hidden, inter=a.inter, layers=a.layers, heads=a.heads,
                          kv_heads=a.kv_heads, head_dim=a.head_dim, max_pos=a.max_pos, tie=not a.untied, eos=eos)
    stream, info = build_stream(tok, train_files, a.chat_fraction, a.seed)
    held_stream, _ = build_stream(tok, held_files, a.chat_fraction, a.seed + 1)
    model = build_target(config, a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train tokens {stream.numel():,} ({info}), held-out tokens {held_stream.numel():,}, "
          f"params {n_params:,}", flush=True)
    opt, step, log = optimizer_and_state(a, model)
    if step:
        print(f"resumed at step {step}", flush=True)

    def loss_of(g):
        windows = random_crops(stream, a.batch, a.seq, g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            return lm_loss(model, windows), windows[:, 1:].numel()

    t_last = time.time()

    def entry_of(since):
        nonlocal t_last
        held = evaluate(model, held_stream, a.seq, batches=4, batch=a.batch)
        now = time.time()
        entry = dict(loss=round(since[-1][0], 4), held_out=round(held, 4),
                     tok_per_s=round(sum(tokens for _, tokens in since) / (now - t_last)),
                     minutes=round((now - t_start) / 60, 2))
        t_last = now
        return entry

    train_steps(a, model, opt, step, log, a.steps, loss_of, entry_of, "target", mininterval=5)
    final_dir = save_final(a, config, lambda dtype: hf_weights(model, dtype),
                           dict(data=info, params=n_params, log=log), eos_ids=eos)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tokenizer beside the model
        shutil.copy(os.path.join(tok_dir, name), os.path.join(final_dir, name))
    print(f"wrote {final_dir} ({(time.time() - t_start) / 60:.1f} min)", flush=True)


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
    train_files, held_files = training_files(a)
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
# The drafter command


def drafter_options(p):
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



def frozen_target(path: str):
    """The target of --target, frozen, and its tokenizer."""
    from tokenizers import Tokenizer
    target = Qwen3.from_pretrained(path, device="cpu", dtype=torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    return target, Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


def drafter_to_train(a, mask_id: int) -> tuple[dict, DFlashDrafter]:
    """(config, drafter): --init's drafter (its shape then sets --layers, --inter, --block-size, --target-layers)
    or a fresh one of those options, made a DFlash 2 drafter with --dflash2."""
    if a.init:
        config = read_json(os.path.join(a.init, "config.json"))
        drafter = DFlashDrafter.from_pretrained(a.init, device="cpu", dtype=torch.float32)
        a.block_size = drafter.block_size
        a.layers, a.inter = len(drafter.layers), drafter.config.model.intermediate_size
        a.target_layers = ",".join(str(i) for i in drafter.config.target_layer_ids)
        if drafter.config.mask_token_id != mask_id:
            raise SystemExit(f"{a.init}: mask token {drafter.config.mask_token_id} is not the target tokenizer's "
                             f"<|mask|> ({mask_id})")
    else:
        layer_ids = [int(x) for x in a.target_layers.split(",")]
        config = zlab_config(read_json(os.path.join(a.target, "config.json")), a.layers, a.block_size, mask_id,
                             layer_ids, a.inter or None)
        drafter = DFlashDrafter(DFlashConfig.from_dict(config))
        init_weights(drafter, a.seed)
    if a.dflash2 and not isinstance(drafter, DFlash2Drafter):
        config, drafter = upgraded_to_dflash2(a, config, drafter)
    return config, drafter


def train_drafter(a):
    """Distil a DFlash block-diffusion drafter from a Qwen3 target (the bundled tiny one on a CPU; a real one on a GPU
    by the same command).

        python scripts/train.py drafter --target runs/target/final --out runs/draft --steps 550
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
    by drafter.DFlashDrafter.from_pretrained. docs/training.md explains the recipe; scripts/train.py holds it in
    reading order after the target's command: the mask rule, the batched forward, anchors / labels / inputs, the
    losses, then data, the target pass and evaluation, and this command.
    """
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    if a.kl_weight is None:
        a.kl_weight = 1.0 if a.objective == "diffusion" else 0.0
    if a.dflash2 and a.objective != "dflash":
        raise SystemExit("error: --dflash2 trains with --objective dflash (the selector learns the greedy labels)")
    target, tok = frozen_target(a.target)
    mask_id = tok.token_to_id("<|mask|>")
    if mask_id is None:
        raise SystemExit(f"{a.target}: the tokenizer has no <|mask|> token")
    config, drafter = drafter_to_train(a, mask_id)
    bs = a.block_size
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
    opt, step, log = optimizer_and_state(a, drafter)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter params {n_params:,}; {'resumed at step %d' % step if step else 'from scratch'}; "
          f"objective {a.objective} gamma {a.gamma} kl {a.kl_weight}", flush=True)
    if not step:
        log.append(dict(step=0, **evaluator(drafter)))
        print(json.dumps(log[-1]), flush=True)
    n_greedy = int(round(a.batch * a.greedy_share))

    def loss_of(g):
        rows = []
        if a.batch - n_greedy:
            starts = torch.randint(0, stream.numel() - a.seq, (a.batch - n_greedy,), generator=g)
            rows += [stream[s:s + a.seq] for s in starts.tolist()]
        if n_greedy:
            rows += list(greedy[torch.randint(0, greedy.shape[0], (n_greedy,), generator=g)])
        return batch_loss(a, drafter, target, torch.stack(rows), g, bs, mask_id)

    t_last = time.time()

    def entry_of(since):
        nonlocal t_last
        entry = dict(loss=round(sum(loss for loss, _ in since) / len(since), 4), valid=round(since[-1][1], 3),
                     s_per_step=round((time.time() - t_last) / len(since), 2),
                     minutes=round((time.time() - t_start) / 60, 2), **evaluator(drafter))
        t_last = time.time()
        return entry

    train_steps(a, drafter, opt, step, log, min(a.steps, a.stop_at or a.steps), loss_of, entry_of,
                f"drafter ({a.objective})", mininterval=10)
    final_dir = save_final(a, config, lambda dtype: zlab_weights(drafter, dtype), dict(params=n_params, log=log))
    print(f"wrote {final_dir} ({(time.time() - t_start) / 60:.1f} min)", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# The command line


COMMANDS = {"target": (target_options, train_target), "drafter": (drafter_options, train_drafter)}


def parser() -> argparse.ArgumentParser:
    """One subcommand per training; a command's --help is its run's docstring."""
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    commands = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (options, run) in COMMANDS.items():
        doc = inspect.getdoc(run)
        summary = " ".join(doc.split("\n\n")[0].split())
        options(commands.add_parser(name, help=summary, description=doc, formatter_class=raw))
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    run = COMMANDS[vars(a).pop("command")][1]  # the arguments a run records are its command's own
    torch.set_num_threads(a.threads)
    run(a)


if __name__ == "__main__":
    main()
