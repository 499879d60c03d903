"""mapa.toml as mapa doctor's checks read it: strictly for its own line, leniently for the others,
so that one bad key does not make every other check judge the defaults instead of what the admin
wrote."""

from __future__ import annotations

import re

from ....errors import MapaError
from ...config import HookConfig, config_from_text


def parse_config(text: str | None, source: str = "mapa.toml") -> tuple[HookConfig, str]:
    """mapa.toml as the checks use it, and its problem ("" when valid, strictly: with the engine's
    validation, as the Prolog reads it). An invalid one still yields what the Epilog's lenient read
    gives, or the defaults (what the hooks then run with)."""
    if text is None:
        return HookConfig(), "not read"
    try:
        return config_from_text(text, source=source, validate=True), ""
    except MapaError as error:
        problem = str(error)
    for candidate in (text, _without_unknown_keys(text), *_without_each_key(text)):
        if candidate is None:
            continue
        try:
            return config_from_text(candidate, source=source, validate=False), problem
        except MapaError:
            continue
    return HookConfig(), problem


def _top_level_keys(text: str) -> set[str] | None:
    import tomllib

    try:
        return set(tomllib.loads(text))
    except tomllib.TOMLDecodeError:
        return None


def _without_keys(text: str, dropped: set[str]) -> str:
    """``text`` less the top-level keys and tables named in ``dropped`` (line by line: a value
    spread over lines is not followed; the caller parses what is left)."""
    kept, table = [], None
    for line in text.splitlines(keepends=True):
        header = re.match(r"\s*\[+\s*\"?([A-Za-z0-9_-]+)", line)
        if header:
            table = header.group(1)
        key = re.match(r"\s*\"?([A-Za-z0-9_-]+)\"?\s*=", line)
        if (table in dropped) or (table is None and key and key.group(1) in dropped):
            continue
        kept.append(line)
    return "".join(kept)


def _without_unknown_keys(text: str) -> str | None:
    """``text`` less its unknown top-level keys and tables (a misspelled key), so that the other
    checks judge what the admin meant; None when that cannot be done simply."""
    from ...config import _KEYS, _OTHER_TOOLS_SECTIONS

    keys = _top_level_keys(text)
    unknown = (keys or set()) - _KEYS - _OTHER_TOOLS_SECTIONS
    return _without_keys(text, unknown) if unknown else None


def _without_each_key(text: str) -> list[str]:
    """``text`` less one of its top-level keys, for each: a key with a value of the wrong type
    (``prolog_budget = "fast"``) leaves the others, [nodes] among them, to be judged as written."""
    keys = _top_level_keys(text) or set()
    return [_without_keys(text, {key}) for key in sorted(keys)]
