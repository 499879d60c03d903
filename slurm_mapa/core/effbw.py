"""Predicted effective bandwidth: a regression over the link classes a pattern's edges use.

The model is data, not code (a TOML file): the link classes it counts (``x1``, ``x2``, ...,
each a list of selectors such as ``NV1``, ``NV>=2``, ``NVS``, ``PCIE`` or a PCIe level) and one
coefficient per term. Terms are products of counts (``x1``, ``x1*x2``) or their inverses
(``1/(x1*x2+1)``), which covers the paper's 14-term model (Eq. 2, Table 2) and the
generalisations a site may fit for its own servers.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError
from .links import PCIE_LEVELS, Link

_PRODUCT = r"x[0-9]+(?:\*x[0-9]+)*"
_TERM = re.compile(rf"^(?:(?P<product>{_PRODUCT})|1/\((?P<inverse>{_PRODUCT})\+1\))$")
_SELECTOR = re.compile(r"^(?:NV(?P<ge>>=)?(?P<n>[1-9][0-9]?)|NVS(?:>=(?P<sn>[1-9][0-9]?))?|PCIE|PIX|PXB|PHB|NODE|SYS)$")


@dataclass(frozen=True)
class Term:
    variables: tuple[int, ...]  # indices into the class counts
    inverse: bool
    coefficient: float

    def value(self, counts: tuple[float, ...]) -> float:
        product = 1.0
        for index in self.variables:
            product *= counts[index]
        return self.coefficient / (product + 1.0) if self.inverse else self.coefficient * product


@dataclass(frozen=True)
class EffectiveBandwidthModel:
    name: str
    class_names: tuple[str, ...]
    selectors: tuple[tuple[str, ...], ...]
    terms: tuple[Term, ...]
    description: str = ""

    def classify(self, link: Link) -> int:
        """The index of the class that counts ``link``; the first class that matches wins."""
        for index, selectors in enumerate(self.selectors):
            if any(_matches(selector, link) for selector in selectors):
                return index
        raise InputError(
            f"effective-bandwidth model {self.name!r} counts no class for link {link.token} "
            f"(its classes: {', '.join(f'{n}={list(s)}' for n, s in zip(self.class_names, self.selectors))})"
        )

    def predict(self, counts: tuple[float, ...]) -> float:
        return sum(term.value(counts) for term in self.terms)

    @cached_property
    def _hash(self) -> int:
        return hash((self.name, self.class_names, self.selectors, self.terms))

    def __hash__(self) -> int:
        # Models key the search's caches: hash the terms once, not on every lookup.
        return self._hash


def _matches(selector: str, link: Link) -> bool:
    if selector == "PCIE":
        return link.kind == "pcie"
    if selector in PCIE_LEVELS:
        return link.kind == "pcie" and link.level == selector
    if selector.startswith("NVS"):
        if link.kind != "nvswitch":
            return False
        return selector == "NVS" or link.links >= int(selector[5:])
    if link.kind != "nvlink":
        return False
    if selector.startswith("NV>="):
        return link.links >= int(selector[4:])
    return link.links == int(selector[2:])


def model_from_dict(data: Mapping[str, Any], *, source: str = "model") -> EffectiveBandwidthModel:
    """Build a model from the parsed TOML of a model file, with errors that name ``source``."""
    classes = data.get("classes")
    terms = data.get("terms")
    if not isinstance(classes, Mapping) or not classes:
        raise InputError(f"{source}: needs a [classes] table, e.g. x1 = [\"NV>=2\", \"NVS\"]")
    if not isinstance(terms, Mapping) or not terms:
        raise InputError(f"{source}: needs a [terms] table of term = coefficient, e.g. \"x1*x2\" = -7.97")
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
            raise InputError(f"{source}: term {text!r} needs a number, got {coefficient!r}")
        parsed.append(Term(variables=variables, inverse=match.group("inverse") is not None, coefficient=float(coefficient)))
    return EffectiveBandwidthModel(
        name=str(data.get("name", source)),
        class_names=names,
        selectors=tuple(selectors),
        terms=tuple(parsed),
        description=str(data.get("description", "")),
    )


def load_model_text(text: str, *, source: str) -> EffectiveBandwidthModel:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InputError(f"{source}: not valid TOML: {error}") from None
    return model_from_dict(data, source=source)


@lru_cache(maxsize=None)
def paper_model() -> EffectiveBandwidthModel:
    """The MAPA paper's DGX-1 V100 model, shipped as package data."""
    # A path next to the package, not importlib.resources: the Prolog pays for every import.
    text = (Path(__file__).resolve().parent.parent / "data" / "models" / "mapa-dgx1-v100.toml").read_text()
    return load_model_text(text, source="mapa-dgx1-v100.toml")


@lru_cache(maxsize=None)
def best_completion(model: EffectiveBandwidthModel, allowed: tuple[int, ...], counts: tuple[int, ...], remaining: int) -> float:
    """The highest prediction reachable from ``counts`` by adding ``remaining`` edges of the ``allowed`` classes.

    The exact search uses it as an upper bound: the model is not monotone (e.g. on the paper's
    coefficients f(0,3,2) > f(4,0,1)), so no simpler bound is safe.
    """
    if remaining == 0:
        return model.predict(counts)
    best = float("-inf")
    for index in allowed:
        bumped = counts[:index] + (counts[index] + 1,) + counts[index + 1 :]
        best = max(best, best_completion(model, allowed, bumped, remaining - 1))
    return best
