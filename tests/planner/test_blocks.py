"""galaxy.planner.blocks: how a piece is timed (the wall time shared by the parts, samples off the line,
sizes timed again where a burst hit them)."""

import pytest
import torch

from galaxy.planner.blocks import BlockBench, off_the_line, time_pieces
from tests.planner.helpers import BERT, model_config


def test_windowed_timing_shares_the_wall_time_by_the_parts():
    """A run whose parts report 1 ms and 3 ms but take 10 ms of wall time (the rest: time the rank
    was stopped, as under a CPU quota) is charged the wall time, split 1:3: at least the 10 ms it
    slept, at most the loop's wall time over the runs (a busy host may stretch both, never break them)."""
    import time

    from galaxy.planner.blocks import windowed

    runs = []

    def once():
        runs.append(1)
        time.sleep(0.01)
        return 0.001, 0.003

    start = time.perf_counter()
    fwd, bwd = windowed(once, 0.05)
    wall = time.perf_counter() - start
    assert bwd == pytest.approx(3 * fwd, rel=1e-9)
    assert 0.01 - 1e-9 <= fwd + bwd <= wall / len(runs), (fwd + bwd, wall, len(runs))
    assert windowed(once, 0.0) == (0.001, 0.003)


def test_off_the_line_flags_a_sample_its_neighbours_disagree_with():
    sizes = [1, 2, 4, 6, 8, 10, 12]
    line = [1.0 + 0.5 * x for x in sizes]
    assert off_the_line(sizes, line, 0.1) == []
    # the last: against the line through 4 and 6 extended; a neighbour of a bad one is flagged too
    assert off_the_line(sizes, [*line[:6], line[6] * 1.3], 0.1) == [5, 6]
    assert off_the_line(sizes, [line[0] * 1.3, *line[1:]], 0.1) == [0, 1]
    assert off_the_line(sizes, [*line[:3], line[3] * 1.3, *line[4:]], 0.1) == [2, 3, 4]
    assert off_the_line(sizes, [*line[:3], line[3] * 1.05, *line[4:]], 0.1) == []
    assert off_the_line([1, 2], [1.0, 9.0], 0.1) == []


def test_time_pieces_times_a_size_again_where_a_burst_hit_every_sample():
    """Pieces that sleep 2 ms per size unit; the size-4 one 200 ms more in every call of the first
    pass (a burst longer than the repetitions, which their median keeps). It comes back near 8 ms,
    timed again with its neighbours; a size another rank asks for (``agree``) is timed again too. (The
    burst is long, so that a busy host, which stretches the sleeps, cannot make the 8 ms look like it.)"""
    import time

    bench = BlockBench(model_config(BERT), 1, 8, torch.device("cpu"), "float32")
    calls = {}

    def make(n, burst):
        def fn(x):
            calls[n] = calls.get(n, 0) + 1
            time.sleep(0.002 * n + (0.2 if burst and n == 4 and calls[n] <= 8 else 0.0))
            return x * 2
        return lambda: ([torch.ones(2, requires_grad=True)], fn)

    sizes = [1, 2, 3, 4, 5, 6, 7]
    out = time_pieces(bench, [make(n, True) for n in sizes], sizes, 3, lambda: None)
    # warm-up + 3 rounds, a training and an inference forward each (8), 3 rounds again (6), saved bytes (1)
    assert calls[3] == calls[4] == calls[5] == 15
    assert out[3][0] < 0.1 and out[3][2] < 0.1  # 208 ms with the burst
    calls.clear()
    asked = []
    time_pieces(bench, [make(n, False) for n in sizes], sizes, 3, lambda: None,
                agree=lambda mine: asked.append(mine) or sorted({*mine, 0}))
    assert len(asked) == 1 and calls[1] == 15
