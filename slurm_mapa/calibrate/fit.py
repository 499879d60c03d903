"""Fit an effective-bandwidth model to measured bus bandwidths, as the MAPA paper did.

Ordinary least squares (NumPy ``lstsq``) over the model's terms, with no intercept column,
like the paper's ``nonlinear-polynomial-model.py``. The default term set for n link classes is
every product of one, two or three distinct classes and its inverse ``1/(product+1)``: for three
classes that is exactly the paper's 14 terms (Table 2).
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
    if not measurements:
        raise InputError("no measurements to fit")
    for m in measurements:
        if len(m.counts) != len(class_names):
            raise InputError(f"measurement {m.label or m.counts}: {len(m.counts)} counts for {len(class_names)} classes")
    base_terms = term_set(terms, len(class_names))
    X = _design(base_terms, [m.counts for m in measurements])
    y = np.array([m.busbw for m in measurements], dtype=float)
    coef, _residuals, rank, _sv = np.linalg.lstsq(X, y, rcond=None)
    fitted = tuple(Term(variables=t.variables, inverse=t.inverse, coefficient=float(c)) for t, c in zip(base_terms, coef))
    model = EffectiveBandwidthModel(
        name=name, class_names=class_names, selectors=selectors, terms=fitted, description=description
    )
    predictions = X @ coef
    errors = predictions - y
    relative = np.abs(errors) / np.where(y > 0, y, np.nan)
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
        rank=int(rank),
        warnings=tuple(warnings),
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
    lines = [
        f"fitted {len(report.model.terms)} terms on {len(report.measurements)} measurements (rank {report.rank})",
        f"  RMSE {report.rmse:.4f} GB/s, MAE {report.mae:.4f} GB/s, "
        f"mean relative error {100 * report.mean_relative_error:.2f}% (max {100 * report.max_relative_error:.2f}%)",
    ]
    if report.loo_rmse is not None:
        lines.append(
            f"  leave-one-out: RMSE {report.loo_rmse:.4f} GB/s, mean relative error {100 * (report.loo_mean_relative_error or 0):.2f}%"
        )
    lines.append("  coefficients:")
    lines += [f"    {term_text(t):<18} {t.coefficient: .9g}" for t in report.model.terms]
    lines.append("  measured vs predicted (GB/s):")
    for m, p in zip(report.measurements, report.predictions):
        lines.append(f"    {m.label or '-':<10} {','.join(map(str, m.counts)):<12} {m.busbw:10.3f} {p:10.3f}")
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
