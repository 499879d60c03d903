"""The event-driven simulator, the time model, the statistics and the decision audit."""

from __future__ import annotations

import pytest

from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay import report
from slurm_mapa.replay.audit import audit
from slurm_mapa.replay.generate import generate
from slurm_mapa.replay.jobs import Job
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate
from slurm_mapa.replay.stats import Dist, Series
from slurm_mapa.replay.timemodel import TimeModel, parse_curve

DGX = [Node("n1", preset("dgx1-v100"))]


def _records(jobs, nodes=DGX, policy="baseline", options=None):
    out = []
    result = simulate(jobs, nodes, policy, options, on_record=out.append)
    return result, {r.id: r for r in out}


def test_fifo_head_of_line_blocking_and_backfill():
    jobs = [
        Job("a", 0, 100, 6),  # takes 6 of 8 GPUs
        Job("b", 1, 10, 4),   # head: does not fit until a ends
        Job("c", 2, 10, 1),   # fits now, but FIFO makes it wait behind b
    ]
    result, recs = _records([Job(**{s: getattr(j, s) for s in Job.__slots__}) for j in jobs])
    assert recs["b"].start == 100 and recs["c"].start == 100
    assert result.jobs == 3 and result.makespan == 110
    _, recs = _records(jobs, options=Options(backfill=True))
    assert recs["c"].start == 2 and recs["b"].start == 100


def test_arrivals_are_honest_and_idle_time_is_skipped():
    result, recs = _records([Job("a", 0, 5, 2), Job("b", 1000, 5, 2)])
    assert recs["b"].start == 1000 and recs["b"].wait == 0
    assert result.makespan == 1005


def test_out_of_order_arrivals_are_reordered_within_the_window():
    result, recs = _records([Job("a", 10, 5, 1), Job("b", 0, 5, 1)])
    assert recs["b"].start == 0 and recs["a"].start == 10 and result.out_of_order == 0


def test_jobs_larger_than_every_node_are_dropped_not_blocking():
    result, recs = _records([Job("big", 0, 5, 9), Job("ok", 1, 5, 2)])
    assert set(recs) == {"ok"} and result.dropped == {"larger than every node": 1}


def test_many_nodes_and_pinning():
    nodes = [Node("n1", preset("dgx1-v100")), Node("n2", preset("dgx1-v100"))]
    _, recs = _records([Job("a", 0, 10, 8), Job("b", 0, 10, 8)], nodes)
    assert recs["a"].node == "n1" and recs["b"].node == "n2" and recs["b"].start == 0
    pinned = [Job("a", 0, 10, 8, node="n1"), Job("b", 0, 10, 8, node="n1")]
    _, recs = _records(pinned, nodes)
    assert recs["b"].node == "n1" and recs["b"].start == 10
    _, recs = _records([Job(**{s: getattr(j, s) for s in Job.__slots__}) for j in pinned], nodes, options=Options(pin_nodes=False))
    assert recs["b"].node == "n2"
    _, recs = _records([Job("wide", 0, 10, 4, nodes=2)], nodes)
    assert recs["wide"].node == "n1,n2"


def test_time_model_slows_sensitive_jobs_on_poor_bandwidth_only():
    model = TimeModel()
    assert model.slowdown(12.3) == 3.0 and model.slowdown(80) == 1.0 and model.slowdown(None) == 1.0
    assert model.runtime(100, False, 4, 12.3, 60.0) == 100 and model.runtime(100, True, 1, None, 60.0) == 100
    assert 1.0 < model.slowdown(30) < 1.8


def test_time_model_reads_the_curve_against_the_best_set_the_fleet_offers():
    """Issue 49: the input's time is the time on the best set; the curve is read at bandwidth/best
    of its full speed (60 GB/s), so the judge's scale does not slow the best sets down."""
    model = TimeModel()
    assert model.slowdown_against(40.0, 40.0) == 1.0 and model.slowdown_against(80.0, 40.0) == 1.0
    assert model.slowdown_against(10.25, 50.0) == model.slowdown(12.3) == 3.0  # 60 x 10.25/50 = 12.3
    assert model.slowdown_against(20.0, 40.0) == model.slowdown(30.0)
    assert model.slowdown_against(None, 40.0) == 1.0 and model.slowdown_against(12.3, None) == 3.0
    # A curve whose top is not 1 still gives the best set its base time.
    assert TimeModel(((10.0, 4.0), (20.0, 2.0))).slowdown_against(5.0, 10.0) == 2.0
    with pytest.raises(InputError, match="full speed"):
        TimeModel(((-5.0, 2.0), (0.0, 1.0)))

    # Alone on an idle node a job gets the best set: it runs its base time (on any node type).
    for name in ("dgx1-v100", "pcie-8"):
        _, recs = _records([Job("a", 0, 100, 4, sensitive=True)], [Node("n", preset(name))],
                           policy="preserve", options=Options(time_model=model))
        assert recs["a"].runtime == 100
    # A mixed fleet: the best 2-GPU set is the DGX-1's NVLink pair; pinned to the PCIe box, a job is slower.
    fleet = [Node("dgx", preset("dgx1-v100")), Node("pcie", preset("pcie-8"))]
    _, recs = _records([Job("a", 0, 100, 2, sensitive=True, node="pcie"), Job("b", 0, 100, 2, sensitive=True, node="dgx")],
                       fleet, policy="preserve", options=Options(time_model=model))
    assert recs["b"].runtime == 100
    assert recs["a"].effective < recs["b"].effective
    assert recs["a"].runtime == pytest.approx(100 * model.slowdown_against(recs["a"].effective, recs["b"].effective))
    assert recs["a"].runtime > 200
    with pytest.raises(InputError, match="BW:SLOWDOWN"):
        parse_curve("12:3,oops")
    with pytest.raises(InputError, match="increase"):
        parse_curve("50:1,12:3")


def test_decisions_are_memoised_per_state():
    decider = Decider()
    simulate(generate("paper", 300, seed=1, load=4), DGX, "preserve", decider=decider)
    first = decider.searches
    simulate(generate("paper", 300, seed=1, load=4), DGX, "preserve", decider=decider)
    assert decider.searches == first and decider.lookups > first


def test_preserve_improves_the_lower_tail_on_the_paper_workload_dgx1():
    """The paper's result, with the paper's model named (issue 38: it is no server's default), and
    judged by it, as the paper judged its policies."""
    from slurm_mapa.core.model_files import paper_model
    from slurm_mapa.replay.simulate import JUDGE_RANKING

    decider = Decider(model=paper_model(), judge=JUDGE_RANKING)
    results = {p: simulate(generate("paper", 300, seed=1, load=4), DGX, p, decider=decider)
               for p in ("baseline", "topo-aware", "greedy", "preserve")}
    pres = results["preserve"].eff_sensitive
    for other in ("baseline", "topo-aware"):
        assert pres.quantile(0) > results[other].eff_sensitive.quantile(0)
        assert pres.quantile(0.25) > results[other].eff_sensitive.quantile(0.25)
    assert results["preserve"].jobs == 300
    text = report.table(list(results.values()))
    assert "preserve" in text and "min" in text
    rows = report.table3(list(results.values()))
    assert rows[0] == {"policy": "baseline", "min": 1.0, "p25": 1.0, "median": 1.0, "p75": 1.0, "max": 1.0, "throughput": 1.0}
    summary = report.summary(results["preserve"])
    assert summary["effective_bw_sensitive"]["n"] == results["preserve"].eff_sensitive.count
    assert 0 <= summary["fragmentation_time_mean"] <= 1


def test_round_robin_keeps_its_queue_per_node():
    _, recs = _records([Job("a", 0, 10, 1), Job("b", 20, 10, 1)], policy="round-robin")
    assert recs["a"].gpus == (0,) and recs["b"].gpus == (1,)
    _, recs = _records([Job("a", 0, 10, 1), Job("b", 20, 10, 1)], policy="first-fit")
    assert recs["b"].gpus == (0,)


def test_unknown_policy_and_empty_cluster():
    with pytest.raises(InputError, match="accepted"):
        simulate([], DGX, "nope")
    with pytest.raises(InputError, match="no nodes"):
        simulate([], [], "baseline")


def test_dist_quantiles_exact_and_bounded():
    d = Dist()
    for v in [1, 2, 3, 4, 5]:
        d.add(float(v))
    assert d.five()["p25"] == 2 and d.quantile(0.5) == 3 and d.mean == 3
    big = Dist(exact_limit=100)
    for i in range(10_000):
        big.add(float(i % 50))
    assert big.values is None and len(big.hist) == 50
    assert big.quantile(0.5) in (24.0, 25.0) and big.quantile(1) == 49
    s = Series(limit=10)
    for t in range(100):
        s.add(float(t), 1.0, 0.0, 0, 0)
    assert len(s.points) <= 11


def _preserve_choice(free, gpus, sensitive):
    from slurm_mapa.core.policies import select
    from slurm_mapa.replay.directives import request_for

    return tuple(sorted(select("preserve", preset("dgx1-v100"), list(free), request_for("ring", gpus, sensitive)).gpus))


def test_audit_recorded_decisions_match_preserve():
    jobs = [
        Job("1", 0, 100, 2, sensitive=True, node="n1", recorded=(0, 3), start=0),
        Job("2", 0, 100, 1, sensitive=False, node="n1", recorded=_preserve_choice([1, 2, 4, 5, 6, 7], 1, False), start=5),
    ]
    decider = Decider()
    result = audit(jobs, DGX, ["preserve", "baseline"], decider)
    assert result["compared"] == 2 and result["policies"]["preserve"]["same_set"] == 2
    assert result["free_sets"] == {"recorded": 0, "rebuilt": 2, "rebuilt_differs_from_recorded": 0}
    overlapping = [Job("1", 0, 100, 2, node="n1", recorded=(0, 3), start=0), Job("2", 0, 100, 1, node="n1", recorded=(3,), start=5)]
    assert audit(overlapping, DGX, ["preserve"], decider)["skipped"] == 1


def test_audit_uses_the_free_set_the_prolog_recorded():
    # Job 1 ended and job 2 started in the same whole second; sacct ordered them wrong, so the
    # times say GPUs 0 and 3 were still held. The recorded free set says they were free.
    free = (0, 1, 2, 3, 4, 5, 6, 7)
    chosen = _preserve_choice(free, 2, True)
    jobs = [
        Job("1", 0, 10, 2, sensitive=True, node="n1", recorded=(0, 3), start=0, recorded_free=free),
        Job("2", 9, 100, 2, sensitive=True, node="n1", recorded=chosen, start=9, recorded_free=free),
    ]
    result = audit(jobs, DGX, ["preserve"], Decider())
    assert result["compared"] == 2 and result["skipped"] == 0
    assert result["free_sets"] == {"recorded": 2, "rebuilt": 0, "rebuilt_differs_from_recorded": 1}
    assert result["policies"]["preserve"]["as_good"] == 2
    assert "1 recorded set(s) differ" in report.audit_text(result)
    # Without the recorded sets, the same log is only as good as its times.
    for job in jobs:
        job.recorded_free = None
    assert audit(jobs, DGX, ["preserve"], Decider())["free_sets"]["rebuilt"] == 1


def test_simulator_hands_preserve_ahead_the_running_jobs():
    """Replaying preserve-ahead step by step: each decision is select() with the jobs running then."""
    from slurm_mapa.core.explain import reported_allocation
    from slurm_mapa.core.policies import select
    from slurm_mapa.hardware.load import model_for_topology
    from slurm_mapa.replay.directives import request_for

    graph = preset("torus2d-16")
    records = []
    jobs = list(generate("paper", 60, seed=4, load=4))
    simulate(jobs, [Node("n1", graph)], "preserve-ahead", on_record=records.append)
    by_id = {job.id: job for job in jobs}
    # ends before starts at the same time, as the simulator frees them; starts in queue (submit) order
    events = sorted([(r.start, 1, r) for r in records] + [(r.end, 0, r) for r in records],
                    key=lambda e: (e[0], e[1], e[2].submit, int(e[2].id)))
    running: dict[str, tuple[int, ...]] = {}
    with_running = 0
    for _, starts, record in events:
        if not starts:
            del running[record.id]
            continue
        held = {g for gpus in running.values() for g in gpus}
        free = [g for g in range(graph.size) if g not in held]
        job = by_id[record.id]
        request = request_for(job.shape, job.gpus, job.sensitive)
        # the replay prices each node type with its own model (hardware.load.model_for_topology), as the Prolog does
        again = select("preserve-ahead", graph, free, request, model_for_topology(graph), running=list(running.values()))
        # the replay reports a collective's set in its best order (core.explain.reported_placement)
        assert tuple(reported_allocation(graph, request, again, model_for_topology(graph)).gpus) == tuple(record.gpus), record.id
        with_running += bool(running)
        running[record.id] = tuple(sorted(record.gpus))
    assert with_running > 40


def test_audit_replays_preserve_ahead_with_the_running_jobs_it_recorded():
    from slurm_mapa.core.policies import select
    from slurm_mapa.replay.directives import request_for

    graph = preset("dgx1-v100")
    free, running = (0, 1, 2, 3), ((4, 5), (6, 7))
    chosen = tuple(sorted(select("preserve-ahead", graph, free, request_for("ring", 3, False), running=running).gpus))
    assert chosen != tuple(sorted(select("preserve-ahead", graph, free, request_for("ring", 3, False)).gpus))
    jobs = [Job("9", 0, 10, 3, node="n1", recorded=chosen, start=0, recorded_free=free, recorded_running=running)]
    result = audit(jobs, DGX, ["preserve-ahead"], Decider())
    assert result["policies"]["preserve-ahead"]["same_set"] == 1
    jobs[0].recorded_running = ()
    assert audit(jobs, DGX, ["preserve-ahead"], Decider())["policies"]["preserve-ahead"]["same_set"] == 0


def test_audit_remakes_a_choice_under_the_affinity_rule_it_was_recorded_with():
    from slurm_mapa.core.affinity import cpus_of_slurms_gpus, select_with_affinity
    from slurm_mapa.core.policies import select
    from slurm_mapa.replay.directives import read_intent, request_for
    from slurm_mapa.slurm.text.decision import Decision

    graph, request = preset("dgx1-v100"), request_for("ring", 2, True)
    free = (0, 1, 2, 3, 5, 6)
    plain = select("preserve", graph, free, request)
    strict, _ = select_with_affinity("preserve", graph, free, request, cpus_of_slurms_gpus(graph, (5, 6)), "strict")
    assert max(plain.gpus) <= 3 and set(strict.gpus) <= {5, 6}  # what the test needs: the rule changed the choice
    record = Decision("n1", strict.gpus, "preserve", free=free, slurm_gpus=(5, 6), affinity="strict").text()
    intent = read_intent(f"mapa:topology=ring sensitive=yes # {record}")
    assert (intent.recorded_slurm, intent.recorded_affinity) == ((5, 6), ("strict", 0.0))
    job = Job("7", 0, 10, 2, sensitive=True, node="n1", recorded=intent.recorded, start=0, recorded_free=intent.recorded_free,
              recorded_slurm=intent.recorded_slurm, recorded_affinity=intent.recorded_affinity)
    assert audit([job], DGX, ["preserve"], Decider())["policies"]["preserve"]["same_set"] == 1
    job.recorded_affinity = None  # an audit blind to the rule counts it as differing
    assert audit([job], DGX, ["preserve"], Decider())["policies"]["preserve"]["same_set"] == 0
    # The job's CPUs as its cgroup held them (cpus=) win over Slurm's GPUs: on socket 0 they make
    # the same rule choose among GPUs 0-3.
    on_socket0, _ = select_with_affinity("preserve", graph, free, request, frozenset({3}), "strict")
    record = Decision("n1", on_socket0.gpus, "preserve", free=free, slurm_gpus=(5, 6), affinity="strict", job_cpus="3").text()
    intent = read_intent(f"mapa:topology=ring sensitive=yes # {record}")
    assert intent.recorded_cpus == frozenset({3})
    job = Job("8", 0, 10, 2, sensitive=True, node="n1", recorded=intent.recorded, start=0, recorded_free=intent.recorded_free,
              recorded_slurm=intent.recorded_slurm, recorded_affinity=intent.recorded_affinity, recorded_cpus=intent.recorded_cpus)
    assert audit([job], DGX, ["preserve"], Decider())["policies"]["preserve"]["same_set"] == 1
    assert read_intent(f"mapa:topology=ring sensitive=yes # {record.replace('cpus=3', 'cpus=9-2')}").recorded_cpus is None


def test_audit_skips_fallback_decisions_but_keeps_their_gpus_busy():
    jobs = [
        Job("1", 0, 100, 2, node="n1", recorded=(0, 1), start=0, recorded_policy="fallback", recorded_free=tuple(range(8))),
        Job("2", 5, 100, 1, node="n1", recorded=(0,), start=5),
    ]
    result = audit(jobs, DGX, ["preserve"], Decider())
    assert result["skipped_reasons"] == {
        "the Prolog fell back (no policy decision)": 1,
        "recorded GPUs overlap a running job's": 1,
    }
