"""The replay's first lines (replay/headline.py): what MAPA gained, read from the report's numbers."""

from __future__ import annotations

from slurm_mapa.replay.headline import POLICY_SUMMARIES, headline, policy_lines
from slurm_mapa.replay.simulate import ALL_POLICIES


def _row(policy, median, p10, fast, checked, wait, n=10):
    stats = {"n": n, "median": median, "p10": p10}
    return {"policy": policy, "jobs": 20, "effective_bw_sensitive": stats, "fast_ring_sensitive": {"fast": fast, "checked": checked},
            "wait": {"mean": wait}}


def _document(time_model=True, judge="link-bound"):
    return {"judge": {"name": judge}, "options": {"time_model": [[12.3, 3.0]] if time_model else None},
            "policies": [_row("baseline", 30.0, 6.7, 5, 10, 900.0), _row("preserve", 40.0, 19.2, 9, 10, 700.0),
                         _row("slurm-native", 13.4, 3.4, 1, 10, 1500.0), _row("greedy", 40.0, 19.2, 8, 10, 800.0)]}


def test_the_headline_reads_each_number_from_the_report_and_names_ties():
    lines = headline(_document(), "a test workload", width=200)
    text = "\n".join(lines)
    assert lines[0] == "What MAPA gained, a test workload:"
    assert "the 10 bandwidth-sensitive jobs of 2+ GPUs, the bandwidth their GPU set's links carry:" in text
    assert "median: MAPA 40.0 GB/s; the others 13.4 (slurm-native) to 40.0 (greedy); Slurm's own: slurm-native 13.4" in text
    assert "worst tenth (p10): MAPA 19.2 GB/s; the others 3.4 (slurm-native) to 19.2 (greedy)" in text
    assert "MAPA 90% of them; the others 10% (slurm-native) to 80% (greedy)" in text
    assert "mean wait of all 20 jobs: MAPA 700 s; the others 800 s (greedy) to 1500 s (slurm-native)" in text
    assert "no policy ranks with it" in text and "waits are modelled, not measured" in text


def test_without_a_time_model_no_wait_is_claimed_and_another_judge_is_named():
    text = "\n".join(headline(_document(time_model=False, judge="derived-dgx1-v100"), "x", width=200))
    assert "mean wait" not in text and "run times as recorded" in text
    assert "their predicted effective bandwidth by the derived-dgx1-v100 model" in text and "the model MAPA ranks with" in text


def test_no_headline_without_mapa_or_without_sensitive_jobs_and_lines_fit_the_width():
    document = _document()
    assert headline({**document, "policies": [r for r in document["policies"] if r["policy"] != "preserve"]}, "x") == []
    none = {**document, "policies": [{**r, "effective_bw_sensitive": {"n": 0, "median": None, "p10": None}} for r in document["policies"]]}
    assert headline(none, "x") == []
    assert all(len(line) <= 60 for line in headline(document, "a test workload", width=60))


def test_every_policy_has_a_summary():
    assert set(ALL_POLICIES) <= set(POLICY_SUMMARIES)
    lines = policy_lines(list(ALL_POLICIES))
    assert len(lines) == len(ALL_POLICIES) and all(line.split()[0] in ALL_POLICIES for line in lines)


def test_prose_folds_at_the_width_and_tables_stay_whole():
    """Issue 39: under COLUMNS=80 the notes ran to 299 characters; a table row is never folded."""
    from slurm_mapa.replay.run import fold_prose

    note = "judged by: link-bound (" + "word " * 40 + ")"
    row = "baseline              300 |    3.4   19.2   30.0   40.0   80.0 |" + " 40.0 |" * 12
    folded = fold_prose("\n".join([note, row, "-" * 140]), 80).splitlines()
    assert all(len(line) <= 80 for line in folded[:-2]) and folded[1].startswith("  ")  # the note, its continuation indented
    assert folded[-2:] == [row, "-" * 140]


def test_one_gpu_jobs_get_one_line_not_a_row_of_dashes_per_policy(capsys, monkeypatch):
    from slurm_mapa.replay.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["run", "--generate", "paper:60", "--topology", "dgx1-v100", "--policies", "baseline,preserve"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ones = [line for line in lines if line.startswith("  1 ")]
    assert len(ones) == 1 and "jobs under every policy, no GPU links to judge; mean wait (s): baseline " in ones[0], ones


def test_long_waits_keep_the_columns_in_hours_or_days():
    from slurm_mapa.replay.report import _duration

    assert _duration(99999.0, 9) == "  99999.0" and _duration(100000.0, 9) == "    27.8h" and _duration(3600.0 * 2400, 9) == "   100.0d"
    assert _duration(None, 9) == "        -" and len(_duration(1e8, 9)) == 9  # three years


def test_mapa_is_named_alike_in_every_table_and_the_audit_says_why_peers_can_score_above_it():
    """Issue 39: 'preserve (MAPA)' in two tables, 'preserve' in the two others, and the audit's
    peers beating MAPA's own records unexplained."""
    from slurm_mapa.replay.report import audit_text, table3_text

    rows = [{"policy": "baseline", "min": 1.0, "p25": 1.0, "median": 1.0, "p75": 1.0, "max": 1.0, "throughput": 1.0},
            {"policy": "preserve", "min": 1.0, "p25": 1.2, "median": 1.1, "p75": 1.1, "max": 1.0, "throughput": 1.3}]
    assert any(line.startswith("preserve (MAPA) ") for line in table3_text(rows).splitlines())
    audit = {"compared": 3, "skipped": 0, "policies": {
        "preserve": {"same_set": 3, "as_good": 3, "recorded_mean_bw": 40.0, "policy_mean_bw": 40.0},
        "greedy": {"same_set": 1, "as_good": 1, "recorded_mean_bw": 40.0, "policy_mean_bw": 44.0}}}
    text = audit_text(audit)
    assert any(line.startswith("preserve (MAPA) ") for line in text.splitlines())
    assert "keep the best links free, not the fastest ones" in text


def _sized(row, by_size):
    return {**row, "by_gpus": {size: {"effective_bw_sensitive": {"median": median, "p10": p10}}
                               for size, (median, p10) in by_size.items()}}


def test_the_sizes_where_mapa_leads_and_where_another_policy_is_ahead_are_named():
    """The totals can hide a size that trails (issue 38): each size's median and p10 against the best other."""
    document = _document()
    sizes = {"preserve": {"1": (None, None), "3": (40.0, 6.7), "5": (40.0, 19.2)},
             "greedy": {"3": (40.0, 40.0), "5": (19.2, 19.2)}, "baseline": {"3": (40.0, 6.7), "5": (19.2, 19.2)},
             "slurm-native": {}}
    document["policies"] = [_sized(row, sizes[row["policy"]]) for row in document["policies"]]
    text = "\n".join(headline(document, "x", width=300))
    assert "by size, MAPA ahead of every other policy: 5-GPU median 40.0 against at most 19.2\n" in text
    assert "by size, another policy ahead of MAPA: 3-GPU p10 6.7 against 40.0 (greedy). MAPA gives" in text
    assert "1-GPU" not in text and "5-GPU p10" not in text  # a tie is neither
    even = [_sized(row, {"3": (40.0, 40.0)}) for row in _document()["policies"]]
    assert "by size" not in "\n".join(headline({**document, "policies": even}, "x", width=300))
