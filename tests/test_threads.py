"""The step's thread count (engine/threads.py): it follows the cores other processes leave free, and the tokens do
not depend on it, so moving it between steps never changes an output."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.threads import ThreadBudget
from quickdraft.errors import InvalidParameterError

# The budget reads the load of the whole machine: another test process beside these would be a busy core.
pytestmark = pytest.mark.alone

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.\n" * 12]


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, "two", None, 10**6, float("nan")])
def test_a_bad_thread_count_is_refused(threads):
    with pytest.raises(InvalidParameterError, match="threads must be 'auto' or a positive int"):
        ThreadBudget(threads)


@pytest.mark.parametrize("weights", ["int4", "bfloat16"])
def test_tokens_do_not_depend_on_the_thread_count(smollm2, weights):
    """Prompt chunks (torch's attention), decode steps and speculative rounds on 1 and on 2 threads."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs 2 threads")
    llm = LLM(str(smollm2), weights=weights, speculative="ngram", kv_cache_memory="128MiB")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outputs = {}
    for threads in (1, 2):
        llm.engine.threads = ThreadBudget(threads)
        llm.reset_prefix_cache()
        outputs[threads] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert torch.get_num_threads() == threads
    assert outputs[1] == outputs[2]


def test_a_budget_made_while_another_lowered_the_count_gets_the_cores_chosen_before():
    """A second LLM built while the first runs one thread for a busy core may still use both cores later."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ThreadBudget(1).apply()
        assert torch.get_num_threads() == 1
        assert ThreadBudget("auto").max_threads == 2
    finally:
        torch.set_num_threads(before)


def _threads_after(budget: ThreadBudget, seconds: float, want) -> int:
    """Apply the budget for up to ``seconds`` (as steps would) until ``want(threads)``; the last count."""
    end = time.monotonic() + seconds
    while True:
        threads = budget.apply()
        if want(threads) or time.monotonic() > end:
            return threads
        time.sleep(0.02)


def test_a_busy_core_takes_a_thread_away_and_gives_it_back():
    if not os.path.exists("/proc/stat") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs /proc and 2 cores")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        budget = ThreadBudget("auto", interval_s=0.2)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            expected = max(1, min(2, os.cpu_count() - 1))
            assert _threads_after(budget, 5.0, lambda t: t == expected) == expected
            assert torch.get_num_threads() == expected
        finally:
            hog.kill()
            hog.wait()
        assert _threads_after(budget, 5.0, lambda t: t == 2) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
