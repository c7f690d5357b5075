"""Timing for the GPU benchmarks: warm-up, one clock pair per repetition, the median.

What ``time_ms`` guarantees (tests/test_benchmarks.py checks it with a fake clock):
  1. every callable runs once untimed first (JIT compilation, first allocations of each buffer set);
  2. a warm-up of about ``warmup_ms`` follows (GPU clocks ramp up), also untimed;
  3. each timed repetition sits between its own pair of clock marks, the callables taken in turn
     (one per copy of the inputs, so that L2 does not keep the previous repetition's inputs);
  4. elapsed times are read after ``clock.synchronize()``, and their median is reported.

A clock has ``mark()`` (a CUDA event recorded on the current stream, or a host time),
``elapsed_ms(start, stop)`` and ``synchronize()``; tests inject a fake one.
"""
import collections
import math
import statistics
import time

#: median milliseconds per call, and every repetition's milliseconds
Timing = collections.namedtuple("Timing", "ms samples")


class CudaClock:
    """Marks are CUDA events on CuPy's current stream (PyTorch's default stream is the same one)."""

    def __init__(self):
        import cupy
        self._cuda = cupy.cuda

    def mark(self):
        event = self._cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start, stop):
        return self._cuda.get_elapsed_time(start, stop)

    def synchronize(self):
        self._cuda.Device().synchronize()


class PerfClock:
    """Host time (``time.perf_counter``) for synchronous callables, e.g. the CUDA emulator."""

    def mark(self):
        return time.perf_counter()

    def elapsed_ms(self, start, stop):
        return (stop - start) * 1e3

    def synchronize(self):
        pass


def time_ms(fns, clock, warmup_ms=50.0, rep_ms=200.0, min_repeats=10, max_repeats=500):
    """Median time of one call, cycling through ``fns`` (zero-argument callables, one per copy
    of the inputs). Repetitions: about ``rep_ms`` worth, at least ``min_repeats``."""
    for fn in fns:  # untimed first calls: compilation and first allocations happen here
        fn()
    clock.synchronize()
    per_call = max(_pass_ms(fns, clock), 1e-3)
    _calls(fns, math.ceil(warmup_ms / per_call))
    repeats = min(max(math.ceil(rep_ms / per_call), min_repeats), max_repeats)
    marks = []
    for i in range(repeats):
        start = clock.mark()
        fns[i % len(fns)]()
        marks.append((start, clock.mark()))
    clock.synchronize()
    samples = [clock.elapsed_ms(start, stop) for start, stop in marks]
    return Timing(statistics.median(samples), samples)


def _pass_ms(fns, clock):
    """Mean time of one call over one pass through ``fns``: sizes the warm-up and the repeats."""
    start = clock.mark()
    _calls(fns, len(fns))
    stop = clock.mark()
    clock.synchronize()
    return clock.elapsed_ms(start, stop) / len(fns)


def _calls(fns, n):
    for i in range(n):
        fns[i % len(fns)]()


def copies_for_l2(nbytes, l2_bytes, most=8):
    """How many copies of inputs of ``nbytes`` to cycle through so that the set touched between two
    uses of one copy exceeds twice the L2 cache (1 when one copy already does)."""
    return max(1, min(most, math.ceil(2 * l2_bytes / max(nbytes, 1))))
