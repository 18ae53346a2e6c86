"""DDTree speculative decoding: generate(), the engine's round, and the command line's entry point (cli.py):

    python ddtree.py --prompt "def fibonacci(n):" --budget 512

Methods, all lossless: ar (plain decoding), dflash (the drafter's chain) and ddtree (the best tree of `budget`
nodes from the drafter's per-position distributions, verified in one forward under an ancestor-only mask). Reading
order: generate() -> Engine -> Engine.step -> Engine.round (five stages; docs/round.md walks through one) -> prefill.
"""

import itertools
import os
import signal
import sys
import threading
import time
import warnings

if __name__ == "__main__":  # Ctrl-C while torch imports (seconds): exit 130 quietly; main() takes over from there
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import torch  # noqa: E402

import compiling
import batch
from batch import Requests, RequestsFailed, Result
from draft_tree import ancestor_matrix, beyond_room, build_tree, build_tree_heap, within_room
from drafter import DFlashDrafter
import families
from families import position_limit
from sampler import Sampling, draw_noise, sample, sample_rows, tempered, verify_chain_sampled, walk_tree, warp_probs
from settings import (Speculation, Target, check_models, check_recalibrate, check_request, check_settings,
                      recurrent_target, verify_rows)
from tree_attn import PrefixMask, compact_kv, round_up

# Eager FlexAttention warns that it materializes the scores: the eager path does, by design.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

# Prompt rows per target forward, fixed per device so that one compiled graph serves every prompt length.
PREFILL_CHUNK = 128
PREFILL_CHUNKS = {"cuda": 512}
DEFAULT_TARGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-target")
DEFAULT_DRAFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-draft")


# ----------------------------------------------------------------------------------------------------------------
# generate() and generate_batch(): the decoding loop


def generate(target: Target, drafter: DFlashDrafter | None = None, prompt_ids=None, method: str = "ddtree",
             budget: int | str | None = None, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop_ids=None,
             compile: bool | str = False, on_tokens=None, speculation: Speculation | None = None,
             recalibrate: bool = False) -> Result:
    """Up to `max_new_tokens` after `prompt_ids` (ints or a 1-D integer tensor): generate_batch for one request.

    budget: ddtree's tree size (default 512), or "auto" (docs/budget.md; recalibrate=True measures again).
    temperature, top_k, top_p, min_p: the target's draws, warped in Hugging Face's order (0 = greedy).
    speculation: settings.Speculation. on_tokens(list[int]) streams each round's tokens. A setting that cannot apply
    is a ValueError; bad values a ValueError or TypeError. A second run on the same models waits (another thread)
    or is a RuntimeError (this thread: on_tokens, on_result), since their caches hold this run's requests.

    stats: new_tokens, rounds, accepted (tokens per round, summing to new_tokens - 1), path_lengths (accepted paths
    before a stop or the limit cut them), tau (mean accepted), seconds, tokens_per_s, compile_seconds, seed.
    """
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens must be a function of a list of token ids, got {on_tokens!r}")
    return generate_batch(target, drafter, [prompt_ids], method, budget, max_new_tokens, temperature, top_k, top_p,
                          min_p, [seed], stop_ids, compile, on_tokens and (lambda i, new: on_tokens(new)), speculation,
                          max_batch=1, recalibrate=recalibrate)[0]


def generate_batch(target: Target, drafter: DFlashDrafter | None = None, prompts=(), method: str = "ddtree",
                   budget: int | str | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seeds=None, stop_ids=None,
                   compile: bool | str = False, on_tokens=None, speculation: Speculation | None = None,
                   max_batch: int = 16, on_result=None, recalibrate: bool = False) -> list[Result]:
    """generate() for many independent requests, up to `max_batch` at a time: one Result per prompt, in order.

    Request i draws as generate(seed=seeds[i]) does (seeds: an int or None per prompt), so it gets its lone run's
    sample. on_tokens(i, list[int]) and on_result(i, Result) report request i (batch.run). A request whose logits or
    draws turn non-finite ends there (Result.error); then batch.RequestsFailed holds every Result. Other settings
    and stats: as generate(), plus stats["batch"] (the batch size it started at).
    """
    sampling, spec = check_settings(method, Sampling(temperature, top_k, top_p, min_p), budget, speculation)
    check_recalibrate(recalibrate, spec.budget)
    check_models(target, drafter, method)
    with batch.models_in_use(target, drafter):
        prompts, seeds, stop = check_request(target, drafter, prompts, seeds, stop_ids, method, max_new_tokens,
                                             spec, compile, on_tokens, max_batch, on_result)

        renewed = []  # recalibrate: the budget-auto engines this call has calibrated again

        def engine_for(longest: int, batch_size: int):  # for a wave whose longest prompt has this length
            budgets = families.family("budget").auto_budgets() if spec.budget == "auto" else ()
            length = cache_length(longest, max_new_tokens, method, spec, drafter, budgets, target.device.type)
            engine = get_engine(target, drafter, method, sampling, spec, length, compile, batch_size, budgets)
            if recalibrate and not any(e is engine for e in renewed):
                engine.renew("asked for (recalibrate)")
                renewed.append(engine)
            return engine

        with torch.inference_mode():
            results = batch.run(engine_for, prompts, seeds, stop, max_new_tokens, max_batch, on_tokens, on_result,
                                dict(method=method, budget=spec.budget))
    if any(r.error is not None for r in results):
        raise RequestsFailed(results)
    return results


def host_read(**parts) -> list[dict]:
    """Per-request integer tensors ([N] or [N, k]; None is left out) read to the host in one transfer: per request,
    a dict by name of an int ([N]) or a list ([N, k])."""
    parts = {name: t for name, t in parts.items() if t is not None}
    ends = list(itertools.accumulate(t.shape[1] if t.dim() == 2 else 1 for t in parts.values()))
    rows = torch.cat([t.long().reshape(t.shape[0], -1) for t in parts.values()], dim=1).tolist()
    return [{name: row[end - 1] if t.dim() == 1 else row[end - t.shape[1]:end]
             for (name, t), end in zip(parts.items(), ends)} for row in rows]


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[N]: whether request n's part of x [N, ...] is all finite."""
    return torch.isfinite(x).flatten(1).all(1)


# ----------------------------------------------------------------------------------------------------------------
# The engine: its masks and compiled steps, the requests' steps, the five stages of a round, the prefill


class Engine:
    """One (target, drafter, method, settings, batch size): its caches, masks, (compiled) steps and requests. Every
    tensor of a round leads with the batch dimension; request n owns row n of every cache."""

    # -- construction ---------------------------------------------------------------------------------------------

    def __init__(self, target: Target, drafter: DFlashDrafter | None, method: str, sampling: Sampling,
                 spec: Speculation, max_seq_len: int, compile: bool | str, batch: int = 1, tally=None):
        self.target, self.drafter, self.method, self.sampling, self.spec = target, drafter, method, sampling, spec
        self.device, self.max_seq_len, self.batch, self.compiled = target.device, max_seq_len, batch, compile
        self.tally = tally  # budget auto (budget.tally): what smaller budgets and the chain would have accepted
        self.last_lengths = self.last_tally = None  # the last step's, read by budget auto
        self.requests, self.guards_checked = None, False  # the requests (adopt), and whether a step checked guards
        # The paper's heap eagerly (the readable reference), the tensor builder compiled (no host sync): same trees.
        self.build_tree = build_tree if compile else build_tree_heap
        target.setup_cache(max_seq_len, batch)
        self.prefill_mask = PrefixMask(prefill_chunk(self.device.type), max_seq_len, self.device, batch, causal=True)
        self.decode_mask = PrefixMask(1, max_seq_len, self.device, batch)
        self.feature_layers = ()
        if drafter is not None:
            drafter.setup_cache(max_seq_len, batch)
            self.feature_layers = tuple(drafter.config.target_layer_ids)
            self.draft_len = drafter.block_size - 1  # L: draft positions per round
            self.tree_size = spec.budget if method == "ddtree" else self.draft_len  # B: the chain is a tree of L
            # D: a tree of B nodes is at most B deep; budget auto's tally reads the chain's L drafts.
            self.max_depth = self.draft_len if tally else min(self.tree_size, self.draft_len)
            # One block mask per kind of drafter layer (docs/checkpoints.md); draft_window limits every kind.
            self.draft_masks = {kind: PrefixMask(drafter.block_size, max_seq_len, self.device, batch, *kind,
                                                 context=spec.draft_window)
                                for kind in drafter.config.mask_kinds}
            self.block_allow = {kind: mask.allow.clone() for kind, mask in self.draft_masks.items()}
            self.verify_mask = PrefixMask(self.tree_size + 1, max_seq_len, self.device, batch)
            # A round near the last RoPE position drafts only the positions left, as z-lab's loop does.
            self.last_position = position_limit(target.config)[0] - 1
        if method == "ar":
            self.round = self.decode  # plain decoding's round
        self.warm = not compile
        # The steps as this device runs them (compiled or eager), under the methods' names on this engine.
        self.round, self.prefill_step, self.compile_options, self.prepare_seconds = compiling.compile_steps(
            self.round, self.prefill_step, target, drafter, compile)
        self.prefill_compiled = compiling.prefill_compiled(compile, self.device.type)

    # -- requests: start, then one step per round -----------------------------------------------------------------

    def start(self, prompts: list[list[int]], seeds: list[int]) -> list[int | None]:
        """Prefill the caches with up to `batch` prompts (rows past them run a one-token dummy); returns each
        request's first new token (the prefill's one host read), None where its logits or draw were not sound."""
        n, pad = len(prompts), self.batch - len(prompts)
        self.setup_caches()
        prompts = list(prompts) + [[0]] * pad
        generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds] + [None] * pad
        self.adopt(Requests(None, torch.tensor([len(p) for p in prompts], device=self.device), generators,
                            torch.tensor([1] * n + [0] * pad, device=self.device)))
        if recurrent_target(self.target):  # a recurrent layer's state starts empty (K/V need no reset: masks)
            self.target.reset_recurrent()
        self.requests.token, ok = self.prefill(prompts)
        read = host_read(token=self.requests.token, sound=ok)[:n]
        return [r["token"] if r["sound"] else None for r in read]

    def adopt(self, requests: Requests):
        """Run `requests` from the next step on (start's, batch.move_to_smaller's, budget auto's switches)."""
        self.requests, self.guards_checked = requests, False

    def finish(self, i: int):
        """Request i has ended: its rows keep running (static shapes) but it no longer advances or draws."""
        self.requests.finish(i)

    def step(self) -> list[tuple[list[int], tuple | None]]:
        """One round for every request: per request, the new token ids (accepted drafts, then the target's next
        token; None where its logits or draws were not sound) and, with show_tree, the round's tree."""
        # Every Dynamo guard at the first step after adopt, then only those that tell graphs apart (docs/compile.md).
        r = self.requests
        with compiling.guards(self.compile_options, check=not (self.compiled and self.guards_checked)):
            rows, length, token, ok, tree, tally = self.round(r.token, r.position, *self.randomness())
        self.guards_checked = True
        # The round's one host read.
        read = host_read(rows=rows, length=length, token=token, sound=ok, tally=tally)
        self.last_lengths = [r["length"] for r in read]
        self.last_tally = None if tally is None else [r["tally"] for r in read]
        # Under CUDA graphs a later compiled call may overwrite these outputs: what outlives the step is copied.
        r.token, r.position = token.clone(), r.position + length * r.live
        # rows[i, 0] is the previous token, emitted last step
        return [(r["rows"][1:r["length"]] + [r["token"]] if r["sound"] else None,
                 None if tree is None else tuple(t[i].clone() for t in tree) + (r["length"],))
                for i, r in enumerate(read)]

    # -- one speculative round: draft -> tree -> verify -> accept -> commit ---------------------------------------

    def round(self, bonus, start, noise, accept_u, draft_noise):
        """bonus [N]: each request's last target token, not yet cached; start [N]: its committed length. Returns
        the committed rows' tokens [N, D + 1] (valid up to `length`), length [N], the next bonus [N], soundness [N]
        (Engine.pick), the trees with show_tree, and budget auto's tally (budget.tally)."""
        # The deepest a node may lie [N]: its position start + depth must not pass the limit.
        room = self.last_position - start
        # 1. Draft: one drafter pass over [bonus, MASK x L] -> per-position logits [N, D, V] (D <= L).
        draft_logits = self.draft(bonus, start)
        # 2. Tree: the budget's most probable prefixes (ddtree) or the drafter's chain (dflash), within the room.
        tokens, parents, depths, q = self.propose(draft_logits, draft_noise, room)
        # 3. Verify: [bonus, nodes...] at positions start + depth, each row seeing the prefix and its ancestors
        # (recurrent layers: each row continues the committed state along its own path; docs/recurrent_tree.md).
        rows, positions, logits, features, recurrent = self.verify(bonus, tokens, parents, depths, start)
        # 4. Accept: the longest path the target's own choices follow, and the target's next token after it.
        path, length, next_token, ok = self.accept(logits, tokens, parents, q, noise, accept_u, room)
        # 5. Commit: the path's K/V to contiguous slots after the prefix (recurrent layers: the state at its end),
        # its features to the drafter's context.
        self.commit(start, path, length, positions, features, recurrent)
        tree = (tokens, parents, depths, path) if self.spec.show_tree else None
        tally = None if self.tally is None else self.tally(self.drafter, draft_logits, room, tokens, path, length,
                                                         next_token)
        return rows.gather(1, path), length, next_token, ok, tree, tally

    def draft(self, bonus, start):
        """The drafter's pass; rows past the room are seen by none, so the rest draft as a block of room + 1."""
        room = (self.last_position - start).clamp(min=0)
        shown = torch.arange(self.drafter.block_size, device=start.device) <= room[:, None, None]
        masks = {kind: mask.set(start, self.block_allow[kind] * shown) for kind, mask in self.draft_masks.items()}
        return self.drafter.draft(bonus, start, masks, self.spec.denoise_steps, self.max_depth)

    def propose(self, draft_logits, draft_noise, room=None):
        """(tokens, parents, depths, q), each [N, nodes] in parent-first order, none deeper than room [N] (None: no
        limit); q the warped draft law of sampled chain drafts, else None. A draft that is not per-position logits
        is its drafter's to cut (the hook `propose`: dflash2.py)."""
        if not torch.is_tensor(draft_logits):
            return self.drafter.propose(self, draft_logits, draft_noise, room)
        if self.method == "ddtree":
            logq = torch.log_softmax(tempered(draft_logits, self.spec.draft_temperature), dim=-1)
            return (*within_room(*self.build_tree(beyond_room(logq, room), self.tree_size), room), None)
        n = draft_logits.shape[0]
        chain_parents = torch.arange(self.draft_len, device=draft_logits.device).expand(n, -1)  # node i under row i
        depths = chain_parents + 1
        if self.spec.draft_sampling:
            q = warp_probs(draft_logits, self.sampling)
            return (*within_room(sample(q, draft_noise), chain_parents, depths, room), q)
        return (*within_room(draft_logits.argmax(-1), chain_parents, depths, room), None)

    def verify(self, bonus, tokens, parents, depths, start):
        """The target over [bonus, nodes...] at RoPE positions start + depth, cache slots start + row, each row
        seeing the prefix and its ancestors; a recurrent target's tree_state is returned for the commit."""
        rows = torch.cat([bonus[:, None], tokens], dim=1)
        positions = start[:, None] + torch.cat([depths[:, :1] * 0, depths], dim=1)
        slots = start[:, None] + torch.arange(self.tree_size + 1, device=rows.device)
        anc = ancestor_matrix(parents, self.max_depth, dtype=torch.uint8)
        recurrent = self.target.tree_state(parents, anc, self.max_depth) if recurrent_target(self.target) else None
        logits, features = self.target(rows, positions, slots, self.verify_mask.set(start, anc),
                                       feature_layers=self.feature_layers, recurrent=recurrent,
                                       argmax=self.sampling.greedy)
        return rows, positions, logits, features, recurrent

    def accept(self, logits, tokens, parents, q, noise, accept_u, room=None):
        """(path [N, D + 1] of accepted rows from the root, length [N], next bonus [N], sound [N]): sampled chain
        drafts by min(1, p/q) with the residual, others by the target's own choices walked down the tree."""
        if self.spec.draft_sampling:
            p = warp_probs(logits, self.sampling)
            accepted, next_token = verify_chain_sampled(p, q, tokens, accept_u, noise, room)
            ok = finite_rows(logits) & finite_rows(p) & finite_rows(q)
            path = torch.arange(self.draft_len + 1, device=logits.device).expand(logits.shape[0], -1)
            return path, accepted + 1, next_token, ok
        choices, ok = self.pick(logits, noise)
        return (*walk_tree(parents, tokens, choices, self.max_depth), ok)

    def commit(self, start, path, length, positions, features, recurrent):
        compact_kv(self.target.kv_caches(), start, path)
        if recurrent_target(self.target):
            self.target.commit_recurrent(recurrent, path, length)
        picked = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
        slots = start[:, None] + torch.arange(path.shape[1], device=path.device)
        self.drafter.append_context(picked, positions.gather(1, path), slots)

    # -- plain decoding and the prefill ---------------------------------------------------------------------------

    def decode(self, token, start, noise):
        """ar's round, returning what round() does. With a drafter (budget auto's plain decoding on a recurrent
        target, whose drafter cannot catch up later), the token's features extend its context."""
        logits, features = self.target(token[:, None], start[:, None], start[:, None], self.decode_mask.set(start),
                                       feature_layers=self.feature_layers,
                                       recurrent=self.chain_state(torch.ones_like(start)), argmax=self.sampling.greedy)
        if self.drafter is not None:
            self.drafter.append_context(features, start[:, None], start[:, None])
        next_token, ok = self.pick(logits, noise)
        return token[:, None], torch.ones_like(start), next_token[:, 0], ok, None, None

    def prefill(self, prompts: list[list[int]], starts: list[int] | None = None, draw: bool = True):
        """Fill the caches with the prompts in fixed chunks, request i's from position starts[i] (default 0) on
        (padding rows' K/V land past the prompt, unread). Returns each request's first new token and whether it was
        sound; draw=False (a catch-up, whose token is unused) draws no uniform."""
        starts = starts or [0] * self.batch
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        offsets = torch.tensor(starts, device=self.device)
        chunk = prefill_chunk(self.device.type)
        if not self.prefill_compiled:  # no graph to keep fixed: only the rows the longest prompt needs
            chunk = min(chunk, max(map(len, prompts)))
        if self.prefill_mask.q_len != chunk:
            self.prefill_mask = PrefixMask(chunk, self.max_seq_len, self.device, self.batch, causal=True)
        # [chunks, N, chunk]: each chunk with strides of its own (a compiled step guards on strides)
        chunks = torch.zeros(round_up(max(map(len, prompts)), chunk) // chunk, self.batch, chunk, dtype=torch.long)
        for i, p in enumerate(prompts):
            for k in range(0, len(p), chunk):
                chunks[k // chunk, i, :len(p[k:k + chunk])] = torch.tensor(p[k:k + chunk])
        chunks, last = chunks.to(self.device), lengths - 1
        noise = self.noise(1) if draw or self.sampling.greedy else \
            torch.ones(self.batch, 1, dtype=torch.float64, device=self.device)
        token = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        ok = torch.ones(self.batch, dtype=torch.bool, device=self.device)
        for k, start in enumerate(range(0, chunks.shape[0] * chunk, chunk)):
            row = (last - start).clamp(0, chunk - 1)[:, None]
            valid = (lengths - start).clamp(0, chunk)  # rows past a prompt are padding (recurrent layers skip them)
            t, o = self.prefill_step(chunks[k], offsets + start, row, valid, noise)  # [N] starts: see PrefixMask.set
            here = (last >= start) & (last < start + chunk)  # the chunk that holds the request's last row
            token, ok = torch.where(here, t[:, 0], token), torch.where(here, o, ok)
        return token, ok

    def prefill_step(self, tokens, start, last_row, valid, noise):
        """A chunk of prompt rows at positions start [N].., the first `valid` [N] the prompt's. Returns the token
        after each request's `last_row` [N, 1] and soundness."""
        positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        mask = self.prefill_mask.set(start)
        logits, features = self.target(tokens, positions, positions, mask, logits_rows=last_row,
                                       feature_layers=self.feature_layers, recurrent=self.chain_state(valid),
                                       argmax=self.sampling.greedy)
        if self.drafter is not None:  # the prompt is the drafter's first context
            self.drafter.append_context(features, positions, positions)
        return self.pick(logits, noise)

    def chain_state(self, valid):
        """A recurrent target's state for a chain of rows (the first valid [N] of each request's), else None."""
        return self.target.chain_state(valid) if recurrent_target(self.target) else None

    def pick(self, logits, noise):
        """The target's token at each row of logits [N, R, V] (greedy: the target's argmax pair), and whether each
        request's draw was sound: every logit finite, every chosen token of positive, finite probability."""
        if self.sampling.greedy:
            tokens, finite = logits
            return tokens, finite.flatten(1).all(1)
        tokens, sound = sample_rows(logits, noise, self.sampling)
        return tokens, finite_rows(logits) & sound

    # -- randomness: drawn outside the compiled graph from each request's seeded generator ------------------------

    def draws(self, per_request) -> tuple:
        """Each running request's per_request(generator) (a tuple of tensors), stacked; ended and padding rows
        draw nothing and get ones."""
        drawn = [None if g is None else per_request(g) for g in self.requests.generators]
        example = next(d for d in drawn if d is not None)
        return tuple(torch.stack([d[k] if d is not None else torch.ones_like(example[k]) for d in drawn])
                     for k in range(len(example)))

    def noise(self, rows: int):
        """One uniform per target draw [N, rows] (sampler.sample; None when greedy)."""
        if self.sampling.greedy:
            return None
        return self.draws(lambda g: (draw_noise((rows,), g, self.device),))[0]

    def randomness(self) -> tuple:
        """The round's random inputs, drawn request by request in a fixed order (so request i's stream is its lone
        run's): a uniform per verified row, then for a sampled chain the accept and draft uniforms."""
        if self.method == "ar":
            return (self.noise(1),)
        if self.sampling.greedy:
            return None, None, None
        if not self.spec.draft_sampling:
            return self.noise(self.tree_size + 1), None, None
        return self.draws(lambda g: (draw_noise((self.tree_size + 1,), g, self.device),
                                     torch.rand(self.draft_len, generator=g, device=self.device),
                                     draw_noise((self.draft_len,), g, self.device)))

    # -- the models' caches, and the warm-up of a compiled engine -------------------------------------------------

    def setup_caches(self):
        """Size the models' caches (shared by every engine, so possibly resized since) for this engine."""
        self.target.setup_cache(self.max_seq_len, self.batch)
        if self.drafter is not None:
            self.drafter.setup_cache(self.max_seq_len, self.batch)

    def kv_caches(self):
        yield from self.target.kv_caches()
        if self.drafter is not None:
            yield from self.drafter.kv_caches()

    def warm_up_slots(self) -> int:
        """The cache slots warm_up's dummy request writes in every row: a prefill chunk, then a round's rows."""
        rows = 1 if self.drafter is None else max(self.tree_size + 1, self.drafter.block_size, self.max_depth + 1)
        return min(self.max_seq_len, max(prefill_chunk(self.device.type), 1 + rows))

    def warm_up(self) -> float:
        """Compile a new compiled engine's steps on a one-token dummy request (until recorded, under CUDA graphs);
        returns the seconds, preparation included (0: nothing to compile). The dummy's K/V are overwritten or unseen."""
        if self.warm:
            return 0.0
        t0 = time.perf_counter()
        for _ in range(compiling.graph_warmup_calls(self.compiled, self.device.type)):
            self.start([[0]], seeds=[0])
            self.step()
        self.warm = True
        return time.perf_counter() - t0 + self.prepare_seconds


_ENGINES: dict = {}
_ENGINES_LOCK = threading.Lock()  # runs on other models may pick engines from other threads


def get_engine(target, drafter, method, sampling, spec, max_seq_len, compile, batch=1, auto=()):
    """The Engine (budget auto: a budget.AutoBudget over one per candidate tree size in `auto`), cached per
    (models, settings, batch size) so repeated calls reuse compiled graphs."""
    settings = (id(target), id(drafter), method, sampling, spec, max_seq_len, compile, auto)
    key = settings + (batch,)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            # Engines of other settings go; those of other batch sizes stay, for a batch that shrinks.
            for old in [k for k in _ENGINES if k[:-1] != settings]:
                del _ENGINES[old]
            if spec.budget == "auto":  # budget.py: imported only when asked for
                _ENGINES[key] = families.family("budget").auto_engine(Engine, target, drafter, sampling, spec,
                                                                      max_seq_len, compile, batch, auto)
            else:
                _ENGINES[key] = Engine(target, drafter, method, sampling, spec, max_seq_len, compile, batch)
        return _ENGINES[key]


def prefill_chunk(device_type: str) -> int:
    return PREFILL_CHUNKS.get(device_type, PREFILL_CHUNK)


def cache_length(prompt_len: int, max_new_tokens: int, method: str, spec: Speculation, drafter,
                 auto=(), device_type: str | None = None) -> int:
    """Cache slots for a request: the prompt in whole prefill chunks (device_type None: the largest chunk), the new
    tokens and a round's scratch rows, bucketed to 1024 so similar requests share graphs."""
    scratch = 0 if method == "ar" else verify_rows(method, spec, drafter, auto) + drafter.block_size
    chunk = prefill_chunk(device_type) if device_type else max(PREFILL_CHUNK, *PREFILL_CHUNKS.values())
    need = round_up(prompt_len, chunk) + max_new_tokens + scratch + 1
    return round_up(max(need, 1024), 1024)


if __name__ == "__main__":  # the command line lives in cli.py
    import cli
    sys.exit(cli.main())
