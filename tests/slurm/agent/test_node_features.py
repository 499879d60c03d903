"""mapa-agent publishes which good placements its node has free, as Slurm node features."""

from __future__ import annotations

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
