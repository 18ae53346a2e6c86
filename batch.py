"""Many requests on one engine: the decoding loop, and a batch that shrinks as its requests end.

ddtree.generate_batch runs each wave of up to max_batch requests through run_requests: prefill, then one
Engine.step per round until every request has ended. A request that ends stops emitting while its rows keep
running (static shapes); once the running requests fit the next smaller power of two they move to an engine of
that size (take, resume), their cache rows and recurrent states with them. Each request draws from its own
generator, so a batch gives every request its lone run's tokens (tests/test_batch.py).
"""

import time
from dataclasses import dataclass, field

import torch


NON_FINITE = ("the target produced non-finite logits or probabilities (NaN/inf weights, or overflow in this "
              "dtype)")


@dataclass
class Result:
    tokens: list[int]
    stats: dict = field(default_factory=dict)
    trees: list = field(default_factory=list)  # with show_tree: (tokens, parents, depths, path, length) per round
    error: str | None = None  # why the request ended before its end (its tokens: those emitted until then)


class RequestsFailed(ValueError):
    """Raised once every request has ended, when some failed (Result.error): `results` holds every request's
    Result, the failed ones' and the rest, complete."""

    def __init__(self, results: list[Result]):
        self.results = results
        failed = [(i, r.error) for i, r in enumerate(results) if r.error is not None]
        super().__init__("; ".join(error if len(results) == 1 else f"prompt {i}: {error}" for i, error in failed))


def run_waves(engine_for, prompts: list, seeds: list, stop: set, max_new_tokens: int, max_batch: int, on_tokens,
              on_result, labels: dict) -> list[Result]:
    """Every request to the end, in waves of up to max_batch (run_requests): engine_for(longest prompt of the wave)
    gives the wave's engines by batch size. on_result(i, Result) gets request i's Result as soon as it ends, its
    stats as of then (compile_seconds counts the compiling so far, budget auto's report its rounds so far) plus
    `labels`."""
    results = []
    for first in range(0, len(prompts), max_batch):
        wave = range(first, min(first + max_batch, len(prompts)))
        engines = engine_for(max(len(prompts[i]) for i in wave))
        engine = engines(batch_bucket(len(wave), max_batch))
        auto = labels.get("budget") == "auto"
        emit_to = on_tokens and (lambda j, new, first=first: on_tokens(first + j, new))

        def ended(j, result, first=first, engine=engine):
            result.stats.update(labels)
            if auto:
                result.stats["auto"] = engine.report()
            if on_result is not None:
                on_result(first + j, result)

        # Budget auto keeps its batch: its candidates' costs are calibrated for one batch size.
        results += run_requests(engine, [prompts[i] for i in wave], [seeds[i] for i in wave], stop, max_new_tokens,
                                emit_to, None if auto else engines, ended)
    return results


def run_requests(engine, prompts: list, seeds: list, stop: set, max_new_tokens: int,
                 on_tokens, engine_for=None, ended=None) -> list[Result]:
    """Run one batch of requests on `engine` to the end: prefill, then rounds until every request has ended.
    engine_for(batch): an engine of the same settings for a smaller batch. The rows of a request that has ended
    still run (static shapes), so once the running requests fit a smaller power of two they move to such an
    engine: a batch whose requests end at different rounds no longer runs every round at its starting size.
    A request whose draws were not sound (the engine's None for it) ends with Result.error, the others go on.
    ended(i, Result): called as request i ends, its stats complete."""
    compile_seconds = engine.warm_up()
    t0, compiling = time.perf_counter(), 0.0  # compiling: seconds since t0 spent warming up smaller engines
    results = [Result(tokens=[], stats=dict(accepted=[], verified=[], seed=seed)) for seed in seeds]
    live = set(range(len(prompts)))
    rows = list(range(len(prompts)))  # the request in each engine row

    def end(i, row, error=None):
        live.discard(i)
        engine.finish(row)
        r = results[i]
        r.error = error
        s, rounds = r.stats, len(r.stats["accepted"])
        s.update(seconds=time.perf_counter() - t0 - compiling, new_tokens=len(r.tokens), rounds=rounds,
                 tau=sum(s["accepted"]) / rounds if rounds else 0.0, compile_seconds=compile_seconds,
                 batch=len(prompts))
        s["tokens_per_s"] = len(r.tokens) / s["seconds"] if s["seconds"] > 0 else 0.0
        if ended is not None:
            ended(i, r)

    def emit_each(new_per_row, is_round=True):
        for row, (new, tree) in enumerate(new_per_row[:len(rows)]):
            i = rows[row]
            if i not in live:
                continue
            if new is None:  # its logits or draws were not sound: it ends here, and the others go on
                end(i, row, NON_FINITE)
                continue
            r = results[i]
            before = len(r.tokens)
            done = emit(r.tokens, new, stop, max_new_tokens, on_tokens and (lambda kept: on_tokens(i, kept)))
            if is_round:  # not the prefill's first token
                r.stats["accepted"].append(len(r.tokens) - before)
                r.stats["verified"].append(len(new))
            if tree is not None:
                r.trees.append(tree)
            if done:
                end(i, row)

    emit_each([(None if t is None else [t], None) for t in engine.start(prompts, seeds)], is_round=False)
    while live:
        emit_each(engine.step())
        if engine_for is not None and live and batch_bucket(len(live), engine.batch) < engine.batch:
            # A running request's caches hold its prompt and its tokens but the last (the next round's input).
            committed = max(len(prompts[i]) + len(results[i].tokens) - 1 for i in live)
            engine, rows, seconds = move_to_smaller(engine, engine_for, rows, live, committed)
            compile_seconds, compiling = compile_seconds + seconds, compiling + seconds
    return results


def move_to_smaller(engine, engine_for, rows: list, live: set, committed: int) -> tuple:
    """Move the running requests (`live`; rows[r] is the request in engine row r; none has more than `committed`
    tokens in the caches) to the engine for the next power of two that holds them. Returns that engine, its rows'
    requests, and the seconds its warm-up took (compiling it, the first time), which the run's time leaves out."""
    keep = [row for row, i in enumerate(rows) if i in live]
    held = take(engine, keep, committed)
    smaller = engine_for(batch_bucket(len(keep), engine.batch))
    # A new engine's warm-up runs a dummy request in every row, over the first warm_up_slots() slots: those of the
    # moved requests are kept aside meanwhile (a few hundred slots, not the whole context).
    window = smaller.warm_up_slots() if not smaller.warm else 0
    saved = [c[:len(keep), :, :window].clone() for c in smaller.kv_caches()] if window else []
    states = [s[:len(keep)].clone() for s in smaller.target.state_tensors()] if window else []
    seconds = smaller.warm_up()
    for cache, rows_before in zip(smaller.kv_caches(), saved):
        cache[:len(keep), :, :window] = rows_before
    for state, rows_before in zip(smaller.target.state_tensors(), states):
        state[:len(keep)] = rows_before
    resume(smaller, held)
    return smaller, [rows[row] for row in keep], seconds


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


def take(engine, rows: list[int], slots: int) -> tuple:
    """The running requests in `rows`, for an engine with a smaller batch (resume): their caches' first `slots`
    slots (every request's committed ones: the rest are scratch) move to the caches' first rows, in place,
    layer by layer (the smaller engine's caches are those rows); returns their next tokens, positions and
    generators."""
    index = torch.tensor(rows, device=engine.device)
    for cache in engine.kv_caches():
        cache[:len(rows), :, :slots] = cache[:, :, :slots].index_select(0, index)
    for state in engine.target.state_tensors():  # recurrent layers' states: one per request, whole
        state[:len(rows)] = state.index_select(0, index)
    return engine.token[index], engine.position[index], [engine.generators[r] for r in rows]



def resume(engine, held: tuple):
    """Carry on the requests taken from another engine of these settings (take) as rows 0, 1, ...; the rows
    past them are padding, as in start()."""
    token, position, generators = held
    n, pad = len(generators), engine.batch - len(generators)
    engine.setup_caches()
    engine.guards_checked = False
    engine.token = torch.cat([token, token.new_zeros(pad)])
    engine.position = torch.cat([position, position.new_ones(pad)])  # a padding row's one-token dummy prompt
    engine.live = torch.tensor([1] * n + [0] * pad, device=engine.device)
    engine.generators = generators + [None] * pad


def batch_bucket(n: int, max_batch: int) -> int:
    """The engine's batch size for n requests: the next power of two (at most max_batch), so that a handful of
    compiled graphs serve every batch size."""
    return min(1 << (n - 1).bit_length(), max_batch)
