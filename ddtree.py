"""DDTree speculative decoding: generate(), the engine's round, and the entry point of the command line (which
lives in cli.py):

    python ddtree.py --prompt "def fibonacci(n):" --budget 512

Three methods share one decoding loop:
  ar      plain autoregressive decoding, one target forward per token;
  dflash  a DFlash drafter proposes a chain of block_size - 1 tokens, the target verifies it in one forward;
  ddtree  the drafter's per-position distributions build the best tree of `budget` nodes, the target verifies
          the whole tree in one forward with an ancestor-only attention mask, and the longest accepted path is
          committed.
Every method is lossless: greedy output equals plain greedy decoding, sampled output follows the target's law.

Reading order: generate() -> Engine (its masks and compiled steps) -> Engine.step (one round, its randomness and
its one host read) -> Engine.round (five stages, each one Engine method calling into the files that own its
work: draft -> drafter.py; tree -> draft_tree.py; verify -> its mask (draft_tree.ancestor_matrix written into a
tree_attn.PrefixMask) and model.py; accept -> sampler.py; commit -> tree_attn.compact_kv, drafter.py) -> the
prefill. Around it, one concern per file: batch.py (the decoding loop, shrinking batches), budget.py (budget
auto), settings.py (Speculation, argument checks), cli.py (the command line), compiling.py (torch.compile, CUDA
graphs), cpu/ (CPU-only speed), gated_delta.py (recurrent layers, docs/recurrent_tree.md).
docs/round.md walks through one round with a picture of its tree and mask.
"""

import contextlib
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

if __name__ == "__main__":  # Ctrl-C while torch imports (seconds): exit 130 quietly; main() takes over from there
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import torch  # noqa: E402

import compiling
import batch
from batch import Requests, RequestsFailed, Result
from draft_tree import ancestor_matrix, beyond_room, build_tree, build_tree_heap, within_room
from drafter import DFlashDrafter
from families import position_limit
from sampler import Sampling, draw_noise, sample, sample_rows, tempered, verify_chain_sampled, walk_tree, warp_probs
from settings import Speculation, Target, check_models, recurrent_target, check_recalibrate, check_request, check_settings, verify_rows
from tree_attn import PrefixMask, compact_kv, round_up

# Eager FlexAttention warns that it materializes the scores: the eager path does, by design; --compile fuses it.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

# Prompt rows per target forward, fixed per device so that one compiled graph serves every prompt length: on a GPU a
# forward of a few hundred rows costs little more than one of 128 (the weights' reads dominate).
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
    """Generate up to `max_new_tokens` after `prompt_ids` (a list of ints or a 1-D integer tensor): the
    one-request case of generate_batch.

    budget: ddtree's tree size (default 512), or "auto": each round runs the candidate (plain decoding, the chain,
    or a tree of settings.AUTO_BUDGETS nodes) with the best tokens/s measured on this device (budget.py; its
    estimates in stats["auto"]; recalibrate=True measures its round times again instead of reading the stored
    calibration, docs/budget.md). temperature, top_k, top_p, min_p: how the target's tokens are drawn, warped in
    Hugging Face's order (temperature 0 = greedy). speculation: how rounds draft beyond the budget
    (settings.Speculation: draft_temperature, draft_sampling, denoise_steps, show_tree). on_tokens(list[int]) is
    called with the tokens each round emits (for streaming). A setting that cannot apply to the method (or
    top_k/top_p/min_p with greedy decoding) is a ValueError, not silently ignored; bad values are a ValueError or
    TypeError saying what is expected.

    A run holds its models until it returns (their caches hold its requests): a run on the same models from another
    thread waits for it, and one from this thread (a call from on_tokens or on_result) is a RuntimeError.

    stats: new_tokens, rounds, accepted (tokens each round emitted; their sum is new_tokens - 1, the first token
    coming from the prefill), path_lengths (the length of each round's accepted path: drafts + the target's next
    token, before a stop token or the token limit cut them), tau = mean of accepted, seconds and tokens_per_s (the
    generation alone), compile_seconds (warming up a new compiled engine, outside `seconds`), seed.
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
    """generate() for many independent requests at once: one Result per prompt, in order.

    The requests run together, up to `max_batch` at a time, each with its own committed length, tree, RoPE
    positions, cache row and random generator: request i draws its randomness from a generator seeded with
    seeds[i] in the order generate(seed=seeds[i]) draws it, so it is the same sample as the lone run (seeds:
    one int or None per prompt; None = a fresh seed). A request that ends (stop token, token limit) stops
    emitting while the rest go on. on_tokens(i, list[int]) streams request i's tokens; on_result(i, Result) gets
    request i's Result as soon as it ends (batch.run). Batches are padded to a power of two, so a few
    compiled graphs serve every batch size, and a batch moves to the next smaller power of two as its requests
    end (stats["batch"] is the size it started at). A request whose logits or draws turn non-finite ends there
    (its Result.error says so, its tokens are those emitted before) while the others go on; once every request
    has ended, batch.RequestsFailed (a ValueError naming the failed prompts) is raised holding every Result.
    Other settings and stats: as generate().
    """
    sampling, spec = check_settings(method, Sampling(temperature, top_k, top_p, min_p), budget, speculation)
    check_recalibrate(recalibrate, spec.budget)
    check_models(target, drafter, method)
    with models_in_use(target, drafter):
        prompts, seeds, stop = check_request(target, drafter, prompts, seeds, stop_ids, method, max_new_tokens,
                                             spec, compile, on_tokens, max_batch, on_result)

        renewed = []  # recalibrate: the budget-auto engines this call has calibrated again

        def engine_for(longest: int, batch_size: int):  # for a wave whose longest prompt has this length
            budgets = ()
            if spec.budget == "auto":
                import budget  # budget auto: imported only when asked for
                budgets = budget.auto_budgets()
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
    widths = {name: 1 if t.dim() == 1 else t.shape[1] for name, t in parts.items()}
    rows = torch.cat([t.long().reshape(t.shape[0], -1) for t in parts.values()], dim=1).tolist()
    out = []
    for row in rows:
        read, at = {}, 0
        for name, t in parts.items():
            read[name] = row[at] if t.dim() == 1 else row[at:at + widths[name]]
            at += widths[name]
        out.append(read)
    return out


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[N]: whether request n's part of x [N, ...] is all finite."""
    return torch.isfinite(x).flatten(1).all(1)


# ----------------------------------------------------------------------------------------------------------------
# The engine: its masks and compiled steps, the requests' steps, the five stages of a round, the prefill


class Engine:
    """One (target, drafter, method, settings, batch size): static caches sized once for `batch` requests of
    `max_seq_len` slots, masks whose tensors are updated in place, the step functions (compiled once, then reused
    by every batch whose settings and shapes match), and the requests' state between steps: each one's last
    token, its position, its generator, and whether it is still running. Every tensor of a round has the batch
    as its leading dimension; request n owns row n of every cache."""

    # -- construction ---------------------------------------------------------------------------------------------

    def __init__(self, target: Target, drafter: DFlashDrafter | None, method: str, sampling: Sampling,
                 spec: Speculation, max_seq_len: int, compile: bool | str, batch: int = 1, tally=None):
        self.target, self.drafter, self.method, self.sampling, self.spec = target, drafter, method, sampling, spec
        self.device, self.max_seq_len, self.batch, self.compiled = target.device, max_seq_len, batch, compile
        self.tally = tally  # budget auto (budget.tally): what smaller budgets and the chain would have accepted
        self.last_lengths = self.last_tally = None  # the last step's, read by budget auto
        self.requests, self.guards_checked = None, False  # the requests (adopt), and whether a step checked guards
        # The tree builder: the paper's heap when eager (host code, the readable reference, and faster outside a
        # graph), the tensor builder when compiled (fixed shapes, no host sync); they give identical trees.
        self.build_tree = build_tree if compile else build_tree_heap
        # The masks: FlexAttention BlockMasks, whose tensors each step rewrites in place.
        target.setup_cache(max_seq_len, batch)
        self.prefill_mask = PrefixMask(prefill_chunk(self.device.type), max_seq_len, self.device, batch, causal=True)
        self.decode_mask = PrefixMask(1, max_seq_len, self.device, batch)
        self.feature_layers = ()
        if drafter is not None:
            drafter.setup_cache(max_seq_len, batch)
            self.feature_layers = tuple(drafter.config.target_layer_ids)
            self.draft_len = drafter.block_size - 1  # L: draft positions per round
            self.tree_size = spec.budget if method == "ddtree" else self.draft_len  # B: the chain is a tree of L
            # D: a tree of B nodes is at most B deep, so a small budget drafts, walks and commits fewer rows.
            # Budget auto's tally reads the chain's L drafts and paths as long.
            self.max_depth = self.draft_len if tally else min(self.tree_size, self.draft_len)
            # The block sees itself bidirectionally, or causally, or within a sliding window, as each drafter
            # layer says (docs/checkpoints.md): one mask per kind; with draft_window W, of the committed context
            # only its last W tokens (every kind: a sliding layer's window intersects it).
            self.draft_masks = {kind: PrefixMask(drafter.block_size, max_seq_len, self.device, batch, *kind,
                                                 context=spec.draft_window)
                                for kind in drafter.config.mask_kinds}
            self.block_allow = {kind: mask.allow.clone() for kind, mask in self.draft_masks.items()}
            self.verify_mask = PrefixMask(self.tree_size + 1, max_seq_len, self.device, batch)
            # The last RoPE position a request may reach (families.position_limit): a round near it drafts only the
            # positions left, as z-lab's loop shortens its last blocks, so that every method reaches the limit.
            self.last_position = position_limit(target.config)[0] - 1
        if method == "ar":
            self.round = self.decode  # plain decoding's round
        self.warm = not compile
        # The round and prefill step as this device runs them, compiled or eager, under the methods' names on this
        # engine; with the round's inductor options and the seconds spent preparing them (counted as compiling).
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
        """Run `requests` from the next step on (Engine.start's, or those another engine of these settings ran:
        batch.move_to_smaller, budget auto's switches). Its first step checks every guard of the compiled round."""
        self.requests, self.guards_checked = requests, False

    def finish(self, i: int):
        """Request i has ended: it stops advancing (its rows keep running in the batch, in scratch slots past its
        committed length, and their results are dropped) and stops drawing randomness."""
        self.requests.finish(i)

    def step(self) -> list[tuple[list[int], tuple | None]]:
        """One round for every request: per request, the new token ids (accepted drafts, then the target's own
        next token; for ar just that token; None where its logits or draws were not sound) and, with show_tree, the
        round's tree. Makes the round's one host read."""
        # Dynamo's guards (docs/compile.md, "Guards checked once per run"): all of them at the first step after the
        # requests were adopted; after it only those that tell the compiled graphs apart.
        r = self.requests
        with compiling.guards(self.compile_options, check=not (self.compiled and self.guards_checked)):
            rows, length, token, ok, tree, tally = self.round(r.token, r.position, *self.randomness())
        self.guards_checked = True
        # The one host read: per request, its committed rows, their count, the next token, whether its draws were
        # sound, and for budget auto the tally.
        read = host_read(rows=rows, length=length, token=token, sound=ok, tally=tally)
        self.last_lengths = [r["length"] for r in read]
        self.last_tally = None if tally is None else [r["tally"] for r in read]
        # Under CUDA graphs a call's outputs live in a memory pool that any later compiled call (this engine's or
        # another's: a catch-up, a switch of budget auto) may overwrite: what outlives the step is copied here, at
        # the store (tests/test_graph_pool.py emulates the pool on the CPU).
        r.token, r.position = token.clone(), r.position + length * r.live
        # rows[i, 0] is the previous token, emitted last step
        return [(r["rows"][1:r["length"]] + [r["token"]] if r["sound"] else None,
                 None if tree is None else tuple(t[i].clone() for t in tree) + (r["length"],))
                for i, r in enumerate(read)]

    # -- one speculative round: draft -> tree -> verify -> accept -> commit ---------------------------------------

    def round(self, bonus, start, noise, accept_u, draft_noise):
        """bonus: [N] the last token the target chose for each request, not yet in its cache; start: [N], its
        position (= the request's committed length). Returns the committed rows' tokens [N, D + 1] (D = self.max_depth,
        the deepest the tree can go; valid up to `length`), length [N], the next bonus [N], whether each request's
        logits and draws were sound (Engine.pick), the trees with show_tree, and for budget auto what smaller
        budgets and the chain would have accepted (budget.tally)."""
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
        tally = None if self.tally is None else self.tally(self.chain(draft_logits, room), tokens, path, length,
                                                         next_token)
        return rows.gather(1, path), length, next_token, ok, tree, tally

    def draft(self, bonus, start):
        """The drafter's pass; the block's rows past the room (round()'s) are seen by none (they are not drafted),
        so the rows within it draft what a block of room + 1 rows drafts."""
        room = (self.last_position - start).clamp(min=0)
        shown = torch.arange(self.drafter.block_size, device=start.device) <= room[:, None, None]
        masks = {kind: mask.set(start, self.block_allow[kind] * shown) for kind, mask in self.draft_masks.items()}
        return self.drafter.draft(bonus, start, masks, self.spec.denoise_steps, self.max_depth)

    def propose(self, draft_logits, draft_noise, room=None):
        """(tokens, parents, depths, q), each [N, nodes]: the nodes in parent-first order, none deeper than the
        room [N] (padding in their place; None: no limit within reach, for a stage timed alone); q the warped
        draft law when the chain's drafts are sampled (for the min(1, p/q) rule), else None. A draft that is not
        per-position logits is its drafter's to cut, in the same ways (the hook `propose`: DFlash 2's lattice,
        dflash2.py)."""
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

    def chain(self, draft_logits, room=None):
        """The drafter's greedy chain [N, D] within the room (-1, no token, past it): budget auto's tally of what
        the chain would accept (a draft not of per-position logits: its drafter's chain, with propose)."""
        chain = draft_logits.argmax(-1) if torch.is_tensor(draft_logits) else self.drafter.chain(draft_logits)
        if room is None:
            return chain
        return torch.where(torch.arange(chain.shape[-1], device=chain.device) < room[:, None], chain, -1)

    def verify(self, bonus, tokens, parents, depths, start):
        """The target over [bonus, nodes...]: RoPE positions start + depth, cache slots start + row, each row seeing
        the committed prefix and its ancestors (the verify mask; a recurrent target's layers take the same tree as
        its tree_state, returned for the commit)."""
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
        """(path [N, D + 1] of accepted rows from the root, length [N], next bonus [N], sound [N]), by the rule that
        keeps the target's law: sampled chain drafts by min(1, p/q) with the residual, deterministic drafts by the
        target's own choices (argmax or a warped sample at every row) walked down the tree."""
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
        # The drafter's context K/V for the committed path (the first half of its forward; DFlash's own code
        # computes it inside the drafter pass), in the slots after `start`.
        picked = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
        slots = start[:, None] + torch.arange(path.shape[1], device=path.device)
        self.drafter.append_context(picked, positions.gather(1, path), slots)

    # -- plain decoding and the prefill ---------------------------------------------------------------------------

    def decode(self, token, start, noise):
        """ar's round: the target over each request's last token; returns what round() does (the one committed row,
        length 1, the next token, soundness, no tree, no tally). With a drafter (budget auto's plain decoding on a
        recurrent target, whose drafter cannot catch up later), the token's features extend its context."""
        logits, features = self.target(token[:, None], start[:, None], start[:, None], self.decode_mask.set(start),
                                       feature_layers=self.feature_layers,
                                       recurrent=self.chain_state(torch.ones_like(start)), argmax=self.sampling.greedy)
        if self.drafter is not None:
            self.drafter.append_context(features, start[:, None], start[:, None])
        next_token, ok = self.pick(logits, noise)
        return token[:, None], torch.ones_like(start), next_token[:, 0], ok, None, None

    def prefill(self, prompts: list[list[int]], starts: list[int] | None = None, draw: bool = True):
        """Fill the caches with the prompts in fixed chunks, all requests side by side, request i's from position
        starts[i] (default 0) on (a shorter prompt's rows past its end are padding: their K/V land beyond the
        prompt, where nothing reads them before they are overwritten). Returns each request's first new token
        (from its last prompt row) and whether it was sound. The target's draw uses one uniform per request,
        drawn once (draw=False: a catch-up, whose token is not used, draws nothing)."""
        starts = starts or [0] * self.batch
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        offsets = torch.tensor(starts, device=self.device)
        chunk = prefill_chunk(self.device.type)
        if not self.prefill_compiled:  # no graph to keep fixed: only the rows the longest prompt needs
            chunk = min(chunk, max(map(len, prompts)))
        if self.prefill_mask.q_len != chunk:
            self.prefill_mask = PrefixMask(chunk, self.max_seq_len, self.device, self.batch, causal=True)
        # [chunks, N, chunk]: each chunk's rows with strides of their own (a compiled step guards on strides, and
        # a slice of [N, chunks x chunk] rows has the longest prompt's, even for N = 1)
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
        """A chunk of prompt rows of every request at positions start.. (the prefill mask's rows), of which the
        first `valid` [N] are the prompt's. Returns the token after each request's `last_row` [N, 1]."""
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
        """The target's token at each row of float32 logits [N, R, V] (when greedy, the target's argmax pair
        instead: Target.__call__'s argmax), and whether each request's draw was sound: every logit finite and
        every chosen token of positive, finite probability (no silent token 0 from a NaN distribution)."""
        if self.sampling.greedy:
            tokens, finite = logits
            return tokens, finite.flatten(1).all(1)
        tokens, sound = sample_rows(logits, noise, self.sampling)
        return tokens, finite_rows(logits) & sound

    # -- randomness: drawn outside the compiled graph from each request's seeded generator ------------------------

    def draws(self, per_request) -> tuple:
        """Each running request's per_request(generator) (a tuple of fixed-shape tensors), stacked along the batch;
        ended requests and padding rows draw nothing and get ones (valid noise, never used)."""
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
        """The round's random inputs; each request draws from its own generator, in a fixed order: one uniform
        per verified row (the target's draws), then, for a sampled chain, the accept uniforms and the drafts'
        uniforms. Drawn request by request, so request i's stream is its lone run's."""
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
        """Size the models' caches for this engine. They are the models', shared by every engine: another engine,
        or a caller, may have resized them since (a no-op otherwise; a smaller batch takes the first rows)."""
        self.target.setup_cache(self.max_seq_len, self.batch)
        if self.drafter is not None:
            self.drafter.setup_cache(self.max_seq_len, self.batch)

    def kv_caches(self):
        yield from self.target.kv_caches()
        if self.drafter is not None:
            yield from self.drafter.kv_caches()

    def warm_up_slots(self) -> int:
        """The cache slots warm_up's dummy request writes in every row: a prefill chunk, then a round's rows after
        its one-token prompt (the verified rows, the drafter's block, the committed path)."""
        rows = 1 if self.drafter is None else max(self.tree_size + 1, self.drafter.block_size, self.max_depth + 1)
        return min(self.max_seq_len, max(prefill_chunk(self.device.type), 1 + rows))

    def warm_up(self) -> float:
        """Compile a new compiled engine's steps by running each once on a one-token dummy request; returns the
        seconds it took (0 when there is nothing to compile), so that a run's tokens/s counts generation alone;
        compile_steps' preparation, when this engine made one, counts too. The dummy's K/V lie in slots that the
        real prefill overwrites or that no mask lets a row see. Under CUDA graphs each step runs until its graph is
        recorded (graph_warmup_calls), so that no user's round pays a capture."""
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


def get_engine(target, drafter, method, sampling, spec, max_seq_len, compile, batch=1,
               auto=()):
    """The Engine (budget auto: a budget.AutoBudget over one Engine per candidate) of these models and settings,
    cached per (models, settings, batch size) so repeated calls reuse caches and compiled graphs. auto: the tree
    sizes of a budget-auto engine."""
    settings = (id(target), id(drafter), method, sampling, spec, max_seq_len, compile, auto)
    key = settings + (batch,)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            # Engines of other settings go (a stale engine holds masks, compiled graphs, and budget auto's buffers);
            # those of other batch sizes stay, for a batch that shrinks as its requests end. The caches are the
            # models'.
            for old in [k for k in _ENGINES if k[:-1] != settings]:
                del _ENGINES[old]
            if spec.budget == "auto":
                import budget  # budget auto: imported only when asked for
                engines = {c: Engine(target, candidate_drafter, candidate_method, sampling, candidate_spec,
                                     max_seq_len, compile, batch, tally)
                           for c, (candidate_method, candidate_drafter, candidate_spec, tally)
                           in budget.auto_candidates(target, drafter, spec, auto).items()}
                _ENGINES[key] = budget.AutoBudget(engines, drafter.block_size)
            else:
                _ENGINES[key] = Engine(target, drafter, method, sampling, spec, max_seq_len, compile, batch)
        return _ENGINES[key]


@dataclass
class InUse:
    """Which thread runs on a model: its caches hold that run's requests until it returns."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: int | None = None  # the thread's ident


_IN_USE: "weakref.WeakKeyDictionary[torch.nn.Module, InUse]" = weakref.WeakKeyDictionary()
_IN_USE_LOCK = threading.Lock()


@contextlib.contextmanager
def models_in_use(*models):
    """Hold the models for one run: every engine on them shares their caches, which hold the run's requests. A run
    on them from another thread waits until this one returns; from this thread (on_tokens, on_result) it would
    overwrite this run's requests, and is refused. Models are taken in one fixed order, so two runs that share
    one of their models cannot each wait for the other."""
    me = threading.get_ident()
    with _IN_USE_LOCK:
        marks = [_IN_USE.setdefault(m, InUse()) for m in sorted({id(m): m for m in models if m is not None}.values(),
                                                                 key=id)]
    if any(mark.owner == me for mark in marks):
        raise RuntimeError("generate() is already running on these models in this thread (called from on_tokens "
                           "or on_result?): their caches hold that run's requests; call it once the run returns, "
                           "or load a second copy of the models")
    held = []
    try:
        for mark in marks:
            mark.lock.acquire()
            mark.owner = me
            held.append(mark)
        yield
    finally:
        for mark in reversed(held):
            mark.owner = None
            mark.lock.release()


def prefill_chunk(device_type: str) -> int:
    return PREFILL_CHUNKS.get(device_type, PREFILL_CHUNK)


def cache_length(prompt_len: int, max_new_tokens: int, method: str, spec: Speculation, drafter,
                 auto=(), device_type: str | None = None) -> int:
    """Cache slots for a request: the prompt (in whole prefill chunks of the device's size; of the largest any
    device uses when device_type is None), the new tokens, and a round's scratch rows past them (the verified rows
    and the drafter's block); bucketed to 1024 so similar requests share graphs."""
    scratch = 0 if method == "ar" else verify_rows(method, spec, drafter, auto) + drafter.block_size
    chunk = prefill_chunk(device_type) if device_type else max(PREFILL_CHUNK, *PREFILL_CHUNKS.values())
    need = round_up(prompt_len, chunk) + max_new_tokens + scratch + 1
    return round_up(max(need, 1024), 1024)


# ----------------------------------------------------------------------------------------------------------------
# Command line


if __name__ == "__main__":  # the command line lives in cli.py
    import cli
    sys.exit(cli.main())
