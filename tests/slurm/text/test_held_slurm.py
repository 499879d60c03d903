"""Slurm's side of a held GPU (issue 50): argv, parsers on literal scontrol output, the plan."""

from __future__ import annotations

import json

import pytest

from slurm_mapa.slurm.text.commands import CommandFailed
from slurm_mapa.slurm.text.held_slurm import (NodePlan, NodeView, create_reservation_argv, delete_reservation_argv, drain_reason,
                                              held_text, merged_comment, node_plan, node_update_argv, parse_held_reservation,
                                              parse_node_view, reservation_change, reservation_name, split_comment)

# `scontrol --json show reservation` of Debian's 26.05.5 (data_parser v0.0.45), trimmed to two
# records: MAPA's for two held GPUs of dgx1, a site's own maintenance reservation, MAPA's of dgx10.
RESERVATIONS_2605 = """{
  "reservations": [
    {"accounts": "", "burst_buffer": "", "core_count": 1,
     "core_specializations": [{"node": "dgx1", "core": "0"}],
     "end_time": {"set": true, "infinite": false, "number": 1827458572},
     "features": "", "flags": ["IGNORE_JOBS", "OVERLAP", "SPEC_NODES"], "groups": "", "licenses": "",
     "max_start_delay": 0, "name": "mapa_held_dgx1", "node_count": 1, "node_list": "dgx1",
     "partition": "gpu", "start_time": {"set": true, "infinite": false, "number": 1795922572},
     "tres": "cpu=1,gres/gpu=2", "users": "root"},
    {"name": "maint_dgx1", "node_list": "dgx1", "tres": "cpu=2", "users": "root"},
    {"name": "mapa_held_dgx10", "node_list": "dgx10", "tres": "cpu=1,gres/gpu=1", "users": "root"},
    {"name": "mapa_held_dgx2", "node_list": "dgx2", "tres": "cpu=1", "users": "root"}
  ],
  "last_update": {"set": true, "infinite": false, "number": 1795922642},
  "meta": {"plugin": {"type": "", "name": "", "data_parser": "data_parser/v0.0.45"}},
  "errors": [],
  "warnings": []
}"""
NO_RESERVATIONS = '{"reservations": [], "last_update": {"set": true, "infinite": false, "number": 1}, "errors": [], "warnings": []}'
# `scontrol --json show node dgx1`, the fields read (26.05.5).
NODE_2605 = ('{"nodes": [{"name": "dgx1", "state": ["MIXED", "RESERVED"], "reason": "", "comment": '
             '"site note mapa-held: GPU 3 (XID 79 twice)", "gres": "gpu:8(S:0-1)"}], "errors": [], "warnings": []}')


def test_the_reservation_of_this_node_is_found_by_name_and_its_gpus_counted():
    assert parse_held_reservation(RESERVATIONS_2605, "dgx1") == 2
    assert parse_held_reservation(RESERVATIONS_2605, "dgx10") == 1
    assert parse_held_reservation(RESERVATIONS_2605, "dgx2") == 0
    assert parse_held_reservation(NO_RESERVATIONS, "dgx1") is None


@pytest.mark.parametrize("text", ["No reservations in the system", '{"reservations": {}}', "[]",
                                  '{"reservations": [], "errors": [{"error": "x"}]}', "x" * (5 << 20)])
def test_what_is_not_a_reservation_list_is_refused(text):
    with pytest.raises(CommandFailed):
        parse_held_reservation(text, "dgx1")


def test_the_node_view_reads_states_reason_and_comment():
    view = parse_node_view(NODE_2605, "dgx1")
    assert view == NodeView(frozenset({"MIXED", "RESERVED"}), "", "site note mapa-held: GPU 3 (XID 79 twice)")
    assert not view.drained
    old = parse_node_view('{"nodes": [{"name": "n1", "state": "IDLE", "reason": null}]}', "n1")  # before v0.0.40
    assert old == NodeView(frozenset({"IDLE"}), "", "")
    with pytest.raises(CommandFailed, match="no record of node dgx2"):
        parse_node_view(NODE_2605, "dgx2")


def test_the_comment_keeps_what_others_wrote():
    ours = held_text({3: "XID 79 twice", 5: ""})
    assert ours == "mapa-held: GPU 3 (XID 79 twice); GPU 5 (no reason given)"
    assert merged_comment("", ours) == ours
    assert merged_comment("rack 4", ours) == f"rack 4 {ours}"
    assert merged_comment(f"rack 4 {held_text({1: 'old'})}", ours) == f"rack 4 {ours}"
    assert merged_comment(f"rack 4 {ours}", "") == "rack 4"
    assert split_comment("rack 4") == ("rack 4", "")
    assert len(held_text({gpu: "x" * 200 for gpu in range(16)})) == 1000


def test_the_reservation_follows_the_held_gpu_count():
    assert reservation_change(2, 2) == (False, 0)
    assert reservation_change(0, None) == (False, 0)
    assert reservation_change(1, None) == (False, 1)
    assert reservation_change(2, 1) == (True, 2)  # a new count is a new reservation (slurmctld keeps the old count on update)
    assert reservation_change(0, 1) == (True, 0)
    assert reservation_change(0, 0) == (True, 0)  # MAPA's name with no GPU in it: not ours to keep


def test_the_node_is_drained_only_when_no_held_gpu_can_be_left_out_otherwise():
    idle = NodeView(frozenset({"IDLE"}), "", "")
    one = {3: "XID 79"}
    assert node_plan(one, 8, [], idle) == NodePlan(comment="mapa-held: GPU 3 (XID 79)")
    # Slurm could not reserve it (every GPU busy): drained, with the Reason naming it.
    busy = node_plan(one, 8, [3], NodeView(frozenset({"MIXED"}), "", ""))
    assert busy.drain == ("mapa-held: Slurm cannot reserve held GPU 3 while jobs use the node's GPUs; drained until it can: "
                          "GPU 3 (XID 79)")
    all_held = {gpu: "bad" for gpu in range(8)}
    assert node_plan(all_held, 8, [], idle).drain.startswith("mapa-held: all 8 GPUs held: GPU 0 (bad); GPU 1 (bad)")
    # MAPA's drain, no longer needed, is lifted; the same drain is not asked again.
    ours = NodeView(frozenset({"IDLE", "DRAIN"}), drain_reason(one, 8, [3]), "mapa-held: GPU 3 (XID 79)")
    assert node_plan(one, 8, [], ours) == NodePlan(undrain=True)
    assert node_plan(one, 8, [3], ours) == NodePlan()
    assert node_plan({}, 8, [], ours) == NodePlan(comment="", undrain=True)
    # An admin's drain is never lifted, nor its Reason replaced.
    admin = NodeView(frozenset({"IDLE", "DRAIN"}), "bad PSU", "")
    assert node_plan(all_held, 8, [], admin).drain is None
    assert node_plan({}, 8, [], admin) == NodePlan()
    assert not NodePlan()


def test_argv_is_what_scontrol_takes():
    assert create_reservation_argv("/usr/bin/scontrol", "dgx1", 2) == [
        "/usr/bin/scontrol", "create", "reservation", "ReservationName=mapa_held_dgx1", "Nodes=dgx1", "TRES=gres/gpu=2",
        "StartTime=now", "Duration=infinite", "Users=root", "Flags=IGNORE_JOBS,OVERLAP",
        "Comment=mapa-held: 2 held GPU(s) of dgx1, named in the node's Comment; `mapa gpu release` on dgx1 ends it"]
    assert delete_reservation_argv("scontrol", "dgx1") == ["scontrol", "delete", "ReservationName=mapa_held_dgx1"]
    with pytest.raises(ValueError, match="node name"):
        reservation_name("dgx1 Nodes=ALL")
    with pytest.raises(ValueError, match="GPU count"):
        create_reservation_argv("scontrol", "dgx1", 0)
    plan = NodePlan(comment="c", drain="mapa-held: r")
    assert node_update_argv("scontrol", "dgx1", plan) == [
        ["scontrol", "update", "NodeName=dgx1", "State=DRAIN", "Reason=mapa-held: r", "Comment=c"]]
    assert node_update_argv("scontrol", "dgx1", NodePlan(comment="", undrain=True)) == [
        ["scontrol", "update", "NodeName=dgx1", "Comment="], ["scontrol", "update", "NodeName=dgx1", "State=UNDRAIN"]]
    assert node_update_argv("scontrol", "dgx1", NodePlan()) == []


def test_a_reason_with_a_control_character_cannot_reach_scontrol_as_one():
    assert json.dumps(held_text({0: "a\tb"})) == '"mapa-held: GPU 0 (a b)"'
    assert "\n" not in drain_reason({0: "a\nb"}, 1, [])
