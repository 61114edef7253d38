"""Late launch: the step estimates it rests on, and the engine thread running calls until the
launch is due (so a request added meanwhile joins the next step)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pd_cluster.engine.launch_timing import MAX_KEYS, MAX_WAIT_S, SHORT_STEP_SAMPLING, WINDOW, LaunchTimer
from pd_cluster.engine.outputs import EngineStats
from pd_cluster.engine.worker import EngineWorker
from tests.engine_flags import check_switch_reaches_every_node


def test_a_step_is_estimated_from_below_by_the_largest_token_count_seen_up_to_it():
    timer = LaunchTimer(min_step_s=0.002, margin_s=0.001)
    assert timer.device_estimate(8) is None  # nothing seen: launch at once
    for seconds in (0.0075, 0.0071, 0.0090):
        timer.record(8, seconds)
    timer.record(136, 0.0095)
    assert timer.device_estimate(8) == 0.0071  # the least recent step of that count
    assert timer.device_estimate(100) == 0.0071  # more tokens never take less
    assert timer.device_estimate(136) == 0.0095
    assert timer.device_estimate(4) is None  # only larger steps seen: no bound from below
    for _ in range(WINDOW):
        timer.record(8, 0.0080)
    assert timer.device_estimate(8) == 0.0080  # older steps leave the window


def test_launch_is_due_before_the_step_in_flight_ends_by_the_hosts_slowest_launch_and_a_margin():
    timer = LaunchTimer(min_step_s=0.002, margin_s=0.001)
    timer.record(8, 0.0075)
    for seconds in (0.0002, 0.0006, 0.0003):
        timer.note_launch(seconds)
    assert timer.lead_s() == pytest.approx(0.0016)
    assert timer.launch_at(100.0, 8) == pytest.approx(100.0 + 0.0075 - 0.0016)
    assert timer.launch_at(100.0, 2) is None  # no estimate
    timer.record(1, 0.0015)
    assert timer.launch_at(100.0, 1) is None  # too short a step to wait in


def test_a_late_launch_drops_the_estimate_it_came_from_and_no_wait_is_long():
    timer = LaunchTimer(min_step_s=0.002, margin_s=0.001)
    timer.record(8, 0.0075)
    timer.record(16, 0.0080)
    timer.forget(12)  # the largest count up to 12: 8's
    assert timer.device_estimate(12) is None and timer.device_estimate(16) == 0.0080
    timer.record(32, 5.0)  # a span that held the host's own stall, say
    assert timer.launch_at(100.0, 32) == pytest.approx(100.0 + MAX_WAIT_S)


def test_steps_known_too_short_to_wait_in_are_timed_once_in_a_while():
    timer = LaunchTimer(min_step_s=0.002)
    assert timer.wants(1)  # not known yet
    timer.record(1, 0.0004)
    wanted = [timer.wants(1) for _ in range(2 * SHORT_STEP_SAMPLING)]
    assert sum(wanted) == 2
    timer.record(8, 0.0075)
    assert timer.wants(8)  # long enough: every step


def test_the_timer_forgets_the_oldest_token_counts_first():
    timer = LaunchTimer()
    for key in range(MAX_KEYS + 3):
        timer.record(key + 1, 0.005)
    assert timer.device_estimate(1) is None and timer.device_estimate(3) is None
    assert timer.device_estimate(MAX_KEYS + 3) == 0.005


class _Scheduler:
    last_step = None


class _TimedEngine:
    """What the worker asks of an engine: its first step's launch is due ``delay`` from now."""

    def __init__(self, delay: float) -> None:
        self.scheduler = _Scheduler()
        self.stats = EngineStats()
        self.deadline = time.monotonic() + delay
        self.events: list[tuple[str, float]] = []
        self.stepped = threading.Event()

    def has_unfinished(self) -> bool:
        return not self.stepped.is_set()

    def launch_deadline(self) -> float | None:
        return self.deadline

    def step(self) -> list:
        self.events.append(("step", time.monotonic()))
        self.stepped.set()
        return []


def test_the_engine_thread_runs_calls_until_the_launch_is_due_then_steps():
    async def main() -> None:
        engine = _TimedEngine(delay=0.5)
        worker = EngineWorker(engine, lambda updates: None)  # type: ignore[arg-type]
        worker.start()
        try:
            # Made while the worker waits for the launch: it runs at once, before the step.
            await worker.call(lambda: engine.events.append(("call", time.monotonic())), timeout=5)
            assert [name for name, _ in engine.events] == ["call"]
            assert engine.events[0][1] < engine.deadline
            assert await asyncio.get_running_loop().run_in_executor(None, engine.stepped.wait, 5)
            assert [name for name, _ in engine.events] == ["call", "step"]
            assert engine.events[1][1] >= engine.deadline
            assert engine.stats.late_launches == 1 and engine.stats.late_launch_wait_s > 0
        finally:
            await worker.stop()
        assert worker.failed is None

    asyncio.run(main())


def test_stopping_the_worker_ends_its_wait_for_a_launch():
    async def main() -> None:
        engine = _TimedEngine(delay=60.0)
        worker = EngineWorker(engine, lambda updates: None)  # type: ignore[arg-type]
        worker.start()
        started = time.monotonic()
        await worker.stop(timeout=10)
        assert worker._thread is not None and not worker._thread.is_alive()
        assert time.monotonic() - started < 10
        assert not engine.stepped.is_set()

    asyncio.run(main())


def test_late_launch_is_asked_for_on_the_command_line_and_reaches_every_node():
    check_switch_reaches_every_node("late-launch", "late_launch")
