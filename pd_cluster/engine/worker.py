"""Runs an engine on its own thread so a node's event loop never blocks on a model step.

Everything that touches the engine goes through :meth:`EngineWorker.call`, which runs the
function on the engine thread between two steps; so the engine needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pd_cluster.aio import wait_for
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.outputs import TokenUpdate
from pd_cluster.engine.step_rates import StepRates

logger = logging.getLogger(__name__)
T = TypeVar("T")

UpdateSink = Callable[[list[TokenUpdate]], None]


class EngineWorker:
    def __init__(self, engine: LLMEngine, on_updates: UpdateSink, idle_poll_s: float = 0.05) -> None:
        self.engine = engine
        self._on_updates = on_updates
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop] | None] = (
            queue.SimpleQueue()
        )
        self._idle_poll_s = idle_poll_s
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Called on the engine thread after each step (e.g. lease expiry checks).
        self.after_step: list[Callable[[], None]] = []
        self.failed: BaseException | None = None
        #: Prefill rate and decode step time, measured from the steps this thread runs.
        self.rates = StepRates()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._calls.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    async def call(self, fn: Callable[..., T], *args: Any, timeout: float = 60.0) -> T:
        """Run ``fn(*args)`` on the engine thread and return its result (or raise its error)."""
        if self.failed is not None:
            raise RuntimeError(f"engine thread died: {self.failed}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._calls.put((lambda: fn(*args), future, loop))
        return await wait_for(future, timeout)

    def _deliver(self, updates: list[TokenUpdate]) -> None:
        try:
            self._on_updates(updates)
        except Exception:
            logger.exception("token update handler failed")

    def _run_call(self, item) -> None:
        fn, future, loop = item
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting caller
            loop.call_soon_threadsafe(_set_exception, future, e)
        else:
            loop.call_soon_threadsafe(_set_result, future, result)

    def _wait_for_launch(self) -> bool:
        """Until the engine's next launch is due (:meth:`LLMEngine.launch_deadline`), run the calls
        that arrive, so requests added meanwhile join that step. False: the worker is stopping."""
        deadline = self.engine.launch_deadline()
        if deadline is None:
            return True
        waited_from = time.monotonic()
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                item = self._calls.get(timeout=remaining)
            except queue.Empty:
                break
            if item is None:
                return False
            self._run_call(item)
        stats = self.engine.stats
        stats.late_launches += 1
        stats.late_launch_wait_s += time.monotonic() - waited_from
        if stats.late_launches & (stats.late_launches - 1) == 0:  # 1, 2, 4, ...: a trace, not a flood
            logger.info("%d launches waited for the step in flight to near its end, %.2f ms each on average",
                        stats.late_launches, 1e3 * stats.late_launch_wait_s / stats.late_launches)
        return True

    def _run(self) -> None:
        engine = self.engine
        assert self._loop is not None
        try:
            while not self._stopping.is_set():
                # Calls first: they add, abort or hand over requests between steps.
                while True:
                    try:
                        item = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._run_call(item)
                if engine.has_unfinished():
                    started = time.perf_counter()
                    if not self._wait_for_launch():
                        return
                    engine.scheduler.last_step = None
                    updates = engine.step()
                    step = engine.scheduler.last_step
                    if step is not None and step.requests:
                        self.rates.record(step.q_lens, step.decode_rows, time.perf_counter() - started)
                    if updates:
                        self._loop.call_soon_threadsafe(self._deliver, updates)
                else:
                    try:
                        item = self._calls.get(timeout=self._idle_poll_s)
                    except queue.Empty:
                        item = False
                    if item is None:
                        return
                    if item:
                        self._run_call(item)
                for hook in self.after_step:
                    hook()
        except BaseException as e:
            self.failed = e
            logger.exception("engine thread failed")


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
