"""mapa-agent publishes which good placements its node has free, as Slurm node features."""

from __future__ import annotations

import json

import pytest

from slurm_mapa.errors import InputError
from slurm_mapa.slurm.text.commands import (
    CommandFailed,
    active_features_argv,
    parse_active_features,
    parse_available_features,
    show_node_argv,
)
from slurm_mapa.slurm.config import HookConfig, config_from_text
from slurm_mapa.slurm.agent.features import Publisher, merged_features
from slurm_mapa.slurm.node_state.ledger import Holding, Ledger, LedgerFile
from slurm_mapa.slurm.text.outlook import parse_outlook

# `scontrol --oneliner show node dgx1` as Slurm 24.11 prints it (abridged in the middle).
SHOW_NODE = ("NodeName=dgx1 Arch=x86_64 CoresPerSocket=20 CPUAlloc=0 CPUEfctv=80 CPUTot=80 CPULoad=0.52 "
             "AvailableFeatures=v100,ib,mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4 ActiveFeatures=v100,ib "
             "Gres=gpu:8 NodeAddr=dgx1 NodeHostName=dgx1 Version=24.11.5 OS=Linux 6.1.0 RealMemory=4000 "
             "State=IDLE ThreadsPerCore=2 Partitions=gpu\n")


def test_the_available_features_are_read_from_scontrol_show_node():
    assert parse_available_features(SHOW_NODE) == ("v100", "ib", "mapa_ring2", "mapa_noring2", "mapa_ring4", "mapa_noring4")
    assert parse_available_features(SHOW_NODE.replace("AvailableFeatures=v100,ib,mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4",
                                                      "AvailableFeatures=(null)")) == ()
    for bad in ("NodeName=dgx1 State=IDLE", SHOW_NODE + " AvailableFeatures=x", SHOW_NODE.replace("ib,", "i\\xe9b,"),
                SHOW_NODE.replace("v100", "v100;rm")):
        with pytest.raises(CommandFailed):
            parse_available_features(bad)
    assert show_node_argv("/usr/bin/scontrol", "dgx1") == ["/usr/bin/scontrol", "--oneliner", "show", "node", "dgx1"]


def test_the_active_features_are_read_from_the_same_output_in_slurms_order():
    assert parse_active_features(SHOW_NODE) == ("v100", "ib")
    assert parse_active_features(SHOW_NODE.replace("ActiveFeatures=v100,ib", "ActiveFeatures=ib,mapa_ring4,v100")) == (
        "ib", "mapa_ring4", "v100")
    assert parse_active_features(SHOW_NODE.replace("ActiveFeatures=v100,ib", "ActiveFeatures=(null)")) == ()
    for bad, message in ((SHOW_NODE.replace("ActiveFeatures=v100,ib ", ""), "0 ActiveFeatures= fields"),
                         (SHOW_NODE + " ActiveFeatures=x", "2 ActiveFeatures= fields"),
                         (SHOW_NODE.replace("ActiveFeatures=v100,ib", "ActiveFeatures=v100,,ib"), "accepted: at most"),
                         (SHOW_NODE.replace("ActiveFeatures=v100,ib", "ActiveFeatures=v100;rm"), "not a list of feature names"),
                         ("x" * (8 << 20), "characters for one node")):
        with pytest.raises(CommandFailed, match=message):
            parse_active_features(bad)


def test_active_features_keep_the_nodes_own_and_replace_mapas():
    assert merged_features(("v100", "ib", "mapa_ring2", "mapa_noring2"), ("mapa_noring2",)) == ("v100", "ib", "mapa_noring2")
    assert merged_features(("ib", "mapa_ring4", "v100"), ("mapa_ring2",)) == ("ib", "v100", "mapa_ring2")  # their order
    assert merged_features((), ("mapa_ring2",)) == ("mapa_ring2",)
    assert active_features_argv("/usr/bin/scontrol", "dgx1", ("v100", "mapa_ring4")) == [
        "/usr/bin/scontrol", "update", "NodeName=dgx1", "ActiveFeatures=v100,mapa_ring4"]
    with pytest.raises(ValueError):
        active_features_argv("/usr/bin/scontrol", "dgx1", ("a,b",))


class FakeScontrol:
    def __init__(self, text: str = SHOW_NODE) -> None:
        self.text = text
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(list(argv))
        if argv[1:3] == ["--oneliner", "show"]:
            return self.text
        if argv[1] == "update":
            return ""
        raise AssertionError(argv)


def config_for(tmp_path, **extra) -> HookConfig:
    return HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log",
                      nodes=(("dgx*", "dgx1-v100"),), feature_sizes=(2, 4), **extra)


def test_the_agent_publishes_only_when_the_features_change(tmp_path):
    config, slurm, logs = config_for(tmp_path), FakeScontrol(), []
    publisher = Publisher("dgx1")
    assert publisher.publish(config, slurm, logs.append)
    assert slurm.calls[-1] == ["/usr/bin/scontrol", "update", "NodeName=dgx1", "ActiveFeatures=v100,ib,mapa_ring2,mapa_ring4"]
    assert not publisher.publish(config, slurm, logs.append) and len(slurm.calls) == 2  # unchanged: slurmctld not asked
    # A job takes 0,3,5,6 (every 4-ring with double links is gone; 2-rings are left).
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 3, 5, 6), "preserve", 1.0)}))
    assert publisher.publish(config, slurm, logs.append)
    assert slurm.calls[-1][-1] == "ActiveFeatures=v100,ib,mapa_ring2,mapa_noring4"
    assert publisher.publish(config, slurm, logs.append, force=True)  # the reconcile pass: slurmctld may have restarted
    assert slurm.calls[-1][-1] == "ActiveFeatures=v100,ib,mapa_ring2,mapa_noring4" and logs == []


def test_a_feature_an_admin_made_inactive_stays_inactive(tmp_path):
    """Issue #31: the node's own features are taken from ActiveFeatures=, not AvailableFeatures=,
    so publishing MAPA's does not turn on again what `scontrol update ... ActiveFeatures=` turned off."""
    node = SHOW_NODE.replace("AvailableFeatures=v100,ib,mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4 ActiveFeatures=v100,ib",
                             "AvailableFeatures=a,b,mapa_ring2,mapa_noring2 ActiveFeatures=a,mapa_ring2")
    slurm, logs = FakeScontrol(node), []
    config = HookConfig(ledger=tmp_path / "ledger.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log",
                        nodes=(("dgx*", "dgx1-v100"),), feature_sizes=(2,))
    publisher = Publisher("dgx1")
    assert publisher.publish(config, slurm, logs.append)
    assert slurm.calls[-1] == ["/usr/bin/scontrol", "update", "NodeName=dgx1", "ActiveFeatures=a,mapa_ring2"] and logs == []
    # A job takes every GPU: MAPA's feature changes, b is still left off.
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding(tuple(range(8)), "preserve", 1.0)}))
    assert publisher.publish(config, slurm, logs.append)
    assert slurm.calls[-1][-1] == "ActiveFeatures=a,mapa_noring2"
    # The admin turns b on again (and a off): the next publication keeps that too.
    slurm.text = node.replace("ActiveFeatures=a,mapa_ring2", "ActiveFeatures=b,mapa_noring2")
    assert publisher.publish(config, slurm, logs.append, force=True)
    assert slurm.calls[-1][-1] == "ActiveFeatures=b,mapa_noring2" and logs == []


def test_nothing_is_published_without_features_in_the_config_or_in_slurm_conf(tmp_path):
    slurm, logs = FakeScontrol(), []
    assert not Publisher("dgx1").publish(HookConfig(ledger=tmp_path / "l.json", nodes=(("dgx*", "dgx1-v100"),)), slurm, logs.append)
    assert slurm.calls == []
    plain = FakeScontrol(SHOW_NODE.replace(",mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4", ""))
    publisher = Publisher("dgx1")
    publisher.publish(config_for(tmp_path), plain, logs.append)
    assert [c for c in plain.calls if c[1] == "update"] == []
    assert "slurm.conf does not list mapa_ring2,mapa_ring4" in logs[0]
    assert not publisher.publish(config_for(tmp_path), plain, logs.append) and len(logs) == 1  # said once


def test_the_fleets_best_sets_the_bar(tmp_path):
    """On a PCIe-8 node, measured against a fleet with DGX-1 nodes, no ring is good enough."""
    config = HookConfig(ledger=tmp_path / "l.json", nodes=(("pcie*", "pcie-8"),), feature_sizes=(2, 4), feature_fleet=("dgx1-v100",))
    slurm = FakeScontrol(SHOW_NODE.replace("NodeName=dgx1", "NodeName=pcie1"))
    Publisher("pcie1").publish(config, slurm, [].append)
    assert slurm.calls[-1][-1] == "ActiveFeatures=v100,ib,mapa_noring2,mapa_noring4"


@pytest.mark.parametrize("table,message", [
    ("sizes = []", "sizes must be"), ("sizes = [1]", "sizes must be"), ("sizes = [2, true]", "sizes must be"),
    ("sizes = [2]\nthreshold = 0", "threshold"), ("sizes = [2]\nthreshold = 1.5", "threshold"),
    ("sizes = [2]\nfleet = \"dgx1-v100\"", "fleet"), ("sizes = [2]\nshape = \"tree\"", r"unknown key 'shape' in \[features\] \(line 3: "),
    ("sizes = [2]\ninsensitive_jobs = \"ring\"", "insensitive_jobs must be \"none\""),
    ("sizes = [2]\noutlook = 1", "outlook must be true"), ("sizes = [2]\noutlook = \"yes\"", "outlook must be true"),
])
def test_a_bad_features_table_is_refused_naming_what_is_accepted(table, message):
    with pytest.raises(InputError, match=message):
        config_from_text(f"[features]\n{table}\n", "mapa.toml", validate=False)
    good = config_from_text("[features]\nsizes = [4, 2, 4]\nfleet = [\"dgx1-v100\"]\n", "mapa.toml", validate=False)
    assert (good.feature_sizes, good.feature_threshold, good.feature_fleet) == ((2, 4), 0.9, ("dgx1-v100",))
    assert good.feature_insensitive_jobs == "none"
    steered = config_from_text("[features]\nsizes = [2]\ninsensitive_jobs = \"noring\"\n", "mapa.toml", validate=False)
    assert steered.feature_insensitive_jobs == "noring"


def test_mapa_job_submit_lua_writes_the_plugin_with_the_configs_settings(tmp_path, capsys):
    import os

    from slurm_mapa.cli import main as mapa_main
    from slurm_mapa.slurm.admin.install import JOB_SUBMIT_LUA, job_submit_text

    shipped = JOB_SUBMIT_LUA.read_text()
    text = job_submit_text((2, 4), "noring")
    changed = [(a, b) for a, b in zip(shipped.splitlines(), text.splitlines()) if a != b]
    assert changed == [("local _NODE_FEATURE_SIZES = {}", "local _NODE_FEATURE_SIZES = { 2, 4 }"),
                       ('local _INSENSITIVE_JOBS = "none"', 'local _INSENSITIVE_JOBS = "noring"')]
    assert job_submit_text(()) == shipped
    with pytest.raises(InputError, match="noring or none"):
        job_submit_text((2,), "all")
    config = tmp_path / "mapa.toml"
    config.write_text("[features]\nsizes = [4, 8]\n")
    os.chmod(config, 0o644)
    target = tmp_path / "etc" / "job_submit.lua"
    target.parent.mkdir()
    assert mapa_main(["job-submit-lua", str(target), "--config", str(config)]) == 0
    assert target.read_text() == job_submit_text((4, 8)) and oct(target.stat().st_mode & 0o777) == "0o644"
    assert capsys.readouterr().out.startswith("JobSubmitPlugins=lua\n# node choice")
    os.chmod(target.parent, 0o777)  # a directory others can change: refused
    assert mapa_main(["job-submit-lua", str(target), "--config", str(config)]) != 0
    assert "cannot write" in capsys.readouterr().err


def test_mapa_hooks_prints_the_slurm_conf_lines_node_choice_needs():
    from slurm_mapa.slurm.admin.install import feature_conf_lines

    assert feature_conf_lines(()) == ""
    assert feature_conf_lines((2, 4)) == (
        "# node choice ([features] in mapa.toml): add to each GPU node's NodeName= line, next to its own features,\n"
        "#   Features=mapa_ring2,mapa_noring2,mapa_ring4,mapa_noring4\n"
        "# and to SchedulerParameters= (comma-separated with what is there):\n"
        "#   ignore_prefer_validation\n")


class FakeSlurmWithEnds(FakeScontrol):
    """FakeScontrol that also answers `squeue --json --states=all --jobs=...` with the jobs' end
    times (``ends``: job -> Unix time; a job left out is one slurmctld no longer knows)."""

    def __init__(self, ends: dict[str, int], text: str = SHOW_NODE) -> None:
        super().__init__(text)
        self.ends = ends

    def __call__(self, argv):
        if argv[0] == "/usr/bin/squeue":
            self.calls.append(list(argv))
            asked = argv[-1].removeprefix("--jobs=").split(",")
            return json.dumps({"jobs": [{"job_id": int(job), "end_time": {"set": True, "infinite": False, "number": self.ends[job]}}
                                        for job in asked if job in self.ends], "errors": []})
        return super().__call__(argv)


def test_the_outlook_says_when_the_running_jobs_free_a_good_ring(tmp_path):
    """[features] outlook = true: the node's Extra says, per feature, the best ring free now, the
    fleet's best and when a good one is expected free, from the jobs' Slurm end times (asked once
    per job; all again at a reconcile pass)."""
    config = config_for(tmp_path, feature_outlook=True)
    # Job 7 holds 0-3, job 8 holds 4-7 (no 4-ring is free); 8 ends first.
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 1, 2, 3), "preserve", 1.0), "8": Holding((4, 5, 6, 7), "preserve", 1.0)}))
    slurm, logs = FakeSlurmWithEnds({"7": 4_000_000_000, "8": 3_000_000_000}), []
    publisher = Publisher("dgx1")
    assert publisher.publish(config, slurm, logs.append)
    update = slurm.calls[-1]
    assert update[:4] == ["/usr/bin/scontrol", "update", "NodeName=dgx1", "ActiveFeatures=v100,ib,mapa_noring2,mapa_noring4"]
    outlook = parse_outlook(update[4].removeprefix("Extra="))
    assert outlook["mapa_ring4"].now is None and outlook["mapa_ring4"].good_at == 3_000_000_000  # job 8's end frees 4-7
    assert outlook["mapa_ring2"].good_at == 3_000_000_000 and outlook["mapa_ring4"].best > outlook["mapa_ring2"].best * 0.5
    assert [c for c in slurm.calls if c[0] == "/usr/bin/squeue"] == [["/usr/bin/squeue", "--json", "--states=all", "--jobs=7,8"]]
    assert publisher.published == ("mapa_noring2", "mapa_noring4")  # what the metrics show
    assert not publisher.publish(config, slurm, logs.append)  # nothing changed: nothing asked
    assert len([c for c in slurm.calls if c[0] == "/usr/bin/squeue"]) == 1
    # Job 8 ends (the ledger drops it); job 9 starts on 4,5: asked about 9 alone.
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 1, 2, 3), "preserve", 1.0), "9": Holding((4, 5), "preserve", 1.0)}))
    slurm.ends["9"] = 3_500_000_000
    assert publisher.publish(config, slurm, logs.append)
    assert [c for c in slurm.calls if c[0] == "/usr/bin/squeue"][-1][-1] == "--jobs=9"
    outlook = parse_outlook(slurm.calls[-1][4].removeprefix("Extra="))
    assert outlook["mapa_ring2"].good_at == 0.0 and outlook["mapa_ring2"].now is not None  # 6,7 are free: a 2-ring now
    assert outlook["mapa_ring4"].good_at == 3_500_000_000
    # A job slurmctld does not know has no end: the rings it holds are not expected free.
    publisher = Publisher("dgx1")
    slurm.ends.pop("9")
    assert publisher.publish(config, slurm, logs.append)
    assert parse_outlook(slurm.calls[-1][4].removeprefix("Extra="))["mapa_ring4"].good_at == 4_000_000_000
    # The reconcile pass asks about every job again (a time limit may have changed).
    slurm.ends["7"] = 3_900_000_000
    assert publisher.publish(config, slurm, logs.append, force=True)
    assert [c for c in slurm.calls if c[0] == "/usr/bin/squeue"][-1][-1] == "--jobs=7,9"
    assert parse_outlook(slurm.calls[-1][4].removeprefix("Extra="))["mapa_ring4"].good_at == 3_900_000_000 and logs == []


def test_an_extra_that_is_not_mapas_is_left_alone_and_said_once(tmp_path):
    config = config_for(tmp_path, feature_outlook=True)
    slurm, logs = FakeSlurmWithEnds({}, SHOW_NODE.rstrip("\n") + " Extra={\"rack\":\"r12\"}\n"), []
    publisher = Publisher("dgx1")
    assert publisher.publish(config, slurm, logs.append)
    assert slurm.calls[-1] == ["/usr/bin/scontrol", "update", "NodeName=dgx1", "ActiveFeatures=v100,ib,mapa_ring2,mapa_ring4"]
    assert len(logs) == 1 and "Extra is not MAPA's" in logs[0]
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 3, 5, 6), "preserve", 1.0)}))
    assert publisher.publish(config, slurm, logs.append)
    assert all(not arg.startswith("Extra=") for arg in slurm.calls[-1]) and len(logs) == 1


def test_without_outlook_nothing_is_asked_and_no_extra_written(tmp_path):
    config = config_for(tmp_path)
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 1, 2, 3), "preserve", 1.0)}))
    slurm = FakeSlurmWithEnds({"7": 4_000_000_000})
    assert Publisher("dgx1").publish(config, slurm, [].append)
    assert [c[0] for c in slurm.calls] == ["/usr/bin/scontrol", "/usr/bin/scontrol"] and len(slurm.calls[-1]) == 4


def test_unreadable_end_times_are_said_once_and_the_outlook_leaves_those_jobs_out(tmp_path):
    config = config_for(tmp_path, feature_outlook=True)
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 3, 5, 6), "preserve", 1.0)}))  # no good 4-ring free

    class Down(FakeSlurmWithEnds):
        def __call__(self, argv):
            if argv[0] == "/usr/bin/squeue":
                raise CommandFailed("squeue exited 1: Unable to contact slurm controller")
            return super().__call__(argv)

    slurm, logs = Down({}), []
    publisher = Publisher("dgx1")
    assert publisher.publish(config, slurm, logs.append)
    assert publisher.publish(config, slurm, logs.append, force=True)
    assert len(logs) == 1 and "end times are unknown" in logs[0] and "Unable to contact" in logs[0]
    assert parse_outlook(slurm.calls[-1][4].removeprefix("Extra="))["mapa_ring4"].good_at is None  # no end known


def test_weights_publish_the_free_gpus_preserved_bandwidth_in_the_same_update(tmp_path):
    """[features] weights = true (issue 40): the node's Slurm Weight is 1 + the summed bandwidth of
    the links among its free GPUs (+ weight_base), in the update that sets the features, and only
    when it changed. Checked against the DGX-1 V100's links as the preset lists them."""
    from slurm_mapa.hardware.presets import preset

    dgx = preset("dgx1-v100")
    config = config_for(tmp_path, feature_weights=True)
    slurm, logs, publisher = FakeScontrol(), [], Publisher("dgx1")
    assert publisher.publish(config, slurm, logs.append)
    idle = 1 + int(sum(dgx.bandwidth(a, b) for a in range(8) for b in range(a + 1, 8)))
    assert slurm.calls[-1] == ["/usr/bin/scontrol", "update", "NodeName=dgx1", "ActiveFeatures=v100,ib,mapa_ring2,mapa_ring4",
                               f"Weight={idle}"]
    # A job on 0-3 keeps 4-7 free: the weight falls to their links' sum, the features stay: one update.
    LedgerFile(config.ledger, 8).write(Ledger({"7": Holding((0, 1, 2, 3), "preserve", 1.0)}))
    assert publisher.publish(config, slurm, logs.append)
    half = 1 + int(sum(dgx.bandwidth(a, b) for a in range(4, 8) for b in range(a + 1, 8)))
    assert slurm.calls[-1][-2:] == ["ActiveFeatures=v100,ib,mapa_ring2,mapa_ring4", f"Weight={half}"] and 1 < half < idle
    assert not publisher.publish(config, slurm, logs.append)  # unchanged: nothing asked
    # A site's tier: weight_base is added.
    tiered = config_for(tmp_path, feature_weights=True, feature_weight_base=1_000_000)
    assert Publisher("dgx1").publish(tiered, slurm, logs.append)
    assert slurm.calls[-1][-1] == f"Weight={1_000_000 + half}" and logs == []
    # Without weights the update names no weight.
    assert Publisher("dgx1").publish(config_for(tmp_path), slurm, logs.append)
    assert not any(arg.startswith("Weight=") for arg in slurm.calls[-1])


@pytest.mark.parametrize("table,message", [
    ("weights = 1", "weights must be true"), ("weights = \"yes\"", "weights must be true"),
    ("weight_base = -1", "weight_base must be a whole number"), ("weight_base = 1.5", "weight_base must be a whole number"),
    ("weight_base = true", "weight_base must be a whole number"), ("weight_base = 2000000001", "weight_base must be a whole number"),
])
def test_a_bad_weights_setting_is_refused_naming_what_is_accepted(table, message):
    with pytest.raises(InputError, match=message):
        config_from_text(f"[features]\nsizes = [2]\n{table}\n", "mapa.toml", validate=False)
    good = config_from_text("[features]\nsizes = [2]\nweights = true\nweight_base = 2000000000\n", "mapa.toml", validate=False)
    assert (good.feature_weights, good.feature_weight_base) == (True, 2_000_000_000)
    assert (HookConfig().feature_weights, HookConfig().feature_weight_base) == (False, 0)


def test_the_weight_argument_is_checked():
    assert active_features_argv("/usr/bin/scontrol", "dgx1", ("mapa_ring2",), None, 7)[-1] == "Weight=7"
    for bad in (0, -1, 2**31, True, 1.5):
        with pytest.raises(ValueError, match="node weight"):
            active_features_argv("/usr/bin/scontrol", "dgx1", ("mapa_ring2",), None, bad)
