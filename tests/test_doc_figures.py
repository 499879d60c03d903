"""The figures the docs state about the models and the search are what the code computes (issue 27).

Each claim names the sentence as it is written and recomputes its numbers; a doc edited without
the code, or code changed under the doc, fails here. (The commands of the docs are run by
tests/test_doc_commands.py; the decision record and gres.conf examples by tests/test_docs.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_mapa.core.model_files import bundled_model, paper_model
from slurm_mapa.core.server_models import dgx1_efficiency
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.hardware.load import model_for_topology
from slurm_mapa.hardware.presets import preset

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _flat(name: str) -> str:
    return " ".join((DOCS / name).read_text(encoding="utf-8").split())


def _best_ring(graph_name: str, gpus: int, model=None, free=None) -> float:
    graph = preset(graph_name)
    model = model or model_for_topology(graph)
    result = select("preserve", graph, free if free is not None else range(graph.size), Request(make_pattern("ring", gpus), True), model)
    return result.placement.effective_bandwidth


def _mi250x_pair(kind: str) -> float:
    """The best 2-GPU ring on an MI250X through an in-package pair (XGMI4) or a relayed one (XGMI0)."""
    graph = preset("mi250x")
    model = model_for_topology(graph)
    wanted = {"in-package": 4, "relayed": 0}[kind]
    pairs = [(a, b) for a in range(graph.size) for b in range(a + 1, graph.size) if graph.link(a, b).token == f"XGMI{wanted}"]
    assert pairs, kind
    return select("preserve", graph, pairs[0], Request(make_pattern("ring", 2), True), model).placement.effective_bandwidth


CLAIMS = [
    # (document, the text as written, the figures in it, what the code gives)
    ("engine.md", "1.18 per GB/s at 2 edges to 2.23 at 5", (1.18, 2.23), lambda: (dgx1_efficiency(0, 2), dgx1_efficiency(0, 5))),
    ("engine.md", "the single NVLink's, 1.11 to 1.72", (1.11, 1.72), lambda: (dgx1_efficiency(1, 2), dgx1_efficiency(1, 5))),
    ("engine.md", "PCIe's, 0.86 to 1.15", (0.86, 1.15), lambda: (dgx1_efficiency(2, 2), dgx1_efficiency(2, 5))),
    ("engine.md", "(4 xGMI links, 200 GB/s) is 235.7 where the paper's model said 58.9", (235.7, 58.9),
     lambda: (_mi250x_pair("in-package"), _best_ring("dgx1-v100", 2, paper_model()))),
    ("engine.md", "a relayed pair (XGMI0, 25 GB/s) 21.6", (21.6,), lambda: (_mi250x_pair("relayed"),)),
    ("replay.md", "predicts 90.0 GB/s for the best 6-GPU ring, 131.8 for 7 and 182.8 for 8", (90.0, 131.8, 182.8),
     lambda: tuple(_best_ring("dgx1-v100", k, paper_model()) for k in (6, 7, 8))),
    ("replay.md", "the largest value it was fitted near is 68.7 (4 GPUs)", (68.7,), lambda: (_best_ring("dgx1-v100", 4, paper_model()),)),
    ("engine.md", "232.54 GB/s", (232.54,), lambda: (bundled_model("nccl-tests-dgx-a100").predict((8,)),)),
    ("engine.md", "about 370 GB/s for 2-4 GPUs, 420/440/460/480 for 5/6/7/8", (370.0, 420.0, 440.0, 460.0, 480.0),
     lambda: tuple(bundled_model("nccl-tests-hgx-h100").predict((k,)) for k in (4, 5, 6, 7, 8))),
]


@pytest.mark.parametrize("doc, text, stated, computed", CLAIMS, ids=[f"{c[0]}: {c[1][:40]}" for c in CLAIMS])
def test_a_stated_figure_is_what_the_code_computes(doc, text, stated, computed):
    assert text in _flat(doc), f"{doc} no longer says {text!r}: update the claim with the doc"
    for figure in stated:
        assert re.search(rf"(?<![0-9.]){re.escape(f'{figure:g}')}(?![0-9])", text), (figure, text)
    got = computed()
    digits = [len(f"{figure}".split(".")[1]) if "." in f"{figure}" else 0 for figure in stated]
    assert tuple(round(value, places) for value, places in zip(got, digits)) == stated, (text, got)
