"""`mapa calibrate` and the effective-bandwidth model kinds (issue 8)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from repo_paths import REPO, TEST_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa import cli
from slurm_mapa.calibrate.fit import Measurement, fit_bottleneck, fit_model, monotonicity_warnings, term_set
from slurm_mapa.calibrate.nccl import parse_nccl_tests, parse_size
from slurm_mapa.calibrate.plan import load_plan, make_plan, measurement_script
from slurm_mapa.core.model_files import load_model_text, model_to_toml, paper_model, term_text
from slurm_mapa.core.server_models import bottleneck_model
from slurm_mapa.core.patterns import make_pattern
from slurm_mapa.core.policies import Request, select
from slurm_mapa.errors import InputError
from slurm_mapa.hardware.load import load_topology
from slurm_mapa.hardware.nvidia_smi import parse_topo_matrix

DATA = TEST_DATA
NCCL = DATA / "nccl-tests"
PCIE = DATA / "nvidia-smi" / "pcie-8gpu-pix-phb-sys.txt"
BRIDGE = DATA / "nvidia-smi" / "4gpu-nvlink-bridge-pairs.txt"


def graph_of(path: Path):
    return parse_topo_matrix(path.read_text()).graph


def ring(k: int, sensitive: bool = True) -> Request:
    return Request(pattern=make_pattern("ring", k), sensitive=sensitive)


def chosen(graph, free, k, model, policy="preserve"):
    return set(select(policy, graph, free, ring(k), model).gpus)


def synthetic_output(busbw: float, gpus: int, *, marker: str = "") -> str:
    """all_reduce_perf output as the tool prints it, with ``busbw`` reached at the largest sizes."""
    lines = [marker] if marker else []
    lines += [
        "# nThread 1 nGpus %d minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0" % gpus,
        "#",
        "# Using devices",
    ]
    lines += [f"#  Rank {r:2d} Group  0 Pid  12345 on    node01 device {r:2d} [0x{r + 16:02x}] NVIDIA A100-SXM4-40GB" for r in range(gpus)]
    lines += [
        "#",
        "#                                                              out-of-place                       in-place",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)",
    ]
    factor = 2 * (gpus - 1) / gpus
    values = []
    for power in range(3, 31):
        size = 1 << power
        bw = busbw * size / (size + (1 << 22))  # latency-bound at small sizes
        if power >= 28:
            bw = busbw
        algbw = bw / factor
        time_us = size / (algbw * 1e3) if algbw > 0 else 0.0
        values += [bw, bw * 0.999]
        lines.append(
            f"{size:12d}  {size // 4:12d}     float     sum      -1  {time_us:7.2f}  {algbw:6.2f}  {bw:6.2f}      0"
            f"  {time_us:7.2f}  {algbw:6.2f}  {bw * 0.999:6.2f}      0"
        )
    lines += ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {sum(values) / len(values):g} ", "#", ""]
    return "\n".join(lines)


# --- the model file kinds ------------------------------------------------------------------


def test_paper_model_still_reproduces_the_reference_values():
    model = paper_model()
    assert model.kind == "regression"
    for counts, value in [((0, 0, 0), 12.335063), ((2, 0, 0), 58.925036), ((0, 3, 2), 53.608775), ((4, 0, 1), 53.509157)]:
        assert model.predict(counts) == pytest.approx(value, abs=1e-6)
    again = load_model_text(model_to_toml(model), source="roundtrip")
    assert again.terms == model.terms and again.selectors == model.selectors


def test_bottleneck_model_file_predicts_the_slowest_used_class():
    text = """
name = "pcie-levels"
kind = "bottleneck"
[classes]
x1 = ["NV>=1", "NVS"]
x2 = ["PIX", "PXB"]
x3 = ["PHB", "NODE", "SYS"]
[bandwidths]
x1 = 100
x2 = 20.5
x3 = 8
"""
    model = load_model_text(text, source="t.toml")
    assert model.kind == "bottleneck" and model.class_bandwidths == (100.0, 20.5, 8.0)
    assert model.predict((4, 0, 0)) == 100.0
    assert model.predict((3, 1, 0)) == 20.5
    assert model.predict((1, 1, 1)) == 8.0
    assert model.predict((0, 0, 0)) == 0.0
    assert load_model_text(model_to_toml(model), source="again") == model


@pytest.mark.parametrize(
    "text, message",
    [
        ('kind = "cubic"\n[classes]\nx1 = ["PCIE"]\n[terms]\nx1 = 1', "unknown model kind"),
        ('kind = "bottleneck"\n[classes]\nx1 = ["PCIE"]\n', "needs a [bandwidths] table"),
        ('kind = "bottleneck"\n[classes]\nx1 = ["PCIE"]\n[bandwidths]\nx1 = -3', "positive number"),
        ('kind = "bottleneck"\n[classes]\nx1 = ["PCIE"]\n[bandwidths]\nx1 = 3\n[terms]\nx1 = 1', "has no [terms]"),
    ],
)
def test_bad_bottleneck_files_are_rejected(text, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model_text(text, source="bad.toml")


def test_default_model_of_a_graph_uses_its_bandwidths():
    dgx = bottleneck_model(load_topology("dgx1-v100"))
    assert dict(zip((s[0] for s in dgx.selectors), dgx.class_bandwidths)) == {"NV2": 50.0, "NV1": 25.0, "SYS": 4.2}
    pcie = bottleneck_model(graph_of(PCIE))
    levels = dict(zip((s[0] for s in pcie.selectors), pcie.class_bandwidths))
    assert levels["PIX"] > levels["PHB"] > levels["SYS"]
    a100 = bottleneck_model(load_topology("dgx-a100"))
    assert a100.class_bandwidths == (300.0,)


# --- the policies prefer the right GPUs ------------------------------------------------------


def test_default_model_prefers_pix_pairs_over_sys_pairs():
    graph = graph_of(PCIE)
    model = bottleneck_model(graph)
    assert chosen(graph, range(8), 2, model) in ({0, 1}, {2, 3}, {4, 5}, {6, 7})
    assert chosen(graph, [0, 2, 4, 5], 2, model) == {4, 5}
    assert chosen(graph, [0, 2, 4], 2, model) == {0, 2}  # PHB beats SYS
    assert chosen(graph, range(8), 4, model) in ({0, 1, 2, 3}, {4, 5, 6, 7})  # no SYS edge
    # The paper's model counts every PCIe level alike: it cannot tell these pairs apart.
    paper = paper_model()
    assert paper.predict((0, 0, 2)) == paper.predict((0, 0, 2))


def test_default_model_prefers_bridged_nv12_pairs():
    graph = graph_of(BRIDGE)
    model = bottleneck_model(graph)
    assert chosen(graph, range(4), 2, model) in ({0, 1}, {2, 3})
    assert chosen(graph, [1, 2, 3], 2, model) == {2, 3}
    assert chosen(graph, [0, 1, 2], 2, model) == {0, 1}


def _measure(tmp_path: Path, graph, truth, *, max_gpus=None, orders="nccl"):
    """Plan on ``graph`` and write one synthetic nccl-tests file per allocation."""
    plan = make_plan(graph, bottleneck_model(graph), max_gpus=max_gpus, orders=orders)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.as_dict()))
    results = tmp_path / "results"
    results.mkdir()
    for run in plan.runs:
        marker = f"# mapa-calibrate id={run.id} ring={','.join(map(str, run.ring))}"
        (results / run.file).write_text(synthetic_output(truth(run), run.gpus, marker=marker))
    return plan, plan_file, sorted(str(p) for p in results.iterdir())


def _fit_cli(tmp_path, plan_file, files, *extra, capsys=None):
    out = tmp_path / "model.toml"
    assert cli.main(["calibrate", "fit", "--plan", str(plan_file), *files, "--output", str(out), *extra]) == 0
    if capsys is not None and "--json" in extra:
        json.loads(capsys.readouterr().out)  # --json: one document on stdout
    return load_model_text(out.read_text(), source=str(out))


def test_fitted_pcie_levels_model_prefers_pix_pairs(tmp_path, capsys):
    graph = graph_of(PCIE)
    level_bw = {"PIX": 11.0, "PHB": 8.5, "SYS": 5.0}

    def truth(run):  # a slowest-link ring that loses a little per extra GPU
        slowest = min(level_bw[graph.link(run.ring[i], run.ring[(i + 1) % run.gpus]).token] for i in range(run.gpus))
        return slowest * (1 - 0.03 * (run.gpus - 2))

    plan, plan_file, files = _measure(tmp_path, graph, truth)
    model = _fit_cli(tmp_path, plan_file, files)  # the default: a bottleneck model
    assert model.kind == "bottleneck" and model.basis == "fitted" and [s[0] for s in model.selectors] == ["PIX", "PHB", "SYS"]
    assert model.fitted_gpus == (2, 8)
    assert chosen(graph, range(8), 2, model) in ({0, 1}, {2, 3}, {4, 5}, {6, 7})
    assert chosen(graph, [0, 2, 4, 5], 2, model) == {4, 5}
    assert chosen(graph, [0, 2, 4], 2, model) == {0, 2}
    report = capsys.readouterr().out
    assert "RMSE" in report and "leave-one-out" in report and "not fitted through" not in report
    # The paper's 14-term regression on the same monotone truth is not monotone itself: not written.
    out = tmp_path / "regression.toml"
    argv = ["calibrate", "fit", "--plan", str(plan_file), *files, "--kind", "regression", "--output", str(out)]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT and not out.exists()
    assert "is not monotone in link quality" in capsys.readouterr().err
    assert cli.main([*argv, "--allow-non-monotone"]) == 0
    regression = load_model_text(out.read_text(), source=str(out))
    assert regression.kind == "regression" and len(regression.terms) == 14


def test_fitted_model_prefers_bridged_nv12_pairs(tmp_path):
    graph = graph_of(BRIDGE)

    def truth(run):
        tokens = {graph.link(run.ring[i], run.ring[(i + 1) % run.gpus]).token for i in range(run.gpus)}
        return 5.0 if "SYS" in tokens else 240.0

    plan, plan_file, files = _measure(tmp_path, graph, truth)
    model = _fit_cli(tmp_path, plan_file, files, "--terms", "linear")
    assert chosen(graph, range(4), 2, model) in ({0, 1}, {2, 3})
    assert chosen(graph, [1, 2, 3], 2, model) == {2, 3}


# --- fitting -------------------------------------------------------------------------------


def _paper_points(orders="all"):
    model = paper_model()
    plan = make_plan(load_topology("dgx1-v100"), model, max_gpus=5, orders=orders)
    return model, plan


def test_fit_recovers_the_paper_coefficients_without_noise():
    model, plan = _paper_points()
    points = [Measurement(run.counts, model.predict(run.counts), run.id) for run in plan.runs]
    report = fit_model(points, class_names=model.class_names, selectors=model.selectors)
    assert report.rank == 14
    assert [term_text(t) for t in report.model.terms] == [term_text(t) for t in model.terms]
    for fitted, paper in zip(report.model.terms, model.terms):
        assert fitted.coefficient == pytest.approx(paper.coefficient, abs=1e-6)
    assert report.rmse < 1e-9 and report.mae < 1e-9 and report.loo_rmse is not None


def test_fit_recovers_the_paper_coefficients_through_nccl_outputs(tmp_path, capsys):
    model = paper_model()
    graph = load_topology("dgx1-v100")
    plan = make_plan(graph, model, max_gpus=5, orders="all")
    (tmp_path / "plan.json").write_text(json.dumps(plan.as_dict()))
    files = []
    for run in plan.runs:
        path = tmp_path / run.file  # named <id>.txt: matched by name, no marker line
        # busbw printed with 2 decimals, as nccl-tests does: feed the exact value through the Avg line instead
        path.write_text(synthetic_output(round(model.predict(run.counts), 2), run.gpus))
        files.append(str(path))
    fitted = _fit_cli(tmp_path, tmp_path / "plan.json", files, "--json", capsys=capsys)
    for got, paper in zip(fitted.terms, model.terms):
        assert got.coefficient == pytest.approx(paper.coefficient, abs=0.5)  # rounding of the printed table only


def test_reported_errors_with_noise_are_right():
    model, plan = _paper_points()
    rng = np.random.default_rng(8)
    # 5% multiplicative noise: the measured values stay positive, so relative errors are defined
    points = [Measurement(run.counts, model.predict(run.counts) * (1 + rng.normal(0, 0.05)), run.id) for run in plan.runs]
    report = fit_model(points, class_names=model.class_names, selectors=model.selectors)
    y = np.array([p.busbw for p in points])
    pred = np.array([report.model.predict(p.counts) for p in points])
    assert report.predictions == pytest.approx(list(pred))
    assert report.rmse == pytest.approx(float(np.sqrt(np.mean((pred - y) ** 2))))
    assert report.mae == pytest.approx(float(np.mean(np.abs(pred - y))))
    assert report.mean_relative_error == pytest.approx(float(np.mean(np.abs(pred - y) / y)))
    assert report.max_relative_error == pytest.approx(float(np.max(np.abs(pred - y) / y)))
    # Least squares: the fitted residual is at most the noise itself (the true coefficients are one candidate).
    noise = y - np.array([model.predict(p.counts) for p in points])
    assert 0 < report.rmse <= float(np.sqrt(np.mean(noise**2)))
    loo = []
    for i in range(len(points)):
        rest = points[:i] + points[i + 1 :]
        sub = fit_model(rest, class_names=model.class_names, selectors=model.selectors)
        loo.append(sub.model.predict(points[i].counts) - points[i].busbw)
    assert report.loo_rmse == pytest.approx(float(np.sqrt(np.mean(np.square(loo)))))
    assert report.loo_rmse > report.rmse
    assert report.loo_mean_relative_error == pytest.approx(float(np.mean(np.abs(loo) / y)))


def test_underdetermined_fit_warns():
    model, plan = _paper_points()
    points = [Measurement(run.counts, model.predict(run.counts)) for run in plan.runs[:5]]
    report = fit_model(points, class_names=model.class_names, selectors=model.selectors)
    assert any("not determined" in w for w in report.warnings)


def test_monotonicity_warnings():
    model, plan = _paper_points()
    used = [run.counts for run in plan.runs]
    warnings = monotonicity_warnings(model, used)
    assert warnings and "non-monotone" in warnings[0]
    linear = [Measurement(c, 30 * c[0] + 15 * c[1] + 5 * c[2]) for c in used]
    report = fit_model(linear, class_names=model.class_names, selectors=model.selectors, terms="linear", check_counts=used)
    assert not [w for w in report.warnings if "non-monotone" in w]
    assert [t.coefficient for t in report.model.terms] == pytest.approx([30, 15, 5])


def test_term_sets():
    assert [term_text(t) for t in term_set("full", 3)] == [term_text(t) for t in paper_model().terms]
    assert len(term_set("full", 2)) == 6 and len(term_set("full", 5)) == 2 * (5 + 10 + 10)
    assert [term_text(t) for t in term_set("x1, x1*x2, 1/(x2+1)", 2)] == ["x1", "x1*x2", "1/(x2+1)"]
    with pytest.raises(InputError):
        term_set("x3", 2)


# --- nccl-tests output ---------------------------------------------------------------------


def test_parse_real_output_mpi_prefixed_with_info_lines():
    result = parse_nccl_tests((NCCL / "aws-efa-eks-p4d-16gpu-mpi-prefixed.txt").read_text())
    assert len(result.rows) == 28
    assert result.rows[0].size == 8 and result.rows[-1].size == 1 << 30
    assert (result.rows[-1].out_of_place_busbw, result.rows[-1].in_place_busbw) == (32.71, 32.84)
    assert result.avg_busbw == 7.80081
    assert result.bus_bandwidth("peak") == 32.84
    assert result.bus_bandwidth("average", parse_size("512M")) == pytest.approx((31.31 + 32.84) / 2)


def test_parse_real_output_current_layout():
    result = parse_nccl_tests((NCCL / "mscclpp-pr507-nvls-with-root-column.txt").read_text())
    assert [row.size for row in result.rows] == [1024, 2048, 4096, 8192, 16384, 32768]
    assert result.rows[-1].out_of_place_busbw == 7.70 and result.rows[-1].in_place_busbw == 7.76
    assert result.avg_busbw is None
    with pytest.raises(InputError, match="no message size of at least"):
        result.bus_bandwidth("peak", parse_size("1M"))


def test_parse_real_output_oldest_layout_without_header():
    result = parse_nccl_tests((NCCL / "nccl-issue340-2x2080ti-nvlink-bridge-oldest-layout.txt").read_text())
    assert len(result.rows) == 12
    assert result.rows[0].busbw == 2.37 and result.bus_bandwidth() == 21.86
    assert result.avg_busbw == 6.6972


def test_every_kept_output_names_its_source():
    for path in NCCL.iterdir():
        assert path.read_text().startswith("# source: https://"), path


def test_parse_synthetic_output_counts_ranks_and_rejects_empty_input():
    result = parse_nccl_tests(synthetic_output(42.0, 4))
    assert result.ranks == 4 and result.bus_bandwidth() == 42.0
    with pytest.raises(InputError, match="no nccl-tests result rows"):
        parse_nccl_tests("# nThread 1 nGpus 2 minBytes 8\n#\n# Using devices\n", source="empty.txt")
    assert parse_size("1G") == 1 << 30 and parse_size("64K") == 65536 and parse_size("8") == 8
    with pytest.raises(InputError):
        parse_size("lots")


# --- plan and CLI --------------------------------------------------------------------------


def test_plan_counts_distinct_rings_and_script_measures_each(tmp_path, capsys):
    graph = load_topology("dgx1-v100")
    all_orders = make_plan(graph, paper_model(), max_gpus=5, orders="all")
    assert len(all_orders.runs) == 39
    assert (0, 3, 2) in {run.counts for run in all_orders.runs}
    nccl = make_plan(graph, paper_model(), max_gpus=5)
    assert len(nccl.runs) == 26
    for run in nccl.runs:
        assert sum(run.counts) == run.gpus  # a 2-GPU ring counts its link twice
    assert len({run.counts for run in nccl.runs}) == len(nccl.runs)
    script = measurement_script(nccl)
    assert script.count('"$ALL_REDUCE_PERF" -b 8 -e 1G -f 2 -g ') == len(nccl.runs)
    assert 'NCCL_ALGO=Ring CUDA_VISIBLE_DEVICES=0,3 "$ALL_REDUCE_PERF" -b 8 -e 1G -f 2 -g 2 >> "$RESULTS"/ring2-02.txt' in script
    assert len({run.file for run in nccl.runs}) == len(nccl.runs)

    out = tmp_path / "cal"
    assert cli.main(["calibrate", "plan", "--topology", str(PCIE), "--max-gpus", "4", "--output-dir", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["classes"] == {"x1": ["PIX"], "x2": ["PHB"], "x3": ["SYS"]}
    assert load_plan(str(out / "plan.json")).runs[0].counts == (2, 0, 0)
    assert (out / "measure.sh").read_text().startswith("#!/bin/bash")


def test_cli_default_and_errors(tmp_path, capsys):
    assert cli.main(["calibrate", "default", "--topology", str(BRIDGE)]) == 0
    model = load_model_text(capsys.readouterr().out, source="stdout")
    assert model.kind == "bottleneck" and model.class_bandwidths == (300.0, 4.2)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(make_plan(graph_of(BRIDGE), bottleneck_model(graph_of(BRIDGE))).as_dict()))
    stray = tmp_path / "other.txt"
    stray.write_text(synthetic_output(10.0, 2))
    assert cli.main(["calibrate", "fit", "--plan", str(plan_file), str(stray)]) == cli.EXIT_BAD_INPUT
    assert "not in the plan" in capsys.readouterr().err
    wrong_size = tmp_path / "ring2-01.txt"
    wrong_size.write_text(synthetic_output(10.0, 3))
    assert cli.main(["calibrate", "fit", "--plan", str(plan_file), str(wrong_size)]) == cli.EXIT_BAD_INPUT
    assert "ran on 3 GPUs" in capsys.readouterr().err
    assert cli.main(["calibrate", "plan", "--topology", "dgx1-v100", "--max-gpus", "9"]) == cli.EXIT_BAD_INPUT


def test_shipped_generic_bottleneck_model_covers_every_link_and_prefers_fast_pairs():
    path = REPO / "slurm_mapa" / "data" / "models" / "bottleneck-generic.toml"
    model = load_model_text(path.read_text(), source=path.name)
    from slurm_mapa.hardware.presets import PRESETS

    for name in PRESETS:
        graph = load_topology(name)
        for a, b in graph.pairs():
            model.classify(graph.link(a, b))  # no link is left out
    pcie, bridge = graph_of(PCIE), graph_of(BRIDGE)
    assert chosen(pcie, [0, 2, 4, 5], 2, model) == {4, 5}
    assert chosen(pcie, [0, 2, 4], 2, model) == {0, 2}
    assert chosen(bridge, [1, 2, 3], 2, model) == {2, 3}
    assert cli.main(["select", "--topology", str(BRIDGE), "--free", "0,2,3", "--gpus", "2",
                     "--directive", "topology=ring sensitive=yes", "--model", str(path)]) == 0


# --- AMD: rccl-tests output, xGMI plans (issue 16) --------------------------------------------


def test_parse_rccl_tests_output():
    result = parse_nccl_tests((NCCL / "rccl-tests-mi250x-2gcd-in-package.txt").read_text(), source="rccl.txt")
    assert result.ranks == 2 and len(result.rows) == 28
    assert result.rows[-1].size == 1 << 30 and result.bus_bandwidth() == 143.09
    assert result.avg_busbw == pytest.approx(47.13929)


def test_a_file_with_two_runs_is_refused():
    one = (NCCL / "rccl-tests-mi250x-2gcd-in-package.txt").read_text()
    with pytest.raises(InputError, match="a second table starts"):
        parse_nccl_tests(one + one, source="two.txt")
    rows = [line for line in one.splitlines() if line.strip() and not line.startswith(("#", "[", "rccl"))]
    with pytest.raises(InputError, match="after '# Collective test concluded: all_reduce_perf'"):
        parse_nccl_tests(one + rows[-1] + "\n", source="two.txt")
    with pytest.raises(InputError, match="a second table starts"):
        parse_nccl_tests(synthetic_output(10.0, 2) + synthetic_output(12.0, 2), source="two.txt")


def test_default_model_of_an_xgmi_node_reads_back_and_ranks_the_classes(tmp_path):
    from slurm_mapa.calibrate.plan import default_model
    from slurm_mapa.hardware.presets import preset

    graph = preset("mi250x")
    model = default_model(graph)
    assert [s[0] for s in model.selectors] == ["NV4", "NV2", "NV1", "SYS"]
    assert model.class_bandwidths == (200.0, 100.0, 50.0, 25.0)
    for a, b in graph.pairs():
        model.classify(graph.link(a, b))
    again = load_model_text(model_to_toml(model), source="m.toml")
    assert chosen(graph, range(8), 2, again) in ({0, 1}, {2, 3}, {4, 5}, {6, 7})
    assert chosen(graph, [0, 2, 3, 6], 2, again) == {2, 3}
    assert cli.main(["calibrate", "default", "--topology", "mi250x", "--output", str(tmp_path / "m.toml")]) == 0


def test_xgmi_plan_measures_with_rccl_tests_and_fits(tmp_path):
    from slurm_mapa.calibrate.plan import default_model
    from slurm_mapa.hardware.presets import preset

    graph = preset("mi250x")
    plan = make_plan(graph, default_model(graph), max_gpus=3)
    assert plan.vendor == "amd"
    script = measurement_script(plan)
    assert "HIP_VISIBLE_DEVICES=0,1 " in script and "CUDA_VISIBLE_DEVICES" not in script and "rccl-tests" in script
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.as_dict()))
    assert load_plan(str(plan_file)).vendor == "amd"
    bandwidth = {"NV4": 140.0, "NV2": 75.0, "NV1": 38.0, "SYS": 20.0}
    results = tmp_path / "results"
    results.mkdir()
    for run in plan.runs:
        slowest = min(bandwidth[[s[0] for s in plan.selectors][i]] for i, c in enumerate(run.counts) if c)
        (results / run.file).write_text(synthetic_output(slowest * (1 - 0.02 * (run.gpus - 2)), run.gpus))
    model = _fit_cli(tmp_path, plan_file, sorted(str(p) for p in results.iterdir()), "--terms", "linear")
    assert chosen(graph, range(8), 2, model) in ({0, 1}, {2, 3}, {4, 5}, {6, 7})


# --- the bottleneck fit (issue 38): monotone by construction ------------------------------------

CLASSES3 = ("x1", "x2", "x3")
SELECTORS3 = (("NV2",), ("NV1",), ("PCIE",))


def _ring(slowest: int, edges: int, classes: int = 3) -> tuple[int, ...]:
    """A ring of ``edges`` edges whose slowest class is ``slowest`` (one edge of it, the rest of class 0)."""
    counts = [0] * classes
    counts[slowest] += 1
    counts[0] += edges - 1
    return tuple(counts)


def test_a_faster_link_measured_slower_is_reported_and_pooled_not_fitted_through():
    truth = {0: 50.0, 1: 25.0, 2: 12.0}
    points = [Measurement(_ring(c, k), truth[c] * (1 + 0.1 * (k - 2)), f"r{c}-{k}") for c in range(3) for k in (2, 3, 4)]
    bad = Measurement(_ring(0, 3), 20.0, "noisy")  # a double-NVLink ring measured below the single NVLink's 27.5
    points = [p for p in points if p.counts != bad.counts] + [bad]
    report = fit_bottleneck(points, class_names=CLASSES3, selectors=SELECTORS3, name="t")
    model = report.model
    assert model.kind == "bottleneck" and model.fitted_gpus == (2, 4)
    assert any(w.startswith("not fitted through: rings with slowest class x1 at 3 edges measured 20.000") for w in report.warnings)
    at3 = [model.predict(_ring(c, 3)) for c in range(3)]
    assert at3[0] >= at3[1] >= at3[2] and at3[0] == pytest.approx((20.0 + 27.5) / 2)  # pooled with x2
    assert model.predict(_ring(2, 4)) == pytest.approx(12.0 * 1.2)  # untouched elsewhere
    assert model.predict((1, 1, 0)) == model.predict(_ring(1, 2))  # a ring runs at its slowest class
    assert load_model_text(model_to_toml(model), source="t.toml") == model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(2, 8), st.floats(0.5, 500.0)), min_size=1, max_size=30))
def test_every_bottleneck_fit_is_monotone_in_link_quality_at_every_edge_count(rows):
    points = [Measurement(_ring(c, k), v) for c, k, v in rows]
    for c in range(3):  # every class measured at least once (else the fit refuses, tested below)
        points.append(Measurement(_ring(c, 2), 10.0 * (3 - c)))
    report = fit_bottleneck(points, class_names=CLASSES3, selectors=SELECTORS3)
    for k in range(2, 12):
        values = [report.model.predict(_ring(c, k)) for c in range(3)]
        assert values[0] >= values[1] - 1e-9 and values[1] >= values[2] - 1e-9, (k, values)


def test_a_class_no_ring_measured_as_slowest_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="no measured ring has x3 as its slowest link class"):
        fit_bottleneck([Measurement(_ring(0, 2), 50.0), Measurement(_ring(1, 3), 25.0)], class_names=CLASSES3,
                       selectors=SELECTORS3)


def test_terms_belong_to_a_regression(tmp_path, capsys):
    graph = graph_of(PCIE)
    _, plan_file, files = _measure(tmp_path, graph, lambda run: 10.0, max_gpus=3)
    out = tmp_path / "m.toml"
    argv = ["calibrate", "fit", "--plan", str(plan_file), *files, "--output", str(out)]
    assert cli.main([*argv, "--kind", "bottleneck", "--terms", "linear"]) == cli.EXIT_BAD_INPUT and not out.exists()
    assert "--terms are a regression's" in capsys.readouterr().err
    assert cli.main([*argv, "--terms", "linear"]) == 0  # --terms alone: a regression (flat truth: monotone)
    assert load_model_text(out.read_text(), source=str(out)).kind == "regression"
