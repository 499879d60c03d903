"""DCGM's HPC job-mapping files (slurm/dcgm.py): their content, the directory writer, and a
round trip through a reader that parses them as dcgm-exporter's hpc.go does."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mapa.slurm.agent import dcgm
from slurm_mapa.slurm import trusted_files as paths
from slurm_mapa.slurm.agent.dcgm import mapping_files, write_mapping

OTHER_UID = 12345
_EXPORTER_NAME = re.compile(r"^\d+(\.\d+)?$")  # validGPUFile in dcgm-exporter's hpc.go


def read_like_exporter(directory: Path) -> dict[str, list[str]]:
    """What dcgm-exporter's getGPUFiles + readFile make of ``directory``: name -> jobs, one per
    line as bufio.Scanner splits them (a final newline ends the last line, no empty token)."""
    jobs = {}
    for entry in os.scandir(directory):
        if entry.is_dir() or not _EXPORTER_NAME.match(entry.name):
            continue
        text = Path(entry.path).read_text()
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        jobs[entry.name] = [line.removesuffix("\r") for line in lines]
    return jobs


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --- mapping_files ------------------------------------------------------------------------------


def test_a_shared_gpu_lists_both_jobs_and_idle_gpus_get_an_empty_file():
    holdings = {"120": (0, 1), "98": (1,), "1000": [3]}
    assert mapping_files(holdings, 4) == {"0": "120\n", "1": "98\n120\n", "2": "", "3": "1000\n"}


def test_gpus_out_of_range_are_ignored():
    assert mapping_files({"7": (1, 2, -1, 8)}, 2) == {"0": "", "1": "7\n"}


def test_anything_but_a_plain_job_id_is_skipped():
    holdings = {"12_3": (0,), "abc": (0,), "": (0,), "5\n6": (0,), " 5": (0,), "1234567890123": (0,), "5": (0,)}
    assert mapping_files(holdings, 1) == {"0": "5\n"}


def test_no_holdings_and_no_gpus():
    assert mapping_files({}, 3) == {"0": "", "1": "", "2": ""}
    assert mapping_files({"5": (0,)}, 0) == {}


def test_jobs_are_sorted_as_numbers_and_a_repeated_gpu_counts_once():
    assert mapping_files({"10": (0, 0), "9": (0,), "100": (0,)}, 1) == {"0": "9\n10\n100\n"}


# --- write_mapping ------------------------------------------------------------------------------


def test_write_creates_the_directory_and_the_files(tmp_path):
    directory = tmp_path / "run" / "dcgm"
    changed = write_mapping(directory, {"0": "5\n", "1": "", "10": "5\n6\n", "2": ""})
    assert changed == ["0", "1", "2", "10"]
    assert _mode(directory) == 0o755
    assert sorted(os.listdir(directory)) == ["0", "1", "10", "2"]  # no temporary file left behind
    assert (directory / "10").read_text() == "5\n6\n" and (directory / "1").read_text() == ""
    assert all(_mode(directory / name) == 0o644 for name in ("0", "1", "2", "10"))


def test_only_changed_files_are_rewritten(tmp_path):
    write_mapping(tmp_path, {"0": "5\n", "1": "", "2": "6\n"})
    inodes = {name: os.lstat(tmp_path / name).st_ino for name in ("0", "1", "2")}
    assert write_mapping(tmp_path, {"0": "5\n", "1": "", "2": "6\n"}) == []
    assert write_mapping(tmp_path, {"0": "5\n", "1": "7\n", "2": "6\n"}) == ["1"]
    assert (tmp_path / "1").read_text() == "7\n"
    assert os.lstat(tmp_path / "0").st_ino == inodes["0"] and os.lstat(tmp_path / "2").st_ino == inodes["2"]
    assert os.lstat(tmp_path / "1").st_ino != inodes["1"]  # replaced, not written in place


def test_a_file_with_the_right_content_but_unreadable_mode_is_rewritten(tmp_path):
    write_mapping(tmp_path, {"0": "5\n"})
    os.chmod(tmp_path / "0", 0o600)
    assert write_mapping(tmp_path, {"0": "5\n"}) == ["0"]
    assert _mode(tmp_path / "0") == 0o644


def test_stale_gpu_files_are_removed_and_foreign_files_left_alone(tmp_path):
    write_mapping(tmp_path, mapping_files({"5": (0, 3)}, 4))
    foreign = ["README", "2.0", ".hidden", "07", "-1", "3.tmp"]
    for name in foreign:
        (tmp_path / name).write_text("x\n")
    (tmp_path / "5").mkdir()  # a directory with a GPU's name: dcgm-exporter skips it, so do we
    assert write_mapping(tmp_path, mapping_files({"5": (0, 3)}, 2)) == ["2", "3"]
    assert sorted(os.listdir(tmp_path)) == sorted(["0", "1", "5", *foreign])
    assert all((tmp_path / name).read_text() == "x\n" for name in foreign)


def test_a_name_that_is_not_a_gpu_index_is_refused_before_anything_is_written(tmp_path):
    for name in ("../x", "07", "2.0", "", "a"):
        with pytest.raises(ValueError, match="not a GPU file name"):
            write_mapping(tmp_path, {"0": "5\n", name: ""})
    assert os.listdir(tmp_path) == []


def test_a_directory_others_can_write_is_refused(tmp_path):
    directory = tmp_path / "dcgm"
    directory.mkdir()
    os.chmod(directory, 0o777)
    with pytest.raises(paths.UnsafePath, match="writable by group or others \\(mode 777\\)"):
        write_mapping(directory, {"0": "5\n"})
    assert os.listdir(directory) == []


def test_a_symlinked_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "dcgm").symlink_to(tmp_path / "real")
    with pytest.raises(paths.UnsafePath, match="is not a real directory"):
        write_mapping(tmp_path / "dcgm", {"0": "5\n"})
    assert os.listdir(tmp_path / "real") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "dcgm"
    directory.mkdir()
    os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.raises(paths.UnsafePath, match=f"belongs to uid {OTHER_UID}; accepted: owned by root"):
        write_mapping(directory, {"0": "5\n"})
    assert os.listdir(directory) == []


# --- round trip ---------------------------------------------------------------------------------

job_ids = st.one_of(st.integers(1, 10**12 - 1).map(str), st.sampled_from(["12_3", "x", "", "5\n6", " 7"]))
holdings_strategy = st.dictionaries(job_ids, st.lists(st.integers(-2, 10), max_size=5), max_size=8)


def _expected(holdings, gpu_count) -> dict[str, set[str]]:
    return {
        str(gpu): {job for job, gpus in holdings.items() if gpu in gpus and re.fullmatch(r"[0-9]{1,12}", job)}
        for gpu in range(gpu_count)
    }


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(holdings_strategy, st.integers(0, 9)), min_size=1, max_size=3))
def test_the_exporter_reads_back_exactly_the_jobs_holding_each_gpu(states):
    with tempfile.TemporaryDirectory() as base:
        directory = Path(base) / "dcgm"
        for holdings, gpu_count in states:  # each write starts from the previous state
            write_mapping(directory, mapping_files(holdings, gpu_count))
            read = read_like_exporter(directory)
            assert {name: set(jobs) for name, jobs in read.items()} == _expected(holdings, gpu_count)
            assert all(job != "" for jobs in read.values() for job in jobs)  # no blank line, no empty hpc_job
            assert all(len(jobs) == len(set(jobs)) for jobs in read.values())


# --- one bad entry, a refused directory, and what is reported (issue #31) ------------------------


def test_a_directory_named_like_a_gpu_does_not_stop_the_other_gpus(tmp_path):
    write_mapping(tmp_path, mapping_files({}, 5))
    os.unlink(tmp_path / "3")
    (tmp_path / "3").mkdir()  # an admin's mistake in root's directory
    (tmp_path / "3" / "keep").write_text("x")
    with pytest.raises(Exception) as caught:
        write_mapping(tmp_path, mapping_files({"7": (1, 3, 4), "8": (0,)}, 5))
    assert read_like_exporter(tmp_path) == {"0": ["8"], "1": ["7"], "2": [], "4": ["7"]}  # written after GPU 3 too
    assert (tmp_path / "3" / "keep").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["0", "1", "2", "3", "4"]
    assert caught.type is dcgm.MappingError and re.fullmatch(r"GPU 3: .*/3 is a directory.*left alone.*", str(caught.value))


def test_update_mapping_reports_each_gpus_problem_and_writes_the_rest(tmp_path):
    for name in ("0", "2"):
        (tmp_path / name).mkdir()
    result = dcgm.update_mapping(tmp_path, mapping_files({"5": (0, 1, 2, 3)}, 4))
    assert result.changed == ("1", "3") and not result.refused
    assert [problem.split(":")[0] for problem in result.problems] == ["GPU 0", "GPU 2"]
    assert result.new == result.problems and result.log_lines() == list(result.problems)
    assert read_like_exporter(tmp_path) == {"1": ["5"], "3": ["5"]}


def test_other_entries_named_like_a_gpu_are_replaced_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("root's file\n")
    directory = tmp_path / "dcgm"
    directory.mkdir()
    os.mkfifo(directory / "0")
    (directory / "1").symlink_to(outside)
    assert write_mapping(directory, mapping_files({"9": (0, 1)}, 2)) == ["0", "1"]
    assert all(stat.S_ISREG(os.lstat(directory / name).st_mode) for name in ("0", "1"))
    assert read_like_exporter(directory) == {"0": ["9"], "1": ["9"]} and outside.read_text() == "root's file\n"


def test_a_gpu_that_cannot_be_written_is_reported_with_the_same_text_each_time(tmp_path, monkeypatch):
    real = paths.replace_file

    def replace_file(target, data, mode=0o644):
        if Path(target).name == "1":  # the error names a fresh temporary file each time...
            raise OSError(28, "No space left on device", f"{target.parent}/.1.{os.urandom(4).hex()}.tmp")
        real(target, data, mode)

    monkeypatch.setattr(paths, "replace_file", replace_file)
    writer = dcgm.MappingWriter()
    first = writer.write(tmp_path, mapping_files({"4": (0, 1, 2)}, 3))
    assert first.changed == ("0", "2") and first.problems == (f"GPU 1: cannot write {tmp_path / '1'}: No space left on device",)
    second = writer.write(tmp_path, mapping_files({"4": (0, 1, 2), "5": (2,)}, 3))
    assert second.problems == first.problems and second.new == () and second.changed == ("2",)  # ...the same problem


def test_a_lasting_gpu_problem_is_reported_once_and_its_end_once(tmp_path):
    writer = dcgm.MappingWriter()
    (tmp_path / "2").mkdir()
    files = mapping_files({"11": (0, 2)}, 3)
    logged = [line for _ in range(60) for line in writer.write(tmp_path, files).log_lines()]  # a minute of the agent's loop
    assert len(logged) == 1 and logged[0].startswith("GPU 2: ")
    (tmp_path / "1").unlink()
    (tmp_path / "1").mkdir()  # a second, different problem: reported, the first one not again
    assert [line.split(":")[0] for line in writer.write(tmp_path, files).log_lines()] == ["GPU 1"]
    os.rmdir(tmp_path / "2")
    result = writer.write(tmp_path, files)
    assert result.changed == ("2",) and result.new == () and result.log_lines() == ["solved: " + logged[0]]
    assert [line.split(":")[0] for line in result.problems] == ["GPU 1"]
    assert writer.write(tmp_path, files).log_lines() == []
    writer.forget()
    assert [line.split(":")[0] for line in writer.write(tmp_path, files).log_lines()] == ["GPU 1"]


def test_a_refused_directory_is_still_refused_but_reported_once_per_distinct_problem(tmp_path):
    directory = tmp_path / "dcgm"
    directory.mkdir()
    os.chmod(directory, 0o777)
    writer = dcgm.MappingWriter()
    files = mapping_files({"5": (0,)}, 2)
    results = [writer.write(directory, files) for _ in range(30)]
    assert all(result.refused and result.changed == () for result in results) and os.listdir(directory) == []
    logged = [line for result in results for line in result.log_lines()]
    assert len(logged) == 1 and "writable by group or others (mode 777)" in logged[0] and "no GPU file written" in logged[0]
    os.chmod(directory, 0o775)  # another problem: reported again, the first one gone
    result = writer.write(directory, files)
    assert [line for line in result.new] and "(mode 775)" in result.new[0] and result.solved == (logged[0],)
    assert writer.write(directory, files).log_lines() == [] and os.listdir(directory) == []
    os.chmod(directory, 0o755)
    result = writer.write(directory, files)
    assert not result.refused and result.changed == ("0", "1") and result.problems == () and len(result.solved) == 1
    assert read_like_exporter(directory) == {"0": ["5"], "1": []}


def test_update_mapping_refuses_a_symlinked_directory_without_raising(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "dcgm").symlink_to(tmp_path / "real")
    result = dcgm.update_mapping(tmp_path / "dcgm", {"0": "5\n"})
    assert result.refused and "is not a real directory" in result.problems[0] and os.listdir(tmp_path / "real") == []
    with pytest.raises(ValueError, match="not a GPU file name"):
        dcgm.update_mapping(tmp_path, {"x": ""})
