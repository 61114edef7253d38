"""What ``pd-cluster quantize`` is asked for: the model, where to write, how to round (no torch
here, so the command line is built without it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

#: The text calibration runs the model over unless another is given: public-domain prose that the
#: quality benchmark does not score (``pd_cluster.bench.quality`` scores other texts).
CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"
METHODS = ("gptq", "rtn")
#: Columns GPTQ rounds together before their error reaches the columns after the block (the
#: algorithm's lazy batch update: the same result, one matrix product a block).
BLOCK = 128
#: GPTQ's damping added to the inputs' moment's diagonal, a fraction of its mean: it keeps the
#: inverse well conditioned where few calibration tokens leave the moment nearly singular.
DAMP = 0.1
#: Where the model's own samples begin (``sampled_tokens``): short openings of unlike kinds of
#: text, so that what it writes covers more than the calibration text's register.
SAMPLE_OPENINGS = ("Once upon a time", "The history of science", "In the year 1850,", "Dear friend,",
                   "The recipe calls for", "Chapter 1", "The following article explains", "Q: What is the capital of",
                   "def main():", "The weather today", "In mathematics, a group is", "The old man walked",
                   "Breaking news:", "Introduction\n\nThis report", "My favourite book", "The law states that")


@dataclass
class QuantizeOptions:
    """What :func:`pd_cluster.quantize.checkpoint.quantize_checkpoint` reads, how it rounds, and
    where it writes."""

    model: str
    out: Path
    method: Literal["gptq", "rtn"] = "gptq"
    calibration: Path = field(default_factory=lambda: CALIBRATION_TEXT)
    #: Calibration tokens a prefill at most (the text is cut into windows of this many).
    window: int = 512
    #: Tokens the model samples itself (from :data:`SAMPLE_OPENINGS`, seeded) to calibrate on
    #: besides the text: the moments of the widest inputs need several times their width in tokens.
    sampled_tokens: int = 4096
    damp: float = DAMP
    block: int = BLOCK
    #: GPTQ rounds the columns of the largest inputs first.
    act_order: bool = False
    device: str = "auto"
