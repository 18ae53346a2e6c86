"""--budget auto: the fastest lossless setting for this device and this pair, measured rather than guessed.

The candidates are plain decoding ("ar"), the DFlash chain ("chain") and DDTree trees of AUTO_BUDGETS nodes. Each
round runs the candidate with the best expected tokens per second, tokens per round over seconds per round:

- Seconds per round are measured. A calibration times every candidate's round on this device, compiled or eager
  as the run is, at the run's batch size and cache size, in passes over the candidates in turn, and keeps each
  one's lowest pass (a busy machine only ever adds time), with more passes while the passes disagree (the machine
  was not quiet): the curve is cached on disk (cache_file()) and reused by later runs. During a run, the rounds a
  candidate runs replace its calibrated time, and candidates not run yet are scaled by how far the measured ones
  of their kind moved from their calibration (the context has grown, the machine is busier). A candidate that
  might win but has not run for STALE_ROUNDS rounds is probed, so that a cost estimated too high is measured
  again; a run whose measurements show the calibration wrong marks it to be renewed by the next run.
- Tokens per round are estimated from the run's own rounds. Plain decoding emits one. The best-first trees are
  nested (the tree of B' nodes is the first B' nodes of the tree of B >= B'), so one verified tree tells what
  every smaller budget would have accepted in that round (accepted_within), and what the chain would
  have (chain_accepted: the chain is the trees' most probable spine). Rounds at the chosen budget keep
  every smaller candidate's estimate current; larger ones are probed: the first round of a run at the largest
  tree that could still win, later rounds at the next size up from the best, whenever probing has cost less than
  PROBE_SHARE of the run's time (a probe's cost: its time less what the best would have taken for its tokens).
  A run starts from the previous run's estimates (of the same engine), weighted as PRIOR_ROUNDS rounds.
- A candidate "could still win" while its round, accepting every draft (block_size tokens), would beat the best
  estimate so far. The same bound prunes the calibration: trees whose round is too slow to beat plain decoding
  even when everything is accepted are not timed, compiled or run (a bigger tree costs at least as much).

Lossless: every round, whichever candidate runs it, commits tokens with the target's law given what is committed
(each method is lossless from any state); the choice depends only on the past and on timings, never on the
round's own randomness. Probe rounds are ordinary rounds: their tokens count, and their time is the run's.
"""

import collections
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, replace

import torch

import tp
from settings import AUTO_BUDGETS, Speculation, recurrent_target

PROBE_SHARE = 0.05  # probing costs at most this share of a run's time (after its first round, a probe)
EMA_ROUNDS = 16  # a tokens-per-round estimate averages about this many recent observations
COST_WINDOW = 16  # a measured round time is the median of this many recent rounds of its candidate
PRIOR_ROUNDS = 4  # a new run of the engine starts from the last run's estimates, weighted as this many rounds
STALE_ROUNDS = 48  # a candidate not run for this many rounds is probed again while it might win...
PROBE_OPTIMISM = 2.0  # ...that is, while it would win were its round this many times cheaper than estimated
RENEW_BELOW = 0.7  # a candidate measured under this share of its calibrated time, and of another's: calibrate again
RENEW_ROUNDS = 2  # rounds of each that such a verdict needs
CALIBRATE_ROUNDS = 6  # timed rounds per candidate and pass (after two untimed ones)
CALIBRATE_PASSES = 3  # passes over the candidates at least; a candidate's cost is its lowest pass (median of rounds)
CALIBRATE_MAX_PASSES = 6  # passes at most, while the calibration is not quiet
QUIET_SPREAD = 1.15  # quiet: each candidate's two lowest passes lie within this factor of each other
CALIBRATE_PROMPT = 256  # prompt tokens of the calibration's dummy requests


def clock() -> float:
    """Seconds, as budget auto times rounds (a test's simulated device stands its own clock in)."""
    return time.perf_counter()


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


# Raised when a change to the engine moves its own round costs, or to the calibration changes what it stores, so
# that calibrations made before are measured again (docs/budget.md says which changes raised it).
COSTS_VERSION = 4


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
    """This engine's calibration from the cache file (a dict: round_s, the seconds per round of each candidate, and
    how it was taken: taken, passes, spread, quiet, and renew, why a run found it wrong, or None), or None: none
    yet, or a file that cannot be read or used (one warning naming it; the run calibrates again and replaces it). A
    cache never stops a run."""
    path = cache_file()
    everything = read_cache(path)
    entry = everything.get(key)
    if entry is None:
        return None
    costs = entry.get("round_s") if isinstance(entry, dict) else None
    if not (isinstance(costs, dict) and costs and all(is_cost(v, untimed=c != "ar") for c, v in costs.items())):
        warnings.warn(f"ignoring the calibration in {path}: its round times are not positive numbers; "
                      f"calibrating again")
        return None
    how = {**UNKNOWN_HOW, **{k: v for k, v in entry.items() if k in UNKNOWN_HOW}, "round_s": costs}
    if how["renew"] is not None:  # a run's reason, as a run wrote it (or as someone edited it: still a renewal)
        how["renew"] = str(how["renew"])
    return how


# How a calibration was taken, where a stored one does not say (one written by hand, or by a test).
UNKNOWN_HOW = dict(taken=None, passes=None, spread=None, quiet=None, renew=None)


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


def save_costs(key: str, calibration: dict):
    """Add one calibration (load_costs' dict) to the cache file (written whole to a temporary file, then renamed
    into place, so a reader never sees half a file). Where it cannot be written: one warning, and the calibration
    serves this run."""
    path = cache_file()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_costs has said what was wrong with the old file
        everything = read_cache(path)
    everything[key] = calibration
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


def mark_for_renewal(key: str, reason: str):
    """Mark the stored calibration of `key` as found wrong (load_costs' renew), so that the next run that reads it
    calibrates again. Nothing when the file holds none (another process replaced it, or it cannot be read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stored = load_costs(key)
    if stored is not None:
        save_costs(key, {**stored, "renew": reason})


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
        t0 = clock()
        engine.step()
        times.append(tp.slowest(clock() - t0, engine.device))
    return times[2:]


def calibrate(engines: dict, block_size: int, prompt_len: int) -> dict:
    """A calibration (load_costs' dict): seconds per round for each candidate, timed in passes over the candidates
    in turn, in order ar, chain, budgets ascending. A pass times a candidate's rounds and keeps their median; the
    candidate's cost is its lowest pass: another job on the machine only ever adds time, so the lowest is the
    nearest to the round's own. The calibration is quiet when each candidate's two lowest passes agree within
    QUIET_SPREAD (the machine was quiet in two passes at least, or equally busy in both); while it is not, it takes
    more passes, up to CALIBRATE_MAX_PASSES, and says so (quiet False) if it never was. A budget whose round
    cannot beat plain decoding even when every draft is accepted ends the curve: it and the larger budgets are
    None (not viable). The first pass already stops at a budget twice too slow, so that the largest trees are not
    timed (nor compiled) for nothing."""
    passes = {c: [] for c in engines}  # each pass's median round time
    dropped = set()

    def too_slow(candidate, margin):
        return isinstance(candidate, int) and block_size / min(passes[candidate]) * margin <= 1 / min(passes["ar"])

    while len(passes["ar"]) < CALIBRATE_PASSES or \
            spread(passes, dropped) > QUIET_SPREAD and len(passes["ar"]) < CALIBRATE_MAX_PASSES:
        first = not passes["ar"]
        for candidate, engine in engines.items():
            if candidate in dropped or first and dropped:
                dropped.add(candidate)
                continue
            passes[candidate].append(statistics.median(round_times(engine, prompt_len)))
            if first and too_slow(candidate, margin=2):
                dropped.add(candidate)
    costs, ended = {}, False
    for candidate in engines:
        ended = ended or candidate in dropped or too_slow(candidate, margin=1)
        costs[name(candidate)] = None if ended and isinstance(candidate, int) else min(passes[candidate])
    worst = spread(passes, dropped)
    return dict(round_s=costs, taken=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), passes=len(passes["ar"]),
                spread=worst, quiet=worst <= QUIET_SPREAD, renew=None)


def spread(passes: dict, dropped: set) -> float:
    """How far the calibration's passes disagree: over the candidates still timed, the largest ratio of a
    candidate's second-lowest pass to its lowest (1.0: two passes agree exactly; inf before two passes)."""
    ratios = [sorted(p)[1] / min(p) if len(p) > 1 else float("inf") for c, p in passes.items() if c not in dropped]
    return max(ratios, default=1.0)


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
    candidates = {"ar": ("ar", drafter if recurrent_target(target) else None, Speculation(), None),
                  "chain": ("dflash", drafter, Speculation(denoise_steps=spec.denoise_steps), None)}
    for b in budgets:
        smaller = tuple(x for x in budgets if x <= b)
        candidates[b] = ("ddtree", drafter, replace(spec, budget=b), functools.partial(tally, smaller))
    return candidates


def auto_engine(engine_class, target, drafter, sampling, spec, max_seq_len, compile, batch, budgets):
    """The AutoBudget over one engine_class engine per candidate (auto_candidates), all over the same caches."""
    engines = {c: engine_class(target, candidate_drafter, method, sampling, candidate_spec, max_seq_len, compile, batch,
                               tally)
               for c, (method, candidate_drafter, candidate_spec, tally)
               in auto_candidates(target, drafter, spec, budgets).items()}
    return AutoBudget(engines, drafter.block_size)


def catch_up(engine, tokens: list[list[int]], starts: list[int]):
    """The target over committed tokens the drafter has not seen (rounds of plain decoding run without it), request
    i's from position starts[i], to extend the drafter's context (an empty list: a dummy row past the committed
    tokens). The target's K/V there are written again, with the same values up to rounding; nothing is drawn from
    the requests' generators. Never for a recurrent target, whose state would take the tokens twice."""
    if recurrent_target(engine.target):
        raise RuntimeError("a catch-up would run committed tokens through the target's recurrent state again")
    engine.prefill([t or [0] for t in tokens], starts, draw=False)


class Estimate:
    """A running mean of the last ~EMA_ROUNDS observations (the plain mean until then)."""

    def __init__(self):
        self.value, self.count = None, 0

    def add(self, x: float):
        self.count += 1
        self.value = x if self.value is None else self.value + (x - self.value) / min(self.count, EMA_ROUNDS)


class RoundTimes:
    """A candidate's measured round times: their median over its last COST_WINDOW rounds (a slow moment of the
    machine moves it little), how many were measured, and at which of the engine's rounds the last one ran."""

    def __init__(self):
        self.recent, self.count, self.at = collections.deque(maxlen=COST_WINDOW), 0, None

    def add(self, seconds: float, at: int):
        self.recent.append(seconds)
        self.count, self.at = self.count + 1, at

    @property
    def value(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None


class AutoBudget:
    """An engine that runs each round on the candidate with the best expected tokens/s: the Engine interface
    (warm_up, start, step, finish) over one Engine per candidate, all sharing the models' caches. engines: candidate
    -> Engine, in the order ar, chain, budgets ascending; every tree engine tallies the smaller budgets."""

    def __init__(self, engines: dict, block_size: int):
        self.engines, self.block_size = engines, block_size
        self.any = engines["chain"]  # any engine with the drafter: what the calibration's key is made of
        self.key = cost_key(self.any)
        self.calibrated, self.viable, self.warm = None, [], False
        self.calibration = {}  # how the calibration was taken (load_costs' dict), and why it was made now if it was
        self.renew_reason = None  # why the next warm-up calibrates again (renew), if it must
        self.renewing = None  # why this run finds the calibration wrong (then marked for renewal in the file)
        self.rounds = 0  # rounds this engine has run, over all its runs
        self.measured = {c: RoundTimes() for c in engines}  # seconds per round, measured in runs
        self.tau = {c: Estimate() for c in engines}  # drafts accepted per round and running request

    # -- the Engine interface --------------------------------------------------------------------------------------

    def renew(self, reason: str):
        """Calibrate again at the next warm-up (generate(recalibrate=True), `bench.py calibrate`), whatever is
        stored; `reason` is reported as stats' calibration.renewed_because."""
        self.renew_reason, self.warm = reason, False

    def warm_up(self) -> float:
        """Load this device's calibration (or make it: when none is stored, when a run marked the stored one for
        renewal, or when renew() asked; seconds reported as stats' calibrate_seconds) and compile the viable
        candidates; returns the seconds spent, which the run's tokens/s leaves out as it does a compile."""
        if self.warm:
            return 0.0
        t0 = clock()
        # tensor parallel: rank 0's file decides (the ranks' files may differ), and rank 0 alone writes
        stored = None if self.renew_reason else tp.same_on_every_rank([load_costs(self.key)])[0]
        why = self.renew_reason or ("none stored" if stored is None else
                                    "other candidates stored" if set(stored["round_s"]) != set(map(name, self.engines))
                                    else stored["renew"])
        self.calibrated_now = why is not None
        if self.calibrated_now:
            prompt_len = max(1, min(CALIBRATE_PROMPT, self.any.max_seq_len - self.scratch()))
            stored = calibrate(self.engines, self.block_size, prompt_len)
            if tp.rank() == 0:
                save_costs(self.key, stored)
        self.calibrated = stored["round_s"]
        self.calibration = {k: stored[k] for k in ("taken", "passes", "spread", "quiet")} | \
            dict(renewed_because=why)
        self.renew_reason, self.renewing = None, None
        self.calibrate_seconds = clock() - t0 if self.calibrated_now else 0.0
        ar = self.calibrated["ar"]
        self.viable = [c for c in self.engines if c == "ar" or (
            self.calibrated[name(c)] is not None and self.block_size / self.calibrated[name(c)] > 1 / ar)]
        for c in self.viable:
            self.engines[c].warm_up()
        self.warm = True
        return clock() - t0

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
        # The candidates share the models' caches. Plain decoding starts when no speculative candidate is warmed
        # up, and it sizes only the target's: another engine may have left the drafter's at another batch size.
        self.any.setup_caches()
        # A speculative engine prefills (the prompt is the drafter's first context), a viable one if any, else any
        # warmed up: a probe of it (probe_candidate) then needs no catch-up over the whole prompt.
        ready = [c for c in self.viable if c != "ar"] + [c for c, e in self.engines.items() if c != "ar" and e.warm
                                                         and self.calibrated[name(c)] is not None]
        self.current = self.engines[next(iter(ready), "ar")]
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
        t0 = clock()
        new = engine.step()
        seconds = tp.slowest(clock() - t0, engine.device)
        self.current = engine
        # A request whose draws were not sound (None) ends now, and its round tells nothing.
        running = [r and tokens is not None for r, (tokens, _) in zip(running, new)]
        for i, (tokens, _) in enumerate(new[:len(self.history)]):
            if running[i]:
                self.history[i] += tokens
        self.schedule.append(name(candidate))
        self.rounds += 1
        if not any(running):  # the batch's last round
            return new
        self.observe(candidate, engine, running, seconds)
        self.check_calibration()
        self.admit_viable()
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
        t0 = clock()
        missed = [h[b:p] if r else [] for h, b, p, r in zip(self.history, self.drafter_behind, positions, running)]
        starts = [b if m else p for m, b, p in zip(missed, self.drafter_behind, positions)]
        pad = engine.batch - len(missed)  # rows past the requests: a dummy row each
        catch_up(engine, missed + [[]] * pad, starts + [0] * pad)
        self.drafter_behind = None
        return tp.slowest(clock() - t0, engine.device)

    def choose(self):
        """(candidate, whether it is a probe): the best estimate, or a probe (probe_candidate), in the run's first
        round and whenever probing has cost less than PROBE_SHARE of the run's time: the probes' overhead (their
        time less what the best candidate would have taken for their tokens; a probe that turns out faster costs
        nothing) and the catch-ups."""
        if not self.schedule or self.probe_overhead + self.catch_up_seconds < PROBE_SHARE * self.seconds:
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
        self.measured[candidate].add(seconds, at=self.rounds)
        if candidate == "chain":
            self.tau["chain"].add(self.mean(engine.last_lengths, running) - 1)
        elif candidate != "ar":
            smaller = tuple(c for c in self.engines if isinstance(c, int) and c <= candidate)  # auto_candidates'
            for j, b in enumerate(smaller + ("chain",)):
                self.tau[b].add(self.mean([t[j] for t in engine.last_tally], running))

    def cost(self, candidate) -> float:
        """Seconds per round: as measured in this engine's runs, else the calibration scaled by drift()."""
        if self.measured[candidate].value is not None:
            return self.measured[candidate].value
        return self.calibrated[name(candidate)] * self.drift(candidate)

    def drift(self, candidate) -> float:
        """How far measured round times moved from their calibration, for a candidate not measured yet: the median
        ratio over the measured candidates of its kind (plain decoding; or a speculative round, the drafter and a
        verify), or over every measured one while none of its kind is (the context has grown, the machine is
        busier). By kind, because a calibration taken while the machine was busy may be wrong for one kind and
        right for the other."""
        ratios = {c: t.value / self.calibrated[name(c)] for c, t in self.measured.items()
                  if t.value is not None and self.calibrated[name(c)] is not None}
        alike = [r for c, r in ratios.items() if (c == "ar") == (candidate == "ar")] or list(ratios.values())
        return statistics.median(alike) if alike else 1.0

    def admit_viable(self):
        """Add to the viable candidates those that could now beat plain decoding accepting every draft, at the round
        times estimated now (a calibration that stored them too slow left them out), among the engines warmed up
        (all of them when eager; compiled, only those viable at the warm-up: the others would compile mid-run, and
        come back when the calibration is renewed). None leaves: a slow moment must not shut a candidate out."""
        rate = 1 / self.cost("ar")
        self.viable = [c for c, e in self.engines.items() if c in self.viable or (
            e.warm and self.calibrated[name(c)] is not None and self.block_size / self.cost(c) > rate)]

    def check_calibration(self):
        """Whether this engine's rounds show its calibration wrong: a candidate measured over RENEW_ROUNDS rounds at
        least under RENEW_BELOW of its calibrated time, and under RENEW_BELOW of another candidate's measured share
        of its own. A run's noise only adds time, so the first was calibrated while the machine was busier;
        relative to another, because a context shorter or longer than the calibration's moves every candidate's
        rounds alike. If so, once: the stored calibration is marked for renewal (the next run that
        reads it calibrates again), and the report says why."""
        if self.renewing is not None:
            return
        ratios = {c: t.value / self.calibrated[name(c)] for c, t in self.measured.items()
                  if t.count and self.calibrated[name(c)] is not None}
        settled = [c for c in ratios if self.measured[c].count >= RENEW_ROUNDS]
        if len(ratios) < 2 or not settled:
            return
        low, high = min(settled, key=ratios.get), max(ratios, key=ratios.get)
        if ratios[low] < RENEW_BELOW and ratios[low] < RENEW_BELOW * ratios[high]:
            self.renewing = " and ".join(f"{name(c)} at {1e3 * self.measured[c].value:.2f} ms a round against "
                                         f"{1e3 * self.calibrated[name(c)]:.2f} calibrated" for c in (low, high))
            if tp.rank() == 0:
                mark_for_renewal(self.key, self.renewing)

    def tokens(self, candidate) -> float | None:
        """Expected tokens per round (accepted drafts and the target's own token); None while unknown."""
        if candidate == "ar":
            return 1.0
        value = self.tau[candidate].value
        return None if value is None else 1.0 + value

    def rate(self, candidate) -> float:
        """Expected tokens per second per request (tokens must be known)."""
        return self.tokens(candidate) / self.cost(candidate)

    def best(self):
        return max((c for c in self.viable if self.tokens(c) is not None), key=self.rate)

    def probe_candidate(self, first: bool):
        """The candidate to probe, if any, for what it would accept or for what it costs.

        What it would accept: a tree larger than the best (whose own rounds inform every smaller candidate) that
        could still beat the best were it to accept every draft. The first probe of a run takes the largest such
        tree, which informs every candidate that could win; later ones the next size up from the best, which costs
        the least and lets the choice climb while bigger trees pay off.
        What it costs: a candidate that would beat the best were its round PROBE_OPTIMISM times cheaper than
        estimated, viable or not (an estimate from a calibration or from rounds measured while the machine was busy
        is too high, and only running the candidate again can show it): while what it accepts is unknown, were it to
        accept every draft (the first probe takes one such when no tree is within reach); else once it has not run
        for STALE_ROUNDS rounds.
        After the first probe, of these the one that ran longest ago."""
        best = self.best()
        rate = self.rate(best)
        larger = [c for c in self.viable if isinstance(c, int) and (not isinstance(best, int) or c > best)]
        within_reach = [c for c in larger if self.block_size / self.cost(c) > rate]
        # Probed for their cost: any candidate warmed up, viable or not (a calibration too high may have made it
        # look too slow to beat plain decoding), that would win at 1 / PROBE_OPTIMISM of its estimated cost: were it
        # to accept every draft, while what it accepts is unknown (the chain, when no tree is viable: nothing else
        # would tell), else with what it accepts, once it has not run for STALE_ROUNDS rounds.
        ready = [c for c, e in self.engines.items() if c != best and e.warm and self.calibrated[name(c)] is not None]
        unknown = [c for c in ready if self.tokens(c) is None and
                   PROBE_OPTIMISM * self.block_size / self.cost(c) > rate]
        if first:
            return within_reach[-1] if within_reach else next(iter(unknown), None)
        last_ran = {c: -math.inf if t.at is None else t.at for c, t in self.measured.items()}
        stale = [c for c in ready if self.tokens(c) is not None and self.rounds - last_ran[c] > STALE_ROUNDS and
                 PROBE_OPTIMISM * self.rate(c) > rate]
        return min(within_reach[:1] + unknown + stale, key=last_ran.get, default=None)

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
        time as estimated now and as calibrated, and the rounds of it this engine has timed), the rounds each ran,
        the probing and its overhead (its rounds' time less what the best candidate would have taken for their
        tokens), and the calibration: how it was taken, why it was made now (if it was), and why this run found
        it wrong (if it did: the next run calibrates again)."""
        counts = {c: self.schedule.count(c) for c in dict.fromkeys(self.schedule)}
        best = self.best()
        return dict(
            choice=name(best), rounds_per_candidate=counts, schedule=self.schedule,
            probe_rounds=self.probe_rounds, probe_seconds=self.probe_seconds,
            probe_overhead_seconds=self.probe_overhead,
            catch_up_seconds=self.catch_up_seconds,
            calibrated_now=self.calibrated_now, calibrate_seconds=self.calibrate_seconds, cost_file=cache_file(),
            calibration=self.calibration | dict(renew=self.renewing),
            candidates={name(c): dict(
                viable=c in self.viable, tokens_per_round=self.tokens(c),
                round_ms=None if self.calibrated[name(c)] is None else 1e3 * self.cost(c),
                calibrated_ms=None if self.calibrated[name(c)] is None else 1e3 * self.calibrated[name(c)],
                timed_rounds=self.measured[c].count,
                tokens_per_s=None if self.tokens(c) is None or self.calibrated[name(c)] is None
                else self.rate(c))
                for c in self.engines})


def tally(budgets: tuple, drafter, draft, room, tokens, path, length, next_token) -> torch.Tensor:
    """A tree round's observation for budget auto, made inside the compiled round (Engine's `tally`):
    [N, len(budgets) + 1], the drafts each of `budgets` and the chain (greedy_chain of the round's draft) would have
    accepted this round, read off this one verified tree (the trees are nested)."""
    within = accepted_within(path, length, budgets)
    chain = chain_accepted(greedy_chain(drafter, draft, room), tokens, path, length, next_token)
    return torch.cat([within, chain[:, None]], dim=1)


def greedy_chain(drafter, draft, room) -> torch.Tensor:
    """The drafter's greedy chain [N, D] of a round's draft (per-position logits, or a family's draft: its
    drafter's `chain` hook), -1 past the room [N]."""
    chain = draft.argmax(-1) if torch.is_tensor(draft) else drafter.chain(draft)
    return torch.where(torch.arange(chain.shape[-1], device=chain.device) < room[:, None], chain, -1)


def accepted_within(path: torch.Tensor, length: torch.Tensor, budgets) -> torch.Tensor:
    """Drafts each smaller budget would have accepted in the same round, read off one verified tree of budget B.

    The trees are nested: the tree of B' <= B nodes is the first B' nodes of the tree of B (both are the first nodes
    of the one global order: docs/lossless.md, "Two builders, one order"), so it holds row r iff 1 <= r <= B'. A
    walk down the smaller tree, fed the same target choices, follows the same path until the path leaves it; rows
    grow along a path (parents precede children), so that walk accepts exactly the path's rows <= B'. path
    [..., L + 1] and length [...] as walk_tree returns them (path[0] = 0 is the root; `length` counts it); returns
    [..., len(budgets)]."""
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
