"""Issue 51: placing a job's nodes in NVLink domains, each policy against its definition and
MAPA's domain-level Preserve against brute force on small clusters."""

from __future__ import annotations

import random
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.core.domains import (
    after, block_levels, block_place, default_need, effective_need, first_fit_place, mapa_place, one_domain,
    parse_need, place, random_place, runs, state_score, usable,
)
from slurm_mapa.errors import InputError

CAP = 4


def best_by_brute_force(free, capacity, nodes, gpus, one_domain_only):
    best = None
    for combo in combinations(usable(free, gpus), nodes):
        if one_domain_only and not one_domain(combo):
            continue
        key = state_score(after(free, combo, gpus), capacity)
        best = key if best is None or key > best else best
    return best


clusters = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(clusters, st.integers(1, 4), st.integers(1, 2), st.sampled_from(["required", "preferred", "any"]))
def test_mapa_keeps_the_most_useful_free_space_brute_force(free, nodes, gpus, need):
    got = mapa_place(free, 2, nodes, gpus, need)
    in_one = best_by_brute_force(free, 2, nodes, gpus, True)
    anywhere = best_by_brute_force(free, 2, nodes, gpus, False)
    if need == "required":
        assert (got is None) == (in_one is None)
    elif need == "preferred" and in_one is None:
        assert (got is None) == (anywhere is None)
    else:
        assert (got is None) == ((in_one if need == "preferred" else anywhere) is None)
    if got is None:
        return
    assert len(set(got)) == nodes and all(free[d][j] >= gpus for d, j in got)
    score = state_score(after(free, got, gpus), 2)
    if need in ("required", "preferred") and in_one is not None:
        assert one_domain(got) and score == in_one
    else:
        assert score == anywhere


def test_a_small_job_goes_to_the_broken_domain_and_a_domain_sized_job_then_fits():
    free = [[CAP] * 4, [CAP, CAP, 0, CAP]]  # domain 0 whole, domain 1 broken
    small = mapa_place(free, CAP, 2, CAP, "any")
    assert {d for d, _ in small} == {1}
    free = after(free, small, CAP)
    assert mapa_place(free, CAP, 4, CAP, "required") == ((0, 0), (0, 1), (0, 2), (0, 3))
    # Slurm's block placement takes the lowest-numbered block that fits: the whole domain
    start = [[CAP] * 4, [CAP, CAP, 0, CAP]]
    assert {d for d, _ in block_place(start, CAP, 2, CAP, "any")} == {0}


def test_mapa_packs_into_used_trays_first_and_keeps_runs():
    free = [[CAP, CAP, CAP, CAP, CAP, 0, CAP]]
    # a 1-node job takes the lone whole node, not one of the run of five
    assert mapa_place(free, CAP, 1, CAP, "any") == ((0, 6),)
    # a 1-GPU job goes to a tray already in use, the fullest that fits
    free = [[CAP, 3, 1, CAP], [2, CAP]]
    assert mapa_place(free, CAP, 1, 1, "any") == ((0, 2),)
    assert mapa_place(free, CAP, 1, 2, "any") == ((1, 0),)


def test_required_waits_and_preferred_spreads():
    free = [[CAP, CAP, 0], [0, CAP, CAP]]
    assert mapa_place(free, CAP, 3, CAP, "required") is None
    assert block_place(free, CAP, 3, CAP, "required") is None
    spread = mapa_place(free, CAP, 3, CAP, "preferred")
    assert spread is not None and not one_domain(spread)
    assert mapa_place(free, CAP, 2, CAP, "preferred") == ((0, 0), (0, 1))


def test_block_follows_the_smallest_level_lowest_numbered_block():
    assert block_levels([18] * 4) == [1, 2, 4]
    assert block_levels([18] * 4, [18, 36]) == [1, 2]
    assert block_levels([9] * 8, [9, 36]) == [1, 4]
    free = [[CAP, 0, 0], [CAP, CAP, 0], [CAP, CAP, CAP], [0, 0, 0]]
    assert block_place(free, CAP, 2, CAP) == ((1, 0), (1, 1))  # base level: block 1 is the first with room
    assert block_place(free, CAP, 3, CAP) == ((2, 0), (2, 1), (2, 2))
    assert block_place(free, CAP, 4, CAP) == ((0, 0), (1, 0), (1, 1), (2, 0))  # no pair of blocks has 4 free: the whole cluster
    # one-node job: the fullest node of the first block with room (cons_tres best fit)
    assert block_place([[0, CAP], [1, 2]], CAP, 1, 1) == ((0, 1),)
    assert block_place([[0, 0], [1, 2]], CAP, 1, 1) == ((1, 0),)


def test_first_fit_and_random_do_not_see_domains():
    free = [[CAP, 0], [CAP, CAP]]
    assert first_fit_place(free, CAP, 2, CAP) == ((0, 0), (1, 0))
    got = random_place(free, CAP, 2, CAP, rng=random.Random(3))
    assert got is not None and len(got) == 2 and set(got) <= {(0, 0), (1, 0), (1, 1)}
    assert random_place(free, CAP, 2, CAP, rng=random.Random(3)) == got  # seeded
    assert place("first-fit", free, CAP, 4, CAP) is None


def test_needs():
    assert parse_need(" Required ") == "required"
    with pytest.raises(InputError, match="accepted: required, preferred, any"):
        parse_need("rack")
    assert default_need(True, 8, 18) == "required"
    assert default_need(True, 19, 18) == "any" and default_need(False, 8, 18) == "any" and default_need(True, 1, 18) == "any"
    assert effective_need("required", False, 20, 18) == "preferred"
    assert effective_need(None, True, 4, 18) == "required"
    with pytest.raises(InputError, match="unknown domain policy"):
        place("best", [[CAP]], CAP, 1, 1)


def test_runs_and_score():
    assert runs([True, True, False, True]) == [2, 1] and runs([]) == []
    assert state_score([[2, 2], [2, 0]], 2) == (1, (2, 1), (2, 1))
