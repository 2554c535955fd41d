"""``ppmedia train CONFIG.yaml [--option value ...]``: a YAML file of training options, read against the
training parser itself (:func:`ppmedia.train.build_parser`), so every option the parser has is a key and
a key the parser does not have is refused.

A key is an option's long name without the dashes, ``batch_size`` or ``batch-size``; a flag takes
``true`` / ``false``; a comma-list option (``freeze``, ``layers_per_stage``) takes a YAML list or the
string. The launcher's keys (:data:`LAUNCH_KEYS`: ``nproc_per_node``, ``nnodes``, ``rdzv_endpoint``,
``rdzv_id``, ``local_addr``) say how ``torch.distributed.run`` starts the processes. Options on the
command line override the file's (``--steps`` replaces the file's ``epochs`` too: one of the two).
Every problem is one :class:`ConfigError` naming the file, the key and what was expected, raised before
any process starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .options import build_parser, parse_args, world_formula, world_size

__all__ = ["ConfigError", "LAUNCH_KEYS", "TrainConfig", "load_config", "option_keys"]

#: the launcher's keys (``torch.distributed.run``'s options of the same names) and their types
LAUNCH_KEYS: dict[str, type] = {"nproc_per_node": int, "nnodes": str, "rdzv_endpoint": str, "rdzv_id": str,
                                "local_addr": str}


class ConfigError(ValueError):
    """A bad configuration file or override: one line naming the file, the key and what was expected."""


@dataclass
class TrainConfig:
    """A configuration read and checked.

    Attributes:
        path: the YAML file.
        argv: the training options, the file's then the command line's (``python -m ppmedia.train ARGV``).
        args: ``argv`` parsed and checked by the training parser.
        launch: the launcher's keys (:data:`LAUNCH_KEYS`), the command line's over the file's.
        world: the processes the run takes (``pp x dp x tp``, x ``cp`` / ``ep`` where the parser has them).
    """

    path: str
    argv: list[str]
    args: argparse.Namespace
    launch: dict[str, Any] = field(default_factory=dict)
    world: int = 1


class _Raising(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # the caller names the file and the key
        raise ConfigError(message)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each long option's action by its key (``--batch-size`` -> ``batch_size``)."""
    found = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                found[option[2:].replace("-", "_")] = action
    return found


def option_keys() -> list[str]:
    """Every key a configuration file may hold: the training options' and the launcher's."""
    return sorted([*_actions(build_parser()), *LAUNCH_KEYS])


def _expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    names = {int: "an integer", float: "a number", None: "a string", str: "a string"}
    return names.get(action.type, f"a value {getattr(action, 'metavar', None) or action.dest} accepts")  # type: ignore[arg-type]


def _tokens(where: str, key: str, value: Any, action: argparse.Action) -> list[str]:
    """The command-line tokens of one file entry, its type checked by the option's own ``type``."""
    option = action.option_strings[-1]
    if action.nargs == 0:  # a flag
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: key '{key}': got {value!r}; expected true or false ({option} is a flag)")
        return [option] if value else []  # `no-pack: true` gives --no-pack, `pack: false` nothing
    if isinstance(value, list) and action.nargs is None:
        value = ",".join(map(str, value))
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: key '{key}': got {value!r}; expected {_expected(action)}")
    token = str(value)
    if callable(action.type):
        try:
            converted = action.type(token)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            detail = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else f"got {value!r}; expected {_expected(action)}"
            raise ConfigError(f"{where}: key '{key}': {detail}") from None
    else:
        converted = token
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: key '{key}': got {value!r}; expected {_expected(action)}")
    return [option, token]


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:  # pragma: no cover  pyyaml is a dependency
        raise ConfigError(f"{path}: reading YAML needs pyyaml (pip install pyyaml)") from None
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file; expected a YAML file of training options")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: got a YAML {type(data).__name__}; expected a mapping of option: value")
    return data


def _unknown(where: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.replace("-", "_"), known, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; 'python -m ppmedia.train --help' lists the options"
    return ConfigError(f"{where}: unknown key '{key}'{hint}")


def _split_launch(where: str, cli: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The command line without the launcher's options (``--nnodes 2``), and those options."""
    rest, launch, i = [], {}, 0
    while i < len(cli):
        name, eq, inline = cli[i].partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key in LAUNCH_KEYS:
            if not eq and i + 1 >= len(cli):
                raise ConfigError(f"{where}: {name} expects a value")
            launch[key] = inline if eq else cli[i + 1]
            i += 1 if eq else 2
            continue
        rest.append(cli[i])
        i += 1
    return rest, launch


def _launch_value(where: str, key: str, value: Any) -> Any:
    kind = LAUNCH_KEYS[key]
    if kind is int:
        try:
            number = int(str(value), 10) if not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or number < 1:
            raise ConfigError(f"{where}: key '{key}': got {value!r}; expected an integer >= 1")
        return number
    if isinstance(value, (bool, dict, list)) or value is None:
        raise ConfigError(f"{where}: key '{key}': got {value!r}; expected a string")
    return str(value)


def _given_on_command_line(cli: list[str]) -> set[str]:
    """The destinations the command line sets (parsed with every default suppressed)."""
    parser = build_parser(_Raising)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_args(cli)))
    except ConfigError as exc:
        raise ConfigError(f"command line: {exc}") from None


def _exclusive_partners(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    partners: dict[str, set[str]] = {}
    for group in parser._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        for dest in dests:
            partners.setdefault(dest, set()).update(dests)
    return partners


def _option_key(message: str, file_keys: dict[str, str]) -> str:
    """The file's key for the first option a parser message names, if the file set it."""
    for word in message.replace(":", " ").replace(",", " ").split():
        if word.startswith("--") and word[2:].replace("-", "_") in file_keys:
            return file_keys[word[2:].replace("-", "_")]
    return ""


def load_config(path: str, cli: list[str] | None = None) -> TrainConfig:
    """Read ``path``, apply the command line ``cli`` over it, and check the result as the training parser
    does (:func:`ppmedia.train.parse_args`); raises :class:`ConfigError` on the first problem."""
    data = _read_yaml(path)
    cli, launch_cli = _split_launch("command line", list(cli or []))
    parser = build_parser(_Raising)
    actions, known = _actions(parser), option_keys()
    given = _given_on_command_line(cli)
    partners = _exclusive_partners(parser)
    overridden = set().union(*(partners.get(d, {d}) for d in given)) if given else set()
    argv: list[str] = []
    launch: dict[str, Any] = {}
    file_keys: dict[str, str] = {}  # option key -> the key as the file spells it
    for raw, value in data.items():
        key = str(raw).replace("-", "_")
        if key in LAUNCH_KEYS:
            launch[key] = _launch_value(path, str(raw), value)
            continue
        if key not in actions:
            raise _unknown(path, str(raw), known)
        file_keys[key] = str(raw)
        tokens = _tokens(path, str(raw), value, actions[key])
        if actions[key].dest not in overridden:
            argv += tokens
    for key, value in launch_cli.items():
        launch[key] = _launch_value("command line", key, value)
    argv += cli
    try:
        args = parse_args(argv, parser=build_parser(_Raising))
    except ConfigError as exc:
        key = _option_key(str(exc), file_keys)
        named = f" (key '{key}' in the file)" if key else ""
        raise ConfigError(f"{path}: {exc}{named}") from None
    config = TrainConfig(path=path, argv=argv, args=args, launch=launch, world=world_size(args))
    _check_launch(config)
    return config


def _check_launch(config: TrainConfig) -> None:
    """``nproc_per_node x nnodes`` must be the run's world; several nodes need ``rdzv_endpoint``."""
    launch, world, path = config.launch, config.world, config.path
    nnodes_text = str(launch.get("nnodes", "1"))
    try:
        nnodes = int(nnodes_text.split(":")[-1])
        if nnodes < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{path}: key 'nnodes': got {nnodes_text!r}; expected an integer >= 1 (or MIN:MAX)") from None
    formula = f"{world_formula(config.args)} = {world}"
    if world % nnodes:
        raise ConfigError(f"{path}: key 'nnodes': {nnodes} nodes do not divide the run's {formula} processes")
    per_node = launch.setdefault("nproc_per_node", world // nnodes)
    if per_node * nnodes != world:
        raise ConfigError(f"{path}: key 'nproc_per_node': {per_node} x nnodes {nnodes} = {per_node * nnodes} "
                          f"processes; expected {formula}")
    if nnodes > 1 and not launch.get("rdzv_endpoint"):
        raise ConfigError(f"{path}: key 'nnodes': {nnodes} nodes meet at a rendezvous: give rdzv_endpoint (HOST:PORT)")
