"""Train the bundled tiny Qwen3 target on the Python standard library's source (CPU, minutes).

    python scripts/train_target.py --out runs/target --steps 1500
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

import argparse
import ast
import json
import math
import os
import random
import sys
import textwrap
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from checkpoints import (CHAT_TEMPLATE, add_training_options, load_train_state, qwen3_config,  # noqa: E402
                         save_checkpoint, save_train_state, stdlib_files, train_tokenizer, write_json_file)
from loading import checkpoint_tensors  # noqa: E402
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


def lr_at(step: int, steps: int, lr: float, warmup: int, final_frac: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from tqdm import tqdm
    t_start = time.time()
    final_dir = os.path.join(a.out, "final")
    os.makedirs(a.out, exist_ok=True)
    train_files, held_files = stdlib_files(HELD_OUT_EVERY)
    if a.files:
        train_files, held_files = train_files[:a.files], held_files[:max(1, a.files // 10)]
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
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    state = load_train_state(a.out, model, opt)
    step = state["step"] if state else 0
    log = state["log"] if state else []
    if state:
        print(f"resumed at step {step}", flush=True)
    model.train()
    bar = tqdm(total=a.steps, initial=step, desc="target", dynamic_ncols=True, mininterval=5)
    t_last, tokens_since = time.time(), 0
    while step < a.steps:
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)  # batch = f(seed, step): resumable
        windows = random_crops(stream, a.batch, a.seq, g)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = lm_loss(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_since += windows[:, 1:].numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % a.eval_every == 0 or step == a.steps:
            model.eval()
            held = evaluate(model, held_stream, a.seq, batches=4, batch=a.batch)
            model.train()
            now = time.time()
            entry = dict(step=step, loss=round(loss.item(), 4), held_out=round(held, 4),
                         tok_per_s=round(tokens_since / (now - t_last)), minutes=round((now - t_start) / 60, 2))
            log.append(entry)
            t_last, tokens_since = now, 0
            bar.write(json.dumps(entry))
        if step % a.save_every == 0 or step == a.steps:
            save_train_state(a.out, model, opt, dict(step=step, log=log, args=vars(a)))
    bar.close()
    # The final checkpoint in the Hugging Face layout, with the tokenizer next to it.
    dtype = torch.bfloat16 if a.save_dtype == "bfloat16" else torch.float32
    config["torch_dtype"] = a.save_dtype
    save_checkpoint(final_dir, config, hf_weights(model, dtype), eos_ids=eos)
    train_tokenizer_copy(tok_dir, final_dir)
    write_json_file(os.path.join(final_dir, "training_log.json"),
                    dict(args=vars(a), data=info, params=n_params, log=log), 1)
    print(f"wrote {final_dir} ({(time.time() - t_start) / 60:.1f} min)", flush=True)


def train_tokenizer_copy(src: str, dst: str):
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))


if __name__ == "__main__":
    main()
