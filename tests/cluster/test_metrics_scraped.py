"""mapa-agent's metrics in the mini cluster: the Prometheus beside slurmctld scrapes every node's
agent; after a few jobs its HTTP API says what the jobs got. The Grafana dashboard's expressions
and the example alert rules run against the same Prometheus."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from slurm_mapa.core.features import best_free
from slurm_mapa.core.search import preserved_bandwidth
from slurm_mapa.hardware.load import load_topology, resolve_model
from slurm_mapa.slurm.text.decision import parse_decisions
from slurm_mapa.slurm.agent.metrics import ring_sizes

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
GRES_CONF = ROOT / "slurm_mapa" / "data" / "gres_conf"  # the gres.conf and topology file of every preset
PROMETHEUS = "http://prometheus:9090"
RULES = "/opt/slurm-mapa/contrib/prometheus/mapa-alerts.yml"  # slurm_mapa/data/contrib/, mounted read-only
DASHBOARD = ROOT / "slurm_mapa" / "data" / "contrib" / "grafana" / "mapa-dashboard.json"

# Asks Prometheus's HTTP API from slurmctld (the image has no curl): argv[1] is the path and query.
_GET = ("import sys, urllib.request; "
        "sys.stdout.write(urllib.request.urlopen('" + PROMETHEUS + "' + sys.argv[1], timeout=20).read().decode())")

HOLDING_JOB = """#!/bin/bash
#SBATCH --gres=gpu:{gpus}
#MAPA topology=ring sensitive=yes
for _ in $(seq 1500); do [ -e /shared/jobs/release-$SLURM_JOB_ID ] && exit 0; sleep 0.2; done
exit 3
"""


def api(cluster, path: str) -> dict:
    answer = json.loads(cluster.exec("slurmctld", ["python3", "-c", _GET, path], timeout=60).stdout)
    assert answer.get("status") == "success", answer
    return answer["data"]


def query(cluster, promql: str) -> list[dict]:
    from urllib.parse import quote

    data = api(cluster, "/api/v1/query?query=" + quote(promql))
    return data["result"]


def scalar(cluster, promql: str) -> float | None:
    """The value of a query that gives one series (None: none)."""
    result = query(cluster, promql)
    assert len(result) <= 1, (promql, result)
    return float(result[0]["value"][1]) if result else None


def eventually(what: str, probe, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(1.0)


def wait_for_targets(cluster) -> None:
    def all_up():
        try:
            targets = api(cluster, "/api/v1/targets?state=active")["activeTargets"]
        except Exception:  # noqa: BLE001 - Prometheus is still starting
            return False
        return {t["labels"]["instance"].split(":")[0] for t in targets if t["health"] == "up"} == set(cluster.nodes)

    eventually("Prometheus scrapes every node's mapa-agent", all_up)


def test_promtool_accepts_the_example_alert_rules(cluster):
    out = cluster.exec("slurmctld", ["promtool", "check", "rules", RULES])
    assert "SUCCESS" in out.stdout + out.stderr, out


def test_prometheus_sees_what_the_jobs_got(cluster):
    wait_for_targets(cluster)
    node, graph = "dgx1", load_topology(str(GRES_CONF / "dgx1-v100.toml"))
    model = resolve_model("", graph)  # the node's default model (mapa.toml's model = "auto"), as the agent's
    decided = f'sum(mapa_decisions_total{{node="{node}",outcome="mapa"}})'
    prologs = f'sum(mapa_prolog_duration_seconds_count{{node="{node}"}})'
    isolated = f'sum(mapa_isolation_requests_total{{node="{node}",outcome="isolated"}})'
    not_isolated = f'sum(mapa_isolation_requests_total{{node="{node}",outcome!="isolated"}})'
    before = {name: scalar(cluster, promql) for name, promql in (("decided", decided), ("prologs", prologs), ("isolated", isolated),
                                                                  ("not isolated", not_isolated))}
    assert None not in before.values(), before  # every outcome is a series from the agent's start
    # The node is idle: once Prometheus has scraped it after the last test's jobs ended (a scrape
    # taken before their Epilogs still shows their GPUs held).
    eventually("the node idle", lambda: scalar(cluster, f'sum(mapa_gpus_held{{node="{node}"}})') == 0)
    jobs = [cluster.sbatch(HOLDING_JOB.format(gpus=gpus), "-w", node) for gpus in (2, 3)]
    try:
        for jobid in jobs:
            cluster.wait_state(jobid, "RUNNING", timeout=60)
        records = [cluster.wait_job(jobid, lambda record: node in parse_decisions(record.get("admin_comment", "")),
                                    timeout=60, what="its decision in the AdminComment") for jobid in jobs]
        decisions = [parse_decisions(record["admin_comment"])[node] for record in records]
        assert all(decision.policy == "preserve" and not decision.fallback for decision in decisions), decisions
        held = {gpu for decision in decisions for gpu in decision.gpus}
        free = tuple(gpu for gpu in range(graph.size) if gpu not in held)
        eventually("both decisions counted", lambda: scalar(cluster, decided) == before["decided"] + 2)
        # The same call counts a decision and times its Prolog: a scrape can fall between the two.
        eventually("both Prologs timed", lambda: scalar(cluster, prologs) == before["prologs"] + 2)
        eventually("the jobs' tasks counted as isolated", lambda: scalar(cluster, isolated) >= before["isolated"] + 2)
        assert scalar(cluster, not_isolated) == before["not isolated"]
        eventually("the GPUs held", lambda: scalar(cluster, f'mapa_gpus_held{{node="{node}",choice="mapa"}}') == len(held) == 5)
        assert scalar(cluster, "max(mapa_gpus_shared)") == 0
        # The fragmentation gauge: the core's best free ring and preserved bandwidth on what is left.
        for k in ring_sizes(graph.size):
            got = scalar(cluster, f'mapa_free_ring_effective_bandwidth_gbps{{node="{node}",k="{k}"}}')
            assert got == pytest.approx(best_free(graph, free, k, model) or 0.0, rel=1e-9), k
        assert scalar(cluster, f'mapa_free_preserved_bandwidth_gbps{{node="{node}"}}') == \
            pytest.approx(preserved_bandwidth(graph, free), rel=1e-9)
        # Controller calls: reconcile passes (squeue) and features and AdminComments (scontrol).
        for command in ("squeue", "scontrol"):
            assert scalar(cluster, f'mapa_controller_calls_total{{node="{node}",command="{command}"}}') > 0, command
        assert scalar(cluster, f'mapa_feature_publications_total{{node="{node}"}}') > 0
        active = re.search(r"ActiveFeatures=(\S*)", cluster.run("scontrol", "show", "node", node)).group(1)
        eventually("the features as slurmctld has them", lambda: {
            series["metric"]["feature"] for series in query(cluster, f'mapa_node_feature_active{{node="{node}"}}')
        } == {name for name in active.split(",") if name.startswith("mapa_")})
    finally:
        for jobid in jobs:
            cluster.run("touch", f"{cluster.job_dir}/release-{jobid}")
        for jobid in jobs:
            cluster.wait_state(jobid, "COMPLETED", timeout=60)
    eventually("the GPUs freed", lambda: scalar(cluster, f'sum(mapa_gpus_held{{node="{node}"}})') == 0)
    assert scalar(cluster, f'mapa_free_ring_effective_bandwidth_gbps{{node="{node}",k="8"}}') == \
        pytest.approx(best_free(graph, range(8), 8, model), rel=1e-9)
    # Every series names its node, and every node's agent answers.
    assert not query(cluster, '{__name__=~"mapa_.+", node=""}')
    assert {s["metric"]["node"] for s in query(cluster, "mapa_node_state_ok == 1")} == set(cluster.nodes)


def test_a_fallback_is_counted_as_one(cluster):
    """An unusable mapa.toml on the node: the job falls back, and Prometheus says so."""
    wait_for_targets(cluster)
    node = "summit1"
    fallbacks = f'sum(mapa_decisions_total{{node="{node}",outcome="fallback"}})'
    held = f'mapa_gpus_held{{node="{node}",choice="fallback"}}'
    before = scalar(cluster, fallbacks)
    jobid = None
    try:
        with cluster.hook_config((node,), "\n[not_a_mapa_table]\n"):  # an unknown key: every job falls back
            jobid = cluster.sbatch(HOLDING_JOB.format(gpus=2), "-w", node)
            cluster.wait_state(jobid, "RUNNING", timeout=60)
            eventually("the fallback counted", lambda: scalar(cluster, fallbacks) == before + 1)
            # The agent reads the same config at scrape time: it cannot tell the node's state then.
            eventually("the state said unreadable", lambda: scalar(cluster, f'mapa_node_state_ok{{node="{node}"}}') == 0)
        entry = cluster.ledger_jobs(node)[str(jobid)]
        assert entry["policy"] == "fallback" and len(entry["gpus"]) == 2, entry
        eventually("the fallback's GPUs held", lambda: scalar(cluster, held) == 2)
    finally:
        if jobid is not None:
            cluster.run("touch", f"{cluster.job_dir}/release-{jobid}")
            cluster.wait_state(jobid, "COMPLETED", timeout=60)
    eventually("the GPUs freed", lambda: scalar(cluster, held) == 0)


def test_every_dashboard_expression_returns_data(cluster):
    wait_for_targets(cluster)
    board = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    assert exprs
    # Prometheus must have two scrapes of each counter for rate() and increase() to answer.
    eventually("two scrapes", lambda: len(query(cluster, "count_over_time(mapa_node_state_ok[1m]) >= 2")) == len(cluster.nodes))
    for expr in exprs:
        promql = expr.replace("$node", ".*").replace("$__rate_interval", "1m")
        assert query(cluster, promql), expr  # parses (status success), and returns series
    # The node variable's label_values(mapa_gpus, node).
    assert set(api(cluster, "/api/v1/label/node/values?match[]=mapa_gpus")) == set(cluster.nodes)


def test_prometheus_evaluates_the_alert_rules(cluster):
    wait_for_targets(cluster)

    def evaluated():
        groups = api(cluster, "/api/v1/rules?type=alert")["groups"]
        rules = [rule for group in groups if group["name"] == "slurm-mapa" for rule in group["rules"]]
        return rules if rules and all(rule.get("health") == "ok" for rule in rules) else None

    rules = eventually("the alert rules evaluated", evaluated)
    assert {rule["name"] for rule in rules} >= {"MapaGpusShared", "MapaFallbacksRising", "MapaIsolationFailing"}
    # No GPU is shared in this cluster (other alerts may fire after the fault tests: they make fallbacks on purpose).
    assert [rule["state"] for rule in rules if rule["name"] == "MapaGpusShared"] == ["inactive"]
