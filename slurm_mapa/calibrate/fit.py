"""Fit an effective-bandwidth model to measured bus bandwidths.

Two kinds (issue 38: a model must be true to the links):

* ``bottleneck`` (:func:`fit_bottleneck`, the default of ``mapa calibrate fit``): a ring is
  priced by its slowest link class at its edge count, as it runs. Each class's curve over edge
  counts is the median of the rings measured with that class as their slowest; a faster class
  measured below a slower one at the same edge count would make the model prefer worse links, so
  the two are pooled (isotonic regression across the classes, best first) and the measurement is
  reported, not fitted through. The model is monotone by construction.
* ``regression`` (:func:`fit_model`): ordinary least squares (NumPy ``lstsq``) over the model's
  terms, with no intercept column, like the paper's ``nonlinear-polynomial-model.py``. The default
  term set for n link classes is every product of one, two or three distinct classes and its
  inverse ``1/(product+1)``: for three classes that is exactly the paper's 14 terms (Table 2).
  Nothing keeps it monotone: ``mapa calibrate fit`` reports where it is not and writes such a
  model only when told to (reproducing the paper's).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..core.effbw import EffectiveBandwidthModel, Term
from ..core.model_files import model_from_dict, term_text
from ..errors import InputError
from .nccl import parse_nccl_tests
from .plan import Plan

_MARKER = re.compile(r"^#\s*mapa-calibrate\b(?P<rest>.*)$")
MAX_RESULT_BYTES = 16 << 20


@dataclass(frozen=True)
class Measurement:
    counts: tuple[int, ...]
    busbw: float  # GB/s
    label: str = ""


@dataclass(frozen=True)
class FitReport:
    model: EffectiveBandwidthModel
    measurements: tuple[Measurement, ...]
    predictions: tuple[float, ...]
    rmse: float
    mae: float
    mean_relative_error: float
    max_relative_error: float
    loo_rmse: float | None
    loo_mean_relative_error: float | None
    rank: int
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "terms": {term_text(t): t.coefficient for t in self.model.terms},
            "measurements": len(self.measurements),
            "rank": self.rank,
            "rmse": self.rmse,
            "mae": self.mae,
            "mean_relative_error": self.mean_relative_error,
            "max_relative_error": self.max_relative_error,
            "loo_rmse": self.loo_rmse,
            "loo_mean_relative_error": self.loo_mean_relative_error,
            "points": [
                {"label": m.label, "counts": list(m.counts), "measured": m.busbw, "predicted": p}
                for m, p in zip(self.measurements, self.predictions)
            ],
            "warnings": list(self.warnings),
        }


def term_set(spec: str, classes: int) -> tuple[Term, ...]:
    """``full`` (products of 1-3 classes and their inverses; the paper's 14 for 3 classes),
    ``linear`` (x1..xn), or a comma-separated list such as ``x1,x2,x1*x2,1/(x1+1)``."""
    names = [f"x{i + 1}" for i in range(classes)]
    if spec in ("full", "paper"):
        texts: list[str] = []
        for order in range(1, min(3, classes) + 1):
            products = ["*".join(names[i] for i in combo) for combo in _paper_order(classes, order)]
            texts += products + [f"1/({p}+1)" for p in products]
    elif spec == "linear":
        texts = names
    else:
        texts = [text.strip() for text in spec.split(",") if text.strip()]
        if not texts:
            raise InputError(f"--terms {spec!r}: name at least one term")
    model = model_from_dict({"classes": {n: ["PCIE"] for n in names}, "terms": {t: 1.0 for t in texts}}, source="--terms")
    return model.terms


def _paper_order(classes: int, order: int) -> list[tuple[int, ...]]:
    combos = list(itertools.combinations(range(classes), order))
    if classes == 3 and order == 2:
        return [(0, 1), (1, 2), (0, 2)]  # the paper's order: x1x2, x2x3, x1x3
    return combos


def _design(terms: Sequence[Term], counts: Sequence[tuple[int, ...]]) -> np.ndarray:
    unit = [Term(variables=t.variables, inverse=t.inverse, coefficient=1.0) for t in terms]
    return np.array([[t.value(tuple(float(x) for x in c)) for t in unit] for c in counts], dtype=float)


def fit_model(
    measurements: Sequence[Measurement],
    *,
    class_names: tuple[str, ...],
    selectors: tuple[tuple[str, ...], ...],
    terms: str = "full",
    name: str = "fitted",
    description: str = "",
    check_counts: Sequence[tuple[int, ...]] | None = None,
) -> FitReport:
    _check_counts(measurements, class_names)
    base_terms = term_set(terms, len(class_names))
    X = _design(base_terms, [m.counts for m in measurements])
    y = np.array([m.busbw for m in measurements], dtype=float)
    coef, _residuals, rank, _sv = np.linalg.lstsq(X, y, rcond=None)
    fitted = tuple(Term(variables=t.variables, inverse=t.inverse, coefficient=float(c)) for t, c in zip(base_terms, coef))
    model = EffectiveBandwidthModel(
        name=name, class_names=class_names, selectors=selectors, terms=fitted, description=description
    )
    predictions = X @ coef
    warnings: list[str] = []
    distinct = len({m.counts for m in measurements})
    if rank < len(base_terms):
        warnings.append(
            f"the {len(base_terms)} terms are not determined by {distinct} distinct count combinations (rank {rank}): "
            f"the fit interpolates the measurements and its coefficients are one of many; measure more allocations or use fewer --terms"
        )
    loo_errors: list[float] = []
    loo_relative: list[float] = []
    if len(measurements) > 1:
        for i in range(len(measurements)):
            keep = np.arange(len(measurements)) != i
            c_i, *_ = np.linalg.lstsq(X[keep], y[keep], rcond=None)
            e = float(X[i] @ c_i - y[i])
            loo_errors.append(e)
            if y[i] > 0:
                loo_relative.append(abs(e) / y[i])
    for m in measurements:
        if m.busbw <= 0:
            warnings.append(f"{m.label or m.counts}: measured bus bandwidth {m.busbw} GB/s is not positive")
    warnings += monotonicity_warnings(model, check_counts if check_counts is not None else sorted({m.counts for m in measurements}))
    return _report(model, measurements, predictions, loo_errors, loo_relative, int(rank), warnings)


def _check_counts(measurements: Sequence[Measurement], class_names: tuple[str, ...]) -> None:
    if not measurements:
        raise InputError("no measurements to fit")
    for m in measurements:
        if len(m.counts) != len(class_names):
            raise InputError(f"measurement {m.label or m.counts}: {len(m.counts)} counts for {len(class_names)} classes")


def _report(model: EffectiveBandwidthModel, measurements: Sequence[Measurement], predictions: Sequence[float],
            loo_errors: Sequence[float], loo_relative: Sequence[float], rank: int, warnings: Sequence[str]) -> FitReport:
    """The fit's errors against the measurements (and left-one-out), as one report."""
    y = np.array([m.busbw for m in measurements], dtype=float)
    errors = np.array(predictions, dtype=float) - y
    relative = np.abs(errors) / np.where(y > 0, y, np.nan)
    return FitReport(
        model=model,
        measurements=tuple(measurements),
        predictions=tuple(float(p) for p in predictions),
        rmse=float(np.sqrt(np.mean(errors**2))),
        mae=float(np.mean(np.abs(errors))),
        mean_relative_error=float(np.nanmean(relative)) if np.any(y > 0) else math.nan,
        max_relative_error=float(np.nanmax(relative)) if np.any(y > 0) else math.nan,
        loo_rmse=float(np.sqrt(np.mean(np.square(loo_errors)))) if loo_errors else None,
        loo_mean_relative_error=float(np.mean(loo_relative)) if loo_relative else None,
        rank=rank,
        warnings=tuple(warnings),
    )


def fit_bottleneck(
    measurements: Sequence[Measurement],
    *,
    class_names: tuple[str, ...],
    selectors: tuple[tuple[str, ...], ...],
    name: str = "fitted",
    description: str = "",
) -> FitReport:
    """A bottleneck model from measured rings; the classes are ranked as given, best first (the
    order ``mapa calibrate plan`` writes them in: widest link first)."""
    _check_counts(measurements, class_names)
    for m in measurements:
        if not any(m.counts):
            raise InputError(f"measurement {m.label or '-'}: its ring uses no link (counts {m.counts})")
        if not m.busbw > 0:
            raise InputError(f"measurement {m.label or m.counts}: bus bandwidth {m.busbw} GB/s; a bottleneck model needs "
                             f"positive values (a failed run? measure it again or leave its file out)")
    curves, warnings = _bottleneck_curves(measurements, class_names)
    model = _bottleneck_model(curves, measurements, class_names, selectors, name, description)
    predictions = [model.predict(m.counts) for m in measurements]
    loo: list[float] = []
    loo_relative: list[float] = []
    for i in range(len(measurements)):
        rest = [m for j, m in enumerate(measurements) if j != i]
        try:
            curves_i, _ = _bottleneck_curves(rest, class_names)
        except InputError:
            continue  # the only ring of its class: nothing predicts it without it
        model_i = _bottleneck_model(curves_i, rest, class_names, selectors, name, description)
        error = model_i.predict(measurements[i].counts) - measurements[i].busbw
        loo.append(error)
        if measurements[i].busbw > 0:
            loo_relative.append(abs(error) / measurements[i].busbw)
    return _report(model, measurements, predictions, loo, loo_relative, sum(1 for curve in curves if curve), warnings)


def _slowest_class(counts: tuple[int, ...]) -> int:
    return max(i for i, c in enumerate(counts) if c)


def _bottleneck_curves(measurements: Sequence[Measurement], class_names: tuple[str, ...]) -> tuple[list[list[tuple[int, float]]], list[str]]:
    """Per class, (edges, GB/s) points monotone across the classes at every edge count measured;
    the warnings say which measurements were pooled because they broke that order."""
    n = len(class_names)
    samples: dict[tuple[int, int], list[float]] = {}
    for m in measurements:
        samples.setdefault((_slowest_class(m.counts), sum(m.counts)), []).append(m.busbw)
    missing = [class_names[i] for i in range(n) if not any(c == i for c, _ in samples)]
    if missing:
        raise InputError(f"no measured ring has {', '.join(missing)} as its slowest link class: measure one that does "
                         f"(`mapa calibrate plan` lists a 2-GPU ring per link class)")
    grid = sorted({edges for _, edges in samples})
    own = {i: sorted((edges, float(np.median(values))) for (c, edges), values in samples.items() if c == i) for i in range(n)}
    warnings: list[str] = []
    values = [[0.0] * n for _ in grid]
    for g, edges in enumerate(grid):
        column = [float(np.interp(edges, [e for e, _ in own[i]], [v for _, v in own[i]])) for i in range(n)]
        weights = [len(samples.get((i, edges), ())) or 1 for i in range(n)]  # an interpolated value weighs one ring
        fitted = _non_increasing(column, weights)
        for i in range(n):
            if abs(fitted[i] - column[i]) > 1e-9 * max(1.0, abs(column[i])) and (i, edges) in samples:
                worse = next((j for j in range(i + 1, n) if column[j] > column[i] + 1e-9), None)
                faster = next((j for j in range(i) if column[j] < column[i] - 1e-9), None)
                why = (f"below the slower class {class_names[worse]}'s {column[worse]:.3f}" if worse is not None
                       else f"above the faster class {class_names[faster]}'s {column[faster]:.3f}" if faster is not None
                       else "out of order with its neighbours")
                warnings.append(f"not fitted through: rings with slowest class {class_names[i]} at {edges} edges measured "
                                f"{column[i]:.3f} GB/s, {why}; pooled to {fitted[i]:.3f} so that a faster link never predicts less")
        values[g] = fitted
    curves = [[(edges, round(values[g][i], 6)) for g, edges in enumerate(grid)] for i in range(n)]
    return curves, warnings


def _non_increasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-increasing sequence nearest ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            mean, weight, length = blocks.pop()
            previous = blocks[-1]
            total = previous[1] + weight
            previous[0] = (previous[0] * previous[1] + mean * weight) / total
            previous[1] = total
            previous[2] += length
    out: list[float] = []
    for mean, _, length in blocks:
        out += [mean] * int(length)
    return out


def _bottleneck_model(curves, measurements, class_names, selectors, name, description) -> EffectiveBandwidthModel:
    edges = sorted({sum(m.counts) for m in measurements})  # a ring of k GPUs has k edges (2 GPUs: both ways)
    return EffectiveBandwidthModel(
        name=name, class_names=class_names, selectors=selectors, terms=(), description=description, kind="bottleneck",
        class_bandwidths=tuple(max(v for _, v in curve) for curve in curves),  # as a model file's curve reads back
        class_curves=tuple(tuple(curve) for curve in curves),
        fitted_gpus=(edges[0], edges[-1]), fitted_edges=(edges[0], edges[-1]), basis="fitted",
    )


def monotonicity_warnings(model: EffectiveBandwidthModel, counts: Sequence[tuple[int, ...]], *, limit: int = 8) -> list[str]:
    """Where upgrading ring edges to better link classes lowers the prediction.

    Classes are ranked by the model's own 2-GPU ring value f(2 e_i). Among the count vectors
    the model will be used on (same number of edges), c' is at least as good as c when, for
    every prefix of that ranking, c' has at least as many edges in those classes; a model that
    predicts f(c') < f(c) there makes the search prefer worse links.
    """
    n = len(model.class_names)
    pair = [model.predict(tuple(2 if j == i else 0 for j in range(n))) for i in range(n)]
    order = sorted(range(n), key=lambda i: -pair[i])
    by_size: dict[int, list[tuple[int, ...]]] = {}
    for c in set(counts):
        by_size.setdefault(sum(c), []).append(c)
    found: list[str] = []
    total = 0
    for size in sorted(by_size):
        group = sorted(by_size[size])
        prefix = {c: list(itertools.accumulate(c[i] for i in order)) for c in group}
        for worse, better in itertools.permutations(group, 2):
            if all(b >= w for b, w in zip(prefix[better], prefix[worse])):
                f_better, f_worse = model.predict(better), model.predict(worse)
                if f_better < f_worse - 1e-9 * max(1.0, abs(f_worse)):
                    total += 1
                    if len(found) < limit:
                        found.append(
                            f"non-monotone: {_fmt_counts(model, better)} predicts {f_better:.2f} GB/s, below "
                            f"{_fmt_counts(model, worse)} at {f_worse:.2f} though its edges are at least as good"
                        )
    if total > len(found):
        found.append(f"... {total - len(found)} more non-monotone pairs")
    return found


def _fmt_counts(model: EffectiveBandwidthModel, counts: tuple[int, ...]) -> str:
    return "(" + ", ".join(f"{name}={c}" for name, c in zip(model.class_names, counts)) + ")"


def measurements_from_files(
    paths: Sequence[str], plan: Plan, *, statistic: str = "peak", min_bytes: int = 0
) -> list[Measurement]:
    """One measurement per nccl-tests output file, matched to the plan by its marker line or file name."""
    by_id = {run.id: run for run in plan.runs}
    found: list[Measurement] = []
    for path in paths:
        file = Path(path)
        try:
            if file.stat().st_size > MAX_RESULT_BYTES:
                raise InputError(f"{path}: larger than {MAX_RESULT_BYTES} bytes; is it an nccl-tests output?")
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise InputError(f"cannot read {path!r}: {error.strerror}") from None
        run_id = _marker_id(text) or file.stem
        run = by_id.get(run_id)
        if run is None:
            raise InputError(
                f"{path}: allocation {run_id!r} is not in the plan (a result file starts with the "
                f"'# mapa-calibrate id=...' line the measurement script writes, or is named <id>.txt)"
            )
        result = parse_nccl_tests(text, source=path)
        if result.ranks is not None and result.ranks != run.gpus:
            raise InputError(f"{path}: nccl-tests ran on {result.ranks} GPUs but allocation {run.id} has {run.gpus}")
        found.append(Measurement(counts=run.counts, busbw=result.bus_bandwidth(statistic, min_bytes), label=run.id))
    return found


def _marker_id(text: str) -> str | None:
    for line in text.splitlines()[:50]:
        match = _MARKER.match(line.strip())
        if match:
            for item in match.group("rest").split():
                key, _, value = item.partition("=")
                if key == "id" and value:
                    return value
    return None


def format_report(report: FitReport) -> str:
    if report.model.kind == "bottleneck":
        head = (f"fitted a bottleneck model (the slowest link class at its edge count) on {len(report.measurements)} "
                f"measurements, {report.rank} classes")
    else:
        head = f"fitted {len(report.model.terms)} terms on {len(report.measurements)} measurements (rank {report.rank})"
    lines = [
        head,
        f"  RMSE {report.rmse:.4f} GB/s, MAE {report.mae:.4f} GB/s, "
        f"mean relative error {100 * report.mean_relative_error:.2f}% (max {100 * report.max_relative_error:.2f}%)",
    ]
    if report.loo_rmse is not None:
        lines.append(
            f"  leave-one-out: RMSE {report.loo_rmse:.4f} GB/s, mean relative error {100 * (report.loo_mean_relative_error or 0):.2f}%"
        )
    if report.model.kind == "bottleneck":
        lines.append("  GB/s per class (best first) at each edge count:")
        lines += [f"    {name:<6} " + ", ".join(f"{edges}: {gbps:.3f}" for edges, gbps in curve)
                  for name, curve in zip(report.model.class_names, report.model.class_curves)]
    else:
        lines.append("  coefficients:")
        lines += [f"    {term_text(t):<18} {t.coefficient: .9g}" for t in report.model.terms]
    lines.append("  measured vs predicted (GB/s):")
    for m, p in zip(report.measurements, report.predictions):
        lines.append(f"    {m.label or '-':<10} {','.join(map(str, m.counts)):<12} {m.busbw:10.3f} {p:10.3f}")
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
