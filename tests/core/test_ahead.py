"""preserve-ahead: exact for its own objective (brute force with itertools), deterministic, never refuses a fit."""

from __future__ import annotations

import random
from functools import lru_cache
from itertools import combinations, permutations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.core import ahead
from slurm_mapa.core.model_files import paper_model
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Allocation, NoFit, Request, all_policies, select
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import preset

MODEL = paper_model()
D = 9


def request(k: int, sensitive: bool) -> Request:
    return Request(make_pattern("ring", k), sensitive)


# --- the brute-force reference: every placement by itertools.permutations, no search code --------


@lru_cache(maxsize=None)
def _graph(name):
    return preset(name)


@lru_cache(maxsize=None)
def job_key(name: str, k: int, gpus: frozenset) -> tuple[float, float]:
    """max over every order of a k-ring on exactly ``gpus`` of (effective, aggregated)."""
    graph = _graph(name)
    pattern = make_pattern("ring", k)
    best = None
    for perm in permutations(sorted(gpus)):
        counts = [0] * len(MODEL.class_names)
        agg = 0.0
        for (a, b), w in zip(pattern.edges, pattern.weights):
            link = graph.link(perm[a], perm[b])
            counts[MODEL.classify(link)] += 1
            agg += w * graph.bandwidths.of(link)
        key = (round(MODEL.predict(tuple(counts)), D), round(agg, D))
        if best is None or key > best:
            best = key
    return best


@lru_cache(maxsize=None)
def best_ring(name: str, k: int, free: frozenset) -> float:
    if len(free) < k:
        return 0.0
    return max(job_key(name, k, frozenset(s))[0] for s in combinations(sorted(free), k))


def future(name: str, free: frozenset, sizes: dict[int, float]) -> float:
    total = sum(sizes.values())
    return round(sum(w / total * best_ring(name, k, free) for k, w in sorted(sizes.items()) if k >= 2 and w > 0), D)


def preserved(name: str, free: frozenset) -> float:
    graph = _graph(name)
    left = sorted(free)
    return round(sum(graph.bandwidth(a, b) for i, a in enumerate(left) for b in left[i + 1 :]), D)


def outlook(name: str, rest: frozenset, sizes: dict[int, float], running) -> float:
    """future(rest), plus the mean over running jobs of future(rest and that job's GPUs)."""
    now = future(name, rest, sizes)
    if not running:
        return now
    groups = sorted(running, key=lambda g: sum(1 << x for x in g))
    later = sum(future(name, rest | frozenset(g), sizes) for g in groups) / len(groups)
    return round(now + later, D)


def brute_choice(name, free, k, sensitive, sizes=None, tolerance=0.0, running=()):
    """(best key, lex-first set among the sets with that key): the objective written out again."""
    sizes = sizes or {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    free = sorted(free)
    subsets = [tuple(s) for s in combinations(free, k)]
    if sensitive and k > 1:
        top = max(job_key(name, k, frozenset(s))[0] for s in subsets)
        allowed = [s for s in subsets if job_key(name, k, frozenset(s))[0] >= round(top - tolerance * abs(top), D)]
        keyed = [((outlook(name, frozenset(free) - set(s), sizes, running), job_key(name, k, frozenset(s))), s) for s in allowed]
    else:
        keyed = [((outlook(name, frozenset(free) - set(s), sizes, running), preserved(name, frozenset(free) - set(s))), s)
                 for s in subsets]
    best = max(key for key, _ in keyed)
    return best, min(s for key, s in keyed if key == best)


def cases(name, count, seed):
    rng = random.Random(seed)
    n = _graph(name).size
    out = []
    while len(out) < count:
        free = tuple(g for g in range(n) if rng.random() < 0.75)
        k = rng.randint(1, 5)
        if k <= len(free):
            out.append((free, k, rng.random() < 0.6))
    return out


@pytest.mark.parametrize("name", ["dgx1-v100", "pcie-8", "dgx1-p100"])
def test_matches_brute_force_objective_and_tie_break(name):
    graph = _graph(name)
    for free, k, sensitive in cases(name, 40, seed=hash(name) % 1000) + [(tuple(range(8)), k, s) for k in range(1, 6) for s in (True, False)]:
        key, expected = brute_choice(name, free, k, sensitive)
        got = ahead.choose_set(graph, free, request(k, sensitive), MODEL)
        assert got == expected, (name, free, k, sensitive, key)
        alloc = ahead.preserve_ahead(graph, free, request(k, sensitive), MODEL)
        assert isinstance(alloc, Allocation) and tuple(sorted(alloc.gpus)) == expected
        if sensitive and k > 1:
            # the order inside the set is the best ring on it
            assert round(alloc.placement.effective_bandwidth, D) == job_key(name, k, frozenset(expected))[0]


def running_cases(name, count, seed):
    """Free sets with the busy GPUs split at random into running jobs of 1-5 GPUs."""
    rng = random.Random(seed)
    out = []
    for free, k, sensitive in cases(name, count, seed):
        busy = [g for g in range(_graph(name).size) if g not in free]
        rng.shuffle(busy)
        groups = []
        while busy:
            size = rng.randint(1, 5)
            groups.append(tuple(sorted(busy[:size])))
            busy = busy[size:]
        out.append((free, k, sensitive, tuple(groups)))
    return out


@pytest.mark.parametrize("name", ["dgx1-v100", "pcie-8", "dgx1-p100"])
def test_outlook_over_running_jobs_matches_brute_force(name):
    graph = _graph(name)
    seen_running = 0
    for free, k, sensitive, running in running_cases(name, 40, seed=17):
        _, expected = brute_choice(name, free, k, sensitive, running=running)
        assert ahead.choose_set(graph, free, request(k, sensitive), MODEL, running=running) == expected, (free, k, sensitive, running)
        result = select("preserve-ahead", graph, free, request(k, sensitive), MODEL, running=running)
        assert tuple(sorted(result.gpus)) == expected
        # the order of the running jobs, and of the GPUs in each, does not matter
        shuffled = [tuple(reversed(g)) for g in reversed(running)]
        assert ahead.choose_set(graph, free, request(k, sensitive), MODEL, running=shuffled) == expected
        seen_running += bool(running)
    assert seen_running >= 30


def test_running_jobs_change_the_choice():
    """On a busy node the outlook looks past what is free now; some choices must differ from without it."""
    graph = _graph("dgx1-v100")
    differ = 0
    for free, k, sensitive, running in running_cases("dgx1-v100", 60, seed=23):
        with_running = ahead.choose_set(graph, free, request(k, sensitive), MODEL, running=running)
        differ += with_running != ahead.choose_set(graph, free, request(k, sensitive), MODEL)
    assert differ >= 3


def test_running_jobs_are_checked():
    graph = _graph("dgx1-v100")
    with pytest.raises(InputError, match="GPU 3 is listed as running a job and also as free"):
        select("preserve-ahead", graph, (0, 1, 2, 3), request(2, False), running=[(3, 4)])
    with pytest.raises(InputError, match="GPU 5 is listed as running a job and also as free"):
        select("preserve-ahead", graph, (0, 1), request(2, False), running=[(4, 5), (5, 6)])
    with pytest.raises(InputError, match="running job's GPU 9 is not on"):
        select("preserve-ahead", graph, (0, 1), request(2, False), running=[(9,)])
    # policies that do not look at running jobs give the same answer with or without them
    assert select("preserve", graph, (0, 1, 2), request(2, False), running=[(4, 5)]) == select("preserve", graph, (0, 1, 2), request(2, False))


def test_sensitive_jobs_get_the_best_effective_bandwidth():
    graph = _graph("dgx1-v100")
    for free, k, _ in cases("dgx1-v100", 30, seed=5):
        if k < 2:
            continue
        alloc = select("preserve-ahead", graph, free, request(k, True))
        paper = select("preserve", graph, free, request(k, True))
        assert round(alloc.placement.effective_bandwidth, D) == round(paper.placement.effective_bandwidth, D)


@pytest.mark.parametrize("sizes,tolerance", [({4: 1.0}, 0.0), ({2: 3.0, 5: 1.0}, 0.0), (None, 0.05), ({3: 1.0, 4: 2.0}, 0.15)])
def test_configured_sizes_and_tolerance_match_brute_force(sizes, tolerance):
    graph = _graph("dgx1-v100")
    policy = ahead.make_preserve_ahead(sizes, tolerance)
    for free, k, sensitive in cases("dgx1-v100", 25, seed=11):
        _, expected = brute_choice("dgx1-v100", free, k, sensitive, sizes, tolerance)
        assert ahead.choose_set(graph, free, request(k, sensitive), MODEL, sizes, tolerance) == expected
        assert tuple(sorted(policy(graph, free, request(k, sensitive), MODEL).gpus)) == expected


def test_keeps_a_quad_free_for_four_gpu_jobs():
    graph = _graph("dgx1-v100")
    alloc = ahead.make_preserve_ahead({4: 1.0})(graph, tuple(range(8)), request(2, False), MODEL)
    rest = frozenset(range(8)) - set(alloc.gpus)
    assert best_ring("dgx1-v100", 4, rest) == best_ring("dgx1-v100", 4, frozenset(range(8)))


@settings(max_examples=60, deadline=None)
@given(
    topo=st.sampled_from(["dgx1-v100", "torus2d-16", "cubemesh-16"]),
    gpus=st.sets(st.integers(min_value=0, max_value=15), max_size=10),
    k=st.integers(min_value=1, max_value=5),
    sensitive=st.booleans(),
    job_sizes=st.lists(st.integers(min_value=1, max_value=6), max_size=8),
)
def test_never_refuses_a_placement_that_fits(topo, gpus, k, sensitive, job_sizes):
    # up to 10 free GPUs on the 16-GPU nodes keeps a cold memo cheap (2^10 free sets)
    graph = _graph(topo)
    free = tuple(sorted(g for g in gpus if g < graph.size))
    busy = [g for g in range(graph.size) if g not in free]
    running = []
    for size in job_sizes:  # some of the busy GPUs, split into running jobs
        if busy[:size]:
            running.append(tuple(busy[:size]))
        busy = busy[size:]
    result = select("preserve-ahead", graph, free, request(k, sensitive), running=running)
    if k <= len(free):
        assert isinstance(result, Allocation)
        assert len(set(result.gpus)) == k and set(result.gpus) <= set(free)
    else:
        assert isinstance(result, NoFit)


def test_deterministic_whatever_the_cache_holds():
    graph = _graph("dgx1-v100")
    work = cases("dgx1-v100", 30, seed=3)
    ahead.clear_cache()
    first = [ahead.preserve_ahead(graph, f, request(k, s), MODEL).gpus for f, k, s in work]
    ahead.clear_cache()
    second = [ahead.preserve_ahead(graph, f, request(k, s), MODEL).gpus for f, k, s in reversed(work)]
    assert first == list(reversed(second))
    assert first == [ahead.preserve_ahead(graph, f, request(k, s), MODEL).gpus for f, k, s in work]


def test_registered_everywhere_a_policy_is():
    assert "preserve-ahead" in all_policies()
    from slurm_mapa.replay.simulate import ALL_POLICIES, Node, simulate
    from slurm_mapa.replay.generate import generate

    assert "preserve-ahead" in ALL_POLICIES
    result = simulate(list(generate("paper", 40, seed=2)), [Node("n0", _graph("dgx1-v100"))], "preserve-ahead")
    assert result.jobs == 40


@pytest.mark.parametrize("sizes,tolerance", [({}, 0.0), ({0: 1.0}, 0.0), ({2: -1.0}, 0.0), ({2: 0.0}, 0.0), (None, -0.1)])
def test_bad_configuration_is_an_input_error(sizes, tolerance):
    with pytest.raises(InputError):
        ahead.make_preserve_ahead(sizes, tolerance)


def test_size_distributions_parse_strictly_and_learn_from_history():
    assert ahead.parse_sizes("1:0.5, 2:0.3,4:0.2") == {1: 0.5, 2: 0.3, 4: 0.2}
    assert ahead.parse_sizes({"4": 1, "2": 3}) == {4: 1.0, 2: 3.0}  # a TOML table: keys are strings
    for bad, message in [("2", "is not GPUS:WEIGHT"), ("x:1", "whole number of GPUs"), ("0:1", "whole number"),
                         ("2:-1", "0 or more"), ("2:nan", "0 or more"), ("2:inf", "0 or more"), ("", "empty"),
                         ({"2": True}, "must be a number"), ("2:0", "no weight")]:
        with pytest.raises(InputError, match=message):
            ahead.parse_sizes(bad)
    assert ahead.sizes_from_jobs([1, 1, 2, 4]) == {1: 0.5, 2: 0.25, 4: 0.25}
    with pytest.raises(InputError, match="no GPU jobs"):
        ahead.sizes_from_jobs([])


def test_configured_sizes_reach_select_the_prolog_the_cli_and_the_replay(tmp_path, capsys):
    import json

    from slurm_mapa.cli import main as mapa_main
    from slurm_mapa.replay.cli import main as replay_main
    from slurm_mapa.slurm.config import config_from_text

    graph = _graph("dgx1-v100")
    free, req = (0, 1, 2, 4, 5, 7), request(2, False)
    sized = ahead.make_preserve_ahead({4: 1.0})
    want = tuple(sorted(sized(graph, free, req, MODEL).gpus))
    default = tuple(sorted(ahead.preserve_ahead(graph, free, req, MODEL).gpus))
    assert want != default  # otherwise this test could not tell the settings were used
    got = select("preserve-ahead", graph, free, req, MODEL, {"preserve-ahead": sized})
    assert tuple(sorted(got.gpus)) == want
    # The Prolog's config.
    config = config_from_text('policy = "preserve-ahead"\n[preserve_ahead]\nsizes = { 4 = 1.0 }\ntolerance = 0.0\n')
    assert config.ahead_sizes == ((4, 1.0),)
    assert tuple(sorted(select(config.policy, graph, free, req, MODEL, config.configured_policies()).gpus)) == want
    assert config_from_text('policy = "preserve"\n[preserve_ahead]\nsizes = { 4 = 1.0 }\n').configured_policies() == {}
    for bad, message in [('[preserve_ahead]\nsizes = "4:1"\n', "table of GPUs to weight"), ('[preserve_ahead]\nsize = {}\n', "takes sizes"),
                         ('[preserve_ahead]\ntolerance = 2\n', "fraction from 0 to 1"), ('[preserve_ahead]\nsizes = { 0 = 1 }\n', "whole number")]:
        with pytest.raises(InputError, match=message):
            config_from_text(bad)
    # mapa select.
    assert mapa_main(["select", "--topology", "dgx1-v100", "--free", "0-2,4,5,7", "--gpus", "2", "--policy", "preserve-ahead",
                      "--ahead-sizes", "4:1", "--json"]) == 0
    assert tuple(sorted(json.loads(capsys.readouterr().out)["gpus"])) == want
    assert mapa_main(["select", "--topology", "dgx1-v100", "--gpus", "1", "--ahead-sizes", "4:1"]) == 2
    assert "settings of --policy preserve-ahead" in capsys.readouterr().err
    # mapa-replay: sizes from the command line, learnt from the input, or from the config.
    jobs = tmp_path / "jobs.csv"
    assert replay_main(["generate", "paper", "--jobs", "30", "--seed", "3", "-o", str(jobs)]) == 0
    capsys.readouterr()
    assert replay_main(["run", str(jobs), "--topology", "dgx1-v100", "--policies", "preserve-ahead", "--ahead-sizes", "log", "--json"]) == 0
    captured = capsys.readouterr()
    assert "sizes learnt from the input" in captured.err and json.loads(captured.out)["policies"][0]["jobs"] == 30
    site = tmp_path / "site.toml"
    site.write_text("[preserve_ahead]\nsizes = { 2 = 1, 4 = 1 }\ntolerance = 0.1\n")
    assert replay_main(["run", str(jobs), "--topology", "dgx1-v100", "--policies", "preserve-ahead", "--config", str(site), "--json"]) == 0
    site.write_text("[preserve_ahead]\ntolerance = 3\n")
    assert replay_main(["run", str(jobs), "--topology", "dgx1-v100", "--config", str(site)]) == 2


# --- under a search limit (the Prolog's 0.2 s) ----------------------------------------------------


def _torus_4x8():
    from slurm_mapa.core.hardware import build_graph

    links = {}
    for r in range(4):
        for c in range(8):
            a = r * 8 + c
            for b in (r * 8 + (c + 1) % 8, ((r + 1) % 4) * 8 + c):
                links[(min(a, b), max(a, b))] = "NV2"
    return build_graph("torus2d-4x8", 32, links, default_link="SYS")


@pytest.mark.parametrize("seed", range(40))
def test_a_limit_its_set_order_fits_in_changes_nothing(seed):
    from slurm_mapa.core.search import SearchLimit

    rng = random.Random(seed)
    graph = preset(rng.choice(["dgx1-v100", "torus2d-16"]))
    free = tuple(sorted(rng.sample(range(graph.size), rng.randint(2, graph.size))))
    request = Request(make_pattern("ring", rng.randint(1, min(len(free), 5))), sensitive=rng.random() < 0.5)
    running = [tuple(g for g in range(graph.size) if g not in free)] if len(free) < graph.size else []
    exact = select("preserve-ahead", graph, free, request, paper_model(), running=running)
    limited = select("preserve-ahead", graph, free, request, paper_model(), running=running, limit=SearchLimit(work=10**9))
    assert limited == exact and limited.policy == "preserve-ahead"


@pytest.mark.parametrize("sensitive", [False, True])
def test_on_a_node_of_more_than_16_gpus_preserve_chooses_and_says_so(sensitive):
    """The look-ahead's tables would hold 2^32 free sets: select() gives the job Preserve's choice,
    with or without a limit, and the allocation (so the decision record) says policy=preserve."""
    from slurm_mapa.core.search import SearchLimit

    graph = _torus_4x8()
    request = Request(make_pattern("ring", 4), sensitive=sensitive)
    free = tuple(range(32))
    for limit in (None, SearchLimit(work=2000)):
        got = select("preserve-ahead", graph, free, request, paper_model(), limit=limit)
        assert isinstance(got, Allocation) and got.policy == "preserve"
        assert got == select("preserve", graph, free, request, paper_model(), limit=limit)
