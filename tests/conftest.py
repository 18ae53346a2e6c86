"""Shared test setup: import the flat top-level modules (`import model`, `import tree_attn`, ...) from the repo
root, and silence eager FlexAttention's CPU warning (expected: the tests run flex_attention uncompiled)."""

import contextlib
import io
import os
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def pytest_configure(config):
    # torch 2.13 warns once per process: "flex_attention called without torch.compile() - this will use an
    # unfused implementation that materializes the full scores matrix ..." (torch/nn/attention/flex_attention.py).
    config.addinivalue_line("filterwarnings",
                            "ignore:flex_attention called without torch.compile:UserWarning")


# Every test file, longest first (each alone, its compiling included: tests/README.md has the times). The two workers
# (pytest.ini) take whole files in collection order, each the next as it finishes one: a long file taken late would
# end the run alone while the other worker idles, so the long ones go first and the short ones last. A file not
# listed goes first (its time unknown, it is taken while the other worker still has long files to run).
LONGEST_FIRST = ("test_speculative.py", "test_budget.py", "test_reliability.py", "test_compiled_acceptance.py",
                 "test_moe.py", "test_draft_window.py", "test_hybrid_generate.py", "test_tp.py", "test_cpu.py",
                 "test_tree_attn.py", "test_gpu_check.py", "test_stat.py", "test_model.py", "test_bench_datasets.py",
                 "test_draft_tree.py", "test_hybrid_model.py", "test_lattice.py", "test_gated_delta.py",
                 "test_batch.py", "test_generate.py", "test_gemma4.py", "test_bench.py", "test_training.py",
                 "test_rope_scaling.py", "test_sampler.py", "test_dflash_reference.py", "test_graph_pool.py",
                 "test_memory.py", "test_drafter_options.py", "test_core_size.py")


def pytest_collection_modifyitems(config, items):
    """Files not in LONGEST_FIRST first, by their number of tests, many first; then LONGEST_FIRST's order; within a
    file the tests keep their order."""
    counts = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, -1), -counts[item.path.name], item.path.name))


@pytest.fixture(scope="session", autouse=True)
def cost_cache(tmp_path_factory):
    """Budget auto's calibrations (budget.cache_file) go to a temporary directory, not the user's ~/.cache."""
    before = os.environ.get("DDTREE_CACHE_DIR")
    os.environ["DDTREE_CACHE_DIR"] = str(tmp_path_factory.mktemp("ddtree-cache"))
    yield
    if before is None:
        del os.environ["DDTREE_CACHE_DIR"]
    else:
        os.environ["DDTREE_CACHE_DIR"] = before


@pytest.fixture
def two_passes(monkeypatch):
    """Budget auto's calibrations take two passes over the candidates, however busy the machine: for the tests of
    what surrounds a calibration (its cache file, reports, the runs after it), not of its passes
    (test_budget.py::test_calibration_keeps_each_candidates_quietest_pass)."""
    import budget
    monkeypatch.setattr(budget, "CALIBRATE_PASSES", 2)
    monkeypatch.setattr(budget, "CALIBRATE_MAX_PASSES", 2)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add OpenMP spin/wake overhead (eager flex_attention on 2 shared cores
    measured 70 ms per call with 2 threads vs 9 ms with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class HostReads:
    """Counts reads of tensor values into Python (tolist, item, bool, int, float, index) while active: on a GPU
    each one is a host sync, so a compiled round should make exactly one. A request also makes one outside its
    rounds: the prefill's first token with its soundness flag (a list prompt is checked in Python, reading
    nothing). The CPU's eager attention reads how many KV slots the mask it materializes covers (cpu.dense_mask,
    on the CPU, where no read is a sync, and never on a GPU): those reads are counted apart, in mask_extents."""

    METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        import cpu
        self.count, self.mask_extents, self.saved, self.dense_mask = 0, 0, {}, cpu.dense_mask.__code__
        for name in self.METHODS:
            self.saved[name] = vars(torch.Tensor).get(name)  # None: inherited from the C base class
            setattr(torch.Tensor, name, self.counted(getattr(torch.Tensor, name)))
        return self

    def counted(self, method):
        def read(tensor, *args, **kwargs):
            if sys._getframe(1).f_code is self.dense_mask:
                self.mask_extents += 1
            else:
                self.count += 1
            return method(tensor, *args, **kwargs)
        return read

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def compiled_equals_eager(run, cases, mode=True, same_acceptance=True):
    """run(case, compile) -> Result. The first compiled case (compile=mode: True or "max-autotune") warms up; after
    it, every compiled case must give eager's tokens with no new graph, no graph break and one host read per round
    (plus a request's one: see HostReads). Every compiled case also accepts what eager accepts, round for round
    (stats["accepted"]): the verify keeps the tokens right whatever the drafter proposes, so a compiled drafter or
    tree builder that goes wrong shows only there (same_acceptance=False where the rounds depend on timings: budget
    auto). Returns the results after warm-up."""
    from torch._dynamo.utils import counters
    eager_runs = [run(c, compile=False) for c in cases]
    eager = [r.tokens for r in eager_runs]
    warm = run(cases[0], compile=mode)
    counters.clear()  # after warm-up: every later round must reuse the graphs, whatever the prompt length
    runs = []
    for c in cases[1:]:
        with HostReads() as reads:
            runs.append(run(c, compile=mode))
        assert reads.count == runs[-1].stats["rounds"] + 1, (reads.count, runs[-1].stats["rounds"])
    assert [warm.tokens] + [r.tokens for r in runs] == eager
    if same_acceptance:
        assert [r.stats["accepted"] for r in [warm] + runs] == [r.stats["accepted"] for r in eager_runs]
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    return runs


def cli(*args):
    """The command line (cli.main) in-process: (exit status, stdout, stderr)."""
    import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def assert_one_error_line(code, err, message):
    """Bad input ends as one `error:` line holding `message`, exit status 2."""
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


class GraphPool:
    """A CPU emulation of what CUDA graph trees do with the outputs of compiled steps: in inference, each replay may
    reuse the memory pool that earlier outputs live in, so an output read after any later compiled call may hold
    that call's values. Here every output of an engine's step (its round, its prefill chunk) that is not one of its
    inputs, weights, caches or masks is poisoned in place (NaN, a huge token id, False) as soon as any step of any
    engine runs again: a stale read then fails loudly or changes the tokens, where on a GPU it would be silent.
    The engines run eagerly: only their outputs' lifetime is emulated."""

    SENTINEL = 2**40 + 7

    def __init__(self):
        self.outputs = []
        self.poisoned = 0

    def install(self, monkeypatch):
        import ddtree
        init = ddtree.Engine.__init__
        pool = self

        def wrapped_init(engine, *args, **kwargs):
            init(engine, *args, **kwargs)
            engine.round = pool.wrap(engine, engine.round)
            engine.prefill_step = pool.wrap(engine, engine.prefill_step)

        monkeypatch.setattr(ddtree.Engine, "__init__", wrapped_init)
        return self

    def wrap(self, engine, step):
        def compiled_step(*args):
            self.poison()
            out = step(*args)
            owned = {t.untyped_storage().data_ptr() for t in self.state_of(engine, args)}
            self.outputs = [t for t in tensors_in(out) if t.untyped_storage().data_ptr() not in owned]
            return out
        return compiled_step

    @staticmethod
    def state_of(engine, args):
        from tree_attn import PrefixMask
        yield from tensors_in(args)
        for model in (engine.target, engine.drafter):
            if model is not None:
                yield from model.parameters()
                yield from model.buffers()
        for mask in vars(engine).values():
            if isinstance(mask, PrefixMask):
                yield from tensors_in(tuple(vars(mask).values()))

    def poison(self):
        for t in self.outputs:
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype == torch.bool:
                t.fill_(False)
            else:
                t.fill_(self.SENTINEL)
            self.poisoned += 1
        self.outputs = []


def tensors_in(obj):
    """The tensors in nested tuples and lists."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x)


# ----------------------------------------------------------------------------------------------------------------
# The shared random pair: a tiny Qwen3 target (vocabulary 16, 3 layers) and a DFlash drafter (2 layers, block 5),
# random weights large enough (std 0.35) that random drafts are often accepted. Written once per session; each
# test module loads its own models from it (engines and compiled graphs stay per module). A module that needs
# other drafters for its target, or a pair of another shape, writes them with the same three functions.

PAIR_VOCAB = 16
PAIR_STOP = 1


def pair_config(layers: int = 3, vocab: int = PAIR_VOCAB, inter: int = 128) -> dict:
    """The pair's target config (hidden 64, 4 heads of 16 over 2 KV heads, stop id PAIR_STOP)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
    from checkpoints import qwen3_config
    return qwen3_config(vocab, hidden=64, inter=inter, layers=layers, heads=4, kv_heads=2, head_dim=16,
                        eos=(PAIR_STOP, 0))


def write_target(path: str, tc: dict, seed: int = 0, std: float = 0.35):
    """Random weights for the target config tc, written as a checkpoint at path."""
    from checkpoints import random_qwen3_weights, save_checkpoint
    save_checkpoint(path, tc, random_qwen3_weights(tc, seed=seed, std=std), eos_ids=[PAIR_STOP])


def write_drafter(path: str, tc: dict, layers: int = 2, block_size: int = 5, seed: int = 5, std: float = 0.35,
                  **config):
    """A random DFlash drafter for the target config tc, reading its first and last layers (config: more of
    checkpoints.dflash_config's fields, as mask_token_id or dflash2), written as a checkpoint at path."""
    from checkpoints import dflash_config, random_dflash_weights, save_checkpoint
    dc = dflash_config(tc, layers=layers, block_size=block_size, target_layer_ids=[0, tc["num_hidden_layers"] - 1],
                       **config)
    save_checkpoint(path, dc, random_dflash_weights(dc, seed=seed, std=std))


def write_random_pair(root, target_layers: int = 3, draft_layers: int = 2) -> dict:
    """The pair's checkpoints under root/target and root/draft; returns their paths."""
    tc = pair_config(target_layers)
    write_target(str(root / "target"), tc)
    write_drafter(str(root / "draft"), tc, layers=draft_layers)
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft")}


def load_pair(files: dict):
    from drafter import DFlashDrafter
    from model import Qwen3
    return (Qwen3.from_pretrained(files["target"], device="cpu"),
            DFlashDrafter.from_pretrained(files["draft"], device="cpu"))


@pytest.fixture(scope="session")
def random_pair_files(tmp_path_factory):
    return write_random_pair(tmp_path_factory.mktemp("random-pair"))


def written_once(root, write):
    """name -> (its directory under root, write(name, directory)): each checkpoint written on first use, then
    shared (the module fixtures' checkpoint cache)."""
    built = {}

    def get(name):
        if name not in built:
            path = str(root / name)
            built[name] = (path, write(name, path))
        return built[name]

    return get


def random_prompts(n: int, vocab: int, longest: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1 to longest - 1 random token ids, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, longest, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


class WeightReads(torch.overrides.TorchFunctionMode):
    """Counts F.linear calls while active: each one is a GEMM that streams one weight, what a decode step's time
    is made of on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def float64_kept():
    """While active, `.float()` and `.to(torch.float32)` leave float64 tensors float64 (see the module doc)."""
    float_, to = torch.Tensor.float, torch.Tensor.to

    def kept_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else float_(self, *args, **kwargs)

    def kept_to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to = kept_float, kept_to
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = float_, to


def causal(n: int, device=None) -> torch.Tensor:
    """The lower-triangular allow matrix of n rows (a prefill chunk's), for tests that write a mask's rows out."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
