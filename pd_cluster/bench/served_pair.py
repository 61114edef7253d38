"""The keys of two served runs on one machine and one load, P + D against mixed nodes, from their
JSONs (``python -m pd_cluster.bench.served --out DIR``): saturation, and goodput (the highest swept
rate at which 90% of requests met the SLO) at the run's SLO and at its second TPOT SLO.

    python -m pd_cluster.bench.served_pair --name tp_70b --pd PD.json --mixed MIXED.json \\
        --out docs/benchmarks/serve-70b-keys.json

writes ``<name>_pd_saturation_vs_mixed``, ``<name>_pd_goodput_vs_mixed`` and
``<name>_pd_goodput_alt_vs_mixed`` (P + D over mixed: above 1, disaggregation serves more).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; where a side met the SLO at no swept rate, None (no ratio to tell)."""
    return a / b if a is not None and b else None


def served_pair_keys(pd: dict[str, Any], mixed: dict[str, Any], name: str) -> dict[str, Any]:
    """The keys (see the module's docstring) and what they were computed from."""
    if pd.get("slo") != mixed.get("slo") or pd.get("alt_slo") != mixed.get("alt_slo"):
        raise ValueError(f"the runs were judged at different SLOs: {pd.get('slo')} {pd.get('alt_slo')} vs "
                         f"{mixed.get('slo')} {mixed.get('alt_slo')}")
    sides = {"pd": pd, "mixed": mixed}
    facts = {side: {"local_args": doc.get("local_args"), "model_shape": doc.get("model_shape"),
                    "saturation_request_throughput": doc.get("saturation_request_throughput"),
                    "max_rate_at_slo": doc.get("max_rate_at_slo"),
                    "max_rate_at_alt_slo": doc.get("max_rate_at_alt_slo")} for side, doc in sides.items()}
    return {
        f"{name}_pd_saturation_vs_mixed": _ratio(pd.get("saturation_request_throughput"),
                                                mixed.get("saturation_request_throughput")),
        f"{name}_pd_goodput_vs_mixed": _ratio(pd.get("max_rate_at_slo"), mixed.get("max_rate_at_slo")),
        f"{name}_pd_goodput_alt_vs_mixed": _ratio(pd.get("max_rate_at_alt_slo"), mixed.get("max_rate_at_alt_slo")),
        "slo": pd.get("slo"),
        "alt_slo": pd.get("alt_slo"),
        "runs": facts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="prefix of the keys, e.g. tp_70b")
    parser.add_argument("--pd", required=True, type=Path, help="the P + D run's JSON")
    parser.add_argument("--mixed", required=True, type=Path, help="the mixed nodes' run's JSON")
    parser.add_argument("--out", type=Path, default=None, help="write the keys here (default: print only)")
    args = parser.parse_args(argv)
    keys = served_pair_keys(json.loads(args.pd.read_text()), json.loads(args.mixed.read_text()), args.name)
    keys["runs"]["pd"]["file"], keys["runs"]["mixed"]["file"] = args.pd.name, args.mixed.name
    text = json.dumps(keys, indent=2) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
