"""The Helm chart's ``engine`` values, made from the engine flags a launcher hands to every node.

The chart (deploy/helm/pd-cluster) takes them as a top-level ``engine`` map, which a node group's
own ``engine`` map overrides, and renders each value that is set as its flag (a key is the flag's
name in camelCase: ``maxTotalTokens`` is ``--max-total-tokens``). This module writes the block of
values.yaml that lists them and the part of values.schema.json that checks them::

    python -m pd_cluster.chart_values deploy/helm/pd-cluster
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd_cluster.config import EngineConfig
from pd_cluster.engine_flags import PASSED_ON, EngineFlag

#: values.yaml's top-level map of engine flags (each node group has one too, overriding it).
ENGINE_KEY = "engine"
#: values.schema.json's definition of such a map.
SCHEMA_DEFINITION = "engine"
WIDTH = 100

_INTRO = (
    "Engine flags of every node (`pd-cluster prefill --help`); null leaves a flag at the node's default. "
    "A node group's own `engine` map overrides them for its nodes (e.g. --set decode.engine.maxNumBatchedTokens=1024). "
    "The model, the device and the GPU share are set above and per node group. This block is written by "
    "`python -m pd_cluster.chart_values` from the engine's configuration (pd_cluster/config.py)."
)
# The block in values.yaml: its comment lines, the key, and its indented lines.
_BLOCK = re.compile(rf"^(?:#[^\n]*\n)*{ENGINE_KEY}:\n(?:[ \t][^\n]*\n)*", re.MULTILINE)


def value_key(flag: EngineFlag) -> str:
    """The flag's key in the chart's values: its name in camelCase (the chart turns it back with kebabcase)."""
    first, *rest = flag.name.split("-")
    return first + "".join(word.capitalize() for word in rest)


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                         break_on_hyphens=False)


def engine_values_yaml() -> str:
    """values.yaml's ``engine`` block: every flag a launcher passes on, commented with its help, null."""
    lines = [*_comment(_INTRO, ""), f"{ENGINE_KEY}:"]
    for flag in PASSED_ON:
        lines += _comment(f"{flag.option}: {flag.help}", "  ")
        if flag.choices:
            lines.append("  # " + " | ".join(map(str, flag.choices)))
        lines.append(f"  {value_key(flag)}: null")
    return "\n".join(lines) + "\n"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (one field's, from pydantic) that also takes null, without pydantic's titles and defaults."""
    variants = [v for v in schema.get("anyOf", [schema]) if v != {"type": "null"}]
    if len(variants) != 1:
        return {"anyOf": [*variants, {"type": "null"}]}
    out = {k: v for k, v in variants[0].items() if k not in ("title", "default", "description")}
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    if "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def engine_values_schema() -> dict[str, Any]:
    """The JSON schema of an ``engine`` map: exactly the flags a launcher passes on, each as the
    engine takes it, or null."""
    fields = EngineConfig.model_json_schema()["properties"]
    properties = {value_key(flag): {**_nullable(fields[flag.field]), "description": f"{flag.option}: {flag.help}"}
                  for flag in PASSED_ON}
    return {"type": "object", "additionalProperties": False, "properties": properties}


def write_chart(chart: Path) -> None:
    """Write the ``engine`` block into the chart's values.yaml and its schema into values.schema.json."""
    values_path = chart / "values.yaml"
    values = values_path.read_text()
    if len(_BLOCK.findall(values)) != 1:
        raise SystemExit(f"{values_path}: expected one top-level `{ENGINE_KEY}:` block to replace")
    values_path.write_text(_BLOCK.sub(lambda _: engine_values_yaml(), values))
    schema_path = chart / "values.schema.json"
    schema = json.loads(schema_path.read_text())
    schema["definitions"][SCHEMA_DEFINITION] = engine_values_schema()
    schema_path.write_text(json.dumps(schema, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_cluster.chart_values", description=__doc__.split("\n\n")[0])
    parser.add_argument("chart", type=Path, help="the chart's directory (deploy/helm/pd-cluster)")
    args = parser.parse_args(argv)
    write_chart(args.chart)
    sys.stdout.write(f"wrote the engine values of {args.chart}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
