"""Issue 40 in the replay: how long a 'require' job holds out (wait rule 'cost') and node weights
(cluster-level Preserve), each checked against numbers worked out apart from the rule's code: the
time curve read directly, end times placed by hand, a reference of Slurm's weight order."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.jobs import Job
from slurm_mapa.replay.node_pick import slurm_pick, weighted_pick
from slurm_mapa.replay.simulate import Decider, Node, Options, Simulation, check_options, simulate
from slurm_mapa.replay.timemodel import TimeModel

DGX1 = preset("dgx1-v100")
PCIE = preset("pcie-8")
FRAGMENTED = 0b00010111  # DGX-1 GPUs 0, 1, 2, 4 free: no 4-ring as good as an idle node's
REST = 0xFF & ~FRAGMENTED


def require_cost(nodes=1, **options) -> Simulation:
    return Simulation([Node(f"n{i + 1}", DGX1) for i in range(nodes)], "preserve",
                      Options(node_choice="require", wait_rule="cost", **options), Decider())


def occupy_until(sim: Simulation, node: int, mask: int, end: float) -> None:
    """A running job holding ``mask`` on ``node`` until ``end`` (placed by hand, not by a policy)."""
    probe = Job(f"held-{node}-{end}", 0, end, mask.bit_count())
    sim.admit(probe)
    job, probe_rid = sim.queue.pop()
    found = sim.decider.decide("preserve", sim.gids[node], 0xFF, probe_rid)
    decision = replace(found[0], mask=mask)
    sim.set_free(node, sim.free[node] & ~mask)
    sim.running.append((end, len(sim.running), job, [(node, decision, None)], 0.0))
    sim.running.sort(key=lambda entry: (entry[0], entry[1]))


def lost_alone(sim: Simulation, job: Job, rid: int) -> float:
    """What the job would lose on the fragmented node, by the default curve read here."""
    curve = TimeModel()
    now = sim.decider.decide("preserve", sim.gids[0], FRAGMENTED, rid)[0].effective
    best = sim.decider.decide("preserve", sim.gids[0], 0xFF, rid)[0].effective
    assert now < best
    return job.runtime * (curve.slowdown_against(now, best) - 1.0)


@pytest.mark.parametrize("ends_after, holds", [(0.5, True), (2.0, False)])
def test_a_require_job_holds_out_exactly_while_the_ring_comes_sooner_than_what_it_would_lose(ends_after, holds):
    sim = require_cost()
    job = Job("s", 0, 10, 4, sensitive=True)
    sim.admit(job)
    rid = sim.queue[0][1]
    lost = lost_alone(sim, job, rid)
    occupy_until(sim, 0, REST, 5.0 + ends_after * lost)
    sim.schedule(5.0)
    assert bool(sim.queue) is holds
    assert sim.result.relaxed == (0 if holds else 1)
    assert not sim.wakeups  # the cost rule sets no fixed bound
    if holds:  # the blocker ends: the ring is there and the job takes it
        sim.finish(5.0 + ends_after * lost, None)
        sim.schedule(5.0 + ends_after * lost)
        assert not sim.queue and sim.result.preference_met == 1


def test_queued_jobs_make_a_slow_run_cost_more_so_the_job_holds_out_longer():
    sim = require_cost()
    job = Job("s", 0, 10, 4, sensitive=True)
    sim.admit(job)
    rid = sim.queue[0][1]
    lost = lost_alone(sim, job, rid)
    for n in range(3):  # three whole-node jobs behind it: each waits for the GPU time a slow run burns
        sim.admit(Job(f"whole{n}", 0, 10, 8))
    # alone it would go now (2x lost); with 3 queued 4-of-8-GPU shares the price is 1 + 3 * 4/8 = 2.5x
    occupy_until(sim, 0, REST, 5.0 + 2.0 * lost)
    sim.schedule(5.0)
    assert [queued.id for queued, _ in sim.queue][0] == "s" and sim.result.relaxed == 0
    occupy_end = 5.0 + 2.6 * lost
    sim2 = require_cost()
    sim2.admit(Job("s", 0, 10, 4, sensitive=True))
    for n in range(3):
        sim2.admit(Job(f"whole{n}", 0, 10, 8))
    occupy_until(sim2, 0, REST, occupy_end)
    sim2.schedule(5.0)
    assert sim2.result.relaxed == 1


def test_the_expected_wait_counts_the_jobs_holding_out_ahead():
    sim = require_cost(nodes=2)
    occupy_until(sim, 0, REST, 20.0)
    occupy_until(sim, 1, REST, 50.0)
    sim.fleet_best(4)
    want = (True, 4)
    assert sim.ring_wait(want, 5.0, 0) == 15.0
    assert sim.ring_wait(want, 5.0, 1) == 45.0
    assert sim.ring_wait(want, 5.0, 7) == 45.0  # more ahead than rings coming: the last one known (a lower bound)


def test_the_pricing_curve_is_the_time_model_when_there_is_one_and_the_papers_when_not():
    curve = TimeModel(((10.0, 5.0), (60.0, 1.0)))
    assert require_cost().pricing == TimeModel()
    assert require_cost(time_model=curve).pricing == curve
    assert require_cost(wait_pricing=curve).pricing == curve


def test_options_name_what_is_wrong_and_what_is_accepted():
    nodes = [Node("n1", DGX1)]
    with pytest.raises(InputError, match="wait rule 'later'.*fixed, cost"):
        check_options("preserve", nodes, Options(node_choice="require", wait_rule="later"))
    with pytest.raises(InputError, match="node weights need"):
        check_options("preserve", nodes, Options(node_weights=True))


# --- node weights ---------------------------------------------------------------------------------

@st.composite
def weighted_clusters(draw):
    n = draw(st.integers(1, 12))
    counts = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    weights = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    eligible = sorted(draw(st.sets(st.integers(0, n - 1))))
    needed = draw(st.integers(1, 3))
    return eligible, weights, counts, needed


@settings(max_examples=400, deadline=None)
@given(weighted_clusters())
def test_weighted_pick_takes_the_lowest_weights_that_can_hold_the_job_then_slurms_choice(case):
    eligible, weights, counts, needed = case
    picked = weighted_pick(eligible, weights, counts, needed)
    if len(eligible) < needed:
        assert picked is None
        return
    # the lowest weight level whose nodes (with every lower weight) are enough
    level = min(w for w in {weights[i] for i in eligible} if sum(weights[i] <= w for i in eligible) >= needed)
    assert picked is not None and len(set(picked)) == needed and set(picked) <= set(eligible)
    assert max(weights[i] for i in picked) <= level
    assert picked == slurm_pick([i for i in eligible if weights[i] <= level], counts, len(counts), needed)
    if len({weights[i] for i in eligible}) == 1:
        assert picked == slurm_pick(eligible, counts, len(counts), needed)


def test_weights_send_an_insensitive_job_to_the_node_whose_free_gpus_are_worth_least():
    # node order puts the DGX-1 first and Slurm's tightest fit would pick it (fewer free GPUs)
    nodes = [Node("dgx", DGX1), Node("pcie", PCIE)]
    for weights, where in ((False, 0), (True, 1)):
        sim = Simulation(nodes, "preserve", Options(node_choice="slurm", node_weights=weights), Decider())
        sim.set_free(0, 0b01111111)
        job = Job("i", 0, 10, 2)
        sim.admit(job)
        sim.schedule(0.0)
        assert sim.running[0][3][0][0] == where


def test_a_replay_with_weights_and_the_cost_rule_keeps_every_job_and_every_gpu_count():
    nodes = [Node("p1", PCIE), Node("d1", DGX1), Node("p2", PCIE), Node("d2", DGX1)]
    jobs = [Job(str(i), float(i % 7), 3.0 + i % 5, 1 + i % 5, sensitive=i % 3 != 0) for i in range(120)]
    result = simulate(jobs, nodes, "preserve", Options(node_choice="require", wait_rule="cost", node_weights=True,
                                                       backfill=True))
    assert result.jobs == 120 and result.stuck == 0


def test_mapa_replay_takes_the_wait_rule_and_weights_and_says_so_in_its_json(capsys):
    import json

    from slurm_mapa.replay.cli import main

    argv = ["run", "--generate", "paper:120", "--nodes", "3", "--topology", "dgx1-v100", "--load", "8", "--backfill",
            "--policies", "preserve", "--node-choice", "first-fit,require", "--time-model", "--json"]
    assert main(argv + ["--wait-rule", "cost", "--node-weights"]) == 0
    out = json.loads(capsys.readouterr().out)
    features = out["options"]["node_features"]
    assert features["wait_rule"] == "cost" and features["node_weights"] is True
    assert [p["node_choice"] for p in out["policies"]] == ["first-fit", "require"]
    assert main(argv + ["--wait-rule", "later"]) == 2
    assert "invalid choice: 'later'" in capsys.readouterr().err


# --- as `mapa release` prices it in Slurm: time limits, the worst ring free now ------------------

def test_with_time_limits_running_jobs_end_at_their_limits_and_the_job_prices_its_limit():
    """wait_limits=3: a job's limit is 3x its run time; a running job placed by hand with run time
    10 from 0 is expected to end at 30, not 10; and the loss is 3x the run time's."""
    sim = require_cost(nodes=2, wait_limits=3.0)
    occupy_until(sim, 0, REST, 10.0)  # its Job's runtime is its end (10), started at 0
    sim.fleet_best(4)
    assert sim.ring_wait((True, 4), 5.0, 0) == 25.0  # ends at 3 x 10 = 30
    assert require_cost(nodes=2).ring_wait((True, 4), 5.0, 0) == float("inf")  # (no running job: no ring expected)
    job = Job("s", 0, 10, 4, sensitive=True)
    oracle, limits = require_cost(), require_cost(wait_limits=3.0)
    for sim in (oracle, limits):
        sim.admit(job)
        occupy_until(sim, 0, REST, 1000.0)
        sim.fleet_best(4)
    lost = lost_alone(oracle, job, oracle.queue[0][1])
    # The blocker (run time 1000 from 0) ends at 1000 for the oracle, at its limit 3000 for Slurm's rule.
    assert oracle.holding_pays(job, oracle.queue[0][1], (True, 4), 0, 5.0) is (995.0 < lost)
    assert limits.holding_pays(job, limits.queue[0][1], (True, 4), 0, 5.0) is (2995.0 < 3 * lost)


def test_with_time_limits_the_loss_is_priced_at_the_worst_ring_free_now():
    """Two nodes with room: an idle DGX-1 and one whose free GPUs hold a poor ring. Slurm may pick
    either, so the rule prices the poor one."""
    sim = require_cost(nodes=2, wait_limits=1.0)
    occupy_until(sim, 1, REST, 1000.0)
    sim.fleet_best(4)
    job = Job("s", 0, 10, 4, sensitive=True)
    sim.admit(job)
    rid = sim.queue[0][1]
    curve = TimeModel()
    worst = sim.decider.decide("preserve", sim.gids[1], FRAGMENTED, rid)[0].effective
    best = sim.decider.decide("preserve", sim.gids[0], 0xFF, rid)[0].effective
    assert worst < best
    expected = 10 * (curve.slowdown_against(worst, best) - 1.0)
    assert expected > 0
    # Holding pays exactly while the wait (1000 - t) is shorter than the worst-priced loss.
    assert sim.holding_pays(job, rid, (True, 4), 0, 1000.0 - expected + 0.5) is True
    sim.holding.clear()
    assert sim.holding_pays(job, rid, (True, 4), 0, 1000.0 - expected - 0.5) is False


def test_time_limits_are_checked():
    with pytest.raises(InputError, match="0 .*or 1 to 100, got 0.5"):
        check_options("preserve", [Node("n1", DGX1)], Options(node_choice="require", wait_rule="cost", wait_limits=0.5))
