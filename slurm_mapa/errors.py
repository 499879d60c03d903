"""The project's error classes. Messages say what was received and what is accepted."""

import argparse
import json
import re


class MapaError(Exception):
    """Base class of every error this project raises on purpose."""


class InputError(MapaError, ValueError):
    """Bad user or admin input (a directive, a topology file, a command-line value)."""


class InternalError(MapaError, RuntimeError):
    """A broken internal invariant: a bug in slurm-mapa, never the user's fault."""


def toml_text(value: object) -> str:
    """``value`` as TOML writes it, for error messages about mapa.toml: true, "text", [2, 4],
    {vm = 5} (not Python's True, 'text', {'vm': 5})."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(key)} = {toml_text(item)}" for key, item in value.items()) + "}"
    if hasattr(value, "isoformat"):  # TOML dates and times
        return value.isoformat()
    return str(value)


def _toml_key(key: object) -> str:
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text, ensure_ascii=False)



def error_line(prog: str, error: BaseException | str) -> str:
    """``PROG: error: what was wrong; what is accepted``: the one line every command ends bad input
    with. A directive's own "MAPA: " prefix (what sbatch users read) is dropped: no doubled prefix."""
    text = str(error)
    if text.startswith("MAPA: "):
        text = text[len("MAPA: "):]
    return f"{prog}: error: {text}"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line through the command's own handler
    (``PROG: error: ...``, exit 2), not argparse's usage block; a value of the wrong type says
    what is accepted."""

    def error(self, message: str):  # type: ignore[override]
        match = re.search(r"invalid (int|float) value: (.*)$", message)
        if match:
            kind, example = ("a whole number", "4") if match.group(1) == "int" else ("a number", "0.5")
            message = f"{message[:match.start()]}{match.group(2)} is not {kind}; accepted: {kind}, e.g. {example}"
        raise InputError(f"{message} (`{self.prog} --help` lists the options)")
