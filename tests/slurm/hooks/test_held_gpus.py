"""GPUs held out of new jobs (issue 50): the record's strict format, the Prolog leaving held GPUs
out (in-process and in mapa-agent it is the same run_prolog), the fail-open fallback taking them
last, and a randomised test with faults: no new job gets a held GPU while enough unheld ones are
free, and no GPU is in two live jobs."""

from __future__ import annotations

import json
import random

import pytest
from fake_slurm import FakeSlurm, env_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.slurm.config import HookConfig
from slurm_mapa.slurm.hooks.epilog import run_epilog
from slurm_mapa.slurm.hooks.prolog import fallback_gpus, run_prolog
from slurm_mapa.slurm.node_state import GpuHold, HeldCorrupt, NodeState
from slurm_mapa.slurm.node_state.held_gpus import held_from_json, held_to_json
from slurm_mapa.slurm.text.decision import parse_decisions


def config_in(tmp_path) -> HookConfig:
    return HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log",
                      nodes=(("dgx*", "dgx1-v100"),), health="off", prolog_budget=3.0)


def hold(config: HookConfig, *gpus: int) -> None:
    for gpu in gpus:
        NodeState.of(config).set_hold(gpu, GpuHold("XID 79", 1_700_000_000.0, "admin"))


# --- the record -------------------------------------------------------------------------------


def test_the_record_round_trips_and_is_parsed_strictly():
    holds = {3: GpuHold("XID 79 twice", 1718000000.5, "admin"), 0: GpuHold("", 1.0, "nvml")}
    assert held_from_json(held_to_json(holds)) == holds
    good = json.loads(held_to_json(holds))
    bad = [
        {**good, "version": 2}, {**good, "extra": 1}, {"version": 1, "gpus": {"03": good["gpus"]["3"]}},
        {"version": 1, "gpus": {"1024": good["gpus"]["3"]}}, {"version": 1, "gpus": {"-1": good["gpus"]["3"]}},
        {"version": 1, "gpus": {"3": {**good["gpus"]["3"], "source": "me"}}},
        {"version": 1, "gpus": {"3": {**good["gpus"]["3"], "reason": "a\nb"}}},
        {"version": 1, "gpus": {"3": {**good["gpus"]["3"], "reason": "x" * 201}}},
        {"version": 1, "gpus": {"3": {**good["gpus"]["3"], "since": True}}},
        {"version": 1, "gpus": {"3": {**good["gpus"]["3"], "since": -5}}},
        {"version": 1, "gpus": {"3": {"reason": "", "since": 1.0}}}, {"version": 1, "gpus": []}, [],
    ]
    for data in bad:
        with pytest.raises(HeldCorrupt):
            held_from_json(json.dumps(data))
    for text in ("", "{", "[" * 100000, "null", '{"version": 1, "gpus": {}, "gpus": 3}'):
        with pytest.raises(HeldCorrupt):
            held_from_json(text)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_a_record_or_refused(data):
    try:
        holds = held_from_json(data.decode("utf-8", "replace"))
    except HeldCorrupt:
        return
    assert all(isinstance(g, int) and 0 <= g <= 1023 for g in holds)


def test_a_symlink_in_the_records_place_is_refused_not_followed(tmp_path):
    config = config_in(tmp_path)
    target = tmp_path / "elsewhere.json"
    target.write_text(held_to_json({1: GpuHold("x", 1.0, "admin")}))
    NodeState.of(config).held_path().symlink_to(target)
    with pytest.raises(HeldCorrupt):
        NodeState.of(config).held_gpus()


def test_hold_and_release_under_the_lock(tmp_path):
    state = NodeState.of(config_in(tmp_path))
    assert state.held_gpus() == {}
    assert state.set_hold(2, GpuHold("bad", 5.0, "admin")) is None
    assert state.set_hold(2, GpuHold("worse", 6.0, "admin")) == GpuHold("bad", 5.0, "admin")
    assert state.held_gpus() == {2: GpuHold("worse", 6.0, "admin")}
    assert state.set_hold(2, None) is not None and state.held_gpus() == {}


# --- the Prolog -------------------------------------------------------------------------------


def test_a_held_gpu_is_left_out_even_when_slurm_gave_it(tmp_path):
    config, slurm, logs = config_in(tmp_path), FakeSlurm(), []
    hold(config, 0, 1)
    slurm.running = {"10"}
    decision = run_prolog(env_for("10", "0,1", "mapa:topology=ring sensitive=yes"), config, slurm, logs.append)
    assert not {0, 1} & set(decision.gpus) and decision.policy == "preserve" and decision.held == ()
    assert "held=" not in slurm.admin["10"]
    assert any("holding out GPUs 0,1" in line for line in logs)


def test_the_provisional_choice_avoids_held_gpus(tmp_path):
    """Slurm's GPUs are the provisional choice only when none is held: a Prolog killed after it
    leaves its job on unheld GPUs."""
    config, slurm, logs = config_in(tmp_path), FakeSlurm(), []
    hold(config, 2)
    slurm.running = {"11"}
    slurm.broken = {"scontrol"}  # no directive: the site default; the ledger shows the provisional choice was unheld
    seen = []
    real = NodeState.commit

    def spy(self, ledger_file, ledger, job_id, holding, *args, **kwargs):
        seen.append(holding)
        return real(self, ledger_file, ledger, job_id, holding, *args, **kwargs)

    NodeState.commit = spy
    try:
        run_prolog(env_for("11", "2,3"), config, slurm, logs.append)
    finally:
        NodeState.commit = real
    assert seen[0].policy == "provisional" and 2 not in seen[0].gpus


def test_too_few_unheld_gpus_falls_back_to_held_ones_last_and_says_so(tmp_path):
    config, slurm, logs = config_in(tmp_path), FakeSlurm(), []
    hold(config, 5)
    slurm.running = {"12"}
    decision = run_prolog(env_for("12", "0,1,2,3,4,5,6,7"), config, slurm, logs.append)
    assert sorted(decision.gpus) == list(range(8)) and decision.held == (5,) and decision.policy == "fallback"
    assert parse_decisions(slurm.admin["12"])["dgx1"].held == (5,)
    assert any("HELD GPUs 5" in line for line in logs)


def test_the_fallback_takes_unheld_free_gpus_first():
    assert fallback_gpus((0, 1), (0, 1, 2, 3), (), frozenset({0})) == (1, 2)
    assert fallback_gpus((2, 3), (0, 1, 2, 3), (), frozenset({0})) == (2, 3)
    assert fallback_gpus((0, 1, 2), (0, 1, 2), (), frozenset({1})) == (0, 2, 1)  # the held one only because it must
    assert fallback_gpus((0, 1), (0, 1), (), frozenset()) == (0, 1)


def test_an_unreadable_record_holds_nothing_out_and_the_job_still_starts(tmp_path):
    config, slurm, logs = config_in(tmp_path), FakeSlurm(), []
    NodeState.of(config).held_path().write_bytes(b"\xff not json")
    slurm.running = {"13"}
    decision = run_prolog(env_for("13", "0,1", "mapa:sensitive=yes"), config, slurm, logs.append)
    assert decision.policy == "preserve"
    assert any("cannot read the held GPUs" in line for line in logs)


# --- randomised, with faults ------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_no_new_job_gets_a_held_gpu_while_enough_unheld_ones_are_free(tmp_path_factory, seed):
    """Random holds, releases, job starts (Slurm choosing among the GPUs it counts free, held ones
    included) and ends, with faults: a corrupt ledger, a scontrol that fails. Invariants: no GPU
    in two live jobs; a new job gets no held GPU when the
    unheld GPUs no live job uses are enough for it (else the record names the held ones it got).
    Epilogs killed right after their .ended file among the ends."""
    rng = random.Random(seed)
    tmp_path = tmp_path_factory.mktemp("held")
    config, slurm, logs = config_in(tmp_path), FakeSlurm(), []
    state = NodeState.of(config)
    live: dict[str, tuple[int, ...]] = {}  # job -> the GPUs it uses
    slurm_gave: dict[str, tuple[int, ...]] = {}
    held: set[int] = set()
    for step in range(40):
        action = rng.random()
        if action < 0.2:
            gpu = rng.randrange(8)
            state.set_hold(gpu, GpuHold("fault", 1.0, "admin"))
            held.add(gpu)
        elif action < 0.3 and held:
            gpu = rng.choice(sorted(held))
            state.set_hold(gpu, None)
            held.discard(gpu)
        elif action < 0.7:
            slurm_free = sorted(set(range(8)) - {g for gpus in slurm_gave.values() for g in gpus})
            if not slurm_free:
                continue
            wanted = rng.randint(1, min(4, len(slurm_free)))
            job = str(1000 + step)
            gave = tuple(sorted(rng.sample(slurm_free, wanted)))
            slurm.running = set(live) | {job}
            slurm.broken = {"scontrol"} if rng.random() < 0.2 else set()
            if rng.random() < 0.1:
                config.ledger.write_bytes(b"{corrupt")
            unheld_free = set(range(8)) - held - {g for gpus in live.values() for g in gpus}
            comment = rng.choice(["", "mapa:topology=ring sensitive=yes", "mapa:sensitive=no"])
            decision = run_prolog(env_for(job, ",".join(map(str, gave)), comment), config, slurm, logs.append)
            gpus = tuple(decision.gpus)
            for other, theirs in live.items():
                assert not set(theirs) & set(gpus), f"job {job} {gpus} shares with job {other} {theirs}"
            if len(unheld_free) >= wanted:
                assert not set(gpus) & held, (f"job {job} got held GPUs: {gpus}, held {sorted(held)}, unheld free {unheld_free}", [l for l in logs if job in l])
            assert set(decision.held) == set(gpus) & held
            live[job], slurm_gave[job] = gpus, gave
        elif live:
            job = rng.choice(sorted(live))
            if rng.random() < 0.3:
                # An Epilog killed right after its .ended file (its wrapper writes it first): the job's
                # files and claims stay until a lock holder reaps it. Its claims once made every commit
                # of the next Prolog fail (ClaimTaken), which then kept a provisional choice made
                # without the lock, held GPUs included (seeds 39 and 188 found it).
                state.say_ended(job)
            else:
                run_epilog({"SLURM_JOB_ID": job}, config, logs.append)
            del live[job], slurm_gave[job]
    assert not [line for line in logs if "internal error" in line or "Traceback" in line]
