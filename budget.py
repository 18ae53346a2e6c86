"""--budget auto: the fastest lossless setting for this device and this pair, measured rather than guessed.

The candidates are plain decoding ("ar"), the DFlash chain ("chain") and DDTree trees of AUTO_BUDGETS nodes. Each
round runs the candidate with the best expected tokens per second, tokens per round over seconds per round:

- Seconds per round are measured. A calibration times every candidate's round on this device, compiled or eager
  as the run is, at the run's batch size and cache size, once: the curve is cached on disk (cache_file()) and
  reused by later runs. During a run, the rounds a candidate runs replace its calibrated time, and candidates not
  run yet are scaled by how far the measured ones moved from their calibration (the context has grown, the
  machine is busier).
- Tokens per round are estimated from the run's own rounds. Plain decoding emits one. The best-first trees are
  nested (the tree of B' nodes is the first B' nodes of the tree of B >= B'), so one verified tree tells what
  every smaller budget would have accepted in that round (accepted_within), and what the chain would
  have (chain_accepted: the chain is the trees' most probable spine). Rounds at the chosen budget keep
  every smaller candidate's estimate current; larger ones are probed: the first round of a run at the largest
  tree that could still win, later rounds at the next size up from the best, whenever probes have taken less
  than PROBE_SHARE of the run's time. A run starts from the previous run's estimates (of the same engine), weighted
  as PRIOR_ROUNDS rounds.
- A candidate "could still win" while its round, accepting every draft (block_size tokens), would beat the best
  estimate so far. The same bound prunes the calibration: trees whose round is too slow to beat plain decoding
  even when everything is accepted are not timed, compiled or run (a bigger tree costs at least as much).

Lossless: every round, whichever candidate runs it, commits tokens with the target's law given what is committed
(each method is lossless from any state); the choice depends only on the past and on timings, never on the
round's own randomness. Probe rounds are ordinary rounds: their tokens count, and their time is the run's.
"""

import contextlib
import functools
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, replace

import torch

import tp
from settings import AUTO_BUDGETS, Speculation

PROBE_SHARE = 0.05  # probe rounds take at most this share of a run's time (after its first round, a probe)
EMA_ROUNDS = 16  # an estimate averages about this many recent observations
PRIOR_ROUNDS = 4  # a new run of the engine starts from the last run's estimates, weighted as this many rounds
CALIBRATE_ROUNDS = 6  # timed rounds per candidate and pass (after two untimed ones)
CALIBRATE_PASSES = 3  # passes over the candidates; a candidate's cost is the median of its timed rounds
CALIBRATE_PROMPT = 256  # prompt tokens of the calibration's dummy requests


def cache_file() -> str:
    """Where calibrations are kept: $DDTREE_CACHE_DIR, else $XDG_CACHE_HOME/ddtree, else ~/.cache/ddtree."""
    root = os.environ.get("DDTREE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ddtree")
    return os.path.join(root, "costs.json")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{device.type}: {name}, {torch.get_num_threads()} threads"


# Raised when a change to the engine moves its own round costs, so that calibrations made before are measured
# again (docs/budget.md says which changes raised it).
COSTS_VERSION = 3


def cost_key(engine) -> str:
    """What a round's time depends on: device, torch, dtype, both models' shapes, compile mode, batch, cache
    slots, the sampling settings (warping costs time), the drafter passes per round, COSTS_VERSION, and under
    tensor parallel the number of ranks."""
    target, drafter = engine.target, engine.drafter
    key = dict(version=COSTS_VERSION, device=device_name(engine.device), torch=torch.__version__,
               dtype=str(target.dtype), target=asdict(target.config), drafter=asdict(drafter.config),
               compile=engine.compiled, batch=engine.batch, slots=engine.max_seq_len,
               sampling=asdict(engine.sampling), denoise_steps=engine.spec.denoise_steps)
    if tp.enabled():  # (a one-device key has no ranks, so the calibrations on file for it keep matching it)
        key["ranks"] = tp.world_size()
    return json.dumps(key, sort_keys=True, default=str)


def load_costs(key: str) -> dict | None:
    """This engine's calibration from the cache file, or None: none yet, or a file that cannot be read or used (one
    warning naming it; the run calibrates again and replaces it). A cache never stops a run."""
    path = cache_file()
    everything = read_cache(path)
    costs = everything.get(key)
    if costs is None:
        return None
    if not (isinstance(costs, dict) and all(is_cost(v, untimed=c != "ar") for c, v in costs.items())):
        warnings.warn(f"ignoring the calibration in {path}: its round times are not positive numbers; "
                      f"calibrating again")
        return None
    return costs


def is_cost(value, untimed: bool = True) -> bool:
    """A calibrated round time: positive seconds, or (untimed) None for a candidate that was not timed (pruned), never
    plain decoding's: every other candidate is measured against it."""
    if value is None:
        return untimed
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def read_cache(path: str) -> dict:
    """The cache file's calibrations ({} when there is none, or with one warning when it cannot be used)."""
    if os.path.exists(path) and not os.path.isfile(path):  # a directory, a FIFO (whose open would wait for a
        return {}  # writer): save_costs says it cannot write there, once
    try:
        with open(path) as f:
            everything = json.load(f)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # none; a path that cannot hold one
        return {}  # (save_costs says so, once)
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the cost cache {path}: {e}; calibrating again")
        return {}
    if not isinstance(everything, dict):
        warnings.warn(f"ignoring the cost cache {path}: it holds {type(everything).__name__}, not calibrations; "
                      f"calibrating again")
        return {}
    return everything


def save_costs(key: str, costs: dict):
    """Add one calibration to the cache file (written whole to a temporary file, then renamed into place, so a
    reader never sees half a file). Where it cannot be written: one warning, and the calibration serves this run."""
    path = cache_file()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_costs has said what was wrong with the old file
        everything = read_cache(path)
    everything[key] = costs
    temporary = f"{path}.{os.getpid()}"
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            raise OSError("not a regular file")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "w") as f:
            json.dump(everything, f, indent=1)
        os.replace(temporary, path)
    except OSError as e:
        warnings.warn(f"cannot write the cost cache {path} ({e}): this run keeps its calibration in memory "
                      f"(set DDTREE_CACHE_DIR to a writable directory)")
        with contextlib.suppress(OSError):
            os.remove(temporary)


def name(candidate) -> str:
    """"ar", "chain" or the budget, as JSON keys and stats spell them."""
    return str(candidate)


def round_times(engine, prompt_len: int) -> list[float]:
    """Seconds of CALIBRATE_ROUNDS of `engine`'s rounds (compiled first if it compiles), on dummy requests
    filling its batch, after two untimed rounds."""
    engine.warm_up()
    engine.start([[1] * prompt_len] * engine.batch, seeds=list(range(engine.batch)))
    times = []
    for i in range(2 + CALIBRATE_ROUNDS):
        t0 = time.perf_counter()
        engine.step()
        times.append(tp.slowest(time.perf_counter() - t0, engine.device))
    return times[2:]


def calibrate(engines: dict, block_size: int, prompt_len: int) -> dict:
    """Seconds per round for each candidate: the median over CALIBRATE_PASSES passes over the candidates in turn
    (so that a slow moment of the machine hits them all alike), in order ar, chain, budgets ascending. A budget
    whose round cannot beat plain decoding even when every draft is accepted ends the curve: it and the larger
    budgets are None (not viable). The first pass already stops at a budget twice too slow, so that the largest
    trees are not timed (nor compiled) for nothing."""
    times = {c: [] for c in engines}

    def too_slow(candidate, margin):
        rate_if_all_accepted = block_size / statistics.median(times[candidate])
        return isinstance(candidate, int) and rate_if_all_accepted * margin <= 1 / statistics.median(times["ar"])

    for passes in range(CALIBRATE_PASSES):
        for candidate, engine in engines.items():
            if times[candidate] is None or passes == 0 and None in times.values():
                times[candidate] = None
                continue
            times[candidate] += round_times(engine, prompt_len)
            if passes == 0 and too_slow(candidate, margin=2):
                times[candidate] = None
    costs, ended = {}, False
    for candidate, t in times.items():
        ended = ended or t is None or too_slow(candidate, margin=1)
        costs[name(candidate)] = None if ended and isinstance(candidate, int) else statistics.median(t)
    return costs


def auto_budgets() -> tuple:
    """The tree sizes budget auto chooses among: AUTO_BUDGETS, whatever the request (a round near the position limit
    drafts fewer rows, so every verify fits)."""
    return AUTO_BUDGETS


def auto_candidates(target, drafter, spec, budgets) -> dict:
    """The candidates, as candidate -> (method, drafter, Speculation, tally) of its engine (all over the same
    caches): plain decoding, the chain, and a tree per budget that also tallies every smaller budget and the chain.
    Plain decoding runs without the drafter (its context catches up when a speculative round follows), except on a
    recurrent target: there it keeps the drafter's context as it decodes (ddtree.Engine.decode), since a catch-up
    would run committed tokens through the recurrent state twice."""
    candidates = {"ar": ("ar", drafter if target.recurrent else None, Speculation(), None),
                  "chain": ("dflash", drafter, Speculation(denoise_steps=spec.denoise_steps), None)}
    for b in budgets:
        smaller = tuple(x for x in budgets if x <= b)
        candidates[b] = ("ddtree", drafter, replace(spec, budget=b), functools.partial(tally, smaller))
    return candidates


def catch_up(engine, tokens: list[list[int]], starts: list[int]):
    """The target over committed tokens the drafter has not seen (rounds of plain decoding run without it), request
    i's from position starts[i], to extend the drafter's context (an empty list: a dummy row past the committed
    tokens). The target's K/V there are written again, with the same values up to rounding; nothing is drawn from
    the requests' generators. Never for a recurrent target, whose state would take the tokens twice."""
    if engine.target.recurrent:
        raise RuntimeError("a catch-up would run committed tokens through the target's recurrent state again")
    engine.prefill([t or [0] for t in tokens], starts, draw=False)


class Estimate:
    """A running mean of the last ~EMA_ROUNDS observations (the plain mean until then)."""

    def __init__(self):
        self.value, self.count = None, 0

    def add(self, x: float):
        self.count += 1
        self.value = x if self.value is None else self.value + (x - self.value) / min(self.count, EMA_ROUNDS)


class AutoBudget:
    """An engine that runs each round on the candidate with the best expected tokens/s: the Engine interface
    (warm_up, start, step, finish) over one Engine per candidate, all sharing the models' caches. engines: candidate
    -> Engine, in the order ar, chain, budgets ascending; every tree engine tallies the smaller budgets."""

    def __init__(self, engines: dict, block_size: int):
        self.engines, self.block_size = engines, block_size
        self.any = engines["chain"]  # any engine with the drafter: what the calibration's key is made of
        self.key = cost_key(self.any)
        self.calibrated, self.viable, self.warm = None, [], False
        self.measured = {c: Estimate() for c in engines}  # seconds per round, measured in runs
        self.tau = {c: Estimate() for c in engines}  # drafts accepted per round and running request

    # -- the Engine interface --------------------------------------------------------------------------------------

    def warm_up(self, recalibrate: bool = False) -> float:
        """Load this device's calibration (or make it, or with `recalibrate` make it again: seconds reported as
        stats' calibrate_seconds) and compile the viable candidates; returns the seconds spent, which the run's
        tokens/s leaves out as it does a compile."""
        if self.warm and not recalibrate:
            return 0.0
        t0 = time.perf_counter()
        # tensor parallel: rank 0's file decides (the ranks' files may differ), and rank 0 alone writes
        self.calibrated = None if recalibrate else tp.same_on_every_rank([load_costs(self.key)])[0]
        self.calibrated_now = self.calibrated is None or set(self.calibrated) != {name(c) for c in self.engines}
        if self.calibrated_now:
            prompt_len = max(1, min(CALIBRATE_PROMPT, self.any.max_seq_len - self.scratch()))
            self.calibrated = calibrate(self.engines, self.block_size, prompt_len)
            if tp.rank() == 0:
                save_costs(self.key, self.calibrated)
        self.calibrate_seconds = time.perf_counter() - t0 if self.calibrated_now else 0.0
        ar = self.calibrated["ar"]
        self.viable = [c for c in self.engines if c == "ar" or (
            self.calibrated[name(c)] is not None and self.block_size / self.calibrated[name(c)] > 1 / ar)]
        for c in self.viable:
            self.engines[c].warm_up()
        self.warm = True
        return time.perf_counter() - t0

    def scratch(self) -> int:
        """Slots the calibration's rounds need past its prompt: a verify and a block per round, and what they
        commit."""
        return max(e.tree_size + 1 for e in self.engines.values() if e.method != "ar") + \
            (2 + CALIBRATE_ROUNDS + 1) * self.block_size

    def start(self, prompts, seeds):
        self.schedule, self.seconds = [], 0.0
        self.probe_rounds, self.probe_seconds, self.probe_overhead, self.catch_up_seconds = 0, 0.0, 0.0, 0.0
        for estimate in self.tau.values():  # the last run's, as a prior that this run's rounds soon outweigh
            estimate.count = min(estimate.count, PRIOR_ROUNDS)
        # The candidates share the models' caches. Plain decoding starts when no speculative candidate is viable,
        # and it sizes only the target's: another engine may have left the drafter's at another batch size.
        self.any.setup_caches()
        # A speculative engine prefills (the prompt is the drafter's first context), unless none is viable.
        self.current = self.engines[next((c for c in self.viable if c != "ar"), "ar")]
        first = self.current.start(prompts, seeds)
        # Each request's tokens (prompt, then what it emitted; the last one is the next round's input, not yet in
        # any cache) while it runs, and where the drafter's context stops when plain decoding has run without it.
        self.history = [list(p) + [t] for p, t in zip(prompts, first)]
        self.drafter_behind = None if self.current.drafter is not None else [0] * len(prompts)
        return first

    def finish(self, i: int):
        self.current.finish(i)

    def step(self):
        """One round on the chosen candidate (Engine.step's result); its time and acceptance update the estimates."""
        candidate, probing = self.choose()
        engine = self.engines[candidate]
        running = [g is not None for g in self.current.requests.generators]
        catch_up = self.keep_drafter_context(engine, running)
        engine.adopt(self.current.requests)  # the caches are shared: the requests are all there is to hand over
        t0 = time.perf_counter()
        new = engine.step()
        seconds = tp.slowest(time.perf_counter() - t0, engine.device)
        self.current = engine
        # A request whose draws were not sound (None) ends now, and its round tells nothing.
        running = [r and tokens is not None for r, (tokens, _) in zip(running, new)]
        for i, (tokens, _) in enumerate(new[:len(self.history)]):
            if running[i]:
                self.history[i] += tokens
        self.schedule.append(name(candidate))
        if not any(running):  # the batch's last round
            return new
        self.observe(candidate, engine, running, seconds)
        # Catching up to switch back to speculation is exploring too: it counts against PROBE_SHARE.
        self.seconds += seconds + catch_up
        self.catch_up_seconds += catch_up
        self.probe_seconds += catch_up
        if probing:
            self.probe_rounds += 1
            self.probe_seconds += seconds
            best = self.best()  # what the probe's tokens would have cost on the best candidate
            self.probe_overhead += seconds - self.mean(engine.last_lengths, running) * self.cost(best) / \
                self.tokens(best)
        return new

    def keep_drafter_context(self, engine, running) -> float:
        """Plain decoding runs without the drafter (its round is then plain decoding's own, at its own cost); the
        drafter's context falls behind, and catches up, in one pass of the target over the tokens it missed
        (catch_up), when a speculative round comes next. Returns the seconds the catch-up took."""
        positions = [len(h) - 1 for h in self.history]  # tokens in the caches, per request
        if engine.drafter is None and self.drafter_behind is None:
            self.drafter_behind = positions
        if engine.drafter is None or self.drafter_behind is None:
            return 0.0
        t0 = time.perf_counter()
        missed = [h[b:p] if r else [] for h, b, p, r in zip(self.history, self.drafter_behind, positions, running)]
        starts = [b if m else p for m, b, p in zip(missed, self.drafter_behind, positions)]
        pad = engine.batch - len(missed)  # rows past the requests: a dummy row each
        catch_up(engine, missed + [[]] * pad, starts + [0] * pad)
        self.drafter_behind = None
        return tp.slowest(time.perf_counter() - t0, engine.device)

    def choose(self):
        """(candidate, whether it is a probe): the best estimate, or a probe of a larger candidate that could still
        win, in the run's first round and whenever probes have taken less than PROBE_SHARE of the run's time."""
        if not self.schedule or self.probe_seconds < PROBE_SHARE * self.seconds:
            probe = self.probe_candidate(first=not self.schedule)
            if probe is not None:
                return probe, True
        return self.best(), False

    # -- estimates and the choice ----------------------------------------------------------------------------------

    @staticmethod
    def mean(values, running) -> float:
        picked = [v for v, r in zip(values, running) if r]
        return sum(picked) / len(picked)

    def observe(self, candidate, engine, running, seconds):
        """Fold one round into the estimates: its time into its candidate's cost; its acceptance into its own
        estimate and, for a tree, every smaller budget's and the chain's."""
        self.measured[candidate].add(seconds)
        if candidate == "chain":
            self.tau["chain"].add(self.mean(engine.last_lengths, running) - 1)
        elif candidate != "ar":
            smaller = tuple(c for c in self.engines if isinstance(c, int) and c <= candidate)  # auto_candidates'
            for j, b in enumerate(smaller + ("chain",)):
                self.tau[b].add(self.mean([t[j] for t in engine.last_tally], running))

    def cost(self, candidate) -> float:
        """Seconds per round: this run's measurement, else the calibration scaled by how far this run's measured
        candidates moved from theirs."""
        if self.measured[candidate].value is not None:
            return self.measured[candidate].value
        ratios = [e.value / self.calibrated[name(c)] for c, e in self.measured.items()
                  if e.value is not None and self.calibrated[name(c)] is not None]
        return self.calibrated[name(candidate)] * (statistics.median(ratios) if ratios else 1.0)

    def tokens(self, candidate) -> float | None:
        """Expected tokens per round (accepted drafts and the target's own token); None while unknown."""
        if candidate == "ar":
            return 1.0
        value = self.tau[candidate].value
        return None if value is None else 1.0 + value

    def best(self):
        known = [c for c in self.viable if self.tokens(c) is not None]
        return max(known, key=lambda c: self.tokens(c) / self.cost(c))

    def probe_candidate(self, first: bool):
        """The candidate to probe, if any: a tree larger than the best (whose own rounds inform every smaller
        candidate) that could still beat the best were it to accept every draft. The first probe of a run takes the
        largest such tree, which informs every candidate that could win; later ones the next size up from the best,
        which costs the least and lets the choice climb while bigger trees pay off."""
        best = self.best()
        rate = self.tokens(best) / self.cost(best)
        larger = [c for c in self.viable if isinstance(c, int) and (not isinstance(best, int) or c > best)]
        within_reach = [c for c in larger if self.block_size / self.cost(c) > rate]
        if not within_reach:
            return None
        return within_reach[-1] if first else within_reach[0]

    def curve(self) -> dict:
        """The calibration as scripts print it: per candidate, seconds per round (None: not timed, or too slow to
        beat plain decoding), the tokens/s it would reach accepting every draft, and whether it is viable."""
        return {name(c): dict(round_s=self.calibrated[name(c)], viable=c in self.viable,
                              tokens_per_s_if_all_accepted=None if self.calibrated[name(c)] is None else
                              (1 if c == "ar" else self.block_size) / self.calibrated[name(c)])
                for c in self.engines}

    def curve_table(self) -> str:
        """curve() as a table."""
        lines = [f"{'candidate':>9s} {'ms/round':>9s} {'tokens/s if all accepted':>25s}  viable"]
        for c, row in self.curve().items():
            if row["round_s"] is None:
                lines.append(f"{c:>9s} {'-':>9s} {'-':>25s}  no: cannot beat plain decoding (or a smaller tree "
                             f"cannot)")
            else:
                lines.append(f"{c:>9s} {1e3 * row['round_s']:9.2f} {row['tokens_per_s_if_all_accepted']:25.1f}  "
                             f"{'yes' if row['viable'] else 'no: cannot beat plain decoding'}")
        return "\n".join(lines)

    def report(self) -> dict:
        """stats["auto"]: the choice, each candidate's estimates (tokens per round and tokens/s per request, round
        time this run and calibrated), the rounds each ran, the probing and its overhead (its rounds' time less
        what the best candidate would have taken for their tokens), and the calibration."""
        counts = {c: self.schedule.count(c) for c in dict.fromkeys(self.schedule)}
        best = self.best()
        return dict(
            choice=name(best), rounds_per_candidate=counts, schedule=self.schedule,
            probe_rounds=self.probe_rounds, probe_seconds=self.probe_seconds,
            probe_overhead_seconds=self.probe_overhead,
            catch_up_seconds=self.catch_up_seconds,
            calibrated_now=self.calibrated_now, calibrate_seconds=self.calibrate_seconds, cost_file=cache_file(),
            candidates={name(c): dict(
                viable=c in self.viable, tokens_per_round=self.tokens(c),
                round_ms=None if self.calibrated[name(c)] is None else 1e3 * self.cost(c),
                calibrated_ms=None if self.calibrated[name(c)] is None else 1e3 * self.calibrated[name(c)],
                tokens_per_s=None if self.tokens(c) is None or self.calibrated[name(c)] is None
                else self.tokens(c) / self.cost(c))
                for c in self.engines})


def tally(budgets: tuple, chain, tokens, path, length, next_token) -> torch.Tensor:
    """A tree round's observation for budget auto, made inside the compiled round (Engine's `tally`):
    [N, len(budgets) + 1], the drafts each of `budgets` and the chain (the drafter's greedy drafts [N, D]) would
    have accepted this round, read off this one verified tree (the trees are nested)."""
    within = accepted_within(path, length, budgets)
    chain = chain_accepted(chain, tokens, path, length, next_token)
    return torch.cat([within, chain[:, None]], dim=1)


def accepted_within(path: torch.Tensor, length: torch.Tensor, budgets) -> torch.Tensor:
    """Drafts each smaller budget would have accepted in the same round, read off one verified tree of budget B.

    The trees are nested: the tree of B' <= B nodes is the first B' nodes of the tree of B (both are the first
    nodes of the one global order: draft_tree.py, "Order"), so it holds row r iff 1 <= r <= B'. A walk down the smaller
    tree, fed the same target choices, follows the same path until the path leaves it; rows grow along a path
    (parents precede children), so that walk accepts exactly the path's rows <= B'. path [..., L + 1] and length
    [...] as walk_tree returns them (path[0] = 0 is the root; `length` counts it); returns [..., len(budgets)]."""
    steps = torch.arange(path.shape[-1], device=path.device)
    on_path = (steps >= 1) & (steps < length[..., None])  # the accepted nodes, root excluded
    limits = torch.as_tensor(budgets, device=path.device)
    return ((path[..., None, :] <= limits[:, None]) & on_path[..., None, :]).sum(-1)


def chain_accepted(chain: torch.Tensor, tokens: torch.Tensor, path: torch.Tensor, length: torch.Tensor,
                   next_token: torch.Tensor) -> torch.Tensor:
    """Drafts the DFlash chain would have accepted in the same round, read off one verified tree.

    The chain is the drafter's argmax at every position, which is the tree's most probable spine: its first d
    drafts are the best prefix of depth d. While the accepted path follows the chain, the target's choices are
    the chain's; where the path leaves the chain (a draft d + 1 other than the chain's), the target chose that
    other token after the shared d drafts, so the chain stops at d: exact. Where the path ends on the chain and
    the target's next token is the chain's next draft, that node lay outside the tree (else the walk would have
    taken it): the chain accepts at least one more, and this returns that lower bound. chain [..., L],
    tokens [..., B], path [..., L + 1] and length [...] as walk_tree returns them, next_token [...]; returns
    [...] long."""
    L = chain.shape[-1]
    drafts = length - 1
    steps = torch.arange(L, device=chain.device)
    on_path = tokens.gather(-1, (path[..., 1:] - 1).clamp(min=0))  # the accepted drafts' tokens, depth by depth
    shared = ((on_path == chain) & (steps < drafts[..., None])).long().cumprod(-1).sum(-1)
    following = chain.gather(-1, shared.clamp(max=L - 1)[..., None])[..., 0]
    return shared + ((shared == drafts) & (shared < L) & (following == next_token)).long()
