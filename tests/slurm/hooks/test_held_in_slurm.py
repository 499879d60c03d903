"""Held GPUs told to slurmctld (issue 50, item 3): tell_slurm against a fake slurmctld that keeps
reservations and the node's state, Reason and Comment as Slurm 24.11 and 26.05 do (a GPU
reservation is refused while jobs hold every GPU: "Requested nodes are busy"); `mapa gpu
hold|release` telling it at once, and mapa-agent's passes telling it again."""

from __future__ import annotations

import types

import pytest
from fake_slurmctld import FakeSlurmctld

from slurm_mapa.cli import main
from slurm_mapa.slurm.admin import gpu_hold
from slurm_mapa.slurm.agent.background import Background
from slurm_mapa.slurm.config import HookConfig
from slurm_mapa.slurm.hooks.held_in_slurm import tell_slurm
from slurm_mapa.slurm.node_state import GpuHold, NodeState


def config_in(tmp_path) -> HookConfig:
    return HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log",
                      nodes=(("dgx*", "dgx1-v100"),), health="off", scontrol="scontrol")


def test_a_held_gpu_is_reserved_and_named_and_all_is_undone_on_release(tmp_path):
    slurm = FakeSlurmctld()
    config = config_in(tmp_path)
    told = tell_slurm(config, "dgx1", 8, {3: "XID 79 twice"}, slurm)
    assert told.complete and told.reserved == 1 and slurm.reservations == {"mapa_held_dgx1": 1}
    assert slurm.comment == "mapa-held: GPU 3 (XID 79 twice)" and "DRAIN" not in slurm.state
    assert "reservation mapa_held_dgx1 holds 1 GPU(s) of dgx1" in told.lines("dgx1")[0]
    slurm.calls.clear()
    again = tell_slurm(config, "dgx1", 8, {3: "XID 79 twice"}, slurm)  # nothing to change: two reads, no write
    assert again.complete and not again.changes("dgx1") and len(slurm.calls) == 2
    told = tell_slurm(config, "dgx1", 8, {3: "XID 79 twice", 5: "row remap"}, slurm)  # a new count: a new reservation
    assert told.deleted and told.reserved == 2 and slurm.reservations == {"mapa_held_dgx1": 2}
    slurm.comment = "rack 4 " + slurm.comment
    tell_slurm(config, "dgx1", 8, {}, slurm)
    assert slurm.reservations == {} and slurm.comment == "rack 4"


def test_every_gpu_held_drains_the_node_and_one_released_lifts_it(tmp_path):
    slurm = FakeSlurmctld()
    config = config_in(tmp_path)
    told = tell_slurm(config, "dgx1", 8, {gpu: "bad" for gpu in range(8)}, slurm)
    assert "DRAIN" in slurm.state and slurm.reason.startswith("mapa-held: all 8 GPUs held: GPU 0 (bad)")
    assert told.node.drain == slurm.reason and slurm.reservations == {"mapa_held_dgx1": 8}
    tell_slurm(config, "dgx1", 8, {gpu: "bad" for gpu in range(7)}, slurm)
    assert "DRAIN" not in slurm.state and slurm.reservations == {"mapa_held_dgx1": 7}


def test_a_busy_node_is_drained_until_slurm_can_reserve_the_gpu(tmp_path):
    slurm = FakeSlurmctld()
    slurm.busy_gpus = 8  # jobs hold every GPU: Slurm refuses the reservation
    config = config_in(tmp_path)
    told = tell_slurm(config, "dgx1", 8, {3: "XID 79"}, slurm)
    assert told.unreserved == [3] and not told.complete and not told.problems
    assert "DRAIN" in slurm.state and "cannot reserve held GPU 3" in slurm.reason
    told = tell_slurm(config, "dgx1", 8, {3: "XID 79"}, slurm)  # still busy: drained again, same Reason
    assert told.lifted and told.unreserved == [3] and "DRAIN" in slurm.state and "cannot reserve held GPU 3" in slurm.reason
    slurm.busy_gpus = 6  # a job ended
    told = tell_slurm(config, "dgx1", 8, {3: "XID 79"}, slurm)
    assert told.complete and told.lifted and "DRAIN" not in slurm.state and slurm.reservations == {"mapa_held_dgx1": 1}
    assert "Slurm: node dgx1 no longer drained by MAPA" in told.lines("dgx1")


def test_an_admins_drain_is_left_alone(tmp_path):
    slurm = FakeSlurmctld()
    slurm.state, slurm.reason = {"IDLE", "DRAIN"}, "bad PSU"
    config = config_in(tmp_path)
    tell_slurm(config, "dgx1", 8, {gpu: "bad" for gpu in range(8)}, slurm)
    tell_slurm(config, "dgx1", 8, {}, slurm)
    assert slurm.reason == "bad PSU" and "DRAIN" in slurm.state


def test_an_unreachable_slurmctld_is_a_problem_said_not_an_error(tmp_path):
    slurm = FakeSlurmctld()
    slurm.down = True
    told = tell_slurm(config_in(tmp_path), "dgx1", 8, {3: "x"}, slurm)
    assert not told.complete and "cannot read the reservations" in told.problems[0]
    assert told.lines("dgx1")[-1].startswith("Slurm: cannot read the reservations")


def _node_config(tmp_path) -> str:
    (tmp_path / "state").mkdir(mode=0o755)
    (tmp_path / "jobs").mkdir(mode=0o755)
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/state/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                      'scontrol = "/usr/bin/scontrol"\n[nodes]\n"*" = "dgx1-v100"\n')
    config.chmod(0o644)
    return str(config)


def test_hold_and_release_tell_slurm_at_once(tmp_path, capsys, monkeypatch):
    slurm = FakeSlurmctld()
    monkeypatch.setattr(gpu_hold, "make_runner", lambda timeout: slurm)
    config = _node_config(tmp_path)
    assert main(["gpu", "hold", "3", "--reason", "XID 79 twice", "--config", config, "--node", "dgx1"]) == 0
    out = capsys.readouterr().out
    assert "Slurm: reservation mapa_held_dgx1 holds 1 GPU(s) of dgx1" in out
    assert "Slurm: node dgx1 Comment='mapa-held: GPU 3 (XID 79 twice)'" in out and slurm.reservations == {"mapa_held_dgx1": 1}
    assert main(["gpu", "release", "3", "--config", config, "--node", "dgx1"]) == 0
    assert "Slurm: deleted reservation mapa_held_dgx1: no GPU is held any more" in capsys.readouterr().out
    assert slurm.reservations == {}
    slurm.down = True
    assert main(["gpu", "hold", "5", "--config", config, "--node", "dgx1"]) == 0  # the hold itself is made
    out = capsys.readouterr().out
    assert "GPU 5 of node dgx1 is held" in out and "mapa-agent tries again at its next reconcile pass" in out


def test_mapa_agent_tells_slurm_again_and_asks_nothing_where_nothing_was_held(tmp_path):
    slurm = FakeSlurmctld()
    config = config_in(tmp_path)
    errors: list[str] = []
    background = Background(types.SimpleNamespace(make_runner=lambda timeout: slurm, metrics=None, log_errors=errors.append), "dgx1")
    assert background.tell_slurm_held(config, force=True) is None and slurm.calls == []  # no held-GPUs file
    NodeState.of(config).set_hold(3, GpuHold("XID 79", 1.0, "admin"))
    assert background.tell_slurm_held(config, force=True).reserved == 1
    del slurm.reservations["mapa_held_dgx1"]  # lost in slurmctld: the next pass makes it again
    assert background.tell_slurm_held(config, force=True).reserved == 1
    NodeState.of(config).set_hold(3, None)
    assert background.tell_slurm_held(config, force=True).deleted
    slurm.calls.clear()
    assert background.tell_slurm_held(config, force=True) is None and slurm.calls == []  # released and told: quiet
    # Busy: the records loop tries again after ends (not every second), the pass always.
    slurm.busy_gpus = 8
    NodeState.of(config).set_hold(1, GpuHold("", 1.0, "admin"))
    assert background.tell_slurm_held(config, force=True).unreserved == [1] and background.held_retry
    slurm.busy_gpus = 0
    background.held_asked_at = -100.0
    assert background.tell_slurm_held(config).complete and not background.held_retry
    assert background.tell_slurm_held(config) is None
    assert "mapa-agent: Slurm: reservation mapa_held_dgx1 holds 1 GPU(s)" in (tmp_path / "log").read_text() and errors == []


@pytest.mark.parametrize("holds", [{}, {8: "not on the node"}])
def test_indices_beyond_the_node_are_not_told(tmp_path, holds):
    slurm = FakeSlurmctld()
    assert tell_slurm(config_in(tmp_path), "dgx1", 8, holds, slurm).complete and slurm.reservations == {}
