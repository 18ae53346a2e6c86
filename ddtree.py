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

from draft_tree import ancestor_matrix, build_tree, build_tree_heap, format_tree
from drafter import DFlashDrafter
from model import Qwen3, read_json
from sampler import Sampling, draw_noise, sample, verify_chain_sampled, walk_tree, warp_probs
from tree_attn import PrefixMask, causal, compact_kv, round_up

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

    def __init__(self, target: Qwen3, drafter: DFlashDrafter | None, method: str, budget: int, sampling: Sampling,
                 max_seq_len: int, compile: bool, draft_temperature: float = 1.0, draft_sampling: bool = False,
                 denoise_steps: int = 1):
        self.target, self.drafter, self.method, self.sampling = target, drafter, method, sampling
        self.device = target.device
        self.max_seq_len = max_seq_len
        self.draft_temperature, self.denoise_steps = draft_temperature, denoise_steps
        # Sampled drafts need the min(1, p/q) rule; greedy decoding and trees use deterministic candidates.
        self.draft_sampling = draft_sampling and method == "dflash" and not sampling.greedy
        target.setup_cache(max_seq_len)
        self.prefill_mask = PrefixMask(PREFILL_CHUNK, max_seq_len, self.device)
        self.prefill_mask.allow.copy_(causal(PREFILL_CHUNK))
        self.decode_mask = PrefixMask(1, max_seq_len, self.device)
        self.decode_mask.allow.fill_(True)
        self.feature_layers = ()
        if drafter is not None:
            drafter.setup_cache(max_seq_len)
            self.feature_layers = tuple(drafter.config.target_layer_ids)
            self.depth = drafter.block_size - 1  # L: draft positions per round
            self.nodes = budget if method == "ddtree" else self.depth  # the chain is a tree of L nodes
            self.draft_mask = PrefixMask(drafter.block_size, max_seq_len, self.device)
            self.draft_mask.allow.fill_(True)  # the block sees itself bidirectionally
            self.verify_mask = PrefixMask(self.nodes + 1, max_seq_len, self.device)
        self.prefill_step, self.decode_step, self.round = self._prefill_step, self._decode_step, self._round
        if compile:
            # One graph per fixed shape (prefill chunk, decode step, round). dynamic=False: a graph that went
            # dynamic on the query length fails to build on CPU (REFERENCE.md §5). CUDA graphs where available.
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            # Every Engine compiles the same methods, so they share one cache per method: an engine whose tensors
            # and settings match an earlier one's reuses its graphs (which read the models and masks through
            # `self` at each call). Room for a few engines (settings, budgets) before dynamo falls back to eager.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.prefill_step, self.decode_step, self.round = (
                torch.compile(f, dynamic=False, fullgraph=True, mode=mode)
                for f in (self._prefill_step, self._decode_step, self._round))

    def pick(self, logits, noise):
        """The target's token at each row of float32 logits [R, V]: argmax when greedy, else a warped sample."""
        if self.sampling.greedy:
            return logits.argmax(-1)
        return sample(warp_probs(logits, self.sampling), noise)

    # -- prefill and plain decoding ------------------------------------------------------------------------------

    def _prefill_step(self, tokens, start, last_row, noise):
        """Run PREFILL_CHUNK prompt rows at positions start.. (rows past the prompt are padding: they write K/V
        beyond the prompt that nothing reads before it is overwritten). Returns the token after `last_row`."""
        pos = start + torch.arange(PREFILL_CHUNK, device=tokens.device)
        mask = self.prefill_mask.set(start)
        logits, features = self.target(tokens, pos, pos, mask, logits_rows=last_row,
                                       feature_layers=self.feature_layers)
        if self.drafter is not None:  # the prompt is the drafter's first context
            self.drafter.append_context(features, pos, pos)
        return self.pick(logits, noise), torch.isfinite(logits).all()

    def _decode_step(self, token, pos, noise):
        mask = self.decode_mask.set(pos[0])
        logits, _ = self.target(token, pos, pos, mask)
        return self.pick(logits, noise), torch.isfinite(logits).all()

    def prefill(self, prompt: torch.Tensor, generator):
        """Fill the caches with the prompt; returns the first new token (sampled from the last prompt row)."""
        n = prompt.numel()
        padded = torch.zeros(round_up(n, PREFILL_CHUNK), dtype=torch.long, device=self.device)
        padded[:n] = prompt
        for start in range(0, n, PREFILL_CHUNK):
            last = torch.tensor([min(n - 1 - start, PREFILL_CHUNK - 1)], device=self.device)
            token, finite = self.prefill_step(padded[start:start + PREFILL_CHUNK],
                                              torch.tensor(start, device=self.device), last, self.noise(1, generator))
        return token, finite

    # -- one speculative round: draft -> tree -> verify -> accept -> commit --------------------------------------

    def _round(self, bonus, start, noise, accept_u, draft_noise):
        """bonus: [1] the last token the target chose, not yet in its cache; start: 0-d, its position (= the
        committed length). Returns the committed rows' tokens [L + 1] (valid up to `length`), length, the next
        bonus, whether the target's logits were finite, and the tree (for --show-tree)."""
        # 1. Draft: one drafter pass over [bonus, MASK x L] -> per-position logits [L, V].
        draft_logits = self.draft(bonus, start)
        # 2. Tree: the budget's most probable prefixes (ddtree) or the drafter's chain (dflash), and its mask.
        tokens, parents, depths, q = self.propose(draft_logits, draft_noise)
        mask = self.tree_mask(start, parents)
        # 3. Verify: [bonus, nodes...] at positions start + depth, each row seeing the prefix and its ancestors.
        rows, pos, logits, features = self.verify(bonus, tokens, depths, start, mask)
        # 4. Accept: the longest path the target's own choices follow, and the target's next token after it.
        path, length, next_token = self.accept(logits, tokens, parents, q, noise, accept_u)
        # 5. Commit: the path's K/V to contiguous slots after the prefix, its features to the drafter's context.
        self.commit(start, path, pos, features)
        return rows[path], length, next_token, torch.isfinite(logits).all(), (tokens, parents, depths, path)

    def draft(self, bonus, start):
        return self.drafter.draft(bonus, start, self.draft_mask.set(start), self.denoise_steps)

    def tree_mask(self, start, parents):
        return self.verify_mask.set(start, ancestor_matrix(parents, self.depth, dtype=torch.uint8))

    def verify(self, bonus, tokens, depths, start, mask):
        rows = torch.cat([bonus.view(1), tokens])
        pos = start + torch.cat([depths.new_zeros(1), depths])
        slots = start + torch.arange(self.nodes + 1, device=rows.device)
        logits, features = self.target(rows, pos, slots, mask, feature_layers=self.feature_layers)
        return rows, pos, logits, features

    def accept(self, logits, tokens, parents, q, noise, accept_u):
        """(path [L + 1] of accepted rows from the root, length, next bonus), by the rule that keeps the target's
        law: sampled chain drafts by min(1, p/q) with the residual, deterministic drafts by the target's own
        choices (argmax or a warped sample at every row) walked down the tree."""
        if self.draft_sampling:
            accepted, next_token = verify_chain_sampled(warp_probs(logits, self.sampling), q, tokens, accept_u, noise)
            return torch.arange(self.depth + 1, device=logits.device), accepted + 1, next_token
        return walk_tree(parents, tokens, self.pick(logits, noise), self.depth)

    def commit(self, start, path, pos, features):
        compact_kv(self.target.kv_caches(), start, path)
        self.extend_context(start, features[path], pos[path])

    def extend_context(self, start, features, positions):
        """The drafter's context K/V for the committed path (the first half of its forward; DFlash's own code
        computes it inside the drafter pass), in the slots after `start`."""
        slots = start + torch.arange(self.depth + 1, device=features.device)
        self.drafter.append_context(features, positions, slots)

    def propose(self, draft_logits, draft_noise):
        """(tokens, parents, depths, q): the nodes in parent-first order; q the warped draft law when the chain's
        drafts are sampled (for the min(1, p/q) rule), else None."""
        L = self.depth
        if self.method == "ddtree":
            logq = torch.log_softmax(draft_logits / self.draft_temperature, dim=-1)
            # Compiled: fixed-shape tensor ops. Eager: the paper's heap, the readable reference, which is also
            # faster outside a graph (0.3 vs 1.0 ms on the bundled pair at B=64). Both give the same tree.
            build = build_tree if torch.compiler.is_compiling() else build_tree_heap
            return (*build(logq, self.nodes), None)
        chain_parents = torch.arange(L, device=draft_logits.device)  # node i hangs under row i
        depths = chain_parents + 1
        if self.draft_sampling:
            q = warp_probs(draft_logits, self.sampling)
            return sample(q, draft_noise), chain_parents, depths, q
        return draft_logits.argmax(-1), chain_parents, depths, None

    def noise(self, rows: int, generator):
        if self.sampling.greedy:
            return None
        return draw_noise((rows, self.target.config.vocab_size), generator, self.device)

    def round_randomness(self, generator):
        """The round's noise, drawn outside the compiled graph from the seeded generator."""
        if self.sampling.greedy:
            return None, None, None
        noise = self.noise(self.nodes + 1, generator)
        if not self.draft_sampling:
            return noise, None, None
        accept_u = torch.rand(self.depth, generator=generator, device=self.device)
        return noise, accept_u, self.noise(self.depth, generator)


_ENGINES: dict = {}


def get_engine(target, drafter, method, budget, sampling, max_seq_len, compile, **options) -> Engine:
    """Engines are cached per (models, settings) so repeated generate() calls reuse caches and compiled graphs."""
    key = (id(target), id(drafter), method, budget, sampling, max_seq_len, compile, tuple(sorted(options.items())))
    if key not in _ENGINES:
        _ENGINES.clear()  # one live engine at a time: caches can be large
        _ENGINES[key] = Engine(target, drafter, method, budget, sampling, max_seq_len, compile, **options)
    return _ENGINES[key]


# ----------------------------------------------------------------------------------------------------------------
# generate()


@dataclass
class Result:
    tokens: list[int]
    stats: dict = field(default_factory=dict)
    trees: list = field(default_factory=list)  # with show_tree: (tokens, parents, depths, path, length) per round


def cache_length(prompt_len: int, max_new_tokens: int, extra: int) -> int:
    """Cache slots for a request, bucketed to 1024 so requests of similar size share compiled graphs."""
    need = round_up(prompt_len, PREFILL_CHUNK) + max_new_tokens + extra + 1
    return round_up(max(need, 1024), 1024)


def check_request(target, drafter, prompt, method, budget, max_new_tokens, seed, draft_temperature, denoise_steps):
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("budget", budget, 1)
    check_int("denoise_steps", denoise_steps, 1)
    if seed is not None:
        check_int("seed", seed, 0)
    if not (isinstance(draft_temperature, (int, float)) and draft_temperature > 0 and
            draft_temperature < float("inf")):
        raise ValueError(f"draft_temperature must be a positive number, got {draft_temperature!r}")
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty")
    vocab = target.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt ids must lie in [0, {vocab}) for this target")
    limit = target.config.max_position_embeddings
    if prompt.numel() + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"target's max_position_embeddings ({limit})")
    if method != "ar":
        if drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        drafter.bind(target)
        # The verify writes budget + 1 rows after the committed tokens; the cache holds at most
        # max_position_embeddings slots (rounded up to the attention block).
        rows = (budget if method == "ddtree" else drafter.block_size) + 1
        if prompt.numel() + max_new_tokens + rows > round_up(limit):
            raise ValueError(f"budget {budget} is beyond what the cache can hold: prompt ({prompt.numel()}) + "
                             f"max_new_tokens ({max_new_tokens}) + {rows} verify rows > {round_up(limit)} slots")


def generate(target: Qwen3, drafter: DFlashDrafter | None = None, prompt_ids=None, method: str = "ddtree",
             budget: int = 512, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop_ids=None, compile: bool = False,
             on_tokens=None, draft_temperature: float = 1.0, draft_sampling: bool = False, denoise_steps: int = 1,
             show_tree: bool = False) -> Result:
    """Generate up to `max_new_tokens` after `prompt_ids` (list of ints or 1-D tensor). See DESIGN.md.

    on_tokens(list[int]) is called with the tokens committed by each round (for streaming). Extras beyond the
    design card: draft_temperature (the drafter's temperature for building trees; 1 as in the paper),
    draft_sampling (dflash: sample the chain from the warped draft law and verify with min(1, p/q)),
    denoise_steps (T drafter passes per round), show_tree (keep each round's tree in Result.trees)."""
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    prompt = torch.as_tensor(prompt_ids if prompt_ids is not None else [], dtype=torch.long).flatten()
    check_request(target, drafter, prompt, method, budget, max_new_tokens, seed, draft_temperature, denoise_steps)
    stop = set(target.eos_ids if stop_ids is None else stop_ids)
    if method == "ar":
        drafter, extra = None, 0
    else:
        extra = (budget if method == "ddtree" else drafter.block_size) + drafter.block_size
    options = dict(draft_temperature=float(draft_temperature), draft_sampling=bool(draft_sampling),
                   denoise_steps=denoise_steps)

    with torch.inference_mode():
        engine = get_engine(target, drafter, method, budget, sampling,
                            cache_length(prompt.numel(), max_new_tokens, extra), compile, **options)
        generator = torch.Generator(device=engine.device)
        generator.manual_seed(seed if seed is not None else torch.seed() % 2**63)
        t0 = time.perf_counter()
        token, finite = engine.prefill(prompt.to(engine.device), generator)
        if not bool(finite):
            raise ValueError(NON_FINITE)
        tokens, accepted, trees = [], [], []
        start = torch.tensor(prompt.numel(), device=engine.device)
        done = emit(tokens, [token.item()], stop, max_new_tokens, on_tokens)
        while not done:
            # Under CUDA graphs the last call's outputs live in the graph's memory pool, which the next replay
            # overwrites: feed back a copy of the token (gpt-fast does the same), never the output itself.
            token = token.clone()
            if method == "ar":
                token, finite = engine.decode_step(token.view(1), start.view(1), engine.noise(1, generator))
                value, ok = torch.stack([token.view(-1)[0], finite.long()]).tolist()  # the step's one host sync
                new, start = [value], start + 1
            else:
                rows, length, token, finite, tree = engine.round(token.view(1), start,
                                                                 *engine.round_randomness(generator))
                # The round's one host sync: the committed rows, how many, the next bonus, and the NaN check.
                out = torch.cat([rows, length.view(1), token.view(1), finite.view(1).long()]).tolist()
                n, ok = out[-3], bool(out[-1])
                new = out[1:n] + [out[-2]]  # accepted drafts (rows[0] is the old bonus, already out) + next bonus
                start = start + length
                if show_tree:
                    trees.append(tuple(t.clone() for t in tree) + (n,))
            if not ok:
                raise ValueError(NON_FINITE)
            accepted.append(len(new))
            done = emit(tokens, new, stop, max_new_tokens, on_tokens)
        seconds = time.perf_counter() - t0
    rounds = len(accepted)
    stats = dict(method=method, budget=budget if method == "ddtree" else None, new_tokens=len(tokens),
                 rounds=rounds, tau=(sum(accepted) / rounds if rounds else 0.0), accepted=accepted,
                 seconds=seconds, tokens_per_s=len(tokens) / seconds if seconds > 0 else 0.0)
    return Result(tokens=tokens, stats=stats, trees=trees)


NON_FINITE = "the target produced non-finite logits (NaN/inf weights, or overflow in this dtype)"


def emit(tokens: list, new: list, stop: set, max_new_tokens: int, on_tokens) -> bool:
    """Append a round's tokens, cut after the first stop token or at the token limit; True when generation ends."""
    kept = []
    for t in new:
        kept.append(t)
        if t in stop or len(tokens) + len(kept) >= max_new_tokens:
            break
    tokens += kept
    if on_tokens:
        on_tokens(kept)
    return kept[-1] in stop or len(tokens) >= max_new_tokens


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

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
        s = self.text.decode(self.ids, skip_special_tokens=True)  # e.g. the final <|im_end|>
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
    p.add_argument("--draft-temperature", type=float, default=1.0,
                   help="temperature of the drafter's distributions when building trees (1 as in the paper)")
    p.add_argument("--draft-sampling", action="store_true",
                   help="dflash: sample the chain from the draft law and verify with min(1, p/q)")
    p.add_argument("--denoise-steps", default="1", help="drafter passes per round (DFlash: 1)")
    p.add_argument("--show-tree", action="store_true", help="print the first round's tree with accepted marks")
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
    if args.method != "ar":
        drafter = DFlashDrafter.from_pretrained(args.draft, device=target.device, dtype=target.dtype)
    streamer = None if args.json else Streamer(text)
    res = generate(target, drafter, prompt_ids, method=args.method, budget=budget, max_new_tokens=max_new,
                   temperature=args.temperature, top_k=top_k, top_p=args.top_p, min_p=args.min_p, seed=seed,
                   compile=args.compile, on_tokens=streamer, draft_temperature=args.draft_temperature,
                   draft_sampling=args.draft_sampling, denoise_steps=as_int("--denoise-steps", args.denoise_steps),
                   show_tree=args.show_tree)
    if args.show_tree and res.trees:
        tokens, parents, depths, path, length = res.trees[0]
        print(f"\nround 1 tree ({args.method}, {int((parents >= 0).sum())} nodes; ✓ accepted):", file=sys.stderr)
        print(format_tree(tokens, parents, depths, accepted_rows=path[:length], decode=lambda t: repr(text.decode([t])),
                          root=repr(text.decode(res.tokens[:1]))),
              file=sys.stderr)
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
