"""The simulator's steps, each alone on a Simulation (replay/simulate.py): what a step changes in
the state it names, checked against numbers worked out by hand from the DGX-1's links."""

from __future__ import annotations

from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.jobs import Job
from slurm_mapa.replay.simulate import INDEX_NODES, Decider, Node, Options, Simulation

DGX1 = preset("dgx1-v100")


def simulation(nodes=2, policy="preserve", **options) -> Simulation:
    return Simulation([Node(f"n{i + 1}", DGX1) for i in range(nodes)], policy, Options(**options), Decider())


def test_set_free_keeps_the_counts_the_index_and_the_preserved_totals_in_step():
    sim = simulation(nodes=INDEX_NODES)  # large enough to be indexed
    whole = sim.totals[0]
    assert sim.totals[0] == sim.totals[1]  # every node idle: nothing is fragmented
    sim.set_free(3, 0b11110000)
    assert sim.count[3] == 4 and 3 in sim.by_count[4] and 3 not in sim.by_count[8]
    # GPUs 4-7 of a DGX-1 keep the preserved bandwidth of their six links (Eq. 3).
    links = sum(DGX1.bandwidth_matrix()[a][b] for a in range(4, 8) for b in range(a + 1, 8))
    node_total = sum(DGX1.bandwidth_matrix()[a][b] for a in range(8) for b in range(a + 1, 8))
    assert abs(sim.totals[0] - (whole - node_total + links)) < 1e-9
    assert sim.first_with_room(5) == 0 and sim.first_with_room(8) == 0
    sim.set_free(0, 0)
    assert sim.first_with_room(5) == 1 and sim.first_with_room(4) == 1 and sim.first_with_room(1) == 1
    sim.set_free(0, 0xFF)
    assert sim.first_with_room(8) == 0


def test_admit_queues_what_fits_some_node_and_drops_the_rest_with_the_reason():
    sim = simulation(nodes=1)
    sim.admit(Job("fits", 0, 10, 4))
    sim.admit(Job("too-big", 1, 10, 9))
    sim.admit(Job("two-nodes", 2, 10, 1, nodes=2))
    assert [job.id for job, _ in sim.queue] == ["fits"]
    assert sim.result.dropped == {"larger than every node": 2}


def test_try_start_takes_the_gpus_and_finish_gives_them_back():
    sim = simulation(nodes=2)
    sim.admit(Job("a", 0, 100, 8))
    sim.admit(Job("b", 0, 50, 4, sensitive=True))
    (a, rid_a), (b, rid_b) = sim.queue
    assert sim.try_start(a, rid_a, 0.0) and sim.free == [0, 0xFF]
    assert sim.try_start(b, rid_b, 0.0) and sim.count == [0, 4]
    assert sim.running[0][0] == 50.0  # b ends first
    ended = []
    sim.finish(60.0, ended.append)
    assert [record.id for record in ended] == ["b"] and sim.free == [0, 0xFF] and sim.releases == 1
    assert sim.result.jobs == 1 and sim.result.size(4).jobs == 1


def test_schedule_stops_at_a_head_that_does_not_fit_unless_backfilling():
    for backfill, started in ((False, ["a"]), (True, ["a", "c"])):
        sim = simulation(nodes=1, backfill=backfill)
        for job in (Job("a", 0, 100, 6), Job("b", 1, 10, 4), Job("c", 2, 10, 1)):
            sim.admit(job)
        sim.schedule(2.0)
        assert sorted(job.id for _, _, job, _, _ in sim.running) == started
        assert [job.id for job, _ in sim.queue] == [j for j in ("b", "c") if j not in started]


def test_a_require_job_waits_for_its_feature_until_its_bound_then_takes_what_is_free():
    sim = simulation(nodes=1, node_choice="require", require_wait=30.0)
    sim.set_free(0, 0b00010111)  # GPUs 0, 1, 2, 4: no 4-GPU NVLink ring left that is as good as an idle node's
    job = Job("s", 0, 10, 4, sensitive=True)
    sim.admit(job)
    assert sim.wanted(job) == (True, 4) and not sim.has_feature(0, sim.free[0], (True, 4))
    sim.schedule(5.0)
    assert list(sim.queue) and sim.wakeups == [30.0]  # it holds out, with a wake-up at its bound
    sim.wake(30.0)
    sim.schedule(30.0)
    assert not sim.queue and sim.result.relaxed == 1 and sim.count == [0]
