"""generate_batch: many requests in one engine, each the same as its lone run.

Greedy: every request of a batch gives exactly its lone run's tokens and per-round counts, for ar, dflash and
ddtree, with ragged prompts (one longer than a prefill chunk), requests that stop early, and more requests than
one batch holds. Seeded sampling: request i of a batch is the same sample as generate(seed=seeds[i]). The command
line's --prompts-file. (Compiled batches, which equal eager ones, reuse their graphs and read the host once per
round: test_speculative.py, beside the compiled engine whose graph serves their batch of one.)"""

import json

import pytest
import torch

import batch as batching
import ddtree
from batch import batch_bucket
from conftest import PAIR_STOP, PAIR_VOCAB, assert_one_error_line, cli, load_pair, write_random_pair
from ddtree import generate, generate_batch
from budget import accepted_within
from sampler import Sampling
from cli import grouped
from settings import Speculation

VOCAB, STOP = PAIR_VOCAB, PAIR_STOP


def write_pair(root, target_layers=3, draft_layers=2):
    """The shared pair's recipe with other layer counts (smaller graphs, for the compiled tests), loaded."""
    return load_pair(write_random_pair(root, target_layers, draft_layers))


@pytest.fixture(scope="module")
def pair(random_pair_files, one_thread):
    return load_pair(random_pair_files)


def models(pair, method):
    """The target, and the drafter unless the method is plain decoding (which takes none)."""
    target, drafter = pair
    return target, None if method == "ar" else drafter


def ragged_prompts(n, seed=0):
    """n prompts of different lengths, the second one longer than a prefill chunk."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, ddtree.PREFILL_CHUNK + 12] + [int(torch.randint(1, 40, (1,), generator=g)) for _ in range(n - 2)]
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


METHODS = [("ar", {}), ("dflash", {}), ("ddtree", dict(budget=6))]


def moves(monkeypatch) -> list:
    """Records (the smaller engine's batch, the requests moved to it) of every move of a shrinking batch."""
    moved, move = [], batching.move_to_smaller

    def recorded(*args):
        smaller, rows, seconds = move(*args)
        moved.append((smaller.batch, len(rows)))
        return smaller, rows, seconds

    monkeypatch.setattr(batching, "move_to_smaller", recorded)
    return moved


@pytest.mark.parametrize("method, kw", METHODS, ids=[m for m, _ in METHODS])
def test_greedy_batch_equals_each_lone_run(pair, method, kw):
    target, drafter = models(pair, method)
    prompts = ragged_prompts(6)
    # 6 requests in batches of at most 4 (a batch of 4, then one of 2); the stop token ends some of them early.
    batch = generate_batch(target, drafter, prompts, method=method, max_new_tokens=24, stop_ids=[STOP], max_batch=4,
                           **grouped(kw))
    lone = [generate(target, drafter, p, method=method, max_new_tokens=24, stop_ids=[STOP], **grouped(kw))
            for p in prompts]
    assert [r.tokens for r in batch] == [r.tokens for r in lone]
    assert [r.stats["accepted"] for r in batch] == [r.stats["accepted"] for r in lone]
    assert [r.stats["path_lengths"] for r in batch] == [r.stats["path_lengths"] for r in lone]
    assert [r.stats["batch"] for r in batch] == [4] * 4 + [2] * 2
    assert any(r.tokens[-1] == STOP and len(r.tokens) < 24 for r in lone), "no request stopped early"
    assert any(len(r.tokens) == 24 for r in lone), "every request stopped early"


SAMPLED = [("ar", dict(temperature=1.0)),
           ("dflash", dict(temperature=0.8, top_k=6, draft_sampling=True)),
           ("ddtree", dict(budget=6, temperature=0.9, top_p=0.9))]


@pytest.mark.parametrize("method, kw", SAMPLED, ids=[m for m, _ in SAMPLED])
def test_seeded_batch_request_is_the_lone_sample(pair, method, kw):
    target, drafter = models(pair, method)
    prompts, seeds = ragged_prompts(5, seed=1), [11, 12, 13, 14, 15]
    batch = generate_batch(target, drafter, prompts, method=method, max_new_tokens=20, seeds=seeds, stop_ids=[],
                           **grouped(kw))
    lone = [generate(target, drafter, p, method=method, max_new_tokens=20, seed=s, stop_ids=[], **grouped(kw))
            for p, s in zip(prompts, seeds)]
    assert [r.stats["seed"] for r in batch] == seeds
    assert [r.tokens for r in batch] == [r.tokens for r in lone]
    # and the seeds matter: other seeds give other samples
    other = generate_batch(target, drafter, prompts, method=method, max_new_tokens=20, seeds=[21, 22, 23, 24, 25],
                           stop_ids=[], **grouped(kw))
    assert [r.tokens for r in other] != [r.tokens for r in batch]


SHRINKING = [("ddtree", dict(budget=6)), ("dflash", dict(temperature=0.9, draft_sampling=True)),
             ("ar", dict(temperature=1.0))]


@pytest.mark.parametrize("method, kw", SHRINKING, ids=[m for m, _ in SHRINKING])
def test_batch_shrinks_as_requests_end_and_each_request_stays_its_lone_run(pair, monkeypatch, method, kw):
    """Requests that end at different rounds (the stop token, the token limit) move the batch to engines of
    smaller batch sizes (8 -> 4 -> 2 -> 1 as they end); every request, greedy or seeded, is still its lone run."""
    target, drafter = models(pair, method)
    resumed = moves(monkeypatch)  # (the engine's batch, the requests it took over)
    prompts, seeds = ragged_prompts(7, seed=7), list(range(30, 37))
    run = lambda prompts, seeds: generate_batch(target, drafter, prompts, method=method, max_new_tokens=30,
                                                seeds=seeds, stop_ids=[STOP], max_batch=8, **grouped(kw))
    lone = [run([p], [s])[0] for p, s in zip(prompts, seeds)]
    assert not resumed, "a lone request moved"
    together = run(prompts, seeds)
    assert [r.tokens for r in together] == [r.tokens for r in lone]
    assert [r.stats["accepted"] for r in together] == [r.stats["accepted"] for r in lone]
    assert [r.stats["batch"] for r in together] == [7] * 7
    assert len({r.stats["rounds"] for r in lone}) > 2, "the requests did not end at different rounds"
    assert resumed and [b for b, _ in resumed] == sorted({b for b, _ in resumed}, reverse=True), resumed
    assert all(b == batch_bucket(n, 8) < 8 for b, n in resumed), resumed


def test_one_verify_tells_what_every_smaller_budget_accepts(pair):
    """The nested-acceptance estimate (budget.accepted_within) from one round at B = 32 equals separate
    one-step runs at each smaller budget from the same contexts (greedy: the same target choices)."""
    target, drafter = pair
    smaller = [1, 2, 4, 8, 16]
    estimated, separate = [], []
    for prompt in ragged_prompts(8, seed=6):
        big = generate(target, drafter, prompt, budget=32, max_new_tokens=2, stop_ids=[],
                       speculation=Speculation(show_tree=True))
        _, _, _, path, length = big.trees[0]
        estimated.append(accepted_within(path, torch.tensor(length), smaller).tolist())
        separate.append([generate(target, drafter, prompt, budget=b, max_new_tokens=2,
                                  stop_ids=[]).stats["path_lengths"][0] - 1 for b in smaller])
    assert estimated == separate
    assert any(row[-1] > row[0] for row in estimated), "no context where a bigger tree accepted more"


def test_batch_bucket_is_a_power_of_two_within_the_limit():
    assert [batch_bucket(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert batch_bucket(5, 6) == 6


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompts=[]), ValueError, "no prompts"),
    (dict(prompts=[1, 2, 3]), TypeError, "prompt 0: prompt_ids must be"),
    (dict(prompts=[[2, 3], []]), ValueError, "prompt 1: the prompt is empty"),
    (dict(prompts=[[2, 3], [VOCAB]]), ValueError, r"prompt 1: prompt ids must lie in"),
    (dict(prompts="abc"), TypeError, "prompts must be a list"),
    (dict(prompts=[[2]], seeds=[1, 2]), TypeError, "one int \\(or None\\) per prompt"),
    (dict(prompts=[[2], [3]], seeds=[1, -1]), ValueError, "prompt 1: seed must be in"),
    (dict(prompts=[[2]], max_batch=0), ValueError, "max_batch must be in"),
    (dict(prompts=[[2]], on_tokens=5), TypeError, "on_tokens must be a function"),
])
def test_bad_batch_input_is_one_clear_error(pair, kwargs, error, message):
    target, _ = pair
    with pytest.raises(error, match=message):
        generate_batch(target, None, method="ar", **grouped(kwargs))


def test_on_tokens_streams_each_request_by_index(pair):
    target, drafter = pair
    prompts = ragged_prompts(3, seed=4)
    streamed = {}
    results = generate_batch(target, drafter, prompts, method="ddtree", budget=4, max_new_tokens=12, stop_ids=[],
                             on_tokens=lambda i, new: streamed.setdefault(i, []).extend(new))
    assert [streamed[i] for i in range(3)] == [r.tokens for r in results]


def poison(monkeypatch, seed: int, from_call: int = 1):
    """The request seeded `seed` gets unsound draws (as from NaN logits) from its from_call-th pick on (1: its
    prefill); the other requests' draws are untouched. Returns the calls counted so far (clear() starts again)."""
    pick, calls = ddtree.Engine.pick, []

    def poisoned(engine, logits, noise):
        tokens, ok = pick(engine, logits, noise)
        rows = [g is not None and g.initial_seed() == seed for g in engine.requests.generators]
        calls.append(any(rows))
        if sum(calls) >= from_call:
            ok = ok & ~torch.tensor(rows, device=ok.device)
        return tokens, ok

    monkeypatch.setattr(ddtree.Engine, "pick", poisoned)
    return calls


@pytest.mark.parametrize("from_call", [1, 4], ids=["in its prefill", "mid-run"])
def test_a_request_whose_logits_turn_non_finite_fails_alone(pair, monkeypatch, from_call):
    """Its error is its own: the other requests of its batch (and of the next one) end as their lone runs, each
    reported as it ends; the failed one ends with an error, and generate_batch raises once all have ended."""
    target, drafter = pair
    prompts, seeds = ragged_prompts(5, seed=3), [10, 11, 12, 13, 14]
    kw = dict(method="ddtree", budget=4, max_new_tokens=16, stop_ids=[])
    lone = [generate(target, drafter, p, seed=s, **kw) for p, s in zip(prompts, seeds)]
    calls = poison(monkeypatch, seed=12, from_call=from_call)
    with pytest.raises(ValueError, match="non-finite"):
        generate(target, drafter, prompts[2], seed=12, **kw)
    calls.clear()
    reported = {}
    with pytest.raises(batching.RequestsFailed, match="^prompt 2: the target produced non-finite") as failed:
        generate_batch(target, drafter, prompts, seeds=seeds, max_batch=4, on_result=reported.__setitem__, **kw)
    results = failed.value.results
    assert sorted(reported) == [0, 1, 2, 3, 4] and all(reported[i] is results[i] for i in reported)
    assert [r.error is None for r in results] == [True, True, False, True, True]
    assert "non-finite" in results[2].error and results[2].tokens == lone[2].tokens[:len(results[2].tokens)]
    assert (len(results[2].tokens) > 0) == (from_call > 1)
    for i in (0, 1, 3, 4):
        assert results[i].tokens == lone[i].tokens and results[i].stats["accepted"] == lone[i].stats["accepted"]


# ---- the command line: --prompts-file ------------------------------------------------------------------------------


def test_prompts_file_gives_each_request_its_lone_result(tmp_path, one_thread):
    lines = ['"def f(x):"', json.dumps({"prompt": "import os\n", "seed": 7}), "", json.dumps("class A:")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    common = ["--max-new-tokens", "10", "--no-chat", "--temperature", "0.8", "--seed", "100", "--budget", "8"]
    code, out, err = cli("--prompts-file", str(path), "--batch-size", "2", *common)
    assert code == 0, err
    rows = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["index"])  # as each ends
    assert [r["index"] for r in rows] == [0, 1, 2] and "3 requests" in err
    # --seed S gives request i the seed S + i, unless its line has its own
    assert [r["stats"]["seed"] for r in rows] == [100, 7, 102]
    for row, prompt in zip(rows, ["def f(x):", "import os\n", "class A:"]):
        lone = cli("--prompt", prompt, *common[:-4], "--seed", str(row["stats"]["seed"]), "--budget", "8",
                   "--json")[1]
        assert json.loads(lone)["tokens"] == row["tokens"]


@pytest.mark.parametrize("content, extra, message", [
    ("{not json\n", [], "line 1: not JSON"),
    ('"ok"\n[1, 2]\n', [], "line 2: expected a JSON string or an object"),
    ('{"prompt": "x", "temperature": 1}\n', [], "line 1: expected a JSON string or an object"),
    ('""\n', [], "line 1: the prompt is empty"),
    ('{"prompt": "x", "seed": -2}\n', [], "seed must be in"),
    ("\n\n", [], "no prompts"),
    ('"x"\n', ["--batch-size", "0"], "--batch-size must be in"),
    ('"x"\n', ["--prompt", "y"], "not allowed with argument"),
    ('"ok"\n' + "[" * 200_000 + "\n", [], "line 2: not JSON (nested too deeply)"),
    ('"ok"\n{"prompt": "x", "seed": ' + "9" * 5000 + "}\n", [], "p.jsonl line 2: Exceeds the limit (4300 digits)"),
    ('"ok"\n\n"x"\n', ["--json"], "--json goes with --prompt"),
    ('"ok"\n', ["--show-tree"], "--show-tree goes with --prompt"),
])
def test_bad_prompts_file_is_one_clear_error(tmp_path, content, extra, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    assert_one_error_line(*cli("--prompts-file", str(path), "--method", "ar", "--no-chat", *extra)[::2], message)


def test_a_failing_request_of_a_prompts_file_costs_only_its_own_line(tmp_path, monkeypatch, one_thread):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"def f(x):"\n\n"import os"\n"class A:"\n"x = 1"\n')
    poison(monkeypatch, seed=102, from_call=2)  # the third request, on line 4
    code, out, err = cli("--prompts-file", str(path), "--batch-size", "4", "--max-new-tokens", "8", "--no-chat",
                         "--budget", "4", "--seed", "100")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and sorted(r["index"] for r in rows) == [0, 1, 3], (code, out, err)
    assert f"error: {path} line 4: the target produced non-finite" in err, err
    assert err.count("error:") == 1 and "Traceback" not in err and "3 of 4 requests" in err, err


def test_prompts_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'"ok"\n"fine"\n"caf\xe9"\n')
    assert_one_error_line(*cli("--prompts-file", str(path), "--method", "ar", "--no-chat")[::2],
                          f"{path} line 3: not UTF-8 text")
    path.write_text('"short"\n' + json.dumps("word " * 3000) + "\n")
    assert_one_error_line(*cli("--prompts-file", str(path), "--method", "ar", "--no-chat")[::2],
                          f"{path} line 2: prompt (3001 tokens) + --max-new-tokens (256) exceeds")


def test_prompts_file_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028, U+2029 and U+0085 unescaped: str.splitlines() would split the line there."""
    import cli as command_line
    path = tmp_path / "p.jsonl"
    prompts = ["a\u2028b", "c\u2029d\u0085e", "f\x1cg\x1dh\x1ei\x0cj\x0bk"]
    path.write_text("\r\n".join(json.dumps(p, ensure_ascii=False) for p in prompts) + "\n", encoding="utf-8")
    assert [(r.line, r.prompt) for r in command_line.read_prompts_file(str(path))] == \
        [(1, prompts[0]), (2, prompts[1]), (3, prompts[2])]


def test_each_request_is_reported_as_soon_as_it_ends(pair):
    # on_result gets a request's Result when it ends, while the batch's other requests still run
    target, drafter = pair
    prompts = ragged_prompts(5, seed=7)
    events = []
    results = generate_batch(target, drafter, prompts, budget=6, max_new_tokens=30, stop_ids=[STOP], max_batch=8,
                             seeds=list(range(5)), on_tokens=lambda i, new: events.append(("tokens", i)),
                             on_result=lambda i, r: events.append(("result", i, list(r.tokens), dict(r.stats))))
    ended = [e for e in events if e[0] == "result"]
    assert sorted(e[1] for e in ended) == list(range(5))
    for _, i, tokens, stats in ended:  # what was reported is the final Result
        assert tokens == results[i].tokens and stats == results[i].stats and stats["method"] == "ddtree"
    first_end = events.index(ended[0])
    assert any(e[0] == "tokens" and e[1] != ended[0][1] for e in events[first_end:]), "no request ran on"


def test_prompts_file_lines_come_as_requests_end_and_ctrl_c_keeps_them(tmp_path, monkeypatch, one_thread):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\ufeff" + "\n".join(json.dumps(f"def f{i}(x):") for i in range(4)) + "\n", encoding="utf-8")
    import cli as command_line
    batch = command_line.generate_batch

    def interrupted(*args, on_result, **kwargs):  # Ctrl-C after the second request has ended
        def report(i, res):
            on_result(i, res)
            if len(reported) == 1:
                raise KeyboardInterrupt
            reported.append(i)
        return batch(*args, on_result=report, **kwargs)

    reported = []
    monkeypatch.setattr(command_line, "generate_batch", interrupted)
    code, out, err = cli("--prompts-file", str(path), "--batch-size", "4", "--max-new-tokens", "6", "--no-chat",
                         "--budget", "8")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 130 and len(lines) == 2 and "interrupted after 2 of 4 requests" in err, (code, out, err)
    assert all(line["text"] and line["stats"]["new_tokens"] == 6 for line in lines)


def test_eager_budget_auto_over_a_prompts_file_says_calibrating_and_reports_its_choice(tmp_path, monkeypatch,
                                                                                         one_thread, two_passes):
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path / "cache"))  # a calibration of its own
    path = tmp_path / "prompts.jsonl"
    path.write_text('"def f(x):"\n"import os"\n')
    code, out, err = cli("--prompts-file", str(path), "--max-new-tokens", "6", "--no-chat", "--budget", "auto")
    assert code == 0, err
    assert "s calibrating)" in err and "compiling" not in err and "auto: best" in err, err


def test_batch_size_needs_a_prompts_file():
    assert_one_error_line(*cli("--prompt", "x", "--method", "ar", "--batch-size", "2")[::2],
                          "--batch-size goes with --prompts-file")


def test_a_long_prompt_in_chunks_is_the_prompt_in_one_pass(pair, monkeypatch):
    # The prefill chunk follows the device (ddtree.PREFILL_CHUNKS): a 1,000-token prompt in chunks of 128 leaves
    # the caches and the first token of the same prompt in one 1,024-row pass, and the same tokens after.
    from ddtree import Engine, Speculation, cache_length
    target, drafter = pair
    prompt = torch.randint(2, VOCAB, (1000,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = Speculation(budget=6)
    state, tokens = [], []
    for chunk in (128, 1024):
        monkeypatch.setattr(ddtree, "PREFILL_CHUNK", chunk)
        engine = Engine(target, drafter, "ddtree", Sampling(), spec, cache_length(1000, 16, "ddtree", spec, drafter),
                        compile=False)
        assert engine.prefill_mask.q_len == chunk
        first = engine.start([prompt], [0])
        state.append([c[:, :, :1000].clone() for c in engine.kv_caches()])
        ddtree._ENGINES.clear()
        tokens.append((first, generate(target, drafter, prompt, budget=6, max_new_tokens=16, stop_ids=[]).tokens))
    for chunked, whole in zip(*state):
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    assert tokens[0] == tokens[1]
    # a CUDA engine's chunk is the larger one, and its cache holds the prompt in whole chunks of it
    monkeypatch.undo()
    assert ddtree.prefill_chunk("cuda") == 512 and ddtree.prefill_chunk("cpu") == 128
    assert cache_length(600, 16, "ar", Speculation(), None, device_type="cuda") == 2048
    assert cache_length(600, 16, "ar", Speculation(), None, device_type="cpu") == 1024


@pytest.mark.parametrize("method, kw", SHRINKING[:2], ids=[m for m, _ in SHRINKING[:2]])
def test_a_shrinking_batch_survives_the_smaller_engines_warm_up(pair, monkeypatch, method, kw):
    # Requests move to the smaller engine's rows in place (batch.take); a smaller engine that is new warms up
    # first, with a dummy request in every row: the moved requests' first slots must come back intact.
    target, drafter = pair
    init = ddtree.Engine.__init__
    warmed = []

    def cold(engine, *args, **kwargs):  # every engine starts as a compiled one does: needing its warm-up
        init(engine, *args, **kwargs)
        engine.warm = False
        warm_up = engine.warm_up
        engine.warm_up = lambda: (warmed.append(engine.batch), warm_up())[1]

    prompts, seeds = ragged_prompts(7, seed=7), list(range(30, 37))
    run = lambda prompts, seeds: generate_batch(target, drafter, prompts, method=method, max_new_tokens=30,
                                                seeds=seeds, stop_ids=[STOP], max_batch=8, **grouped(kw))
    lone = [run([p], [s])[0] for p, s in zip(prompts, seeds)]
    ddtree._ENGINES.clear()
    monkeypatch.setattr(ddtree.Engine, "__init__", cold)
    together = run(prompts, seeds)
    assert [r.tokens for r in together] == [r.tokens for r in lone]
    assert len(warmed) > 1, warmed  # smaller engines were warmed up mid-run
