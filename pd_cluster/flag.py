"""The mark a config field carries to be a command-line flag.

A field of :class:`~pd_cluster.config.EngineConfig` annotated ``Annotated[T, Flag()]`` is a flag
of every command that builds an engine; its type, default and ``description`` (the help text) come
from the field itself, so the flag is declared once, where the setting is. Kept apart from the
config so that the config imports nothing else of ours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line, beyond what its type and default already say."""

    #: The flag's name without its dashes, where it is not the field's name with dashes.
    name: str | None = None
    #: How ``--help`` names the value (argparse's ``metavar``); None: from the field's type.
    metavar: str | None = None
    #: Launchers (``pd-cluster local``, the Ray launcher, the Helm chart) hand the flag to every
    #: node as given. False: each sets it per node itself (the model, which the master loads too,
    #: and the device and GPU share, which follow from where a node is placed).
    passed_on: bool = True
