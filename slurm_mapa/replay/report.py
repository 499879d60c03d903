"""Reports of replay runs: summary dicts (JSON), the terminal table, Table 3, per-job CSV rows."""

from __future__ import annotations

from typing import Iterable, Sequence

from ..words import PRESERVED_WHY
from .results import Record, RunResult

CSV_HEADER = (
    "job,policy,node,submit,start,end,wait,runtime,base_runtime,gpus,sensitive,pattern,"
    "effective_bw,aggregated_bw,preserved_bw,ranked_bw,fast_ring"
)


def _r(value, digits: int = 3):
    return None if value is None else round(value, digits)


def summary(result: RunResult) -> dict:
    def five(dist):
        return {k: _r(v) for k, v in dist.five().items()}

    return {
        "policy": result.policy,
        "node_choice": result.node_choice,
        "jobs": result.jobs,
        "dropped": dict(result.dropped),
        "stuck_in_queue": result.stuck,
        "judged_by": result.judge,
        "effective_bw_sensitive": five(result.eff_sensitive),
        "effective_bw_insensitive": five(result.eff_insensitive),
        "ranked_bw_sensitive": five(result.ranked_sensitive),
        "slowest_hop_sensitive": five(result.hop_sensitive),
        "fast_ring_sensitive": {"checked": result.ring_checked, "fast": result.fast_ring},
        "preserved_bw_after_decision": five(result.preserved_after),
        "preserved_bw_time_mean": _r(result.mean_preserved),
        "fragmentation_time_mean": _r(result.mean_fragmentation, 4),
        "wait": five(result.wait),
        "wait_sensitive": five(result.wait_sensitive),
        "node_preference": {"met": result.preference_met, "missed": result.preference_missed,
                            "relaxed_constraints": result.relaxed},
        "cpu_affinity": {"local_jobs": result.affinity_local, "remote_jobs": result.affinity_remote},
        "runtime": five(result.runtime),
        "runtime_sensitive": five(result.runtime_sensitive),
        "makespan": _r(result.makespan),
        "throughput_per_hour": _r(result.throughput_per_hour),
        "out_of_order_arrivals": result.out_of_order,
        "grounded_predictions": result.grounded,
        "extrapolated_predictions": result.extrapolated,
        "extrapolated": result.extrapolated > 0,  # some effective bandwidths are the model's extrapolations
        "by_gpus": {
            str(gpus): {
                "jobs": size.jobs,
                "effective_bw_sensitive": five(size.eff_sensitive),
                "effective_bw_insensitive": five(size.eff_insensitive),
                "ranked_bw_sensitive": five(size.ranked_sensitive),
                "slowest_hop_sensitive": five(size.hop_sensitive),
                "fast_ring_sensitive": {"checked": size.ring_checked, "fast": size.fast_ring},
                "wait": five(size.wait),
                "grounded_predictions": size.grounded,
                "extrapolated_predictions": size.extrapolated,
                "extrapolated": size.extrapolated > 0,
            }
            for gpus, size in sorted(result.by_gpus.items())
        },
        "over_time": [
            {"t": _r(t), "preserved_bw": _r(p), "fragmentation": _r(f, 4), "queued": q, "running": r}
            for t, p, f, q, r in result.series.points
        ],
    }


def table3(results: Sequence[RunResult], baseline: str = "baseline") -> list[dict] | None:
    """The paper's Table 3: run-time speed-up over ``baseline`` at min/25/50/75/max, and throughput."""
    bases = {r.node_choice: r for r in reversed(results) if r.policy == baseline}
    if not bases or not any(b.jobs for b in bases.values()):
        return None
    qs = (("min", 0.0), ("p25", 0.25), ("median", 0.5), ("p75", 0.75), ("max", 1.0))
    rows = []
    for r in results:
        base = bases.get(r.node_choice)
        if base is None or not base.jobs:
            continue
        row = {"policy": r.policy} if r.node_choice == "first-fit" else {"policy": r.policy, "node_choice": r.node_choice}
        for name, q in qs:
            b, p = base.runtime.quantile(q), r.runtime.quantile(q)
            row[name] = _r(b / p) if b and p else None
        row["throughput"] = _r(r.throughput_per_hour / base.throughput_per_hour) if base.throughput_per_hour else None
        rows.append(row)
    return rows


def _duration(value, width: int, digits: int = 1) -> str:
    """Seconds in a column of ``width``: as seconds up to 99,999 s, beyond that in hours (``27.8h``)
    or days (``41.2d``), so that a trace's long waits keep the columns aligned."""
    if value is None or value < 100000:
        return _fmt(value, width, digits)
    hours = value / 3600
    return (f"{hours:.1f}h" if hours < 1000 else f"{hours / 24:.1f}d").rjust(width)


def _fmt(value, width: int, digits: int = 1) -> str:
    if value is None:
        return "-".rjust(width)
    if isinstance(value, float):
        return f"{value:.{digits}f}".rjust(width)
    return str(value).rjust(width)


MAPA_POLICY = "preserve"

# One logical line per column group: the report folds them at the terminal's width (fold_prose).
TABLE_LEGEND = "\n".join((
    "columns: 'preserve (MAPA)' is MAPA's policy (the paper's Preserve); the others are the allocators clusters use "
    "today (`mapa-replay policies`).",
    "  sensitive effective BW: the judged bandwidth (GB/s, by the judge named above, 'judged by'; link-bound: 0.8 x "
    "the ring rate, the bus bandwidth rings can carry over the set's links) of the GPU set each bandwidth-sensitive "
    "job of 2+ GPUs got: min, 25th percentile (p25), median, 75th (p75), max over those jobs; higher is better.",
    "  insens.: the median of the same for the other jobs.",
    "  ranked: the median of the sensitive jobs' predicted bandwidth by the ranking model (what MAPA ranks sets by, "
    "and what `mapa select` and `mapa explain` call 'predicted'; a policy that ranks with it scores well there by "
    "construction).",
    "  preserved: the link bandwidth (GB/s) among the GPUs left free, averaged over time (what the next sensitive "
    "job can still get); frag: 1 - preserved / the most any free set of that size could keep, averaged (0 = none).",
    "  " + PRESERVED_WHY + ".",
    "  wait: seconds from submit to start (mean, and p95: 95th percentile); makespan: first submit to last end; "
    "from 100,000 s on these are in hours (h) or days (d).",
))

BY_GPUS_LEGEND = ("n: the sensitive jobs of that size; p10, med, p90: 10th percentile, median, 90th percentile of "
                  "their judged bandwidth (and of the insensitive jobs'); ranked: their median predicted bandwidth "
                  "by the ranking model; fast ring: the share of them whose GPUs hold a ring over NVLink/xGMI/NVSwitch "
                  "links only, read from the links, no model ('-': not checked, sets above 10 GPUs)")


def policy_label(result: RunResult) -> str:
    """The run's label, with MAPA's own policy named as such."""
    return f"{result.label} (MAPA)" if result.policy == MAPA_POLICY else result.label


NARROW_NOTE = ("narrowed to the terminal's {width} columns: {hidden} are left out here ({wide} columns show them; "
               "--json and --csv hold every number)")


def table(results: Sequence[RunResult], width: int | None = None) -> str:
    """The comparison table: one line per policy, then what its columns mean; on a terminal
    narrower than the table, the columns a first look needs (the legend says which are left out)."""
    head = (
        f"{'policy':<18} {'jobs':>6} | {'sensitive effective BW (GB/s)':^34} | {'insens.':>7} | {'ranked':>7} | "
        f"{'preserved':>9} {'frag':>5} | {'wait mean':>9} {'p95':>8} | {'makespan':>9} {'jobs/h':>8}"
    )
    if width is not None and width < len(head):
        if width >= SPLIT_WIDTH:
            return _split_table(results)
        return _narrow_table(results, width, len(head))
    sub = (f"{'':<18} {'':>6} | {'min':>6} {'p25':>6} {'med':>6} {'p75':>6} {'max':>6} | {'median':>7} | {'median':>7} | "
           f"{'mean GB/s':>9} {'mean':>5} | {'(s)':>9} {'(s)':>8} | {'(s)':>9} {'':>8}")
    lines = [head, sub, "-" * len(head)]
    for r in results:
        f = r.eff_sensitive.five()
        lines.append(
            f"{policy_label(r) + _outside_mark(r):<18} {r.jobs:>6} | "
            + " ".join(_fmt(f[k], 6) for k in ("min", "p25", "median", "p75", "max"))
            + f" | {_fmt(r.eff_insensitive.quantile(0.5), 7)} | {_fmt(r.ranked_sensitive.quantile(0.5), 7)}"
            + f" | {_fmt(r.mean_preserved, 9)} {_fmt(r.mean_fragmentation, 5, 2)} | "
            + f"{_duration(r.wait.mean, 9)} {_duration(r.wait.quantile(0.95), 8)} | {_duration(r.makespan, 9, 0)} "
            + _fmt(r.throughput_per_hour, 8)
        )
    lines += _outside_note(results)
    lines.append(TABLE_LEGEND)
    return "\n".join(lines)


def _outside_note(results: Sequence[RunResult]) -> list[str]:
    """The line that explains the table's ``*`` marks (none without a mark): one phrase per
    distinct count, with the policies that have it (not the same phrase per policy)."""
    grouped: dict[str, list[str]] = {}
    for r in results:
        if _outside_mark(r):
            grouped.setdefault(outside_text(r), []).append(r.label)
    if not grouped:
        return []
    every = len(results) > 1 and sum(map(len, grouped.values())) == len(results) and len(grouped) == 1
    notes = [f"{text}: {'every policy' if every else ', '.join(labels)}" for text, labels in grouped.items()]
    return ["* effective bandwidths outside the judging model's fitted range: " + "; ".join(notes)]


SPLIT_WIDTH = 84  # the widest of the two halves _split_table prints


def _split_table(results: Sequence[RunResult]) -> str:
    """The comparison table as two stacked halves, each under SPLIT_WIDTH columns, every number
    kept: the bandwidths, then preserved bandwidth, waits and throughput (a pipe, a saved file or a
    terminal of 84 to 141 columns; --wide keeps one table)."""
    head = (f"{'policy':<18} {'jobs':>6} | {'sensitive effective BW (GB/s)':^34} | {'insens.':>7} | {'ranked':>7}")
    sub = (f"{'':<18} {'':>6} | {'min':>6} {'p25':>6} {'med':>6} {'p75':>6} {'max':>6} | {'median':>7} | {'median':>7}")
    lines = [head, sub, "-" * len(head)]
    for r in results:
        f = r.eff_sensitive.five()
        lines.append(f"{policy_label(r) + _outside_mark(r):<18} {r.jobs:>6} | "
                     + " ".join(_fmt(f[k], 6) for k in ("min", "p25", "median", "p75", "max"))
                     + f" | {_fmt(r.eff_insensitive.quantile(0.5), 7)} | {_fmt(r.ranked_sensitive.quantile(0.5), 7)}")
    head2 = (f"{'policy':<18} | {'preserved':>9} {'frag':>5} | {'wait mean':>9} {'p95':>8} | {'makespan':>9} {'jobs/h':>8}")
    sub2 = (f"{'':<18} | {'mean GB/s':>9} {'mean':>5} | {'(s)':>9} {'(s)':>8} | {'(s)':>9} {'':>8}")
    lines += ["", head2, sub2, "-" * len(head2)]
    for r in results:
        lines.append(f"{policy_label(r):<18} | {_fmt(r.mean_preserved, 9)} {_fmt(r.mean_fragmentation, 5, 2)} | "
                     f"{_duration(r.wait.mean, 9)} {_duration(r.wait.quantile(0.95), 8)} | {_duration(r.makespan, 9, 0)} "
                     + _fmt(r.throughput_per_hour, 8))
    lines += _outside_note(results)
    lines.append(TABLE_LEGEND)
    return "\n".join(lines)


def _narrow_table(results: Sequence[RunResult], width: int, wide: int) -> str:
    head = f"{'policy':<18} {'jobs':>5} | {'sensitive BW (GB/s)':^20} | {'insens.':>7} | {'wait mean':>9} {'jobs/h':>7}"
    sub = f"{'':<18} {'':>5} | {'min':>6} {'p25':>6} {'med':>6} | {'median':>7} | {'(s)':>9} {'':>7}"
    lines = [head, sub, "-" * len(head)]
    for r in results:
        f = r.eff_sensitive.five()
        lines.append(f"{policy_label(r) + _outside_mark(r):<18} {r.jobs:>5} | "
                     + " ".join(_fmt(f[k], 6) for k in ("min", "p25", "median"))
                     + f" | {_fmt(r.eff_insensitive.quantile(0.5), 7)} | {_duration(r.wait.mean, 9)} "
                     + _fmt(r.throughput_per_hour, 7))
    lines += _outside_note(results)
    lines += [line for line in TABLE_LEGEND.splitlines()
              if not line.lstrip().startswith(("ranked:", "preserved:", PRESERVED_WHY[:20]))]
    lines.append(NARROW_NOTE.format(width=width, hidden="the sensitive jobs' p75 and max, ranked, preserved, frag, "
                                    "the wait's p95 and the makespan", wide=wide))
    return "\n".join(lines)


def _outside_mark(result: RunResult) -> str:
    """``*`` after a run whose effective bandwidths include some outside the judging model's fitted range."""
    return "*" if result.extrapolated or result.grounded else ""


def outside_text(result: RunResult) -> str:
    """How many of a run's effective bandwidths lie outside the judging model's fitted range, and how each is reported."""
    parts = []
    if result.extrapolated:
        parts.append(f"{result.extrapolated} EXTRAPOLATED by the model")
    if result.grounded:
        parts.append(f"{result.grounded} from the link-bound model instead")
    return ", ".join(parts)


def dropped_text(results: Sequence[RunResult]) -> str:
    """The jobs no policy replayed, and why (the same for every policy unless said)."""
    by_policy = {r.policy: r.dropped for r in results if r.dropped}
    if not by_policy:
        return ""
    distinct = {tuple(sorted(d.items())) for d in by_policy.values()}

    def words(dropped: dict) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))

    hint = ""
    if any("larger than every node" in reason for d in by_policy.values() for reason in d):
        hint = (" (a multi-node job needs its node count: NNodes in the sacct fields, or node=N in AllocTRES; "
                "or the cluster needs larger nodes)")
    if len(distinct) == 1 and len(by_policy) == len(results):
        return f"not replayed: {words(next(iter(by_policy.values())))}{hint}"
    return "not replayed: " + "; ".join(f"{p}: {words(d)}" for p, d in by_policy.items()) + hint


def by_gpus_text(results: Sequence[RunResult], width: int | None = None) -> str:
    """Results per job size (GPUs per node): effective bandwidth p10/median/p90, mean wait; on a
    terminal narrower than that, the sensitive jobs' columns and the wait only."""
    sizes = sorted({g for r in results for g in r.by_gpus})
    if not sizes:
        return ""
    head = (f"{'GPUs':>4} {'policy':<18} {'jobs':>6} | {'sensitive eff. BW (GB/s)':^27} | {'ranked':>6} {'fast':>5} | "
            f"{'insensitive':^20} | {'wait mean':>9}")
    sub = (f"{'':>4} {'':<18} {'':>6} | {'n':>6} {'p10':>6} {'med':>6} {'p90':>6} | {'med':>6} {'ring':>5} | "
           f"{'p10':>6} {'med':>6} {'p90':>6} | {'(s)':>9}")
    wide = len(head)
    narrow = width is not None and width < wide
    if narrow:
        head = f"{'GPUs':>4} {'policy':<18} {'jobs':>5} | {'sensitive BW (GB/s)':^27} {'fast':>5} | {'wait mean':>9}"
        sub = f"{'':>4} {'':<18} {'':>5} | {'n':>6} {'p10':>6} {'med':>6} {'p90':>6} {'ring':>5} | {'(s)':>9}"
    marked = any(size.grounded or size.extrapolated for r in results for size in r.by_gpus.values())
    lines = ["by GPUs per node" + (" (* = outside the judging model's fitted range: see the 'judged by' line above)" if marked else "")
             + "; " + BY_GPUS_LEGEND, head, sub, "-" * len(head)]
    if narrow:
        lines.insert(1, NARROW_NOTE.format(width=width, hidden="ranked and the insensitive jobs' p10, median and p90",
                                           wide=wide))
    for gpus in sizes:
        judged = [r for r in results if gpus in r.by_gpus
                  and (r.by_gpus[gpus].eff_sensitive.count or r.by_gpus[gpus].eff_insensitive.count)]
        if not judged:  # 1-GPU jobs: no link to judge; one line, not a row of dashes per policy
            waits = ", ".join(f"{policy_label(r)} {_fmt(r.by_gpus[gpus].wait.mean, 1, 0).strip()}" for r in results if gpus in r.by_gpus)
            jobs = max(r.by_gpus[gpus].jobs for r in results if gpus in r.by_gpus)
            lines.append(f"{gpus:>3}  {jobs} jobs under every policy, no GPU links to judge; mean wait (s): {waits}")
            continue
        for r in results:
            size = r.by_gpus.get(gpus)
            if size is None:
                continue
            mark = "*" if size.grounded or size.extrapolated else " "  # the same rule as _outside_mark
            s, i = size.eff_sensitive, size.eff_insensitive
            if narrow:
                lines.append(f"{gpus:>3}{mark} {policy_label(r):<18} {size.jobs:>5} | {s.count:>6} "
                             + " ".join(_fmt(s.quantile(q), 6) for q in (0.1, 0.5, 0.9))
                             + f" {_fast_share(size)} | {_duration(size.wait.mean, 9)}")
                continue
            lines.append(
                f"{gpus:>3}{mark} {policy_label(r):<18} {size.jobs:>6} | {s.count:>6} "
                + " ".join(_fmt(s.quantile(q), 6) for q in (0.1, 0.5, 0.9))
                + f" | {_fmt(size.ranked_sensitive.quantile(0.5), 6)} {_fast_share(size)}"
                + " | " + " ".join(_fmt(i.quantile(q), 6) for q in (0.1, 0.5, 0.9))
                + f" | {_duration(size.wait.mean, 9)}"
            )
    return "\n".join(lines)


def _fast_share(size) -> str:
    """The share of a size's sensitive jobs whose GPUs hold a ring over fast links only, as a percentage."""
    if not size.ring_checked:
        return "-".rjust(5)
    return f"{100.0 * size.fast_ring / size.ring_checked:.0f}%".rjust(5)


def table3_text(rows: list[dict]) -> str:
    lines = [f"{'policy':<18} {'MIN':>6} {'25th':>6} {'50th':>6} {'75th':>6} {'MAX':>6} {'Tput':>6}", "-" * 60]
    for row in rows:
        lines.append(
            f"{row['policy'] + (' (MAPA)' if row['policy'] == MAPA_POLICY else '') + ('/' + row['node_choice'] if row.get('node_choice') else ''):<18} "
            + " ".join(_fmt(row[k], 6, 3) for k in ("min", "p25", "median", "p75", "max"))
            + f" {_fmt(row['throughput'], 6, 2)}"
        )
    return "\n".join(lines)


def csv_row(rec: Record) -> str:
    def num(v, d=3):
        return "" if v is None else f"{v:.{d}f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)

    fields = [
        rec.id, rec.policy, rec.node, num(rec.submit), num(rec.start), num(rec.end), num(rec.wait), num(rec.runtime),
        num(rec.base_runtime), " ".join(map(str, rec.gpus)), "1" if rec.sensitive else "0", rec.shape,
        num(rec.effective), num(rec.aggregated), num(rec.preserved), num(rec.ranked),
        "" if rec.fast_ring is None else "1" if rec.fast_ring else "0",
    ]
    return ",".join(_quote(f) for f in fields)


def _quote(text: str) -> str:
    if any(c in text for c in ',"\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def audit_text(audit: dict) -> str:
    if not audit.get("compared"):
        return f"recorded MAPA decisions: none comparable ({audit.get('note', 'no job carries one')})"
    lines = [
        f"recorded MAPA decisions: {audit['compared']} compared"
        + (f", {audit['skipped']} skipped ({', '.join(f'{n} {r}' for r, n in audit['skipped_reasons'].items())})" if audit["skipped"] else ""),
    ]
    free_sets = audit.get("free_sets")
    if free_sets:
        line = f"free sets: {free_sets['recorded']} as the Prolog recorded them, {free_sets['rebuilt']} rebuilt from start/end times"
        if free_sets["rebuilt_differs_from_recorded"]:
            line += f" ({free_sets['rebuilt_differs_from_recorded']} recorded set(s) differ from what the times suggest)"
        lines.append(line)
    lines.append(f"{'policy':<18} {'same GPUs':>9} {'as good':>8} {'mean eff. BW (recorded vs policy)':>34}")
    for name, row in audit["policies"].items():
        label = f"{name} (MAPA)" if name == MAPA_POLICY else name
        lines.append(
            f"{label:<18} {row['same_set']:>9} {row['as_good']:>8} "
            f"{_fmt(row['recorded_mean_bw'], 16)} vs {_fmt(row['policy_mean_bw'], 14)}"
        )
    lines.append(AUDIT_LEGEND)
    return "\n".join(lines)


AUDIT_LEGEND = (
    "same GPUs: jobs for which the policy, in the recorded state, picks the GPUs the Prolog recorded; as good: equal on "
    "the job's Preserve objective (the predicted effective bandwidth of a sensitive job, the preserved bandwidth of the "
    "others). mean eff. BW: the ranking model's predicted bandwidth of the recorded sets vs the policy's, over every "
    "compared job (named 'predicted' by `mapa select`). A policy that maximizes bandwidth for every job (greedy, the peers) can score above MAPA's records "
    "there: MAPA gives the insensitive jobs the GPUs that keep the best links free, not the fastest ones.")


def records_csv(records: Iterable[Record]) -> Iterable[str]:
    yield CSV_HEADER + "\n"
    for rec in records:
        yield csv_row(rec) + "\n"
