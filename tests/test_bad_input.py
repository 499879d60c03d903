"""Bad input through the real command lines (issue 27): one line `<prog>: error: ...` on stderr
that names the file or option and what is accepted, exit status 2, never a traceback, never a
silent zero. Each case runs `mapa` or `mapa-replay` in-process, as the console scripts do."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.cli import main as mapa_main
from slurm_mapa.replay.cli import main as replay_main

DATA = Path(__file__).parent / "data"
NVIDIA_TOPO = DATA / "nvidia-smi" / "dgx1-v100.txt"
ROCM = DATA / "rocm-smi"
SACCT_COMMAND = "sacct --parsable2 -X -a -S YYYY-MM-DD -o JobID,JobName"  # the command of docs/replay.md
RANDOM_BYTES = random.Random(27).randbytes(4096)
LOW_POWER = "WARNING: AMD GPU device(s) is/are in a low-power state. Check power control/runtime_status"


def call(main, argv, capsys):
    """(exit status, stdout, stderr) of one in-process run; SystemExit (argparse) counts as its code."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(main, argv, capsys, *expected: str) -> str:
    """Asserts exit 2 and one error line containing every ``expected`` text; returns the line."""
    code, out, err = call(main, argv, capsys)
    assert code == 2, (code, out[-500:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(("mapa: error: ", "mapa-replay: error: ")), err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


@pytest.fixture
def bad_files(tmp_path):
    files = {"random": tmp_path / "random.bin", "empty": tmp_path / "empty.txt"}
    files["random"].write_bytes(RANDOM_BYTES)
    files["empty"].write_bytes(b"")
    return files


# --- 1. files that are not UTF-8 text, or empty -------------------------------------------------

ACCEPTED_MODEL = "accepted: a UTF-8 TOML model file"
ACCEPTED_TOPOLOGY_TEXT = "accepted: the saved text output of `nvidia-smi topo -m`, `rocm-smi --showtopo"


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_select_model_file(kind, bad_files, capsys):
    path = bad_files[kind]
    problem = "is not UTF-8 text" if kind == "random" else "is empty"
    refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "2", "--model", path], capsys,
            f"model file {str(path)!r}", problem, ACCEPTED_MODEL)


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_calibrate_plan_file(kind, bad_files, capsys):
    path = bad_files[kind]
    problem = "is not UTF-8 text" if kind == "random" else "is empty"
    refused(mapa_main, ["calibrate", "fit", "--plan", path, bad_files["empty"]], capsys,
            f"plan {str(path)!r}", problem, "accepted: the plan.json that `mapa calibrate plan")


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_topo_discover_from_file(kind, bad_files, capsys):
    path = bad_files[kind]
    problem = "is not UTF-8 text" if kind == "random" else "is empty"
    refused(mapa_main, ["topo", "discover", "--source", "file", "--file", path], capsys,
            f"--file {str(path)!r}", problem, ACCEPTED_TOPOLOGY_TEXT)
    refused(mapa_main, ["topo", "discover", "--source", "file", "--file", NVIDIA_TOPO, "--gpu-list", path], capsys,
            f"--gpu-list {str(path)!r}", problem, "accepted: the saved text output of `nvidia-smi -L`")


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_topology_files(kind, bad_files, capsys):
    path = bad_files[kind]
    problem = "is not UTF-8 text" if kind == "random" else "is empty"
    for argv in (["topo", "show", path], ["select", "--topology", path, "--gpus", "2"]):
        refused(mapa_main, argv, capsys, f"topology file {str(path)!r}", problem, "accepted: a preset (dgx1-v100")


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_replay_model_and_config(kind, bad_files, capsys):
    path = bad_files[kind]
    problem = "is not UTF-8 text" if kind == "random" else "is empty"
    refused(replay_main, ["run", "--generate", "paper:5", "--model", path], capsys,
            f"model file {str(path)!r}", problem, ACCEPTED_MODEL)
    if kind == "random":  # an empty config is a valid empty TOML: every default
        refused(replay_main, ["run", "--generate", "paper:5", "--config", path], capsys,
                f"--config {path}", "is not UTF-8", "accepted: a UTF-8 TOML file")


# --- 2. replay logs that hold no job it can read ------------------------------------------------

SACCT_TABLE = """\
JobID           JobName  Partition    Account  AllocCPUS      State ExitCode
------------ ---------- ---------- ---------- ---------- ---------- --------
1001             train2        gpu    physics         16  COMPLETED      0:0
1001.batch        batch               physics         16  COMPLETED      0:0
1002              bench        gpu    physics          8     FAILED      1:0
"""


def _random_lines(path: Path, size: int) -> None:
    rng = random.Random(27)
    with open(path, "w", encoding="utf-8") as handle:
        written = 0
        while written < size:
            line = "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(1, 120))) + "\n"
            handle.write(line)
            written += len(line)


@pytest.mark.parametrize("case, content, reason", [
    ("random", RANDOM_BYTES, "it is not text: byte"),
    ("empty", b"", "is empty"),
    ("sacct-table", SACCT_TABLE.encode(), "it is sacct's default fixed-width table"),
    ("json-object", b"{}\n", 'sacct --json output needs a top-level object with a "jobs" list'),
    ("json-list", b"[1, 2]\n", "malformed record(s)"),
    ("random-lines", None, "malformed record(s)"),
])
def test_replay_log_with_no_readable_job(case, content, reason, tmp_path, capsys):
    path = tmp_path / f"{case}.log"
    if content is None:
        _random_lines(path, 10 << 20)
    else:
        path.write_bytes(content)
    line = refused(replay_main, ["run", path, "--nodes", "1", "--policies", "preserve"], capsys,
                   f"input {str(path)!r}", reason, "accepted: sacct --parsable2 output with its header line",
                   SACCT_COMMAND, "`sacct --json` output")
    assert ("holds no job records mapa-replay can read" in line) != (case == "empty")


def test_replay_sacct_table_given_as_sacct(tmp_path, capsys):
    path = tmp_path / "table.txt"
    path.write_text(SACCT_TABLE)
    refused(replay_main, ["run", path, "--format", "sacct", "--nodes", "1"], capsys,
            "it is sacct's default fixed-width table", "not a sacct --parsable2 header", SACCT_COMMAND)


def test_replay_log_of_cpu_jobs_only_says_so(tmp_path, capsys):
    path = tmp_path / "cpu.sacct"
    path.write_text("JobID|Submit|Start|End|AllocTRES\n"
                    "7|2026-01-01T00:00:00|2026-01-01T00:00:05|2026-01-01T01:00:00|cpu=4,mem=1G,node=1\n")
    refused(replay_main, ["run", path, "--nodes", "1"], capsys, "holds no GPU job to replay",
            "skipped 1 no GPUs", "gres/gpu=N")


def test_replay_stdin_of_random_bytes(monkeypatch, capsys):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(RANDOM_BYTES)))
    refused(replay_main, ["run", "-", "--nodes", "1"], capsys, "input stdin holds no job records")


def test_a_log_with_good_and_bad_rows_still_replays(tmp_path, capsys):
    """Bad rows beside good ones are counted and reported; the replay goes on (exit 0)."""
    path = tmp_path / "mixed.sacct"
    path.write_bytes((DATA / "sacct" / "mixed-p.txt").read_bytes() + RANDOM_BYTES[:500] + b"\ngarbage|line\n")
    code, out, err = call(replay_main, ["run", path, "--topology", "dgx1-v100", "--policies", "preserve"], capsys)
    assert code == 0 and "Traceback" not in err, err
    flat = " ".join(out.split())  # the report folds its lines; the temporary path's length moves the folds
    assert "4 GPU job(s) read" in flat and "malformed:" in flat and "malformed record(s) were skipped" in flat


# --- 3. --generate KIND[:JOBS] ------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["paper:abc", "paper:-5", "paper:", "paper:0", "paper:1.5", "paper:" + "9" * 30,
                                  "paper:\uff11\uff12", "nope:5", ":5"])
def test_generate_spec_is_checked(spec, capsys):
    refused(replay_main, ["run", "--generate", spec], capsys, f"--generate {spec!r}",
            "accepted: KIND or KIND:JOBS, KIND one of paper, amaral, multinode and JOBS a whole number from 1")


def test_generate_spec_accepted_forms(capsys):
    for spec, jobs in (("paper:3", 3), ("amaral:4", 4)):
        code, out, err = call(replay_main, ["run", "--generate", spec, "--policies", "preserve", "--json"], capsys)
        assert code == 0, err
        assert json.loads(out)["read"]["jobs"] == jobs


# --- 4. mapa select --free ----------------------------------------------------------------------

@pytest.mark.parametrize("free, expected", [
    ("0-3,,5", "'0-3,,5' has an empty item (item 2)"),
    (",", "',' has an empty item (item 1)"),
    ("0,1,", "'0,1,' has an empty item (item 3)"),
    ("3-1", "range '3-1' runs backwards"),
    ("-1", "bad part '-1'"),
    ("0-3,-2", "bad part '-2'"),
    ("0,0", "names GPU 0 twice"),
    ("0-3,2", "names GPU 2 twice"),
    ("0,8", "GPU 8 is not on dgx1-v100; accepted: GPUs 0 to 7"),
    ("6-9", "GPU 8 is not on dgx1-v100"),
])
def test_free_list_is_checked(free, expected, capsys):
    refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "2", f"--free={free}"], capsys,
            "--free: ", expected, "accepted")


def test_running_list_is_checked(capsys):
    refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "2", "--free", "0-3", "--running", "4,9"], capsys,
            "--running: GPU 9 is not on dgx1-v100")
    refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "2", "--free", "0-3", "--running", "4,,5"], capsys,
            "--running: '4,,5' has an empty item")


def test_free_list_forms_still_accepted(capsys):
    code, out, err = call(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "2", "--free", " 0, 1 ,2-3", "--json"],
                          capsys)
    assert code == 0 and json.loads(out)["free"] == [0, 1, 2, 3], err


# --- 5. rocm-smi's WARNING lines, before and among its tables ----------------------------------

def _with_warning(name: str, *warnings: str) -> str:
    """A saved rocm-smi text with rocm-smi's warning lines where it prints them: after the command
    line (if the fixture has one), before the first banner."""
    lines = (ROCM / name).read_text().splitlines(True)
    at = next(i for i, line in enumerate(lines) if line.startswith("=") or "rocm-smi" in line and "$" in line)
    if "$" in lines[at]:
        at += 1
    return "".join(lines[:at] + [w + "\n" for w in warnings] + ["\n"] + lines[at:])


@pytest.mark.parametrize("name", ["mi300x-showtopo.txt", "pcie-4gpu-showtopo.txt"])
def test_rocm_smi_low_power_warning_is_skipped(name, tmp_path, capsys):
    from slurm_mapa.hardware.rocm_smi import parse_amd_topology

    text = _with_warning(name, LOW_POWER)
    assert LOW_POWER in text
    plain, warned = parse_amd_topology((ROCM / name).read_text()), parse_amd_topology(text)
    assert warned.graph.bandwidth_matrix() == plain.graph.bandwidth_matrix() and warned.notes == plain.notes
    path = tmp_path / name
    path.write_text(text)
    code, out, err = call(mapa_main, ["topo", "discover", "--source", "file", "--file", path, "--name", "n1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["gpus"] == plain.graph.size
    assert call(mapa_main, ["topo", "show", path], capsys)[0] == 0


def _warned_inside(name: str) -> str:
    """The saved text with rocm-smi's low-power warning where ROCm 7 prints it on an MI300-series node,
    the line right after the 'ROCm System Management Interface' banner, and in the middle: before
    the Hops section and between two rows of the first table."""
    lines = (ROCM / name).read_text().splitlines(True)
    out: list[str] = []
    rows = 0
    for line in lines:
        if "Hops between two GPUs" in line:
            out.append(LOW_POWER + "\n")
        out.append(line)
        if "ROCm System Management Interface" in line:
            out.append(LOW_POWER + "\n")
        elif line.startswith("GPU") and not line.startswith("GPU["):
            rows += 1
            if rows == 2:
                out.append("WARNING: No AMD GPUs specified\n")
    return "".join(out)


@pytest.mark.parametrize("name", ["mi300x-showtopo.txt", "pcie-4gpu-showtopo.txt", "mi250x-showtopo-nodesbw.txt"])
def test_rocm_smi_warnings_after_the_banner_and_between_tables_are_skipped(name, tmp_path, capsys):
    from slurm_mapa.hardware.rocm_smi import parse_amd_topology

    text = _warned_inside(name)
    lines = text.splitlines()
    banner = next(i for i, line in enumerate(lines) if "ROCm System Management Interface" in line)
    assert lines[banner + 1] == LOW_POWER and text.count(LOW_POWER) == 2 and "WARNING: No AMD GPUs specified" in text
    plain, warned = parse_amd_topology((ROCM / name).read_text()), parse_amd_topology(text)
    assert warned.graph.bandwidth_matrix() == plain.graph.bandwidth_matrix()
    assert warned.graph.links == plain.graph.links
    assert (warned.notes, warned.numa_nodes, warned.products) == (plain.notes, plain.numa_nodes, plain.products)
    path = tmp_path / name
    path.write_text(text)
    code, shown, err = call(mapa_main, ["topo", "show", path, "--json"], capsys)
    assert code == 0, err
    code, expected, err = call(mapa_main, ["topo", "show", ROCM / name, "--json"], capsys)
    assert code == 0 and json.loads(shown)["links"] == json.loads(expected)["links"], err


def test_rocm_smi_warning_lines_do_not_make_other_text_a_topology(tmp_path, capsys):
    path = tmp_path / "warnings.txt"
    path.write_text(f"WARNING: No AMD GPUs specified\n{LOW_POWER}\n\nnot a topology\n")
    refused(mapa_main, ["topo", "discover", "--source", "file", "--file", path], capsys, str(path), "expected")
    # Only a line that starts with WARNING: is skipped: other text where rocm-smi puts its warning is refused.
    lines = (ROCM / "mi300x-showtopo.txt").read_text().splitlines(True)
    at = next(i for i, line in enumerate(lines) if "ROCm System Management Interface" in line) + 1
    for odd in ("Warning: AMD GPU device(s) is/are in a low-power state", "NOTE: " + LOW_POWER):
        path.write_text("".join(lines[:at] + [odd + "\n"] + lines[at:]))
        refused(mapa_main, ["topo", "discover", "--source", "file", "--file", path], capsys,
                f"rocm-smi, line {at + 1}: {odd!r}")


# --- any bytes as a file argument: exit 0 or 2, never a traceback -------------------------------

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _fuzz(main, argv_of, data: bytes, tmp_path, capsys) -> None:
    path = tmp_path / "fuzz.bin"
    path.write_bytes(data)
    code, out, err = call(main, argv_of(path), capsys)
    assert code in (0, 2), (code, err[-2000:])
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1


@FUZZ
@given(data=st.binary(max_size=2000) | st.text(max_size=500).map(lambda t: t.encode()))
def test_any_bytes_as_select_model(data, tmp_path, capsys):
    _fuzz(mapa_main, lambda p: ["select", "--topology", "dgx1-v100", "--gpus", "2", "--model", p], data, tmp_path, capsys)


@FUZZ
@given(data=st.binary(max_size=2000) | st.text(max_size=500).map(lambda t: t.encode()))
def test_any_bytes_as_replay_log(data, tmp_path, capsys):
    _fuzz(replay_main, lambda p: ["run", p, "--nodes", "1", "--policies", "preserve"], data, tmp_path, capsys)


@FUZZ
@given(data=st.binary(max_size=2000) | st.text(max_size=500).map(lambda t: t.encode())
       | st.sampled_from([LOW_POWER, "WARNING: x"]).map(lambda w: (w + "\n\n").encode()
                                                          + (ROCM / "mi300x-showtopo.txt").read_bytes()[:400]))
def test_any_bytes_as_topology_file(data, tmp_path, capsys):
    _fuzz(mapa_main, lambda p: ["topo", "discover", "--source", "file", "--file", p], data, tmp_path, capsys)


PROMPTS = ["$", "root@node:~#", "[admin@node ~]$", "(base) admin@node:~/topo$", "PS C:\\Users\\admin>"]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("saved", ["nvidia-smi/dgx1-v100.txt", "nvidia-smi/prompt-rhel-hgx-h100.txt", "rocm-smi/mi300x-showtopo.txt",
                                   "rocm-smi/mi250x-amd-smi-topology.txt", "rocm-smi/mi250x-showtopo-nodesbw.txt"])
def test_a_paste_that_ends_with_the_shells_next_prompt_reads_as_without_it(saved, prompt, tmp_path, capsys):
    original = (DATA / saved).read_text()
    path = tmp_path / "pasted.txt"
    path.write_text(original.rstrip("\n") + "\n" + prompt + " \n\n")
    code, pasted, err = call(mapa_main, ["topo", "show", path, "--json"], capsys)
    assert code == 0, err
    code, plain, err = call(mapa_main, ["topo", "show", DATA / saved, "--json"], capsys)
    assert code == 0 and json.loads(pasted)["links"] == json.loads(plain)["links"], err


@pytest.mark.parametrize("line", ["root@node:~# ls", "GPU9 X", "$ echo done"])
def test_text_after_the_table_that_is_not_a_bare_prompt_is_still_refused(line, tmp_path, capsys):
    for saved in ("nvidia-smi/dgx1-v100.txt", "rocm-smi/mi300x-showtopo.txt"):
        path = tmp_path / "pasted.txt"
        path.write_text((DATA / saved).read_text().rstrip("\n") + "\n" + line + "\n")
        refused(mapa_main, ["topo", "show", path], capsys, line.split()[0])


def test_amd_smi_warnings_before_its_tables_are_skipped(tmp_path, capsys):
    saved = (ROCM / "mi250x-amd-smi-topology.txt").read_text()
    path = tmp_path / "warned.txt"
    path.write_text("WARNING: User is missing the following required groups: render, video. Please add user to these groups.\n"
                    + saved)
    code, warned, err = call(mapa_main, ["topo", "show", path, "--json"], capsys)
    assert code == 0, err
    code, plain, err = call(mapa_main, ["topo", "show", ROCM / "mi250x-amd-smi-topology.txt", "--json"], capsys)
    assert json.loads(warned)["links"] == json.loads(plain)["links"]


# --- issue 52: one dialect -------------------------------------------------------------------


def test_a_gpu_count_outside_the_server_gets_one_message_whatever_its_size(capsys):
    """--gpus 9 and --gpus 99 on an 8-GPU server: the same message (99 met the pattern limit first,
    with a doubled 'mapa: error: MAPA:' prefix); 0 too."""
    for count in (9, 99, 0):
        line = refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", count], capsys,
                       f"{count} GPUs asked of dgx1-v100, which has 8; accepted: 1 to 8")
        assert "MAPA:" not in line


def test_a_gpu_count_that_is_no_number_is_one_line_not_the_usage(capsys):
    refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "1e3"], capsys,
            "argument --gpus: '1e3' is not a whole number; accepted: a whole number, e.g. 4", "mapa select --help")
    refused(replay_main, ["run", "--generate", "paper:10", "--seed", "x"], capsys, "'x' is not a whole number")


def test_no_command_prints_a_doubled_prefix(capsys):
    """A directive's own 'MAPA: ' prefix (what sbatch users read) is dropped after 'mapa: error: '."""
    line = refused(mapa_main, ["select", "--topology", "dgx1-v100", "--gpus", "2", "--directive", "topology=bogus"],
                   capsys, "unknown topology 'bogus'")
    assert line.startswith("mapa: error: ") and "MAPA:" not in line


def test_an_unknown_topology_reads_alike_in_mapa_and_mapa_replay(capsys):
    mapa = refused(mapa_main, ["select", "--topology", "dgx1-v10", "--gpus", "2"], capsys)
    replay = refused(replay_main, ["run", "--generate", "paper:10", "--topology", "dgx1-v10"], capsys)
    assert mapa.removeprefix("mapa: error: ") == replay.removeprefix("mapa-replay: error: ")
    assert "(did you mean 'dgx1-v100'?) is neither a preset (dgx1-v100, " in mapa


def test_a_missing_mapa_toml_reads_alike_in_hooks_and_status(capsys, tmp_path):
    from slurm_mapa.slurm.config import missing_config

    missing = tmp_path / "mapa.toml"
    expected = "mapa: error: " + missing_config(missing)
    assert refused(mapa_main, ["hooks", "--config", missing, "--node", "n1", "--cc", "none", tmp_path / "out"], capsys) == expected
    assert refused(mapa_main, ["status", "--config", missing, "n1"], capsys) == expected


def test_mapa_agent_has_a_version_and_one_line_errors(capsys):
    from slurm_mapa import version_text
    from slurm_mapa.slurm.agent.service import main as agent_main

    code, out, _ = call(agent_main, ["--version"], capsys)
    assert code == 0 and out == version_text("mapa-agent") + "\n"
    code, _, err = call(agent_main, ["--bogus"], capsys)
    assert code == 2 and err.strip().splitlines() == ["mapa-agent: error: unrecognized arguments: --bogus "
                                                      "(`mapa-agent --help` lists the options)"]


def test_a_truncated_topo_matrix_is_blamed_on_the_missing_rows(capsys, tmp_path):
    """The header named GPU2, whose row was cut off: the error blamed the header line."""
    path = tmp_path / "topo.txt"
    path.write_text("\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV1\tNV1\t0-19\nGPU1\tNV1\t X \tNV1\t0-19\n")
    line = refused(mapa_main, ["select", "--topology", path, "--gpus", "2"], capsys,
                   "the header names 3 devices but the matrix has rows only for GPU0 GPU1; the rows of GPU2 are missing")
    assert "header does not" not in line and "unexpected" not in line
