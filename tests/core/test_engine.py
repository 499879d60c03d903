"""Unit tests of the engine's pieces: links, graphs, patterns, the model, the policies."""

from __future__ import annotations

import pytest

from slurm_mapa.core.effbw import best_completion
from slurm_mapa.core.model_files import load_model_text, paper_model
from slurm_mapa.core.hardware import build_graph
from slurm_mapa.core.links import Bandwidths, Link, parse_link
from slurm_mapa.core.patterns import make_pattern, squarest_grid
from slurm_mapa.core.policies import NoFit, Request, select
from slurm_mapa.core.search import preserved_bandwidth
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.presets import PRESETS, preset

MODEL = paper_model()


@pytest.mark.parametrize(
    "counts,expected",
    [((0, 0, 0), 12.335063), ((2, 0, 0), 58.925036), ((0, 3, 2), 53.608775), ((4, 0, 1), 53.509157)],
)
def test_paper_model_reproduces_the_reference_values(counts, expected):
    assert MODEL.predict(counts) == pytest.approx(expected, abs=1e-5)


def test_paper_model_counts_the_link_classes_as_the_paper_does():
    assert MODEL.classify(parse_link("NV2")) == 0
    assert MODEL.classify(parse_link("NV12")) == 0
    assert MODEL.classify(parse_link("NVS18")) == 0
    assert MODEL.classify(parse_link("NV1")) == 1
    assert MODEL.classify(parse_link("SYS")) == 2
    assert MODEL.classify(parse_link("PIX")) == 2


def test_best_completion_is_the_maximum_over_all_completions():
    best = best_completion(MODEL, (0, 1, 2), (0, 0, 0), 5)
    assert best == pytest.approx(MODEL.predict((5, 0, 0)))
    # without double links the best 5-edge completion is (0,3,2), not (0,5,0)
    assert best_completion(MODEL, (1, 2), (0, 0, 0), 5) == pytest.approx(MODEL.predict((0, 3, 2)))


def test_model_file_errors_name_the_problem():
    with pytest.raises(InputError, match="unknown link selector 'NVX'"):
        load_model_text('[classes]\nx1 = ["NVX"]\n[terms]\nx1 = 1.0\n', source="m.toml")
    with pytest.raises(InputError, match="uses x2"):
        load_model_text('[classes]\nx1 = ["NV1"]\n[terms]\n"x1*x2" = 1.0\n', source="m.toml")
    with pytest.raises(InputError, match="not valid TOML"):
        load_model_text("[classes", source="m.toml")


@pytest.mark.parametrize(
    "token,link",
    [("NV1", Link("nvlink", 1)), ("nv18", Link("nvlink", 18)), ("NVS12", Link("nvswitch", 12)),
     ("SOC", Link("pcie", level="SYS")), ("NODE", Link("pcie", level="NODE"))],
)
def test_link_tokens(token, link):
    assert parse_link(token) == link


@pytest.mark.parametrize("token", ["NV0", "NVLINK", "", "PCI", "NV1X"])
def test_bad_link_tokens_list_what_is_accepted(token):
    with pytest.raises(InputError, match="accepted"):
        parse_link(token)


def test_bandwidths_follow_the_paper_table_and_are_configurable():
    bw = Bandwidths()
    assert bw.of(parse_link("NV2")) == 50 and bw.of(parse_link("NV1")) == 25 and bw.of(parse_link("SYS")) == 12
    assert Bandwidths(nvlink_generation=1).of(parse_link("NV1")) == 20
    custom = Bandwidths(pcie={"PIX": 24, "PXB": 20, "PHB": 16, "NODE": 12, "SYS": 8})
    assert custom.of(parse_link("PIX")) == 24
    with pytest.raises(InputError, match="generation 9"):
        Bandwidths(nvlink_generation=9)


def test_graph_validation():
    with pytest.raises(InputError, match="unknown GPU 4"):
        build_graph("t", 4, {(0, 4): "NV1"})
    with pytest.raises(InputError, match="to itself"):
        build_graph("t", 4, {(1, 1): "NV1"})
    with pytest.raises(InputError, match="conflicting entries for GPUs 0-1: NV1 and NV2"):
        build_graph("t", 4, {(0, 1): "NV1", (1, 0): "NV2"})
    graph = build_graph("t", 3, {(0, 1): "NV2"}, default_link="PHB")
    assert graph.link(1, 2).token == "PHB"
    assert graph.link(1, 0) == graph.link(0, 1)


def test_presets_are_symmetric_and_match_their_documented_shapes():
    for name in PRESETS:
        graph = preset(name)
        for a, b in graph.pairs():
            assert graph.link(a, b) == graph.link(b, a)
    dgx = preset("dgx1-v100")
    assert sum(dgx.link(a, b).token == "NV2" for a, b in dgx.pairs()) == 8
    assert sum(dgx.link(a, b).token == "NV1" for a, b in dgx.pairs()) == 8
    for name in ("torus2d-16", "cubemesh-16", "dgx1-v100"):
        graph = preset(name)
        for gpu in graph.gpus:
            ports = sum(graph.link(gpu, other).links for other in graph.gpus if other != gpu)
            assert ports <= 6, (name, gpu)  # a V100 has six NVLink ports
    assert all(preset("dgx-a100").link(a, b).token == "NVS12" for a, b in preset("dgx-a100").pairs())


def test_pattern_shapes():
    assert make_pattern("ring", 2).edges == ((0, 1), (1, 0))
    assert len(make_pattern("ring", 5).edges) == 5
    assert make_pattern("tree", 5).edges == ((0, 1), (0, 2), (1, 3), (1, 4))
    assert len(make_pattern("ring+tree", 5).edges) == 9
    assert len(make_pattern("all", 5).edges) == 10
    assert make_pattern("mesh2d", 6).grid == (2, 3)
    assert len(make_pattern("torus2d", 9).edges) == 18
    assert len(make_pattern("hypercube", 8).edges) == 12
    assert squarest_grid(7) == (1, 7)
    with pytest.raises(InputError, match="power-of-two"):
        make_pattern("hypercube", 6)
    with pytest.raises(InputError, match="3 weights given for the 4 edges"):
        make_pattern("ring", 4, weights=(1.0, 2.0, 3.0))


def test_preserved_bandwidth_counts_every_link_among_the_free_gpus():
    dgx = preset("dgx1-v100")
    assert preserved_bandwidth(dgx, [0, 1, 3]) == 25 + 50 + 25
    assert preserved_bandwidth(dgx, [0, 5]) == 12


POLICY_TABLE = [
    # description, topology, free, k, sensitive, policy, expected GPU set
    ("baseline takes the lowest free indices", "dgx1-v100", range(8), 2, True, "baseline", {0, 1}),
    ("topo-aware stays in one socket", "dgx1-v100", [2, 3, 4, 5, 6], 3, False, "topo-aware", {4, 5, 6}),
    ("topo-aware falls back to baseline", "dgx1-v100", [2, 3, 4, 5], 3, False, "topo-aware", {2, 3, 4}),
    ("greedy takes the double link", "dgx1-v100", range(8), 2, False, "greedy", {0, 3}),
    ("preserve: sensitive pair gets a double link", "dgx1-v100", range(8), 2, True, "preserve", {0, 3}),
    ("preserve: insensitive job takes the GPU that strands least", "dgx1-v100", [0, 1, 2, 3, 5], 1, False, "preserve", {5}),
    # 4,5 sit behind one PCIe switch (PIX); 1,2 reach each other through the host bridge (PHB)
    ("preserve: PIX pair for a sensitive pair on PCIe", "pcie-8", [1, 2, 4, 5], 2, True, "preserve", {4, 5}),
    ("preserve: summit triangle", "summit", [0, 2, 3, 4, 5], 3, True, "preserve", {3, 4, 5}),
]


@pytest.mark.parametrize("description,topology,free,k,sensitive,policy,expected", POLICY_TABLE, ids=[row[0] for row in POLICY_TABLE])
def test_policy_table(description, topology, free, k, sensitive, policy, expected):
    chosen = select(policy, preset(topology), free, Request(make_pattern("ring", k), sensitive))
    assert set(chosen.gpus) == expected


def test_does_not_fit_is_a_normal_result_naming_request_and_free_gpus():
    result = select("preserve", preset("summit"), [0, 4], Request(make_pattern("ring", 3), True))
    assert isinstance(result, NoFit)
    assert result.reason == "3 GPU(s) requested (ring), only 2 free: 0,4"


def test_unknown_policy_and_gpu_are_input_errors():
    with pytest.raises(InputError, match="accepted: baseline"):
        select("fastest", preset("summit"), [0], Request(make_pattern("ring", 1), True))
    with pytest.raises(InputError, match="GPU 9 is not on summit"):
        select("preserve", preset("summit"), [9], Request(make_pattern("ring", 1), True))


def test_decisions_are_deterministic():
    graph = preset("torus2d-16")
    request = Request(make_pattern("ring", 5), True)
    first = select("preserve", graph, range(16), request)
    assert all(select("preserve", graph, range(16), request).gpus == first.gpus for _ in range(3))


def test_one_bandwidth_per_gpu_set_for_collectives_and_order_for_rank_patterns():
    """Issue 17 item 5: NCCL builds its own rings, so a collective's set is scored by its best order;
    a rank-order pattern (chain, mesh, custom) is scored in the order the policy gave."""
    from slurm_mapa.core.explain import alternatives, reported_allocation

    graph = preset("dgx1-v100")
    model = paper_model()
    ring = Request(make_pattern("ring", 8), sensitive=False)
    shown = {name: reported_allocation(graph, ring, select(name, graph, range(8), ring, model), model) for name in ("greedy", "preserve", "baseline")}
    assert len({round(a.placement.effective_bandwidth, 9) for a in shown.values()}) == 1
    raw = select("greedy", graph, range(8), ring, model)
    assert raw.placement.effective_bandwidth < shown["greedy"].placement.effective_bandwidth  # greedy wrote an aggregated-best order
    chain = Request(make_pattern("chain", 4), sensitive=False)
    chosen = select("greedy", graph, range(8), chain, model)
    assert reported_allocation(graph, chain, chosen, model) is chosen
    # mapa select --explain: each alternative set is reported by its best ring
    four = Request(make_pattern("ring", 4), sensitive=False)
    chosen = select("greedy", graph, range(8), four, model)
    sensitive_four = Request(make_pattern("ring", 4), sensitive=True)
    for alt in alternatives(graph, tuple(range(8)), four, chosen, model):
        best = select("preserve", graph, alt.placement.gpus, sensitive_four, model).placement.effective_bandwidth
        assert alt.placement.effective_bandwidth == pytest.approx(best)


def test_the_paper_model_is_reproduced_by_name_and_prices_the_dgx1_by_default_no_more():
    """The values above are the paper's model's, named (issue 38): the DGX-1 V100's default model
    is one true to its links; the paper's regression keeps its numbers under its own name."""
    from slurm_mapa.core.model_files import load_model
    from slurm_mapa.hardware.load import model_for_topology

    assert model_for_topology(preset("dgx1-v100")).name == "derived-dgx1-v100"
    model = load_model("mapa-paper-dgx1")
    assert model is paper_model()
    assert round(model.predict((2, 0, 0)), 6) == 58.925036 and round(model.predict((0, 3, 2)), 6) == 53.608775


@pytest.mark.parametrize("work", [1, 5, 50, 500, None])
def test_a_limited_reordering_never_reports_worse_than_the_chosen_order(work):
    """reported_placement re-orders a collective's set; with a limit that runs out it reports the
    better of the order found and the chosen one, and keeps the choice's own gap."""
    import dataclasses

    from slurm_mapa.core.explain import reported_placement
    from slurm_mapa.core.search import SearchLimit, best_placement

    graph, model = preset("torus2d-16"), paper_model()
    pattern = make_pattern("ring", 9)
    chosen = best_placement(graph, range(16), pattern, "preserved", model)
    chosen = dataclasses.replace(chosen, gap=1.5)
    reported = reported_placement(graph, pattern, chosen, model, SearchLimit(work=work) if work else None)
    assert sorted(reported.gpus) == sorted(chosen.gpus) and reported.gap == 1.5
    assert reported.effective_bandwidth >= chosen.effective_bandwidth - 1e-9
    exact = reported_placement(graph, pattern, chosen, model)
    assert reported.effective_bandwidth <= exact.effective_bandwidth + 1e-9
