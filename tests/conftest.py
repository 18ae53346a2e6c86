"""Shared test setup: import the flat top-level modules (`import model`, `import tree_attn`, ...) from the repo
root, and silence eager FlexAttention's CPU warning (expected: the tests run flex_attention uncompiled)."""

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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add OpenMP spin/wake overhead (eager flex_attention on 2 shared cores
    measured 70 ms per call with 2 threads vs 9 ms with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
