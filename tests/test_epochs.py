"""The schedule arithmetic both backends share, checked exhaustively on small numbers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datacat.errors import OptionError
from datacat.loading.epochs import plan_schedule, round_robin_consumed
from datacat.loading.shuffle import Feistel, RunShuffle, shard_order


@pytest.mark.parametrize("n", [1, 2, 3, 7, 55, 64, 1000, 4097])
def test_feistel_is_a_permutation_and_depends_on_key(n: int) -> None:
    perm = [Feistel(n, 1)[i] for i in range(n)]
    assert sorted(perm) == list(range(n))
    if n > 10:
        assert perm != [Feistel(n, 2)[i] for i in range(n)] and perm != list(range(n))


@pytest.mark.parametrize("n", [1, 3, 1023, 1024, 1025, 4097, 3_000_017])
def test_feistel_take_gives_what_indexing_gives_block_by_block(n: int) -> None:
    import pickle
    import random

    rng = random.Random(n)
    perm = Feistel(n, 2**64 - 5)
    batches = [range(s, min(s + 64, n)) for s in range(0, min(n, 3000), 64)]
    batches += [[rng.randrange(n) for _ in range(50)], list(range(n - min(n, 70), n))[::-1]]
    for indices in batches:
        assert perm.take(indices) == [perm[i] for i in indices]
        assert perm.take_array(np.asarray(indices, dtype=np.int64)).tolist() == [perm[i] for i in indices]
    copy = pickle.loads(pickle.dumps(perm))  # a worker's copy, its last block included
    assert copy.take(batches[0]) == [perm[i] for i in batches[0]]
    for outside in ([n], [-1], [0, n + 5]):
        with pytest.raises(IndexError):
            perm.take(outside)
        with pytest.raises(IndexError):
            perm.take_array(np.asarray(outside, dtype=np.int64))


@pytest.mark.parametrize("n", [1, 5, 16_384, 16_385, 50_000])
def test_feistel_take_range_gives_what_indexing_gives_across_blocks(n: int) -> None:
    perm = Feistel(n, 7)
    span = Feistel.SPAN
    ranges = [(0, min(n, 1024)), (max(n - 3, 0), n), (0, 0)]
    ranges += [(span - 10, min(span + 10, n)), (1, min(2 * span + 5, n))] if n > span else []
    for start, stop in ranges * 2:  # the second pass reads the kept blocks
        got = perm.take_range(start, stop)
        assert got.dtype == np.int64 and got.tolist() == [perm[i] for i in range(start, stop)]
    with pytest.raises(ValueError):
        perm.take_range(0, 1)[:1] = 3  # handed out of a kept block: read-only
    for start, stop in ((-1, 1), (0, n + 1)):
        with pytest.raises(IndexError):
            perm.take_range(start, stop)


@pytest.mark.parametrize(("n", "run"), [(1, 4), (3, 4), (64, 8), (1000, 64), (1001, 64), (4097, 7)])
def test_run_shuffle_is_a_permutation_of_runs_that_moves_each_epoch(n: int, run: int) -> None:
    perm = RunShuffle(n, 11, run)
    order = [perm[i] for i in range(n)]
    assert sorted(order) == list(range(n))
    assert perm.take_array(np.arange(n, dtype=np.int64)).tolist() == order == perm.take(range(n))
    picked = np.asarray([n - 1, 0, n // 2, n // 2], dtype=np.int64)
    assert perm.take_array(picked).tolist() == [order[i] for i in picked]
    for start, stop in ((0, n), (n // 3, n - n // 5), (max(n - 5, 0), n), (n // 2, n // 2)):  # the tail included
        assert perm.take_range(start, stop).tolist() == order[start:stop]
    # Within a run the records are neighbours (modulo n, where the turn wraps a run round).
    breaks = sum((b - a) % n != 1 for a, b in itertools.pairwise(order))
    assert breaks <= n // run + 2
    if n > 100:
        assert order != [RunShuffle(n, 12, run)[i] for i in range(n)]
        assert perm.turn != RunShuffle(n, 12, run).turn  # the runs' boundaries, and the tail, move too
    with pytest.raises(IndexError):
        perm.take_array(np.asarray([n], dtype=np.int64))
    with pytest.raises(IndexError):
        perm.take_range(0, n + 1)
    with pytest.raises(IndexError):
        perm[-1]


@pytest.mark.parametrize("steps", [False, True])
def test_schedule_is_exactly_once_with_equal_batch_counts(steps: bool) -> None:
    for records, world, batch in itertools.product(range(1, 60), range(1, 6), (1, 3, 4, 8)):
        for drop in (False, True):
            try:
                schedules = [
                    plan_schedule(records, rank=r, world_size=world, batch_size=batch, drop_remainder=drop, steps=steps)
                    for r in range(world)
                ]
            except OptionError:
                assert records < world * (batch if drop else 1) or (
                    not drop and records // world < -(-records // (world * batch))
                )
                continue
            covered = sorted(s.at(i) for s in schedules for i in range(s.count))
            for s in schedules:  # a batch's indices at once, and indices across batches, as one by one
                for indices in ([*range(s.count)], [*range(s.batch_sizes[0])][::-1], [s.count - 1, 0]):
                    assert s.at_all(indices) == [s.at(i) for i in indices]
            assert covered == list(range(len(covered)))  # no overlap, no gap: a prefix of the sequence
            if not steps:
                assert all([s.at(i) for i in range(s.count)] == list(range(s.start, s.stop)) for s in schedules)
            assert len({s.batches for s in schedules}) == 1
            assert all(0 < size <= batch for s in schedules for size in s.batch_sizes)
            if drop:
                assert all(size == batch for s in schedules for size in s.batch_sizes)
                assert records - len(covered) < world * batch  # only a tail that fills no batch everywhere
            else:
                assert len(covered) == records


def _order(records: int, world: int, batch: int, first: int = 0) -> list[list[int]]:
    """Each global step's positions, rank after rank."""
    schedules = [
        plan_schedule(records, rank=r, world_size=world, batch_size=batch, drop_remainder=False, first=first)
        for r in range(world)
    ]
    out = []
    for b in range(schedules[0].batches):
        step = []
        for s in schedules:
            lo = sum(s.batch_sizes[:b])
            step += [s.at(i) for i in range(lo, lo + s.batch_sizes[b])]
        out.append(step)
    return out


def test_global_steps_are_a_single_processs_batches_split_and_resume_on_any_world() -> None:
    records = 1000
    eight = _order(records, 8, 4)
    single = _order(records, 1, 32)
    assert eight[:-2] == single[:-2]  # rank r's batch of step g is the r-th part of one process's batch g
    assert [p for step in eight for p in step] == list(range(records))
    schedule = plan_schedule(records, rank=3, world_size=8, batch_size=4, drop_remainder=False)
    for stopped in (0, 5, 17, len(eight) - 2):
        position = schedule.position(stopped)
        assert position == 32 * stopped  # every rank stops at the same global position
        for world, batch in ((4, 4), (16, 3), (3, 7)):
            rest = _order(records, world, batch, first=position)
            delivered = [p for step in eight[:stopped] for p in step] + [p for step in rest for p in step]
            assert delivered == list(range(records)), (stopped, world, batch)
    with pytest.raises(OptionError, match="8 records left after the resume point cannot give each of 16 rank"):
        _order(records, 16, 3, first=schedule.position(len(eight) - 1))  # the last step's 8 records, 16 ranks


def test_schedule_refusals_name_the_numbers() -> None:
    with pytest.raises(OptionError, match="3 records cannot fill one batch of 2 on each of 2"):
        plan_schedule(3, rank=0, world_size=2, batch_size=2, drop_remainder=True)
    with pytest.raises(OptionError, match="3 records cannot give each of 4 rank"):
        plan_schedule(3, rank=0, world_size=4, batch_size=2, drop_remainder=False)


def test_round_robin_consumed_matches_simulation() -> None:
    for lengths in itertools.product(range(5), repeat=3):
        for taken in range(sum(lengths) + 1):
            got, n = [0, 0, 0], 0
            while n < taken:
                for k in range(3):
                    if n < taken and got[k] < lengths[k]:
                        got[k] += 1
                        n += 1
            assert round_robin_consumed(list(lengths), taken) == got


def test_torch_worker_runs_resume_in_the_uninterrupted_order() -> None:
    from datacat.backends.torch import worker_indices

    def merged(length: int, start: int, workers: int, sequential: bool) -> list[int]:
        queues = [list(worker_indices(length, start, workers, k, sequential=sequential)) for k in range(workers)]
        out = []
        while any(queues):
            for queue in queues:
                if queue:
                    out.append(queue.pop(0))
        return out

    for length, workers, sequential in itertools.product(range(12), (1, 2, 3, 4), (True, False)):
        full = merged(length, 0, workers, sequential)
        assert sorted(full) == list(range(length))
        if not sequential:
            assert full == list(range(length))  # the same order for any worker count
        for start in range(length + 1):
            assert merged(length, start, workers, sequential) == full[start:]


def test_shard_order_reshuffles_by_epoch() -> None:
    orders = [shard_order(20, seed=0, epoch=e, shuffle=True) for e in range(3)]
    assert all(sorted(o) == list(range(20)) for o in orders) and orders[0] != orders[1]
    assert shard_order(5, seed=0, epoch=0, shuffle=False) == [0, 1, 2, 3, 4]
