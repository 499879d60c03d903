"""The replay's text tables say what their columns mean and name MAPA's policy (issue 27)."""

from __future__ import annotations

import contextlib
import io
import re

from slurm_mapa.replay.cli import main


def _demo_text() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", "--generate", "paper:80", "--topology", "dgx1-v100", "--policies", "baseline,preserve,greedy"]) == 0
    return out.getvalue()


def test_every_column_abbreviation_of_the_tables_is_defined_under_them():
    text = _demo_text()
    table, _, rest = text.partition("columns: ")
    legend = rest.split("\n\n", 1)[0]
    header = "\n".join(line for line in table.splitlines() if "|" in line and not line.startswith(("baseline", "greedy", "preserve")))
    for term in sorted(set(re.findall(r"\b(p\d\d|frag|insens\.|preserved|makespan|wait)\b", header))):
        assert term in legend, (term, legend)
    by_gpus = text[text.index("by GPUs per node"):]
    by_gpus_head = by_gpus.split("\n", 3)
    for term in ("p10", "med", "p90", "n:"):
        assert term in by_gpus_head[0], by_gpus_head[0]


def test_mapas_policy_is_named_as_mapa_in_both_tables():
    text = _demo_text()
    rows = [line for line in text.splitlines() if re.match(r"^\s*(\d+\S?\s+)?preserve(?![a-z-])", line)]
    assert rows and all("preserve (MAPA)" in line for line in rows), rows
    assert not any("baseline (MAPA)" in line or "greedy (MAPA)" in line for line in text.splitlines())


def test_each_node_type_is_priced_by_its_own_model_unless_one_is_given():
    import json

    def replay(*extra: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["run", "--generate", "paper:60", "--cluster", "a:hgx-h100,b:dgx1-v100", "--policies", "preserve", "--json",
                         *extra]) == 0
        return json.loads(out.getvalue())

    own = replay()["model"]
    assert own["per_node_type"] is True
    assert [m["name"] for m in own["models"]] == ["derived-dgx1-v100", "nccl-tests-hgx-h100"]
    one = replay("--model", "mapa-paper-dgx1")["model"]
    assert one["per_node_type"] is False and [m["name"] for m in one["models"]] == ["mapa-paper-dgx1"]
    # On the H100 node alone: its published nccl-tests curve (370 GB/s for 2-4 GPUs, up to 480) prices
    # every sensitive job, not the DGX-1 regression (58.9 GB/s for a 2-GPU ring).
    def sensitive(*extra: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["run", "--generate", "paper:60", "--topology", "hgx-h100", "--policies", "preserve", "--json", *extra]) == 0
        return json.loads(out.getvalue())["policies"][0]

    # The ranking model's own score (what the policy maximized); the judged one is the link-bound
    # model's whatever ranked: 0.8 x the 450 GB/s NVSwitch port of every H100.
    assert sensitive()["ranked_bw_sensitive"]["min"] >= 370.0 and sensitive()["ranked_bw_sensitive"]["max"] <= 480.0
    assert sensitive("--model", "mapa-paper-dgx1")["ranked_bw_sensitive"]["min"] < 100.0
    for extra in ((), ("--model", "mapa-paper-dgx1")):
        assert sensitive(*extra)["judged_by"] == "link-bound"
        assert sensitive(*extra)["effective_bw_sensitive"]["min"] == sensitive(*extra)["effective_bw_sensitive"]["max"] == 360.0
