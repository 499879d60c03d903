"""The ring outlook a node publishes in its Extra field (issue 40): built, parsed back, and
anything else refused with the text quoted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_mapa.slurm.text.commands import CommandFailed, active_features_argv
from slurm_mapa.slurm.text.outlook import RingOutlook, extra_of_node, outlook_text, parse_outlook

OUTLOOK = {"mapa_ring2": RingOutlook(48.1, 53.6, 0.0), "mapa_ring4": RingOutlook(None, 53.6, 1764330000.2),
           "mapa_ring8": RingOutlook(None, 53.6, None)}


def test_the_text_is_one_token_and_reads_back():
    text = outlook_text(OUTLOOK)
    assert text == "mapa_ring2=48.1/53.6@0,mapa_ring4=-/53.6@1764330001,mapa_ring8=-/53.6@-"
    assert parse_outlook(text) == {**OUTLOOK, "mapa_ring4": RingOutlook(None, 53.6, 1764330001.0)}  # whole seconds, later
    assert parse_outlook("") == {} and parse_outlook("(null)") == {} and outlook_text({}) == ""
    assert active_features_argv("scontrol", "dgx1", ("mapa_ring2",), text)[-1] == f"Extra={text}"


@given(st.dictionaries(st.sampled_from([f"mapa_ring{k}" for k in range(2, 17)] + ["mapa_tree4", "mapa_ring_tree3"]),
                       st.builds(RingOutlook, st.none() | st.floats(0, 999), st.floats(0, 999),
                                 st.none() | st.just(0.0) | st.integers(1, 10**11).map(float)), max_size=8))
def test_any_outlook_reads_back_to_two_decimals(outlook):
    back = parse_outlook(outlook_text(outlook))
    assert list(back) == list(outlook)
    for name, entry in outlook.items():
        got = back[name]
        assert (got.now is None) == (entry.now is None) and (got.now is None or abs(got.now - entry.now) <= 0.005 + 1e-9)
        assert abs(got.best - entry.best) <= 0.005 + 1e-9 and got.good_at == entry.good_at


@pytest.mark.parametrize("text", [
    "site text", "mapa_ring4=41/53@0 x", "mapa_ring4=41/53", "mapa_ring4=41/-@0", "mapa_ring4=41/53@-1", "ring4=1/2@0",
    "mapa_ring4=41/53@0,", "mapa_ring4=1e3/53@0", "mapa_ring4=41/53@01", "mapa_ring4=41/53@0," * 70, "x" * 5000,
    "mapa_ring4=41/53@0\nNodeName=evil",
])
def test_anything_else_is_refused_quoting_it(text):
    with pytest.raises(CommandFailed, match="Extra"):
        parse_outlook(text)


def test_bad_values_are_not_written():
    for bad in ({"mapa_ring4": RingOutlook(float("nan"), 53.6, 0.0)}, {"mapa_ring4": RingOutlook(1.0, 1e7, 0.0)},
                {"mapa ring4": RingOutlook(1.0, 2.0, 0.0)}, {f"mapa_ring{k}": RingOutlook(1.0, 2.0, 0.0) for k in range(70)}):
        with pytest.raises(ValueError):
            outlook_text(bad)
    with pytest.raises(ValueError, match="Extra"):
        active_features_argv("scontrol", "dgx1", (), "a b")


def test_the_extra_field_of_scontrol_show_node():
    line = "NodeName=dgx1 Arch=x86_64 ActiveFeatures=mapa_ring2 Gres=gpu:8(S:0-1) State=IDLE Partitions=gpu"
    assert extra_of_node(line) == ""  # Slurm prints no Extra= when the node has none
    assert extra_of_node(line + " Extra=mapa_ring2=48.1/53.6@0") == "mapa_ring2=48.1/53.6@0"
    assert extra_of_node(line + " Extra=(null)") == ""
    with pytest.raises(CommandFailed, match="2 Extra="):
        extra_of_node(line + " Extra=a Extra=b")
