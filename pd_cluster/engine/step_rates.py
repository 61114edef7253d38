"""How fast this engine runs, measured from its own steps: the prefill rate and the decode step's
time as a function of the batch. Nodes report these to the master, which prices a request on a
node (the time it would wait and compute there) with them instead of with guessed weights.

Each is a least-squares line over recent steps with exponential forgetting, so it follows the
load the node sees now: decode step seconds = base + per_request * rows, and prefill seconds =
overhead + tokens / rate (the decode rows sharing a step are priced by the decode line first).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Weight an older sample keeps per new one: about the last 100 steps count.
DECAY = 0.99
#: Samples (in decayed weight) before a line is trusted.
MIN_WEIGHT = 3.0


@dataclass
class _Line:
    """Decayed least squares of y = a + b * x (weights sum, x, y, x*x, x*y)."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.w = self.w * DECAY + 1.0
        self.sx = self.sx * DECAY + x
        self.sy = self.sy * DECAY + y
        self.sxx = self.sxx * DECAY + x * x
        self.sxy = self.sxy * DECAY + x * y

    def fit(self) -> tuple[float, float] | None:
        """(a, b) with b >= 0; a line through the origin when x barely varied; None if too few."""
        if self.w < MIN_WEIGHT or self.sx <= 0:
            return None
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mean_x * mean_x
        if var > 0.05 * mean_x * mean_x:
            b = (self.sxy / self.w - mean_x * mean_y) / var
            if b > 0:
                a = mean_y - b * mean_x
                if a >= 0:
                    return a, b
        # x barely varied (or the fit went negative): all of the time is per unit of x.
        return 0.0, self.sy / self.sx


@dataclass
class StepRates:
    """Fed by the engine thread after each step; read (as plain floats) by the status reporter."""

    decode: _Line
    prefill: _Line

    def __init__(self) -> None:
        self.decode = _Line()
        self.prefill = _Line()

    def record(self, q_lens: list[int], decode_rows: int, seconds: float) -> None:
        """One step: its rows' query lengths, how many of them decode one token, its wall time."""
        if seconds <= 0 or not q_lens:
            return
        prefill_tokens = sum(q_lens) - decode_rows
        if prefill_tokens <= 0:
            self.decode.add(float(decode_rows), seconds)
            return
        decode_s = self.decode_step_s(decode_rows) if decode_rows else 0.0
        self.prefill.add(float(prefill_tokens), max(seconds - decode_s, 0.2 * seconds))

    def decode_line(self) -> tuple[float, float] | None:
        """(seconds of a step at no batch, seconds each running request adds), or None."""
        return self.decode.fit()

    def decode_step_s(self, rows: int) -> float:
        line = self.decode.fit()
        return 0.0 if line is None else line[0] + line[1] * rows

    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second, leaving out each step's fixed cost; 0 when not measured."""
        line = self.prefill.fit()
        return 0.0 if line is None or line[1] <= 0 else 1.0 / line[1]
