"""Model files: the TOML text of an effective-bandwidth model read into a model and written back,
and the models shipped in ``data/models`` (the paper's DGX-1 V100 model, the per-server ones,
the link-bound reporting model).

Errors name the file, what is wrong in it and what is accepted. Imports :mod:`.effbw` (the model
types) and :mod:`.links`; its only reads are model files, through ``textfile.py`` for an
admin's file.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError, toml_text
from .effbw import _SELECTOR, _TERM, MODEL_KINDS, MODEL_TIES, EffectiveBandwidthModel, LinkBoundModel, Term
from .links import PCIE_LEVELS


def model_from_dict(data: Mapping[str, Any], *, source: str = "model") -> EffectiveBandwidthModel:
    """Build a model from the parsed TOML of a model file, with errors that name ``source``."""
    classes = data.get("classes")
    terms = data.get("terms")
    kind = data.get("kind", "regression")
    if kind not in MODEL_KINDS:
        raise InputError(f"{source}: unknown model kind {kind!r} (accepted: {', '.join(MODEL_KINDS)})")
    if not isinstance(classes, Mapping) or not classes:
        raise InputError(f"{source}: needs a [classes] table, e.g. x1 = [\"NV>=2\", \"NVS\"]")
    fitted = _fitted_range(data.get("fitted_gpus"), source, "fitted_gpus", "GPU counts")
    metadata = {
        "fitted_gpus": fitted,
        "fitted_edges": _fitted_range(data.get("fitted_edges"), source, "fitted_edges", "edge counts"),
        "fitted_links": _fitted_links(data.get("fitted_links"), source),
        "basis": _basis(data.get("basis"), source),
        "ties": _ties(data.get("ties"), source),
    }
    if kind == "bottleneck":
        model = _bottleneck_from_dict(data, classes, source=source)
        if model.class_curves and metadata["fitted_edges"] is None:
            # A curve's points are the edge counts it was built on: beyond them it is flat, an extrapolation.
            points = [edges for curve in model.class_curves for edges, _ in curve]
            metadata["fitted_edges"] = (min(points), max(points))
        return replace(model, **metadata)
    if not isinstance(terms, Mapping) or not terms:
        raise InputError(f"{source}: needs a [terms] table of term = coefficient, e.g. \"x1*x2\" = -7.97")
    names, selectors = _parse_classes(classes, source=source)
    parsed: list[Term] = []
    for text, coefficient in terms.items():
        match = _TERM.match(text.replace(" ", ""))
        if not match:
            raise InputError(f"{source}: unknown term {text!r} (accepted: products like x1*x2 or inverses like 1/(x1*x2+1))")
        product = match.group("product") or match.group("inverse")
        variables = tuple(int(v[1:]) - 1 for v in product.split("*"))
        for index in variables:
            if not 0 <= index < len(names):
                raise InputError(f"{source}: term {text!r} uses x{index + 1}, but only {', '.join(names)} are defined")
        if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)):
            raise InputError(f"{source}: term {text!r} needs a number, got {toml_text(coefficient)}")
        parsed.append(Term(variables=variables, inverse=match.group("inverse") is not None, coefficient=float(coefficient)))
    return EffectiveBandwidthModel(
        name=str(data.get("name", source)),
        class_names=names,
        selectors=selectors,
        terms=tuple(parsed),
        description=str(data.get("description", "")),
        **metadata,
    )


MODEL_BASES = ("fitted", "published", "derived")
_LINK_TOKEN = re.compile(r"^(?:NVS?[1-9][0-9]?|XGMI(?:0|[1-9][0-9]?)|PCIE|PIX|PXB|PHB|NODE|SYS)$")


def _fitted_range(value: Any, source: str, key: str, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
        or value[0] > value[1]
    ):
        raise InputError(f"{source}: {key} must be [LOW, HIGH], two {what} with LOW <= HIGH (e.g. [2, 5]), got {toml_text(value)}")
    return (value[0], value[1])


def _fitted_links(value: Any, source: str) -> tuple[tuple[str, float], ...]:
    """``[fitted_links]``: link token = the GB/s that link had where the model's numbers were taken."""
    if value is None:
        return ()
    accepted = "a table of link token = GB/s, e.g. NV2 = 50.0, NVS12 = 300.0, XGMI4 = 200.0, PCIE = 12.0 (any PCIe level)"
    if not isinstance(value, Mapping) or not value:
        raise InputError(f"{source}: fitted_links must be {accepted}; got {toml_text(value)}")
    links = []
    for token, bandwidth in value.items():
        if not _LINK_TOKEN.match(token):
            raise InputError(f"{source}: fitted_links: unknown link token {token!r} ({accepted})")
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise InputError(f"{source}: fitted_links: {token} needs a positive number of GB/s, got {toml_text(bandwidth)}")
        links.append((token, float(bandwidth)))
    return tuple(links)


def _basis(value: Any, source: str) -> str:
    if value is None:
        return ""
    if value not in MODEL_BASES:
        raise InputError(f"{source}: basis must be one of {', '.join(MODEL_BASES)} (how its numbers were obtained), got {toml_text(value)}")
    return str(value)


def _ties(value: Any, source: str) -> str:
    if value is None:
        return "rings"
    if value not in MODEL_TIES:
        raise InputError(f"{source}: ties must be \"rings\" (among sets priced equal, the one whose links carry the most "
                         f"rings) or \"first\" (the first found, as the paper's reference implementation), got {toml_text(value)}")
    return str(value)


def _parse_classes(classes: Mapping[str, Any], *, source: str) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    names = tuple(classes)
    expected = tuple(f"x{i + 1}" for i in range(len(names)))
    if names != expected:
        raise InputError(f"{source}: classes must be named {', '.join(expected)} in that order, got {', '.join(names)}")
    selectors: list[tuple[str, ...]] = []
    for name, values in classes.items():
        if not isinstance(values, list) or not values:
            raise InputError(f"{source}: class {name} must be a non-empty list of link selectors")
        for value in values:
            if not isinstance(value, str) or not _SELECTOR.match(value):
                raise InputError(
                    f"{source}: class {name}: unknown link selector {value!r} "
                    f"(accepted: NV<n>, NV>=<n>, NVS, NVS>=<n>, PCIE, {', '.join(PCIE_LEVELS)})"
                )
        selectors.append(tuple(values))
    return names, tuple(selectors)


def _bottleneck_from_dict(data: Mapping[str, Any], classes: Mapping[str, Any], *, source: str) -> EffectiveBandwidthModel:
    names, selectors = _parse_classes(classes, source=source)
    bandwidths = data.get("bandwidths")
    if not isinstance(bandwidths, Mapping) or set(bandwidths) != set(names):
        raise InputError(f"{source}: a bottleneck model needs a [bandwidths] table with one GB/s value per class ({', '.join(names)})")
    if data.get("terms"):
        raise InputError(f"{source}: a bottleneck model has no [terms] (it predicts the slowest used class's bandwidth)")
    values: list[float] = []
    curves: list[tuple[tuple[int, float], ...]] = []
    for name in names:
        value = bandwidths[name]
        if isinstance(value, Mapping):
            curve = _curve(value, f"{source}: bandwidth of {name}")
            curves.append(curve)
            values.append(max(v for _, v in curve))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"{source}: bandwidth of {name} must be a positive number of GB/s or a table of edges = GB/s "
                             f"(e.g. {{ 2 = 208.0, 8 = 232.5 }}), got {toml_text(value)}")
        values.append(float(value))
        curves.append(())
    return EffectiveBandwidthModel(
        name=str(data.get("name", source)),
        class_names=names,
        selectors=selectors,
        terms=(),
        description=str(data.get("description", "")),
        kind="bottleneck",
        class_bandwidths=tuple(values),
        class_curves=tuple(curves) if any(curves) else (),
    )


def _curve(table: Mapping[str, Any], where: str) -> tuple[tuple[int, float], ...]:
    accepted = "a table of edge count = GB/s, e.g. { 2 = 208.0, 8 = 232.5 } (a k-GPU ring has k edges)"
    points = []
    for key, value in table.items():
        if not str(key).isdigit() or not 1 <= int(key) <= 4096:
            raise InputError(f"{where}: {key!r} is not an edge count ({accepted})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"{where}: {key} edges needs a positive number of GB/s, got {toml_text(value)} ({accepted})")
        points.append((int(key), float(value)))
    if not points:
        raise InputError(f"{where}: an empty table ({accepted})")
    return tuple(sorted(points))


def model_to_toml(model: EffectiveBandwidthModel, *, comments: tuple[str, ...] = ()) -> str:
    """The model file text for ``model`` (loads back to an equal model)."""
    lines = [f"# {line}" if line else "#" for line in comments]
    lines.append(f"name = {_toml_string(model.name)}")
    if model.description:
        lines.append(f"description = {_toml_string(model.description)}")
    if model.kind != "regression":
        lines.append(f"kind = {_toml_string(model.kind)}")
    if model.basis:
        lines.append(f"basis = {_toml_string(model.basis)}")
    if model.ties != "rings":
        lines.append(f"ties = {_toml_string(model.ties)}")
    if model.fitted_gpus is not None:
        lines.append(f"fitted_gpus = [{model.fitted_gpus[0]}, {model.fitted_gpus[1]}]")
    if model.fitted_edges is not None:
        lines.append(f"fitted_edges = [{model.fitted_edges[0]}, {model.fitted_edges[1]}]")
    if model.fitted_links:
        lines += ["", "[fitted_links]"]
        lines += [f"{token} = {value!r}" for token, value in model.fitted_links]
    lines += ["", "[classes]"]
    for name, selectors in zip(model.class_names, model.selectors):
        lines.append(f"{name} = [{', '.join(_toml_string(s) for s in selectors)}]")
    if model.kind == "bottleneck":
        lines += ["", "[bandwidths]"]
        curves = model.class_curves or ((),) * len(model.class_names)
        for name, value, curve in zip(model.class_names, model.class_bandwidths, curves):
            if curve:
                lines.append(f"{name} = {{ {', '.join(f'{edges} = {gbps!r}' for edges, gbps in curve)} }}")
            else:
                lines.append(f"{name} = {value!r}")
    else:
        lines += ["", "[terms]"]
        for term in model.terms:
            lines.append(f"{_toml_string(term_text(term))} = {term.coefficient!r}")
    return "\n".join(lines) + "\n"


def term_text(term: Term) -> str:
    product = "*".join(f"x{index + 1}" for index in term.variables)
    return f"1/({product}+1)" if term.inverse else product


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_model_text(text: str, *, source: str) -> EffectiveBandwidthModel:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{source}: not valid TOML: {error}") from None
    return model_from_dict(data, source=source)


def load_model_file(path: str) -> EffectiveBandwidthModel:
    """A model file named by an admin (``--model``, the hooks' ``model`` key)."""
    from ..textfile import read_text  # strict UTF-8, one-line errors (never a decode traceback)

    accepted = "a UTF-8 TOML model file with [classes] and [terms] or [bandwidths] (docs/calibration.md)"
    return load_model_text(read_text(path, what="model file", accepted=accepted), source=path)


_MODELS_DIR = Path(__file__).resolve().parent.parent / "data" / "models"
GROUNDED_MODEL_FILE = "link-bound.toml"
GROUNDED_MODEL_NAME = GROUNDED_MODEL_FILE[:-5]


PAPER_MODEL = "mapa-paper-dgx1"
# The paper's regression's name before it stopped being the DGX-1 V100's default (decision records
# and configs of earlier releases name it): still read as the paper's model.
PAPER_MODEL_OLD_NAME = "mapa-dgx1-v100"
# Models that reproduce a paper and rank no server unless asked for by name.
REPRODUCTION_ONLY = frozenset({PAPER_MODEL})


@lru_cache(maxsize=None)
def paper_model() -> EffectiveBandwidthModel:
    """The MAPA paper's DGX-1 V100 regression (its Table 2), shipped as package data under its own
    name; no server's default (docs/engine.md, "The paper's model")."""
    # A path next to the package, not importlib.resources: the Prolog pays for every import.
    text = (_MODELS_DIR / f"{PAPER_MODEL}.toml").read_text()
    return load_model_text(text, source=f"{PAPER_MODEL}.toml")


def bundled_model_names() -> list[str]:
    """Names of the model files shipped with the package (``--model NAME``)."""
    # os.listdir, not Path.glob: the same names at a fraction of the cost, paid by every Prolog.
    return sorted(name[:-5] for name in os.listdir(_MODELS_DIR) if name.endswith(".toml") and name != GROUNDED_MODEL_FILE)


_FIRST_TABLE = re.compile(r"^[ \t]*\[", re.MULTILINE)
_BASIS_LINE = re.compile(r'^basis = "([a-z]*)"[ \t]*$', re.MULTILINE)


@lru_cache(maxsize=None)
def bundled_model_basis(name: str) -> str:
    """A bundled model's ``basis``, what :func:`bundled_model` would say, without parsing the
    whole file where its top-level keys (the lines before its first table) hold a plain
    ``basis = "word"`` line, or no file line says "basis" at all: choosing a server's model
    (server_models.matching_model) then parses only the candidates' files, not every derived
    model's (about 3 ms of a fresh Prolog's first decision). Anything else (a multi-line string
    there, another spelling) is read by parsing the whole file."""
    text = (_MODELS_DIR / f"{name}.toml").read_text()
    first_table = _FIRST_TABLE.search(text)
    head = text[:first_table.start()] if first_table else text
    found = _BASIS_LINE.search(head)
    if found and '"""' not in head and "'''" not in head:
        return _basis(found.group(1), f"{name}.toml")
    if "basis" not in text:
        return ""
    return bundled_model(name).basis


def is_bundled_model(name: str) -> bool:
    """Whether ``name`` names a bundled model (its file's stem, or the paper model's old name)."""
    return name == PAPER_MODEL_OLD_NAME or name in bundled_model_names()


def load_model(name_or_path: str) -> EffectiveBandwidthModel:
    """A model file by path, or a bundled model by name (``mapa-paper-dgx1``, ``bottleneck-generic``)."""
    if os.path.isfile(name_or_path):
        return load_model_file(name_or_path)
    stem = name_or_path[:-5] if name_or_path.endswith(".toml") else name_or_path
    if stem == GROUNDED_MODEL_FILE[:-5]:
        raise InputError(
            f"model {name_or_path!r} is the link-bound reporting model: it scores a chosen GPU set but cannot rank "
            f"placements (accepted: a model file or one of {', '.join(bundled_model_names())})"
        )
    if is_bundled_model(stem):
        return bundled_model(stem)
    raise InputError(f"no model file or bundled model {name_or_path!r} (accepted: a model file path or one of {', '.join(bundled_model_names())})")


@lru_cache(maxsize=None)
def bundled_model(name: str) -> EffectiveBandwidthModel:
    """A model shipped in ``data/models`` by its name (the file's stem), read once."""
    if name in (PAPER_MODEL, PAPER_MODEL_OLD_NAME):
        return paper_model()
    return load_model_text((_MODELS_DIR / f"{name}.toml").read_text(), source=f"{name}.toml")


@lru_cache(maxsize=None)
def grounded_model() -> LinkBoundModel:
    """The link-bound model shipped as ``data/models/link-bound.toml``."""
    path = _MODELS_DIR / GROUNDED_MODEL_FILE
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{path}: not valid TOML: {error}") from None
    values = []
    for key in ("efficiency", "pcie_efficiency"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise InputError(f"{path}: {key} must be a fraction in (0, 1], got {toml_text(value)}")
        values.append(float(value))
    return LinkBoundModel(name=str(data.get("name", "link-bound")), efficiency=values[0], pcie_efficiency=values[1],
                          description=str(data.get("description", "")))
