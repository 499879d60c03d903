"""core/order.py: the order MAPA's GPUs are paired with Slurm's ascending indices in, and the job
file that keeps the pairing (slurm/jobfiles.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.core.order import prefix_order
from slurm_mapa.hardware.presets import PRESETS, preset
from slurm_mapa.slurm.node_state.job_files import JobMapping, job_file_text, parse_job_mapping

NAMES = sorted(PRESETS)


@st.composite
def node_and_gpus(draw):
    graph = preset(draw(st.sampled_from(NAMES)))
    gpus = draw(st.lists(st.sampled_from(list(graph.gpus)), min_size=1, max_size=graph.size, unique=True))
    return graph, gpus


@settings(max_examples=300, deadline=None)
@given(node_and_gpus())
def test_the_order_is_a_permutation_led_by_a_best_linked_pair(case):
    graph, gpus = case
    order = prefix_order(graph, gpus)
    assert sorted(order) == sorted(gpus)
    assert prefix_order(graph, list(reversed(gpus))) == order  # a function of the set alone
    if len(order) >= 2:
        best = max(graph.bandwidth(a, b) for a, b in itertools.combinations(gpus, 2))
        assert graph.bandwidth(order[0], order[1]) == best


@settings(max_examples=300, deadline=None)
@given(node_and_gpus())
def test_each_next_gpu_best_closes_the_ring_of_those_before_it(case):
    """The greedy rule, checked against every choice it could have made at each step."""
    graph, gpus = case
    order = prefix_order(graph, gpus)
    for i in range(2, len(order)):
        first, last, rest = order[0], order[i - 1], order[i:]
        gain = {g: graph.bandwidth(last, g) + graph.bandwidth(g, first) for g in rest}
        assert gain[order[i]] == max(gain.values())


def test_on_a_dgx1_the_first_two_of_a_ring_of_four_are_a_double_nvlink():
    dgx = preset("dgx1-v100")
    order = prefix_order(dgx, (0, 1, 2, 3))
    assert dgx.link(order[0], order[1]).token == "NV2"
    assert all(dgx.link(a, b).token.startswith("NV") for a, b in zip(order, order[1:]))  # ranks r, r+1 linked


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 63), min_size=1, max_size=16, unique=True), st.data())
def test_the_job_file_round_trips_its_pairing(gpus, data):
    slurm = data.draw(st.lists(st.integers(0, 63), min_size=len(gpus), max_size=len(gpus), unique=True))
    paired = data.draw(st.permutations(gpus))
    mapping = parse_job_mapping(job_file_text(gpus, slurm, paired).encode())
    assert mapping == JobMapping(tuple(gpus), tuple(sorted(slurm)), tuple(paired))
    for count in range(len(gpus) + 1):
        asked = sorted(slurm)[:count]
        assert mapping.mapa_gpus_for(asked) == tuple(paired[:count])


@pytest.mark.parametrize("text", [
    b"MAPA_GPUS=1,2\nSLURM_GPUS=0\nPAIRED_GPUS=1,2\n",  # counts differ
    b"MAPA_GPUS=1,2\nSLURM_GPUS=1,0\nPAIRED_GPUS=1,2\n",  # not ascending
    b"MAPA_GPUS=1,2\nSLURM_GPUS=0,1\nPAIRED_GPUS=1,3\n",  # pairs another GPU
    b"MAPA_GPUS=1,2\nSLURM_GPUS=0,1\n",  # half a pairing
    b"MAPA_GPUS=1,2\nPAIRED_GPUS=1,2\nSLURM_GPUS=0,1\n",
    b"MAPA_GPUS=1,2\nSLURM_GPUS=0,1\nPAIRED_GPUS=1,2\nextra\n",
    b"MAPA_GPUS=1,2\nSLURM_GPUS=0,1\nPAIRED_GPUS=1,2",
    b"MAPA_GPUS=1,2\nSLURM_GPUS=0,\xff\nPAIRED_GPUS=1,2\n",
])
def test_a_job_file_that_is_not_what_the_prolog_writes_is_refused(text):
    with pytest.raises(ValueError):
        parse_job_mapping(text)


def test_slurm_gpus_outside_the_pairing_map_to_nothing():
    mapping = JobMapping((4, 7), (0, 1), (7, 4))
    assert mapping.mapa_gpus_for([1]) == (4,) and mapping.mapa_gpus_for([2]) is None
    assert JobMapping((4, 7)).mapa_gpus_for([0]) is None  # an earlier release's file pairs nothing
