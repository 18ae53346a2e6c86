"""Many requests on one engine: the decoding loop, and a batch that shrinks as its requests end. Each request draws
from its own generator, so a batch gives every request its lone run's tokens."""

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from settings import recurrent_target


NON_FINITE = ("the target produced non-finite logits or probabilities (NaN/inf weights, or overflow in this "
              "dtype)")


@dataclass
class Requests:
    """An engine's requests between rounds, one entry per engine row (made by Engine.start, advanced by step)."""
    token: torch.Tensor | None  # [N] long: the target's last choice, not yet cached (None before the prefill)
    position: torch.Tensor  # [N] long: the committed length
    generators: list  # [N] torch.Generator, or None: an ended request or a padding row, which draw nothing
    live: torch.Tensor  # [N] 1 while the request advances, else 0

    def select(self, rows: list[int]) -> "Requests":
        """The requests in these engine rows, in this order, as rows 0, 1, ..."""
        index = torch.tensor(rows, device=self.position.device)
        return Requests(self.token[index], self.position[index], [self.generators[r] for r in rows],
                        self.live[index])

    def padded(self, batch: int) -> "Requests":
        """These requests, then ended padding rows at position 1 (as Engine.start pads) up to `batch`."""
        pad = batch - len(self.generators)
        return Requests(torch.cat([self.token, self.token.new_zeros(pad)]),
                        torch.cat([self.position, self.position.new_ones(pad)]), self.generators + [None] * pad,
                        torch.cat([self.live, self.live.new_zeros(pad)]))

    def finish(self, row: int):
        """The request in `row` has ended: it stops advancing and drawing randomness."""
        self.live[row] = 0
        self.generators[row] = None


@dataclass
class Result:
    tokens: list[int]
    stats: dict = field(default_factory=dict)
    trees: list = field(default_factory=list)  # with show_tree: (tokens, parents, depths, path, length) per round
    error: str | None = None  # why the request ended before its end (its tokens: those emitted until then)


class RequestsFailed(ValueError):
    """Raised once every request has ended, when some failed (Result.error); `results` holds every Result."""

    def __init__(self, results: list[Result]):
        self.results = results
        failed = [(i, r.error) for i, r in enumerate(results) if r.error is not None]
        super().__init__("; ".join(error if len(results) == 1 else f"prompt {i}: {error}" for i, error in failed))


def run(engine_for, prompts: list, seeds: list, stop: set, max_new_tokens: int, max_batch: int = 1,
        on_tokens=None, on_result=None, labels: dict | None = None) -> list[Result]:
    """Every request to the end, in waves of up to max_batch: prefill, then rounds until each has ended, on
    engine_for(longest prompt, batch size). Once the running requests fit a smaller power of two they move to such
    an engine (not under budget auto: its costs are calibrated for one batch size). A request whose draws were not
    sound ends with Result.error. on_result(i, Result) gets request i's Result, stats as of then plus `labels`."""
    labels = labels or {}
    auto = labels.get("budget") == "auto"
    results = [Result(tokens=[], stats=dict(accepted=[], path_lengths=[], seed=seed)) for seed in seeds]
    for first in range(0, len(prompts), max_batch):
        rows = list(range(first, min(first + max_batch, len(prompts))))  # the request in each engine row
        longest = max(len(prompts[i]) for i in rows)
        engine = engine_for(longest, batch_bucket(len(rows), max_batch))
        compile_seconds = engine.warm_up()
        t0, compiling = time.perf_counter(), 0.0  # compiling: seconds since t0 spent warming up smaller engines
        live, size = set(rows), len(rows)

        def end(i, row, error=None):
            live.discard(i)
            engine.finish(row)
            r = results[i]
            r.error = error
            s, rounds = r.stats, len(r.stats["accepted"])
            s.update(seconds=time.perf_counter() - t0 - compiling, new_tokens=len(r.tokens), rounds=rounds,
                     tau=sum(s["accepted"]) / rounds if rounds else 0.0, compile_seconds=compile_seconds,
                     batch=size)
            s["tokens_per_s"] = len(r.tokens) / s["seconds"] if s["seconds"] > 0 else 0.0
            s.update(labels)
            if auto:
                s["auto"] = engine.report()
            if on_result is not None:
                on_result(i, r)

        def emit_each(new_per_row, is_round=True):
            for row, (new, tree) in enumerate(new_per_row[:len(rows)]):
                i = rows[row]
                if i not in live:
                    continue
                if new is None:  # its logits or draws were not sound: it ends here, and the others go on
                    end(i, row, NON_FINITE)
                    continue
                r = results[i]
                kept = emitted(new, stop, max_new_tokens - len(r.tokens))
                r.tokens += kept
                if on_tokens:
                    on_tokens(i, kept)
                if is_round:  # not the prefill's first token
                    r.stats["accepted"].append(len(kept))
                    r.stats["path_lengths"].append(len(new))
                if tree is not None:
                    r.trees.append(tree)
                if kept[-1] in stop or len(r.tokens) >= max_new_tokens:
                    end(i, row)

        first_tokens = engine.start([prompts[i] for i in rows], [seeds[i] for i in rows])
        emit_each([(None if t is None else [t], None) for t in first_tokens], is_round=False)
        while live:
            emit_each(engine.step())
            if not auto and live and batch_bucket(len(live), engine.batch) < engine.batch:
                # A running request's caches hold its prompt and its tokens but the last (the next round's input).
                committed = max(len(prompts[i]) + len(results[i].tokens) - 1 for i in live)
                engine, rows, seconds = move_to_smaller(engine, lambda b: engine_for(longest, b), rows, live,
                                                        committed)
                compile_seconds, compiling = compile_seconds + seconds, compiling + seconds
    return results


def move_to_smaller(engine, engine_for, rows: list, live: set, committed: int) -> tuple:
    """Move the running requests (`live`; rows[r] is engine row r's; at most `committed` tokens cached) to the
    engine for the next power of two that holds them. Returns it, its rows' requests and its warm-up seconds."""
    keep = [row for row, i in enumerate(rows) if i in live]
    held = take(engine, keep, committed)
    smaller = engine_for(batch_bucket(len(keep), engine.batch))
    # A new engine's warm-up writes a dummy request's first warm_up_slots() slots in every row: kept aside meanwhile.
    window = smaller.warm_up_slots() if not smaller.warm else 0
    saved = [c[:len(keep), :, :window].clone() for c in smaller.kv_caches()] if window else []
    states = [s[:len(keep)].clone() for s in recurrent_states(smaller.target)] if window else []
    seconds = smaller.warm_up()
    for cache, rows_before in zip(smaller.kv_caches(), saved):
        cache[:len(keep), :, :window] = rows_before
    for state, rows_before in zip(recurrent_states(smaller.target), states):
        state[:len(keep)] = rows_before
    smaller.setup_caches()
    smaller.adopt(held.padded(smaller.batch))
    return smaller, [rows[row] for row in keep], seconds


def emitted(new: list, stop: set, room: int) -> list:
    """A round's new tokens as far as they are emitted: through the first stop token, at most `room` of them."""
    kept = new[:room]
    return next((kept[:k + 1] for k, t in enumerate(kept) if t in stop), kept)


def take(engine, rows: list[int], slots: int) -> Requests:
    """The requests in `rows`, moved to the caches' first rows (the smaller engine's), in place: their first
    `slots` slots (the committed ones) and recurrent states; returns their Requests."""
    index = torch.tensor(rows, device=engine.device)
    for cache in engine.kv_caches():
        cache[:len(rows), :, :slots] = cache[:, :, :slots].index_select(0, index)
    for state in recurrent_states(engine.target):
        state[:len(rows)] = state.index_select(0, index)
    return engine.requests.select(rows)


def recurrent_states(target) -> list:
    """A recurrent target's per-request state tensors (none for any other)."""
    return list(target.state_tensors()) if recurrent_target(target) else []


def batch_bucket(n: int, max_batch: int) -> int:
    """The engine's batch size for n requests: the next power of two (at most max_batch), for few graphs."""
    return min(1 << (n - 1).bit_length(), max_batch)


@dataclass
class InUse:
    """Which thread runs on a model: its caches hold that run's requests until it returns."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: int | None = None  # the thread's ident


_IN_USE: "weakref.WeakKeyDictionary[torch.nn.Module, InUse]" = weakref.WeakKeyDictionary()
_IN_USE_LOCK = threading.Lock()


@contextlib.contextmanager
def models_in_use(*models):
    """Hold the models (whose caches hold the run's requests) for one run: another thread waits, this thread is
    refused. Models are taken in one fixed order, so two runs cannot each wait for the other."""
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
