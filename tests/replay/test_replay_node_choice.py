"""Node choice in the replay (issue 15): Slurm's cons_tres model, --prefer and --constraint on MAPA's
node features (stale within a scheduling pass), the wait bound, and the JSON output."""

from __future__ import annotations

import json

import pytest

from slurm_mapa.core.hardware import build_graph
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.cli import main
from slurm_mapa.replay.jobs import Job
from slurm_mapa.replay.node_pick import slurm_pick
from slurm_mapa.replay.simulate import Node, Options, simulate

# Six GPUs on PCIe, one double-NVLink pair (0-1): the only good 2-GPU ring.
ONE_PAIR = build_graph("one-pair-6", 6, {(0, 1): "NV2"}, default_link="PHB")
PCIE6 = build_graph("pcie-6", 6, {}, default_link="PHB")
DGX = preset("dgx1-v100")
PCIE8 = preset("pcie-8")


def _run(jobs, nodes, choice, policy="preserve", **options):
    records = {}
    result = simulate(jobs, nodes, policy, Options(node_choice=choice, **options), on_record=lambda r: records.__setitem__(r.id, r))
    return result, records


def test_slurm_pick_is_cons_tres_best_fit_over_runs_of_consecutive_nodes():
    assert slurm_pick([0, 1, 2], [8, 3, 5], 3) == [1]  # one run: the node with the fewest free GPUs
    assert slurm_pick([0, 1], [4, 4], 2) == [0]  # ties: the first
    # two runs (node 2 cannot hold the job): the run with fewer free GPUs wins, even though node 0 is tighter
    assert slurm_pick([0, 1, 3], [1, 8, 0, 2], 4) == [3]
    assert slurm_pick([0, 2, 3], [1, 5, 5, 5], 4, needed=2) == [2, 3]  # multi-node: the first sufficient run
    assert slurm_pick([0, 2], [1, 5, 5], 3, needed=2) == [0, 2]  # no run is sufficient: the first eligible
    assert slurm_pick([], [1], 1) is None


def test_slurm_takes_the_tightest_node_first_fit_the_first():
    nodes = [Node("n1", DGX), Node("n2", DGX)]

    def jobs():
        return [Job("fill", 0, 100, 6, node="n2"), Job("j", 1, 10, 2)]

    _, ff = _run(jobs(), nodes, "first-fit")
    _, sl = _run(jobs(), nodes, "slurm")
    assert ff["j"].node == "n1" and sl["j"].node == "n2"


def test_prefer_sends_a_sensitive_job_to_a_node_with_its_ring_and_counts_it():
    nodes = [Node("n1", PCIE8), Node("n2", DGX)]

    def jobs():
        return [Job("fill", 0, 100, 5, node="n1"), Job("s", 1, 10, 2, sensitive=True)]

    _, sl = _run(jobs(), nodes, "slurm")
    result, pr = _run(jobs(), nodes, "prefer")
    assert sl["s"].node == "n1"  # tightest: 3 free GPUs on PCIe
    assert pr["s"].node == "n2" and pr["s"].ranked > 50  # mapa_ring2 is active on the DGX-1 only
    assert result.preference_met == 1 and result.preference_missed == 0


def test_insensitive_jobs_prefer_the_complement_or_the_tightest_fit():
    nodes = [Node("n1", ONE_PAIR), Node("n2", PCIE6)]

    def jobs():
        # the fill keeps the good pair free (Preserve), so n1 is the tightest node and still has mapa_ring2
        return [Job("fill", 0, 100, 2, node="n1"), Job("i", 1, 10, 2)]

    _, best_fit = _run(jobs(), nodes, "prefer", insensitive="best-fit")
    _, complement = _run(jobs(), nodes, "prefer", insensitive="complement")
    _, complement_min = _run(jobs(), nodes, "prefer", insensitive="complement-min")
    assert best_fit["i"].node == "n1"
    assert complement["i"].node == "n2" and complement_min["i"].node == "n2"  # mapa_noring2


def test_features_are_stale_within_a_pass_and_fresh_at_the_next():
    nodes = [Node("n1", ONE_PAIR), Node("n2", ONE_PAIR)]
    fill = Job("fill", 0, 100, 2, node="n1")  # n1: 4 free with the good pair: the tightest preferred node
    _, same_pass = _run([fill, Job("c", 1, 50, 2, sensitive=True), Job("d", 1, 50, 2, sensitive=True)], nodes, "prefer")
    assert same_pass["c"].node == "n1" and same_pass["c"].ranked > 50
    # d is looked at in the same pass: n1 still publishes mapa_ring2 (as the agent had not republished yet)
    assert same_pass["d"].node == "n1" and same_pass["d"].ranked < 15
    fill = Job("fill", 0, 100, 2, node="n1")
    _, next_pass = _run([fill, Job("c", 1, 50, 2, sensitive=True), Job("d", 2, 50, 2, sensitive=True)], nodes, "prefer")
    assert next_pass["d"].node == "n2" and next_pass["d"].ranked > 50


def test_require_holds_out_until_the_wait_bound_then_relaxes():
    nodes = [Node("n1", PCIE8), Node("n2", DGX)]

    def jobs():
        return [Job("whole", 0, 100, 8, node="n2"), Job("s", 1, 10, 2, sensitive=True)]

    _, prefer = _run(jobs(), nodes, "prefer")
    assert prefer["s"].start == 1 and prefer["s"].node == "n1"
    result, short = _run(jobs(), nodes, "require", require_wait=50)
    # nothing else happens at 51: the simulator wakes at the bound
    assert short["s"].start == 51 and short["s"].node == "n1"
    assert result.relaxed == 1 and result.preference_missed == 1
    result, long = _run(jobs(), nodes, "require", require_wait=200)
    assert long["s"].start == 100 and long["s"].node == "n2" and result.relaxed == 0


def test_require_wakeup_also_unblocks_a_fifo_head_without_backfill():
    nodes = [Node("n1", PCIE8), Node("n2", DGX)]
    jobs = [Job("whole", 0, 100, 8, node="n2"), Job("s", 1, 10, 2, sensitive=True), Job("after", 2, 10, 1)]
    _, recs = _run(jobs, nodes, "require", require_wait=30, backfill=False)
    assert recs["s"].start == 31 and recs["after"].start == 31


def test_insensitive_jobs_are_never_held_by_require():
    nodes = [Node("n1", PCIE8), Node("n2", DGX)]
    _, recs = _run([Job("whole", 0, 100, 8, node="n2"), Job("i", 1, 10, 2)], nodes, "require", require_wait=1000)
    assert recs["i"].start == 1


def test_bad_options_are_refused():
    from slurm_mapa.errors import InputError

    for options in ({"node_choice": "random"}, {"insensitive": "spread"}, {"feature_threshold": 0.0}, {"require_wait": -1}):
        with pytest.raises(InputError):
            simulate([], [Node("n1", DGX)], "preserve", Options(**options))


def _distributions(value, path="$"):
    if isinstance(value, dict):
        if "median" in value and "n" in value:
            yield path, value
        for key, item in value.items():
            yield from _distributions(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _distributions(item, f"{path}[{i}]")


def test_cli_node_choice_json_and_every_distribution_has_p10(capsys):
    code = main(["run", "--generate", "paper:120", "--nodes", "3", "--topology", "dgx1-v100", "--load", "8", "--backfill",
                 "--policies", "preserve", "--node-choice", "first-fit,slurm,prefer,require", "--require-wait", "0.5",
                 "--time-model", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["node_choice"] for p in out["policies"]] == ["first-fit", "slurm", "prefer", "require"]
    assert out["options"]["node_choice"] == ["first-fit", "slurm", "prefer", "require"]
    assert out["options"]["node_features"]["require_wait_s"] == 30.0
    found = list(_distributions(out))
    assert any(path.endswith("wait_sensitive") for path, _ in found)
    assert any(".by_gpus." in path for path, _ in found)
    for path, dist in found:
        assert "p10" in dist and "p90" in dist, path
    assert out["policies"][2]["node_preference"]["met"] > 0
    assert out["policies"][0]["node_preference"] == {"met": 0, "missed": 0, "relaxed_constraints": 0}


def test_cli_table_labels_and_bad_choice(capsys):
    assert main(["run", "--generate", "paper:40", "--nodes", "2", "--policies", "preserve", "--node-choice", "slurm"]) == 0
    assert "preserve/slurm" in capsys.readouterr().out
    assert main(["run", "--generate", "paper:40", "--node-choice", "random"]) == 2
    assert "unknown node choice random" in capsys.readouterr().err
    assert main(["run", "--generate", "paper:40", "--feature-sizes", "1,2"]) == 2
    assert main(["run", "--generate", "paper:40", "--require-wait", "-1"]) == 2


def test_table3_compares_each_node_choice_with_its_own_baseline(capsys):
    assert main(["run", "--generate", "paper:80", "--nodes", "2", "--load", "6", "--policies", "baseline,preserve",
                 "--node-choice", "first-fit,prefer", "--time-model", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["table3"]
    assert [(r["policy"], r.get("node_choice")) for r in rows] == [
        ("baseline", None), ("preserve", None), ("baseline", "prefer"), ("preserve", "prefer")]
    assert rows[0]["throughput"] == 1.0 and rows[2]["throughput"] == 1.0
