"""The fast lane's batches: calls of one loop iteration go over together, and a batch whose
wait runs out hands back the calls the lane has not started."""

from __future__ import annotations

import asyncio
import threading
import time

from agile_llmenvs.transport.fast_lane import FastLane, LaneBatcher, LaneJob


def test_one_iteration_calls_go_over_as_one_batch_run_in_order() -> None:
    lane = FastLane()
    order: list[int] = []
    threads: set[int] = set()

    def call(i: int) -> int:
        order.append(i)
        threads.add(threading.get_ident())
        return i * 10

    async def main() -> list[LaneJob | None]:
        batcher = LaneBatcher(lane, wait_s=1.0)
        futures = [batcher.add(lambda i=i: call(i)) for i in range(5)]
        return list(await asyncio.gather(*futures))

    try:
        jobs = asyncio.run(main())
    finally:
        lane.close()
    assert order == [0, 1, 2, 3, 4]
    assert len(threads) == 1
    assert threading.get_ident() not in threads
    assert all(job is not None and job.done for job in jobs)
    assert [job.result() for job in jobs if job is not None] == [0, 10, 20, 30, 40]


def test_a_batch_past_its_wait_hands_back_the_calls_not_started() -> None:
    lane = FastLane()
    release = threading.Event()
    ran: list[str] = []

    def slow() -> str:
        ran.append("slow")
        release.wait(5)
        return "slow done"

    def fast() -> str:
        ran.append("fast")
        return "fast done"

    async def main() -> tuple[LaneJob | None, LaneJob | None, float, str]:
        batcher = LaneBatcher(lane, wait_s=0.02)
        first, second = batcher.add(slow), batcher.add(fast)
        start = time.perf_counter()
        handed = await asyncio.gather(first, second)
        waited = time.perf_counter() - start
        running = handed[0]
        assert running is not None
        late = running.future(asyncio.get_running_loop())
        release.set()
        return handed[0], handed[1], waited, await late

    try:
        running, never, waited, late = asyncio.run(main())
    finally:
        lane.close()
    assert running is not None
    assert running.started
    assert never is None  # the lane did not start it: the caller runs it elsewhere
    assert late == "slow done"  # the running call's result still arrives
    assert ran == ["slow"]
    assert 0.02 <= waited < 1.0  # the loop waited the batch's bound, not the slow call


def test_a_busy_lane_starts_nothing_of_a_new_batch() -> None:
    lane = FastLane()
    release = threading.Event()

    async def main() -> tuple[LaneJob | None, LaneJob | None]:
        batcher = LaneBatcher(lane, wait_s=0.01)
        slow = await batcher.add(lambda: release.wait(5))
        assert not lane.free  # the slow call still holds the lane
        after = await batcher.add(lambda: "never on the lane")
        release.set()
        return slow, after

    try:
        slow, after = asyncio.run(main())
    finally:
        lane.close()
    assert slow is not None
    assert slow.started
    assert after is None


def test_a_call_the_lane_never_started_in_time_is_handed_back() -> None:
    lane = FastLane()
    release = threading.Event()
    try:
        holding = lane.run(lambda: release.wait(5), wait_s=0.01)  # holds the lane's thread
        assert holding is not None
        assert holding.started
        assert lane.run(lambda: "queued behind it", wait_s=0.01) is None
    finally:
        release.set()
        lane.close()
