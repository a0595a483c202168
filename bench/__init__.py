"""Benchmarks (not tests): each prints its figures on its last line; see bench/RESULTS.md."""

import timeit


def interpreter_ms() -> float:
    """How quick this machine's Python is right now: the best of five timings of
    `sum(range(10**6))`, in ms. A shared VM's speed drifts by two to three times
    over a day; printed beside a run's figures, it says which runs can be compared."""
    return min(timeit.repeat("sum(range(10**6))", number=10, repeat=5)) * 100
