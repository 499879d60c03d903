"""CPU affinity in the decision (slurm_mapa/core/affinity.py): the CPU-list parser on Slurm's own
text, the strict / prefer / ignore rule against brute force on whole presets, properties on random
cases, and the settings in the config files, `mapa select` and the replay."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bruteforce import brute_force_all, preserve_objective
from slurm_mapa.cli import main as mapa_main
from slurm_mapa.core.affinity import (
    MAX_CPU_ID,
    MAX_CPU_LIST_CHARS,
    MODES,
    AffinityNoFit,
    decide,
    gpu_cpus,
    local_gpus,
    loss_fraction,
    modelled_job_cpus,
    parse_cpu_ids,
    select_with_affinity,
    settings_from_table,
)
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Allocation, NoFit, Request, select
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.gres import format_cpu_list
from slurm_mapa.hardware.presets import preset
from slurm_mapa.replay.cli import main as replay_main
from slurm_mapa.replay.config import parse_config
from slurm_mapa.replay.generate import generate
from slurm_mapa.replay.simulate import Decider, Node, Options, simulate
from slurm_mapa.slurm.config import config_from_text

MODEL = paper_model()


def pcie8_with_affinity():
    """pcie-8 carries no CPU affinity; give it two 16-core, 2-thread sockets (GPUs 0-3 and 4-7)."""
    return replace(preset("pcie-8"), cpu_affinity=("0-15,32-47",) * 4 + ("16-31,48-63",) * 4)


# --- the CPU-list parser ---------------------------------------------------------------------

# `scontrol show job -d` prints one such line per node of the job.
SCONTROL_LINES = [
    ("     Nodes=dgx01 CPU_IDs=0-3,40-43 Mem=64000 GRES=gpu:4(IDX:0-3)", {0, 1, 2, 3, 40, 41, 42, 43}),
    ("     Nodes=gpu[01-02] CPU_IDs=12 Mem=0 GRES=gpu:1(IDX:5)", {12}),
    ("     Nodes=n7 CPU_IDs=0,2,4,6-7 Mem=1024 GRES=", {0, 2, 4, 6, 7}),
    ("     Nodes=big CPU_IDs=0-255 Mem=0 GRES=gpu:8(IDX:0-7)", set(range(256))),
]


@pytest.mark.parametrize("line, expected", SCONTROL_LINES)
def test_parser_reads_the_cpu_ids_of_scontrol_show_job_details(line, expected):
    token = next(part for part in line.split() if part.startswith("CPU_IDs="))
    assert parse_cpu_ids(token) == frozenset(expected)  # with the key
    assert parse_cpu_ids(token.partition("=")[2]) == frozenset(expected)  # the value alone


def test_parser_reads_a_cgroup_cpuset_and_overlapping_items():
    assert parse_cpu_ids("0-19,40-59") == frozenset(range(20)) | frozenset(range(40, 60))
    assert parse_cpu_ids("5,1-3,2") == frozenset({1, 2, 3, 5})  # any order, overlaps are harmless
    assert parse_cpu_ids(f"0,{MAX_CPU_ID}") == frozenset({0, MAX_CPU_ID})


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is empty"),
        ("CPU_IDs=", "is empty"),
        (" 0-3", "is not a CPU id"),
        ("0-3\n", "is not a CPU id"),
        ("0, 1", "is not a CPU id"),
        ("0,,1", "is not a CPU id"),
        ("0-3,", "is not a CPU id"),
        (",0", "is not a CPU id"),
        ("-1", "is not a CPU id"),
        ("+1", "is not a CPU id"),
        ("01", "is not a CPU id"),
        ("0x10", "is not a CPU id"),
        ("1e3", "is not a CPU id"),
        ("0-3-5", "is not a CPU id"),
        ("0\u20133", "is not a CPU id"),  # an en dash
        ("\u0663", "is not a CPU id"),  # an Arabic-Indic digit three
        ("cpu_ids=0", "is not a CPU id"),
        ("Cpus=0-3", "is not a CPU id"),
        ("3-1", "runs backwards"),
        (str(MAX_CPU_ID + 1), f"beyond {MAX_CPU_ID}"),
        (f"0-{MAX_CPU_ID + 1}", f"beyond {MAX_CPU_ID}"),
        ("123456", "is not a CPU id"),
        ("0," * (MAX_CPU_LIST_CHARS // 2) + "0", "characters long"),
    ],
)
def test_parser_refuses_what_slurm_does_not_print_and_says_what_is_accepted(text, message):
    with pytest.raises(InputError, match="accepted") as caught:
        parse_cpu_ids(text)
    assert message in str(caught.value)
    assert len(str(caught.value)) < 400  # a huge input is not echoed whole


@pytest.mark.parametrize("value", [None, 3, b"0-3", ["0-3"]])
def test_parser_wants_text(value):
    with pytest.raises(InputError, match="must be text"):
        parse_cpu_ids(value)


@given(st.sets(st.integers(0, MAX_CPU_ID), min_size=1, max_size=200))
def test_parser_reads_back_what_the_gres_writer_formats(ids):
    assert parse_cpu_ids(format_cpu_list(ids)) == frozenset(ids)


def test_a_topology_with_an_unreadable_affinity_is_named():
    graph = replace(preset("dgx1-v100"), cpu_affinity=("0-19",) * 7 + ("N/A",))
    with pytest.raises(InputError, match=r"'dgx1-v100': cpu_affinity of GPU 7"):
        gpu_cpus(graph)


# --- small pieces ----------------------------------------------------------------------------


def test_local_gpus_and_why_everything_may_be_local():
    dgx = preset("dgx1-v100")
    assert local_gpus(dgx, range(8), frozenset({0})) == ((0, 1, 2, 3), "")
    assert local_gpus(dgx, range(8), frozenset({25, 45})) == ((0, 1, 2, 3, 4, 5, 6, 7), "")  # both sockets
    assert local_gpus(dgx, (1, 5), frozenset({999})) == ((), "")
    assert local_gpus(dgx, (1, 5), None) == ((1, 5), "the job's CPUs are unknown: every GPU counts as local")
    assert local_gpus(preset("pcie-8"), (1, 5), frozenset({0})) == ((1, 5), "topology pcie-8 has no CPU affinity: every GPU counts as local")


def test_loss_fraction_is_the_share_of_the_best_value_given_up():
    assert loss_fraction(30.0, 40.0) == 0.25
    assert loss_fraction(29.9, 40.0) > 0.25
    assert loss_fraction(50.0, 40.0) == 0.0  # the local choice is better: no loss
    assert loss_fraction(0.0, 0.0) == 0.0


def test_modelled_job_cpus_are_those_of_the_lowest_free_gpus():
    dgx = preset("dgx1-v100")
    socket0 = frozenset(range(20)) | frozenset(range(40, 60))
    assert modelled_job_cpus(dgx, range(8), 2) == socket0
    assert modelled_job_cpus(dgx, (3, 4, 5), 2) == frozenset(range(80))  # GPUs 3 and 4: both sockets
    assert modelled_job_cpus(dgx, (3,), 2) is None  # does not fit
    assert modelled_job_cpus(preset("pcie-8"), range(8), 2) is None  # no affinity: everything local


def test_strict_no_fit_says_it_is_the_affinity():
    dgx = preset("dgx1-v100")
    request = Request(make_pattern("ring", 3), True)
    result, why = select_with_affinity("preserve", dgx, (1, 2, 5, 6, 7), request, parse_cpu_ids("0-3"), "strict")
    assert isinstance(result, AffinityNoFit) and isinstance(result, NoFit)
    assert result.policy == "preserve"
    assert "only 2 free GPU(s) local to the job's CPUs: 1,2 (strict CPU affinity; free: 1,2,5,6,7)" in result.reason
    assert why.as_dict() == {"mode": "strict", "local_gpus": [1, 2], "local": None, "loss": None, "value": None,
                             "note": "too few local GPUs"}
    # enforce-binding is strict whatever the mode says
    again, why = select_with_affinity("preserve", dgx, (1, 2, 5, 6, 7), request, parse_cpu_ids("0-3"), "ignore", enforce_binding=True)
    assert again == result and why.mode == "strict"


def test_prefer_takes_the_local_ring_until_it_loses_too_much():
    dgx = preset("dgx1-v100")
    request = Request(make_pattern("ring", 2), True)
    free = (1, 3, 4, 5)  # local to socket 0: 1 and 3 (one NVLink); 4-5 has a single NVLink too, 1-5 a double one
    plain = select("preserve", dgx, free, request, MODEL)
    assert not set(plain.gpus) <= {1, 3}
    kept, why = select_with_affinity("preserve", dgx, free, request, parse_cpu_ids("0-19"), "prefer", max_loss=1.0, model=MODEL)
    assert set(kept.gpus) == {1, 3} and why.local is True and why.value == "effective" and 0 < why.loss < 1
    lost, why_not = select_with_affinity("preserve", dgx, free, request, parse_cpu_ids("0-19"), "prefer", max_loss=why.loss / 2,
                                         model=MODEL)
    assert lost == plain and why_not.local is False and why_not.loss == why.loss


def test_settings_are_checked():
    graph = preset("dgx1-v100")
    request = Request(make_pattern("ring", 2), True)
    with pytest.raises(InputError, match="unknown affinity mode 'loose' \\(accepted: strict, prefer, ignore\\)"):
        select_with_affinity("preserve", graph, range(8), request, None, "loose")
    for bad in (-0.1, 1.5, True):
        with pytest.raises(InputError, match="max_loss must be a fraction from 0 to 1"):
            select_with_affinity("preserve", graph, range(8), request, None, "prefer", max_loss=bad)
    with pytest.raises(InputError, match="free GPU 9 is not on dgx1-v100"):
        select_with_affinity("preserve", graph, (1, 9), request, frozenset({0}), "prefer")


# --- the rule against brute force ------------------------------------------------------------


def _kept(graph, left) -> float:
    """Eq. 3 written out again: the bandwidth among the GPUs left free."""
    left = sorted(left)
    return sum(graph.bandwidth(a, b) for i, a in enumerate(left) for b in left[i + 1 :])


BRUTE_GRAPHS = {"dgx1-v100": lambda: preset("dgx1-v100"), "pcie-8+affinity": pcie8_with_affinity}
# socket 0 only, socket 1 only, both, no GPU's CPUs, unknown
JOB_CPUS = {
    "dgx1-v100": [frozenset({0}), frozenset({61, 62}), frozenset({5, 25}), frozenset({500}), None],
    "pcie-8+affinity": [frozenset({3}), frozenset({48}), frozenset({0, 16}), frozenset({500}), None],
}


@pytest.mark.parametrize("name", list(BRUTE_GRAPHS))
def test_the_rule_matches_brute_force_on_every_free_set(name):
    """Every free set, ring size up to 4, sensitivity, job CPU set, mode and a few max_loss values."""
    graph = BRUTE_GRAPHS[name]()

    @lru_cache(maxsize=None)
    def brute(free: tuple[int, ...], k: int):
        return brute_force_all(graph, free, make_pattern("ring", k), MODEL)

    checked = 0
    for free_size in range(1, graph.size + 1):
        for free in combinations(range(graph.size), free_size):
            for k in range(1, min(4, free_size) + 1):
                for sensitive in (True, False):
                    objective = preserve_objective(make_pattern("ring", k), free, sensitive, MODEL)
                    request = Request(make_pattern("ring", k), sensitive)
                    everywhere = brute(free, k)[objective]
                    for job_cpus in JOB_CPUS[name]:
                        local = tuple(g for g in free if job_cpus is None or gpu_cpus(graph)[g] & job_cpus)
                        near = brute(local, k)[objective] if len(local) >= k else None
                        for mode in MODES:
                            for max_loss in ((0.0, 0.1, 0.25, 1.0) if mode == "prefer" else (0.25,)):
                                result, why = select_with_affinity("preserve", graph, free, request, job_cpus, mode, max_loss=max_loss, model=MODEL)
                                _check(graph, free, local, everywhere, near, objective, mode, max_loss, result, why)
                                checked += 1
    assert checked > 10_000


def _check(graph, free, local, everywhere, near, objective, mode, max_loss, result, why):
    case = (free, local, objective, mode, max_loss)
    if mode == "ignore" or local == free:
        assert isinstance(result, Allocation) and result.gpus == everywhere[1], case
        return
    if mode == "strict":
        if near is None:
            assert isinstance(result, AffinityNoFit), case
        else:
            assert result.gpus == near[1] and set(result.gpus) <= set(local) and why.local, case
        return
    if set(everywhere[1]) <= set(local):  # prefer: the policy's own choice is local, nothing is given up
        assert result.gpus == everywhere[1] and why.loss == 0.0 and why.local, case
        return
    if near is None:  # prefer with too few local GPUs
        assert result.gpus == everywhere[1] and why.loss is None, case
        return
    best_value = everywhere[0][0]
    near_value = near[0][0] if objective != "preserved" else _kept(graph, set(free) - set(near[1]))
    loss = loss_fraction(near_value, best_value)
    assert why.loss == pytest.approx(loss, abs=1e-9), case
    if abs(loss - max_loss) < 1e-6:
        assert result.gpus in (near[1], everywhere[1]), case  # on the edge: rounding decides
    elif loss > max_loss:
        assert result.gpus == everywhere[1] and why.value == ("preserved" if objective == "preserved" else "effective"), case
    else:
        assert result.gpus == near[1] and why.local, case
        assert result.placement.preserved_bandwidth == pytest.approx(_kept(graph, set(free) - set(near[1]))), case


# --- properties on random cases --------------------------------------------------------------

PROPERTY_GRAPHS = ["dgx1-v100", "summit", "dgx-a100", "mi250x", "hgx-h100"]
POLICIES = ["preserve", "greedy", "baseline", "topo-aware"]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(PROPERTY_GRAPHS + ["pcie-8+affinity", "random"]))
    if name == "random":
        size = draw(st.integers(2, 7))
        links = {(a, b): draw(st.sampled_from(["NV1", "NV2", "PIX", "PHB", "SYS"])) for a in range(size) for b in range(a + 1, size)}
        affinity = [format_cpu_list(draw(st.sets(st.integers(0, 15), min_size=1, max_size=6))) for _ in range(size)]
        graph = build_graph("random", size, links, cpu_affinity=affinity)
    elif name == "pcie-8+affinity":
        graph = pcie8_with_affinity()
    else:
        graph = preset(name)
    top = max(max(cpus) for cpus in gpu_cpus(graph))
    free = tuple(sorted(draw(st.sets(st.integers(0, graph.size - 1), min_size=1))))
    job_cpus = draw(st.none() | st.frozensets(st.integers(0, top + 4), min_size=1, max_size=8))
    k = draw(st.integers(1, min(5, graph.size)))
    request = Request(make_pattern(draw(st.sampled_from(["ring", "all", "tree"])), k), draw(st.booleans()))
    return graph, free, job_cpus, request, draw(st.sampled_from(POLICIES)), draw(st.sampled_from(MODES)), draw(st.floats(0, 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_rule_properties(case):
    graph, free, job_cpus, request, policy, mode, max_loss = case
    result, why = select_with_affinity(policy, graph, free, request, job_cpus, mode, max_loss=max_loss, model=MODEL)
    plain = select(policy, graph, free, request, MODEL)
    local = why.local_gpus
    assert set(local) <= set(free)
    if job_cpus is None:
        assert local == free and result == plain and why.local in (True, None)  # unknown CPUs: everything local
        assert "unknown" in why.note or mode == "ignore"
        return
    if isinstance(result, Allocation):
        assert why.local == (set(result.gpus) <= set(local))
    if mode == "ignore" or local == free:
        assert result == plain
    elif mode == "strict":
        if len(local) < request.gpus:
            assert isinstance(result, AffinityNoFit)
        else:
            assert set(result.gpus) <= set(local)  # strict never returns a GPU that is not local
            assert result.gpus == select(policy, graph, local, request, MODEL).gpus
    elif len(local) < request.gpus:
        assert result == plain
    elif isinstance(plain, Allocation) and set(plain.gpus) <= set(local):
        assert result == plain and why.loss == 0.0  # the policy's own choice is local: nothing given up
    else:
        near = select(policy, graph, local, request, MODEL)
        value = "effective" if request.sensitive and request.gpus > 1 else "preserved"
        best = plain.placement.effective_bandwidth if value == "effective" else plain.placement.preserved_bandwidth
        mine = near.placement.effective_bandwidth if value == "effective" else _kept(graph, set(free) - set(near.gpus))
        loss = loss_fraction(mine, best)
        assert why.loss == pytest.approx(loss, abs=1e-9)
        if loss > max_loss + 1e-9:
            assert result == plain  # the local optimum loses too much: the global one
        elif loss < max_loss - 1e-9:
            assert result.gpus == near.gpus  # the local optimum
    enforced, why_enforced = select_with_affinity(policy, graph, free, request, job_cpus, mode, max_loss=max_loss, enforce_binding=True,
                                                  model=MODEL)
    strict, _ = select_with_affinity(policy, graph, free, request, job_cpus, "strict", model=MODEL)
    assert enforced == strict and why_enforced.mode == "strict"


def test_decide_calls_the_policy_it_is_given_and_nothing_else():
    graph = preset("dgx1-v100")
    request = Request(make_pattern("ring", 2), True)
    calls = []

    def run(subset):
        calls.append(subset)
        return select("preserve", graph, subset, request, MODEL)

    decide(run, graph, (1, 3, 4, 5), request, frozenset({0}), "prefer")
    assert calls == [(1, 3, 4, 5), (1, 3)]
    calls.clear()
    decide(run, graph, (1, 3, 4, 5), request, frozenset({0}), "ignore")
    assert calls == [(1, 3, 4, 5)]


# --- config files ----------------------------------------------------------------------------


def test_hook_config_reads_the_affinity_table():
    assert (config_from_text("").affinity_mode, config_from_text("").affinity_max_loss) == ("prefer", 0.1)  # no table: prefer
    assert config_from_text("[affinity]\n").affinity_mode == "prefer"  # a table: prefer unless it says otherwise
    config = config_from_text('[affinity]\nmode = "strict"\nmax_loss = 0.1\n', "t")
    assert (config.affinity_mode, config.affinity_max_loss) == ("strict", 0.1)
    config = config_from_text("[affinity]\nmax_loss = 0\n", "t")
    assert (config.affinity_mode, config.affinity_max_loss) == ("prefer", 0.0)


@pytest.mark.parametrize(
    "table, message",
    [
        ('mode = "loose"', 'mode must be one of strict, prefer, ignore, got "loose"'),
        ("mode = 1", "mode must be one of strict, prefer, ignore, got 1"),
        ("max_loss = 1.5", "max_loss must be a fraction from 0 to 1, got 1.5"),
        ("max_loss = -0.1", "max_loss must be a fraction from 0 to 1, got -0.1"),
        ("max_loss = true", "max_loss must be a fraction from 0 to 1, got true"),
        ('max_loss = "0.2"', 'max_loss must be a fraction from 0 to 1, got "0.2"'),
        ("enforce = true", '[affinity] takes mode = "strict" | "prefer" | "ignore" and max_loss'),
    ],
)
def test_hook_config_refuses_a_bad_affinity_table(table, message):
    with pytest.raises(InputError) as caught:
        config_from_text(f"[affinity]\n{table}\n", "mapa.toml")
    assert str(caught.value).startswith("mapa.toml: ")
    assert message in str(caught.value)
    with pytest.raises(InputError, match=r"\[affinity\] takes"):
        config_from_text('affinity = "strict"\n', "mapa.toml")


def test_replay_config_accepts_the_same_table():
    assert parse_config('[affinity]\nmode = "strict"\n').affinity == ("strict", 0.1)
    assert parse_config("").affinity is None
    with pytest.raises(InputError, match="max_loss must be a fraction"):
        parse_config("[affinity]\nmax_loss = 2\n")
    assert settings_from_table(None, "x") == ("prefer", 0.1)


# --- mapa select -----------------------------------------------------------------------------


def run_mapa(capsys, *argv):
    code = mapa_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_mapa_select_with_job_cpus(capsys):
    base = ("select", "--topology", "dgx1-v100", "--free", "1,3,4,5", "--gpus", "2", "--directive", "sensitive=yes")
    code, out, _ = run_mapa(capsys, *base, "--json")
    assert code == 0 and "affinity" not in json.loads(out)  # no affinity options: the output is as before
    code, out, _ = run_mapa(capsys, *base, "--job-cpus", "0-19,40-59", "--affinity-max-loss", "1", "--json")
    data = json.loads(out)
    assert code == 0 and sorted(data["gpus"]) == [1, 3]
    assert data["affinity"]["mode"] == "prefer" and data["affinity"]["local"] is True and data["affinity"]["local_gpus"] == [1, 3]
    code, out, _ = run_mapa(capsys, *base, "--job-cpus", "0-19,40-59", "--affinity", "ignore")
    assert code == 0 and "CPU affinity         ignore: local GPUs 1,3, chosen local: no (affinity ignored)" in out


def test_mapa_select_strict_no_fit_and_bad_input(capsys):
    base = ("select", "--topology", "dgx1-v100", "--free", "1,2,5,6,7", "--gpus", "3")
    code, out, _ = run_mapa(capsys, *base, "--job-cpus", "CPU_IDs=0-3", "--affinity", "strict")
    assert code == 1
    assert "does not fit: 3 GPU(s) requested (ring), only 2 free GPU(s) local to the job's CPUs: 1,2" in out
    code, _, err = run_mapa(capsys, *base, "--job-cpus", "0-3,x")
    assert code == 2 and err.startswith("mapa: error: --job-cpus: CPU list '0-3,x': 'x' is not a CPU id")
    code, _, err = run_mapa(capsys, *base, "--affinity-max-loss", "2")
    assert code == 2 and "max_loss must be a fraction from 0 to 1" in err


# --- the replay ------------------------------------------------------------------------------


def _replay(graph, affinity, decider=None, max_loss=0.25):
    jobs = list(generate("paper", 400, seed=3, load=1.5))
    nodes = [Node(f"n{i}", graph) for i in range(2)]
    return simulate(jobs, nodes, "preserve", Options(backfill=True, affinity=affinity, affinity_max_loss=max_loss), decider=decider)


def test_replay_affinity_modes():
    dgx = preset("dgx1-v100")
    decider = Decider()  # shared: the memo must tell the modes apart
    off = _replay(dgx, None, decider)
    ignore = _replay(dgx, "ignore", decider)
    strict = _replay(dgx, "strict", decider)
    prefer = _replay(dgx, "prefer", decider)
    assert (off.affinity_local, off.affinity_remote) == (0, 0)  # not modelled
    assert ignore.eff_sensitive.values == off.eff_sensitive.values  # ignore only counts
    assert ignore.affinity_local + ignore.affinity_remote == ignore.jobs and ignore.affinity_remote > 0
    assert strict.affinity_remote == 0 and strict.jobs == off.jobs
    assert prefer.affinity_remote <= ignore.affinity_remote
    assert _replay(dgx, "prefer", None, max_loss=0.0).affinity_remote >= prefer.affinity_remote
    no_affinity = _replay(preset("pcie-8"), "strict")
    assert (no_affinity.affinity_local, no_affinity.affinity_remote) == (0, 0)  # every GPU local: nothing to count
    with pytest.raises(InputError, match="unknown affinity mode"):
        _replay(dgx, "loose")


def test_replay_cli_affinity(capsys, tmp_path):
    base = ["run", "--generate", "paper:200", "--topology", "dgx1-v100", "--nodes", "2", "--policies", "preserve"]
    assert replay_main(base + ["--affinity", "strict", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["cpu_affinity"] == {"mode": "strict", "max_loss": 0.1}
    assert out["policies"][0]["cpu_affinity"]["remote_jobs"] == 0
    assert replay_main(base) == 0
    assert "CPU affinity" not in capsys.readouterr().out
    config = tmp_path / "mapa.toml"
    config.write_text('[affinity]\nmode = "prefer"\nmax_loss = 0.5\n')
    assert replay_main(base + ["--config", str(config)]) == 0
    assert "CPU affinity: prefer, max loss 0.5;" in capsys.readouterr().out
    assert replay_main(base + ["--affinity-max-loss", "0.1"]) == 2
    assert "--affinity-max-loss is a setting of --affinity prefer" in capsys.readouterr().err
