"""The engine's command-line flags, read from :class:`~pd_cluster.config.EngineConfig`'s marked fields.

One declaration (the field: its type, default, constraints and description) makes the argparse
argument of every command that builds an engine, the words a launcher puts on a node's command
line, and the options ``pd-cluster local`` and the Ray launcher keep for their nodes
(:class:`NodeEngineOptions`). A flag left out of a command line is ``None`` here: the engine's
default (or a node role's, see ``pd_cluster.cli.engine_config_from_args``) applies.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, Field, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

from pd_cluster.config import EngineConfig
from pd_cluster.flag import Flag

#: How a list flag is written: comma-separated, or ``none`` for the empty list.
EMPTY_LIST = "none"


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: how it is parsed, shown and written again for a node's command line."""

    field: str  # the EngineConfig field (and the argparse dest)
    name: str  # without its dashes
    help: str
    annotation: Any  # the field's type
    kind: type  # bool, int, float, str or list (of int)
    choices: tuple[Any, ...] | None
    metavar: str | None
    passed_on: bool
    #: Words the flag takes besides a value of its kind (``auto`` of ``int | Literal["auto"]``).
    words: tuple[str, ...] = ()

    @property
    def option(self) -> str:
        return f"--{self.name}"

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add the flag, defaulting to None: left out, the engine's own default applies."""
        if self.kind is bool:
            parser.add_argument(self.option, action=argparse.BooleanOptionalAction, dest=self.field, default=None,
                                help=self.help)
        else:
            parser.add_argument(self.option, dest=self.field, type=self.parse, default=None, choices=self.choices,
                                metavar=self.metavar, help=self.help)

    def parse(self, text: str) -> Any:
        """A value from its command-line text, checked as EngineConfig checks the field."""
        try:
            value = self._convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self._expected()} (got {text!r})") from None
        if self.choices is None:  # argparse checks choices itself, with a message that lists them
            try:
                EngineConfig.model_validate({self.field: value})
            except ValidationError as e:
                message = e.errors()[0]["msg"].removeprefix("Value error, ")
                raise argparse.ArgumentTypeError(f"{message[:1].lower()}{message[1:]} (got {text!r})") from None
        return value

    def _convert(self, text: str) -> Any:
        if text.strip().lower() in self.words:
            return text.strip().lower()
        if self.kind is list:
            if text.strip().lower() in ("", EMPTY_LIST):
                return []
            return [int(part) for part in text.split(",") if part.strip()]
        return self.kind(text)

    def _expected(self) -> str:
        if self.kind is list:
            return f"comma-separated integers or {EMPTY_LIST!r}"
        kind = {int: "an integer", float: "a number"}.get(self.kind, "a value")
        return " or ".join([kind, *map(repr, self.words)])

    def argv(self, value: Any) -> list[str]:
        """The words that give ``value`` to a node command ([] for None: the node's default)."""
        if value is None:
            return []
        if self.kind is bool:
            return [self.option if value else f"--no-{self.name}"]
        if self.kind is list:
            return [self.option, ",".join(map(str, value)) or EMPTY_LIST]
        return [self.option, str(value)]


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _split_words(annotation: Any) -> tuple[Any, tuple[str, ...]]:
    """``int | Literal["auto"]`` -> (int, ("auto",)): a value type that also takes some words."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return annotation, ()
    literals = [a for a in get_args(annotation) if get_origin(a) is Literal]
    rest = [a for a in get_args(annotation) if get_origin(a) is not Literal]
    words = tuple(w for lit in literals for w in get_args(lit) if isinstance(w, str))
    if len(rest) != 1 or not words or len(words) != sum(len(get_args(lit)) for lit in literals):
        return annotation, ()
    base = rest[0]
    if get_origin(base) is Annotated:
        base = get_args(base)[0]
    return base, words


def _bounds(info: FieldInfo) -> tuple[Any, Any]:
    low = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
    return low, high


def _flag_of(field: str, info: FieldInfo, mark: Flag) -> EngineFlag:
    if not info.description:
        raise TypeError(f"EngineConfig.{field} is a flag: its description is the flag's help, so it needs one")
    base, words = _split_words(_without_none(info.annotation))
    choices = None
    if get_origin(base) is Literal:
        choices = get_args(base)
        kind: type = type(choices[0])
    elif get_origin(base) is list and get_args(base) == (int,):
        kind = list
    elif base in (bool, int, float, str):
        kind = base
    else:
        raise TypeError(f"EngineConfig.{field}: no command-line form for {info.annotation!r}")
    metavar = mark.metavar
    low, high = _bounds(info)
    if metavar is None and kind is int and low is not None and high is not None:
        metavar = f"{{{low}..{high}}}"
    if metavar is None and kind is list:
        metavar = "N,N,..."
    return EngineFlag(field=field, name=mark.name or field.replace("_", "-"), help=info.description,
                      annotation=info.annotation, kind=kind, choices=choices, metavar=metavar,
                      passed_on=mark.passed_on, words=words)


def read_flags(config: type[BaseModel]) -> tuple[EngineFlag, ...]:
    """The flags of ``config``'s fields that carry a :class:`Flag`, in field order."""
    flags = []
    for field, info in config.model_fields.items():
        mark = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if mark is not None:
            flags.append(_flag_of(field, info, mark))
    return tuple(flags)


ENGINE_FLAGS: tuple[EngineFlag, ...] = read_flags(EngineConfig)
#: The flags a launcher hands to every node as given.
PASSED_ON: tuple[EngineFlag, ...] = tuple(f for f in ENGINE_FLAGS if f.passed_on)


def engine_flag(field: str) -> EngineFlag:
    """The flag of one EngineConfig field."""
    for flag in ENGINE_FLAGS:
        if flag.field == field:
            return flag
    raise KeyError(f"EngineConfig.{field} is not a command-line flag")


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         flags: Iterable[EngineFlag] = ENGINE_FLAGS) -> None:
    for flag in flags:
        flag.add_to(parser)


def given_values(args: argparse.Namespace, flags: Iterable[EngineFlag] = ENGINE_FLAGS) -> dict[str, Any]:
    """EngineConfig field -> value of each of ``flags`` the command line gave."""
    return {f.field: value for f in flags if (value := getattr(args, f.field, None)) is not None}


def engine_argv(values: Mapping[str, Any], flags: Sequence[EngineFlag] = PASSED_ON) -> list[str]:
    """The command-line words of the ``flags`` that ``values`` (EngineConfig field -> value) set."""
    return [word for flag in flags for word in flag.argv(values.get(flag.field))]


class _NodeEngineOptionsBase(BaseModel):
    """Checks the given values as the engine will, so a launcher refuses them before any node starts."""

    def engine_values(self) -> dict[str, Any]:
        """EngineConfig field -> value of every flag that was given (not None)."""
        return {f.field: value for f in PASSED_ON if (value := getattr(self, f.field)) is not None}

    def engine_argv(self) -> list[str]:
        """The words that hand the given flags to a node command."""
        return engine_argv(self.engine_values())

    @model_validator(mode="after")
    def _valid_for_the_engine(self) -> _NodeEngineOptionsBase:
        EngineConfig.model_validate(self.engine_values())
        return self


#: The flags a launcher hands to every node, each None (the node's default) unless given; the
#: options of ``pd-cluster local`` and the Ray launcher's spec extend it.
NodeEngineOptions: type[_NodeEngineOptionsBase] = create_model(
    "NodeEngineOptions",
    __base__=_NodeEngineOptionsBase,
    __module__=__name__,
    **{f.field: (Optional[f.annotation], Field(default=None, description=f.help)) for f in PASSED_ON},
)
