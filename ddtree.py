"""DDTree speculative decoding: the engine and the command line.

    python ddtree.py --prompt "def fibonacci(n):" --budget 512

Three methods share one decoding loop:
  ar      plain autoregressive decoding, one target forward per token;
  dflash  a DFlash drafter proposes a chain of block_size - 1 tokens, the target verifies it in one forward;
  ddtree  the drafter's per-position distributions build the best tree of `budget` nodes, the target verifies
          the whole tree in one forward with an ancestor-only attention mask, and the longest accepted path is
          committed.
Every method is lossless: greedy output equals plain greedy decoding, sampled output follows the target's law.
"""

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from model import Qwen3, read_json
from sampler import Sampling, draw_noise, sample, warp_probs
from tree_attn import PrefixMask, causal, round_up

# Eager FlexAttention (the uncompiled path, used on CPU and in tests) warns that it materializes scores: we know.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

PREFILL_CHUNK = 128  # prompt rows per target forward; fixed so one compiled graph serves every prompt length
METHODS = ("ddtree", "dflash", "ar")
DEFAULT_TARGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-target")
DEFAULT_DRAFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-draft")


# ----------------------------------------------------------------------------------------------------------------
# The engine: static buffers, masks and (optionally compiled) steps for one target (+ drafter) and settings


def check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class Engine:
    """Everything that must keep its identity across calls so compiled graphs are reused: the caches (sized once
    for `max_seq_len`), the masks whose tensors are updated in place, and the step functions."""

    def __init__(self, target: Qwen3, sampling: Sampling, max_seq_len: int, compile: bool):
        self.target, self.sampling = target, sampling
        self.device = target.device
        self.max_seq_len = max_seq_len
        target.setup_cache(max_seq_len)
        self.prefill_mask = PrefixMask(PREFILL_CHUNK, max_seq_len, self.device)
        self.prefill_mask.allow.copy_(causal(PREFILL_CHUNK))
        self.decode_mask = PrefixMask(1, max_seq_len, self.device)
        self.decode_mask.allow.fill_(True)
        self.prefill_step, self.decode_step = self._prefill_step, self._decode_step
        if compile:
            # One graph per fixed shape (prefill chunk, decode step). dynamic=False: a graph that went dynamic on
            # the query length fails to build on CPU (REFERENCE.md §5). CUDA graphs where available.
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self.prefill_step = torch.compile(self._prefill_step, dynamic=False, fullgraph=True, mode=mode)
            self.decode_step = torch.compile(self._decode_step, dynamic=False, fullgraph=True, mode=mode)

    def pick(self, logits, noise):
        """The target's next token from float32 logits [R, V]: argmax when greedy, else a warped sample."""
        if self.sampling.greedy:
            return logits.argmax(-1)
        return sample(warp_probs(logits, self.sampling), noise)

    def _prefill_step(self, tokens, start, last_row, noise):
        """Run PREFILL_CHUNK prompt rows at positions start.. (rows past the prompt are padding: they write K/V
        beyond the prompt that nothing reads before it is overwritten). Returns the token after `last_row`."""
        pos = start + torch.arange(PREFILL_CHUNK, device=tokens.device)
        mask = self.prefill_mask.set(start)
        logits, _ = self.target(tokens, pos, pos, mask, logits_rows=last_row)
        return self.pick(logits, noise), torch.isfinite(logits).all()

    def _decode_step(self, token, pos, noise):
        mask = self.decode_mask.set(pos[0])
        logits, _ = self.target(token, pos, pos, mask)
        return self.pick(logits, noise), torch.isfinite(logits).all()

    def noise(self, rows: int, generator):
        if self.sampling.greedy:
            return None
        return draw_noise((rows, self.target.config.vocab_size), generator, self.device)

    def prefill(self, prompt: torch.Tensor, generator):
        """Fill the cache with the prompt; returns the first new token (sampled from the last prompt row)."""
        n = prompt.numel()
        padded = torch.zeros(round_up(n, PREFILL_CHUNK), dtype=torch.long, device=self.device)
        padded[:n] = prompt
        for start in range(0, n, PREFILL_CHUNK):
            last = torch.tensor([min(n - 1 - start, PREFILL_CHUNK - 1)], device=self.device)
            noise = self.noise(1, generator)
            token, finite = self.prefill_step(padded[start:start + PREFILL_CHUNK], torch.tensor(start, device=self.device),
                                              last, noise)
        return token, finite


_ENGINES: dict = {}


def get_engine(target, sampling, max_seq_len, compile) -> Engine:
    """Engines are cached per (model, settings) so repeated generate() calls reuse caches and compiled graphs."""
    key = (id(target), sampling, max_seq_len, compile)
    if key not in _ENGINES:
        _ENGINES.clear()  # one live engine at a time: caches can be large
        _ENGINES[key] = Engine(target, sampling, max_seq_len, compile)
    return _ENGINES[key]


# ----------------------------------------------------------------------------------------------------------------
# generate()


@dataclass
class Result:
    tokens: list[int]
    stats: dict = field(default_factory=dict)


def cache_length(prompt_len: int, max_new_tokens: int, extra: int) -> int:
    """Cache slots for a request, bucketed to 1024 so requests of similar size share compiled graphs."""
    need = round_up(prompt_len, PREFILL_CHUNK) + max_new_tokens + extra + 1
    return round_up(max(need, 1024), 1024)


def generate(target: Qwen3, drafter=None, prompt_ids=None, method: str = "ddtree", budget: int = 512,
             max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, seed: int | None = None, stop_ids=None, compile: bool = False,
             on_tokens=None) -> Result:
    """Generate up to `max_new_tokens` after `prompt_ids` (list of ints or 1-D tensor). See DESIGN.md.

    on_tokens(list[int]) is called with the tokens committed by each round (for streaming)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("budget", budget, 1)
    if seed is not None:
        check_int("seed", seed, 0)
    prompt = torch.as_tensor(prompt_ids if prompt_ids is not None else [], dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty")
    vocab = target.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt ids must lie in [0, {vocab}) for this target")
    limit = target.config.max_position_embeddings
    if prompt.numel() + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"target's max_position_embeddings ({limit})")
    stop = set(target.eos_ids if stop_ids is None else stop_ids)
    if method != "ar":
        raise ValueError(f"method {method!r} needs a drafter, which this build does not have yet; use --method ar")

    with torch.inference_mode():
        engine = get_engine(target, sampling, cache_length(prompt.numel(), max_new_tokens, 0), compile)
        generator = torch.Generator(device=engine.device)
        generator.manual_seed(seed if seed is not None else torch.seed() % 2**63)
        t0 = time.perf_counter()
        token, finite = engine.prefill(prompt.to(engine.device), generator)
        tokens, accepted = [], []
        pos = torch.tensor([prompt.numel()], device=engine.device)
        while True:
            value, ok = token.item(), bool(finite)  # the round's one host sync
            if not ok:
                raise ValueError("the target produced non-finite logits (NaN/inf weights or overflow in this dtype)")
            if tokens:
                accepted.append(1)  # AR: one token per target forward after the prefill
            tokens.append(value)
            if on_tokens:
                on_tokens([value])
            if value in stop or len(tokens) >= max_new_tokens:
                break
            token, finite = engine.decode_step(token.view(1), pos, engine.noise(1, generator))
            pos += 1
        seconds = time.perf_counter() - t0
    rounds = len(accepted)
    stats = dict(method=method, budget=None, new_tokens=len(tokens), rounds=rounds,
                 tau=(sum(accepted) / rounds if rounds else 0.0), accepted=accepted, seconds=seconds,
                 tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0)
    return Result(tokens=tokens, stats=stats)


# ----------------------------------------------------------------------------------------------------------------
# Text: tokenizer.json through `tokenizers`, chat templates through jinja2 (as transformers renders them)


class Text:
    def __init__(self, path: str):
        from tokenizers import Tokenizer
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"{path}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(file)
        config_file = os.path.join(path, "tokenizer_config.json")
        self.config = read_json(config_file) if os.path.isfile(config_file) else {}
        template_file = os.path.join(path, "chat_template.jinja")
        self.chat_template = self.config.get("chat_template")
        if os.path.isfile(template_file):
            with open(template_file) as f:
                self.chat_template = f.read()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def special(self, name: str) -> str:
        value = self.config.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def render_chat(self, prompt: str) -> str:
        """The user turn plus the assistant header, as transformers' apply_chat_template(add_generation_prompt=True,
        enable_thinking=False) renders it (DFlash drafters were trained without thinking)."""
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
            json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        return env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, enable_thinking=False,
            bos_token=self.special("bos_token"), eos_token=self.special("eos_token"))


class Streamer:
    """Prints text as tokens are committed, holding back an incomplete UTF-8 sequence until it completes."""

    def __init__(self, text: Text, out=sys.stdout):
        self.text, self.out, self.ids, self.printed = text, out, [], 0

    def __call__(self, new_ids):
        self.ids += new_ids
        s = self.text.decode(self.ids)
        if s.endswith("\ufffd"):
            return
        self.out.write(s[self.printed:])
        self.out.flush()
        self.printed = len(s)


# ----------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    p = argparse.ArgumentParser(description="DDTree speculative decoding with a Qwen3 target and a DFlash drafter.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--target", default=DEFAULT_TARGET, help="Qwen3 checkpoint: local directory or hub repo id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="DFlash drafter: local directory or hub repo id")
    p.add_argument("--method", default="ddtree", choices=METHODS)
    p.add_argument("--budget", default="512", help="tree nodes per round (ddtree)")
    p.add_argument("--max-new-tokens", default="256")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", default="0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", default=None)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the checkpoint's chat template (default: on when it has one)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


def as_int(name: str, text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def run_cli(args) -> int:
    budget = as_int("--budget", args.budget)
    max_new = as_int("--max-new-tokens", args.max_new_tokens)
    top_k = as_int("--top-k", args.top_k)
    seed = None if args.seed is None else as_int("--seed", args.seed)
    Sampling(args.temperature, top_k, args.top_p, args.min_p)  # validate before loading anything
    check_int("--budget", budget, 1)
    if args.device is not None:
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(f"device {args.device!r} is not usable here ({str(e).splitlines()[0]})") from None
    target = Qwen3.from_pretrained(args.target, device=args.device, dtype=args.dtype)
    text = Text(target.path)
    chat = args.chat if args.chat is not None else bool(text.chat_template)
    if chat and not text.chat_template:
        raise ValueError(f"{args.target}: --chat asked for, but the checkpoint has no chat template")
    prompt_ids = text.encode(text.render_chat(args.prompt) if chat else args.prompt)
    if not args.prompt or not prompt_ids:
        raise ValueError("the prompt is empty")
    drafter = None
    streamer = None if args.json else Streamer(text)
    res = generate(target, drafter, prompt_ids, method=args.method, budget=budget, max_new_tokens=max_new,
                   temperature=args.temperature, top_k=top_k, top_p=args.top_p, min_p=args.min_p, seed=seed,
                   compile=args.compile, on_tokens=streamer)
    s = res.stats
    if args.json:
        print(json.dumps(dict(text=text.decode(res.tokens), tokens=res.tokens, stats=s)))
    else:
        print()
        print(f"[{s['method']}] {s['new_tokens']} tokens in {s['rounds']} rounds, tau {s['tau']:.2f}, "
              f"{s['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run_cli(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
