"""When to launch a pipelined step: just before the step in flight ends, not as soon as it starts.

With overlap scheduling the host launches step N+1 right after step N starts on the device. A
request arriving while step N runs then misses step N+1 (already launched without it) and joins
step N+2: about two and a half steps from its arrival to its first token. Launched just before
step N ends instead, step N+1 takes what arrived meanwhile, a step sooner, and the device still
never waits on the host. That needs two estimates, kept here from the steps already run: how long
the step in flight keeps the device (CUDA events around each step's kernels, by the step's token
count) and how long the host takes to schedule and launch a step.

Only steps long enough to be worth it wait (:attr:`LaunchTimer.min_step_s`): a small model's
sub-millisecond steps launch at once, as before.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import torch

#: Measured steps kept per token count, and launches kept for the host's lead.
WINDOW = 4
#: Token counts remembered (oldest forgotten first).
MAX_KEYS = 64
#: The longest wait for a launch, whatever the estimate.
MAX_WAIT_S = 0.1
#: Steps known to be too short to wait in are timed once in this many (the events cost the host
#: microseconds a step, which a small model's sub-millisecond steps feel).
SHORT_STEP_SAMPLING = 64


@dataclass
class StepMarks:
    """CUDA events before a step's first kernel and after its last (its sampling)."""

    key: int
    start: torch.cuda.Event
    end: torch.cuda.Event | None = None
    #: Whether the step before still ran once this one's kernels were queued: then the start event
    #: completed when that step ended, and the span is the device's time alone. Otherwise it may
    #: hold the host's own (a first launch, a compile, a capture) and says nothing of the step.
    device_bound: bool = False


@dataclass
class LaunchTimer:
    """Device time of steps by token count, and the host's time to launch one."""

    #: Steps estimated shorter than this launch at once: too little to win, the most to lose.
    min_step_s: float = 0.002
    #: Added to the host's slowest recent launch (a GIL hand-over, a page fault).
    margin_s: float = 0.0015
    _device_s: dict[int, deque[float]] = field(default_factory=dict)
    _keys: list[int] = field(default_factory=list)
    _launch_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW * 2))
    _skipped: int = 0

    def wants(self, key: int) -> bool:
        """Whether to time a step of ``key`` tokens: not while steps that long are known to be too
        short to wait in, but for one in :data:`SHORT_STEP_SAMPLING`, so a change is seen."""
        estimate = self.device_estimate(key)
        if estimate is None or estimate >= self.min_step_s:
            return True
        self._skipped += 1
        return self._skipped % SHORT_STEP_SAMPLING == 0

    def begin(self, key: int, device: torch.device) -> StepMarks:
        """Mark a step's start in its stream, before its first kernel is launched."""
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        return StepMarks(key, start)

    def finish(self, marks: StepMarks, device: torch.device) -> None:
        """Mark a step's end, after its last kernel (its sampling) is launched."""
        marks.end = torch.cuda.Event(enable_timing=True)
        marks.end.record(torch.cuda.current_stream(device))

    def observe(self, marks: StepMarks) -> None:
        """Take a step's device time once its tokens are read back (its end follows them at once),
        if the span measured it alone (:attr:`StepMarks.device_bound`)."""
        if marks.end is None or not marks.device_bound:
            return
        marks.end.synchronize()
        self.record(marks.key, marks.start.elapsed_time(marks.end) / 1e3)

    def record(self, key: int, seconds: float) -> None:
        """A step of ``key`` tokens kept the device ``seconds``."""
        times = self._device_s.get(key)
        if times is None:
            if len(self._keys) >= MAX_KEYS:
                self._device_s.pop(self._keys.pop(0))
            times = self._device_s[key] = deque(maxlen=WINDOW)
            bisect.insort(self._keys, key)
        times.append(seconds)

    def forget(self, key: int) -> None:
        """Drop what is known of steps up to ``key`` tokens' length: a launch timed from it came too
        late (the step ran out first), so the next ones launch at once and measure again."""
        i = bisect.bisect_right(self._keys, key)
        if i:
            self._device_s.pop(self._keys.pop(i - 1))

    def note_launch(self, seconds: float) -> None:
        """The host's time from deciding to launch a step to its kernels being queued."""
        self._launch_s.append(seconds)

    def device_estimate(self, key: int) -> float | None:
        """A step of ``key`` tokens' device time, from below: the least of the recent steps of
        the largest token count seen up to ``key`` (more tokens never take less time), so a wrong
        guess launches early (the old behaviour), never late."""
        i = bisect.bisect_right(self._keys, key)
        if i == 0:
            return None
        return min(self._device_s[self._keys[i - 1]])

    def lead_s(self) -> float:
        """How long before the step in flight ends the next launch begins."""
        return (max(self._launch_s) if self._launch_s else 0.0) + self.margin_s

    def launch_at(self, running_since: float, key: int) -> float | None:
        """When to launch the next step, on the host's monotonic clock, given that a step of
        ``key`` tokens has had the device since ``running_since``; None: launch at once."""
        estimate = self.device_estimate(key)
        if estimate is None or estimate < self.min_step_s:
            return None
        return running_since + min(estimate - self.lead_s(), MAX_WAIT_S)
