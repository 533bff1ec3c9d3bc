"""The kernels' parallel loop (csrc/steal.h, ``steal_for``): each thread runs its own contiguous run of the items,
then takes what is left at the back of the others' runs; every item runs exactly once. The weight products, the
per-head products and the attention kernel split their work with it (their outputs are tested against the plain
path in test_few_rows.py, test_kernels.py and the block tests)."""

import pytest
import torch
from conftest import require_kernels

from kvlm.kernels import cpu


@pytest.fixture
def ext():
    require_kernels()
    return cpu.extension()


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1001])
def test_every_item_runs_exactly_once(ext, two_threads, n):
    ran = ext.steal_for_threads(n, n // 3, 20.0)  # the first third slow: the runs end apart
    assert ran.shape == (n,)
    assert bool(((ran == 0) | (ran == 1)).all()), ran  # -1: never ran, -2: ran twice


def test_a_thread_done_with_its_run_takes_the_back_of_the_others(ext, two_threads):
    """Items 0-4 (the first thread's run) are slow: the second thread, done with items 5-9, takes the last of the
    first run from its back, and the first thread still starts at its front. Under load the second thread may
    start late, so a few tries."""
    for _ in range(5):
        ran = ext.steal_for_threads(10, 5, 20_000.0)
        assert bool(((ran == 0) | (ran == 1)).all()), ran
        first = ran[:5].tolist()
        if ran[0] == 0 and 1 in first:  # stolen from the back: a suffix of the first run
            k = first.index(1)
            assert first[k:] == [1] * (5 - k) and first[:k] == [0] * k, first
            return
    pytest.fail(f"the second thread never took an item of the first's run: {ran.tolist()}")


def test_one_thread_runs_everything_in_order(ext):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ran = ext.steal_for_threads(50, 10, 10.0)
    finally:
        torch.set_num_threads(saved)
    assert ran.tolist() == [0] * 50
