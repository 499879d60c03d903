"""The Slurm-text layer on hostile input: command output decoding, bounded parsers, and the
AdminComment shared between an admin's note and MAPA's record (issue 13, points 1, 10 and 12).

Literal inputs first, then property tests. The Runner tests run real tiny scripts; the
job_submit.lua tests run the plugin under Lua 5.1 (skipped with MAPA_SKIP_LUA=1 when it is missing).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
import tracemalloc
from pathlib import Path

import pytest
from repo_paths import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mapa.errors import InputError
from slurm_mapa.replay.jobs import ReadStats
from slurm_mapa.replay.sacct import read_sacct_text
from slurm_mapa.slurm.text.commands import (
    MAX_GPU_INDEX,
    MAX_GPU_LIST_CHARS,
    MAX_OUTPUT_BYTES,
    CommandFailed,
    Runner,
    is_job_id,
    parse_gpu_indices,
    parse_job_ids,
    parse_job_json,
    slurm_gpus_on_only_node,
    timed_out,
)
from slurm_mapa.slurm.text.decision import (
    MAX_ADMIN_COMMENT_CHARS,
    MAX_RECORD_SCAN_CHARS,
    AdminComment,
    Decision,
    find_record,
    parse_decisions,
    read_admin_comment,
    record_directive,
    split_admin_comment,
    with_decision,
)
from slurm_mapa.slurm.text.directive import parse_comment, parse_directive, parse_directive_lines

ROOT = REPO
PLUGIN = ROOT / "slurm_mapa" / "data" / "slurm" / "job_submit.lua"
RING_YES = parse_directive("topology=ring sensitive=yes")


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "cmd.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# --- Runner: any bytes, bounded time and output -----------------------------------------------


def test_runner_decodes_latin1_output_and_the_directive_parser_judges_it(tmp_path):
    latin1 = b"#!/bin/bash\n# Auteur: J\xe9r\xf4me\n#SBATCH --gres=gpu:2\nsrun train\n"
    (tmp_path / "batch").write_bytes(latin1)
    out = Runner(timeout=5)([script(tmp_path, f"cat {tmp_path / 'batch'}\n")])
    assert out == "#!/bin/bash\n# Auteur: J\ufffdr\ufffdme\n#SBATCH --gres=gpu:2\nsrun train\n"
    assert parse_directive_lines(out) is None  # no #MAPA line: the non-ASCII comment is not an error
    (tmp_path / "batch").write_bytes(b"#!/bin/bash\n#MAPA topology=ring # J\xe9r\xf4me\nsrun x\n")
    with pytest.raises(InputError, match=r"character '\\ufffd' at column 24"):
        parse_directive_lines(Runner(timeout=5)([script(tmp_path, f"cat {tmp_path / 'batch'}\n")]))


def test_runner_decodes_stderr_of_a_failing_command(tmp_path):
    with pytest.raises(CommandFailed, match="exited 3: bad J\ufffdr\ufffdme"):
        Runner(timeout=5)([script(tmp_path, "printf 'bad J\\351r\\364me' >&2; exit 3\n")])


def test_runner_keeps_the_old_call_forms_and_feeds_stdin(tmp_path):
    assert Runner(timeout=5)(["/bin/echo", "hi"]) == "hi\n"
    assert Runner()(["/bin/cat"], "x" * 300_000) == "x" * 300_000  # larger than a pipe buffer
    assert Runner(timeout=5)(["/bin/cat"], stdin="é") == "é"


def test_runner_timeout_override_only_lowers_and_kills_what_the_command_started(tmp_path):
    # The backgrounded sleep keeps stdout open: without killing the session, reading would wait 30 s.
    hang = script(tmp_path, "sleep 30 &\necho started\nsleep 30\n")
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="timed out after 0.3 s"):
        Runner(timeout=5)([hang], timeout=0.3)
    assert time.monotonic() - started < 3
    started = time.monotonic()
    with pytest.raises(CommandFailed, match="timed out after 0.3 s") as raised:
        Runner(timeout=0.3)([hang], timeout=60)  # a budget never extends the configured timeout
    assert time.monotonic() - started < 3
    assert timed_out(str(raised.value))  # what mapa doctor tells from a failure (a busy slurmctld, not a wrong name)
    with pytest.raises(CommandFailed) as raised:
        Runner(timeout=5)([script(tmp_path, "echo 'Node dgx9 not found' >&2\nexit 1\n")])
    assert not timed_out(str(raised.value))
    with pytest.raises(CommandFailed, match="no time left"):
        Runner(timeout=5)(["/bin/echo"], timeout=0)
    time.sleep(0.2)
    survivors = subprocess.run(["pgrep", "-f", f"^/bin/sh {hang}"], capture_output=True, text=True).stdout.split()
    assert survivors == []


def test_runner_bounds_output_and_refuses_what_cannot_run(tmp_path):
    with pytest.raises(CommandFailed, match=f"printed more than {MAX_OUTPUT_BYTES} bytes"):
        Runner(timeout=10)([script(tmp_path, f"head -c {MAX_OUTPUT_BYTES + 1} /dev/zero\n")])
    assert len(Runner(timeout=10)([script(tmp_path, f"head -c {MAX_OUTPUT_BYTES} /dev/zero\n")])) == MAX_OUTPUT_BYTES
    with pytest.raises(CommandFailed, match="embedded null byte"):
        Runner()(["/bin/echo", "a\0b"])
    with pytest.raises(CommandFailed, match="cannot run /nonexistent/scontrol"):
        Runner()(["/nonexistent/scontrol"])


# --- bounded parsers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("0-999999999999", "above 1023"),
        ("0-20000000", "above 1023"),
        ("1024", "index 1024 is above 1023"),
        ("5-2", "range '5-2' runs backwards"),
        ("0,2,0", "names GPU 0 twice"),
        ("0-3,2", "names GPU 2 twice"),
        ("0;rm", "bad part '0;rm'"),
        ("\u0663", "bad part"),  # an Arabic-Indic digit: str.isdigit() says yes, Slurm never prints it
        ("0-1023," * 3000, f"at most {MAX_GPU_LIST_CHARS} characters"),
        ("-1", "bad part '-1'"),
    ],
)
def test_gpu_lists_out_of_bounds_are_refused_before_anything_is_built(text, message):
    tracemalloc.start()
    started = time.process_time()
    try:
        with pytest.raises(ValueError, match=message) as caught:
            parse_gpu_indices(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - started < 0.5 and peak < 256 << 10
    assert "accepted: indices 0 to 1023" in str(caught.value)


def test_gpu_lists_in_bounds():
    assert parse_gpu_indices("0-2,5") == (0, 1, 2, 5)
    assert parse_gpu_indices(" 7 , 3-4 ,,") == (7, 3, 4)  # order kept, blanks and empty parts skipped
    assert parse_gpu_indices("") == ()
    assert parse_gpu_indices(f"0-{MAX_GPU_INDEX}") == tuple(range(MAX_GPU_INDEX + 1))
    assert parse_gpu_indices("0007") == (7,)


def test_job_ids_are_whole_strings_of_ascii_digits():
    assert is_job_id("7") and is_job_id("123456789012")
    for bad in ("7\n", "\n7", "7 ", "", "1234567890123", "\u0667", "+7", 7, None):
        assert not is_job_id(bad), bad
    assert parse_job_ids("12\n 13\r\n\n") == {"12", "13"}
    with pytest.raises(CommandFailed, match="'12 13'"):
        parse_job_ids("12 13\n")
    with pytest.raises(CommandFailed, match="characters"):
        parse_job_ids("1\n" * (MAX_OUTPUT_BYTES // 2 + 1))


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"jobs":' * 50_000, "", "null", "[1]", '"jobs"', '{"jobs": 5}', '{"jobs": []}', '{"jobs": [7]}',
     '{"jobs": [{}]', "\ufffd", " " * (MAX_OUTPUT_BYTES + 1)],
)
def test_unreadable_job_json_is_a_command_error(text):
    with pytest.raises(CommandFailed):
        parse_job_json(text)


def test_job_json_with_replaced_bytes_still_reads():
    job = parse_job_json('{"jobs": [{"name": "J\ufffdr\ufffdme", "admin_comment": "mapa:topology=ring"}]}')
    assert job["name"] == "J\ufffdr\ufffdme"


def test_gres_detail_on_hostile_records():
    assert slurm_gpus_on_only_node({"gres_detail": ["gpu:a100:2(IDX:1,0)"]}) == (0, 1)
    for unreadable in ({}, {"gres_detail": None}, {"gres_detail": [7]}, {"gres_detail": [{"x": 1}]},
                       {"gres_detail": ["gpu:1(IDX:0)", "gpu:1(IDX:1)"]}, {"gres_detail": ["gpu:1(IDX:0);x"]},
                       {"gres_detail": ["x" * 100_000]}, []):
        assert slurm_gpus_on_only_node(unreadable) is None, unreadable  # type: ignore[arg-type]
    started = time.process_time()
    for huge in ("gpu:1(IDX:0-999999999999)", "gpu:1(IDX:0-20000000)", ",".join(["gpu:1(IDX:0-1023)"] * 2000)):
        with pytest.raises(ValueError, match="accepted: indices 0 to 1023"):
            slurm_gpus_on_only_node({"gres_detail": [huge]})
    assert time.process_time() - started < 1


def test_directive_lines_with_replacement_and_other_non_ascii_text():
    text = "#!/bin/bash\n# \ufffd\u00e9\u4e2d\U0001f600 \u2028 x\n#SBATCH -J \ufffd\n#MAPA topology=tree\nsrun \ufffd\n#MAPA bad\ufffd"
    assert parse_directive_lines(text) == parse_directive("topology=tree")
    with pytest.raises(InputError, match=r"MAPA: line 2: character '\\ufffd'"):
        parse_directive_lines("#!/bin/sh\n#MAPA topology=\ufffdring\n")
    with pytest.raises(InputError, match="MAPA: line 2: '#mapa' here is not a directive"):
        parse_directive_lines("#!/bin/sh\n#mapa topology=\ufffd\n")
    assert parse_directive_lines("#!/bin/sh\n#MAPA\ufffd topology=ring\n") is None  # not '#MAPA ': a plain comment


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("#MAPmap \t\n\r=:\ufffd\u00e9x1,-")) | st.characters(), max_size=200))
def test_directive_lines_raise_only_input_errors(text):
    try:
        parse_directive_lines(text)
    except InputError as error:
        assert str(error).startswith("MAPA: ")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789,- \t\n\u0663x")), max_size=60))
def test_gpu_lists_raise_only_value_errors(text):
    try:
        gpus = parse_gpu_indices(text)
    except ValueError:
        return
    assert len(set(gpus)) == len(gpus) and all(0 <= g <= MAX_GPU_INDEX for g in gpus)


# --- the AdminComment: the admin's text and MAPA's record -------------------------------------

N1 = Decision("n1", (0, 3), "preserve", 58.9, 100.0, 216.0, free=(0, 1, 2, 3))
N2 = Decision("n2", (4, 7), "preserve", 58.9, 100.0, 216.0)


def test_an_admin_note_without_a_record_is_kept_in_front():
    text = with_decision("checked by ops", RING_YES, N1)
    assert text == "checked by ops mapa:topology=ring sensitive=yes # n1=0,3 policy=preserve free=0,1,2,3 eff=58.900 agg=100.000 pres=216.000"
    assert parse_decisions(text) == {"n1": N1} and record_directive(text) == RING_YES
    assert split_admin_comment(text) == ("checked by ops", text.removeprefix("checked by ops "))


def test_admin_text_before_and_after_the_record_survives_every_rewrite():
    admin = "ticket #42: keep mapa:topology=tree sensitive=no # n1=0,3 policy=greedy # checked by ops"
    text = with_decision(admin, RING_YES, N2)
    assert text == ("ticket #42: keep mapa:topology=ring sensitive=yes # n1=0,3 policy=greedy "
                    "# n2=4,7 policy=preserve eff=58.900 agg=100.000 pres=216.000 # checked by ops")
    again = with_decision(text, RING_YES, N1)  # n1 replaced, n2 kept as written
    parts = read_admin_comment(again)
    assert parts.before == "ticket #42: keep" and parts.after == ("checked by ops",)
    assert parse_decisions(again) == {"n2": N2, "n1": N1}
    assert with_decision(again, RING_YES, N1) == again  # idempotent


def test_words_appended_to_a_replaced_decision_are_kept():
    admin = "mapa:topology=ring sensitive=yes # n1=0 policy=fallback fallback=no-ledger seen-by-bob # n2=5 policy=x 2nd"
    text = with_decision(admin, RING_YES, N1)
    assert text.startswith("mapa:topology=ring sensitive=yes # n2=5 policy=x 2nd # n1=0,3 policy=preserve")
    assert text.endswith("# seen-by-bob")


def test_what_is_not_a_record_or_not_a_decision_stays_the_admins():
    for note in ("MAPA: checked", "see mapa:docs", "mapa:topology=blob", "xmapa:topology=ring", "MAPA:topology=ring extra words"):
        assert find_record(note) is None and record_directive(note) is None and parse_decisions(note) == {}
        text = with_decision(note, RING_YES, N2)
        assert text.startswith(note + " mapa:topology=ring sensitive=yes # n2=4,7")
        assert read_admin_comment(text).before == note
    text = "mapa:topology=ring sensitive=no # ticket=12 # n1=0 # n2=x policy=p # n3=1 policy=greedy"
    parts = read_admin_comment(text)
    assert parts.decisions == ("n3=1 policy=greedy",) and parts.after == ("ticket=12", "n1=0", "n2=x policy=p")
    assert with_decision(text, RING_YES, N2).endswith("# n3=1 policy=greedy # n2=4,7 policy=preserve eff=58.900 agg=100.000 "
                                                      "pres=216.000 # ticket=12 # n1=0 # n2=x policy=p")


def test_the_record_is_the_first_mapa_word_that_parses():
    text = "re MAPA: bug #7 mapa: is fine, mapa:topology=tree sensitive=yes # n1=2 policy=preserve"
    assert split_admin_comment(text)[0] == "re MAPA: bug #7 mapa: is fine,"
    assert record_directive(text) == parse_directive("topology=tree sensitive=yes")
    assert parse_decisions(text)["n1"].gpus == (2,)


def test_old_records_read_as_before():
    assert parse_decisions("mapa: # n1=0,1 policy=preserve")["n1"].gpus == (0, 1)
    old = "mapa:topology=ring sensitive=yes # dgx1=0,3 policy=preserve-ahead free=0,2,3 running=1,4/5,6,7 eff=58.900"
    assert parse_decisions(old) == {
        "dgx1": Decision("dgx1", (0, 3), "preserve-ahead", 58.9, free=(0, 2, 3), running=((1, 4), (5, 6, 7)))
    }
    assert record_directive(old) == RING_YES and split_admin_comment(old) == ("", old)
    assert parse_decisions(old.replace("running=1,4/5,6,7", "running=3-1"))["dgx1"].running == ()
    assert parse_decisions("") == {} and record_directive("") is None and split_admin_comment("  ") == ("", "")


def test_an_isolation_note_is_part_of_the_nodes_decision():
    from slurm_mapa.slurm.text.decision import MAX_WHY_CHARS, why_token

    directive = parse_directive("topology=ring sensitive=yes")
    reason = "cannot set up the devices cgroup /sys/fs/cgroup/devices/mapa/job_12: [Errno 30] Read-only # file system"
    noted = Decision("dgx1", (4, 5), "preserve", 50.0, free=(4, 5, 6), isolation="failed-open", why=reason)
    text = with_decision("ops: ok", directive, noted)
    assert text.endswith("dgx1=4,5 policy=preserve free=4,5,6 eff=50.000 isolation=failed-open why=cannot_set_up_the_devices_"
                         "cgroup_/sys/fs/cgroup/devices/mapa/job_12:_[Errno_30]_Read-only_-_file_system")
    recorded = parse_decisions(text)["dgx1"]
    assert (recorded.isolation, recorded.why) == ("failed-open", why_token(reason)) and recorded.free == (4, 5, 6)
    assert len(why_token("x " * 500)) == MAX_WHY_CHARS
    # Only the known states are read as a note; anything else in that place is ignored.
    assert parse_decisions("mapa: # dgx1=0 policy=preserve isolation=whatever")["dgx1"].isolation == ""


def test_the_record_names_slurms_gpus_and_the_affinity_rule():
    from slurm_mapa.slurm.text.decision import affinity_token, parse_affinity

    text = Decision("dgx1", (0, 3), "preserve", slurm_gpus=(6, 7), affinity=affinity_token("prefer", 0.25)).text()
    assert text == "dgx1=0,3 policy=preserve slurm=6,7 affinity=prefer:0.25"
    recorded = parse_decisions(f"mapa: # {text}")["dgx1"]
    assert (recorded.slurm_gpus, recorded.affinity) == ((6, 7), "prefer:0.25")
    assert affinity_token("strict", 0.25) == "strict" and parse_affinity("strict") == ("strict", 0.0)
    for bad in ("prefer", "prefer:x", "prefer:1.5", "strict:0.1", "ignore", "loose:0.2", ""):
        assert parse_affinity(bad) is None, bad
        assert parse_decisions(f"mapa: # dgx1=0 policy=preserve affinity={bad}")["dgx1"].affinity == ""
    assert parse_decisions("mapa: # dgx1=0 policy=preserve slurm=x,y")["dgx1"].slurm_gpus == ()


def test_the_record_stays_bounded():
    busy = Decision("big", tuple(range(64)), "preserve", free=tuple(range(64)), running=(tuple(range(64, 128)),))
    many, i = "mapa:topology=ring sensitive=yes", 0
    while len(many) + len(busy.text()) < MAX_ADMIN_COMMENT_CHARS:  # room for the compact decision only
        many, i = many + f" # n{i}=0,1,2,3 policy=preserve free=0-7", i + 1
    text = with_decision(many, RING_YES, busy)
    assert len(with_decision(many, RING_YES, Decision("small", (0,), "preserve", free=(0, 1)))) > len(many)
    assert len(text) <= MAX_ADMIN_COMMENT_CHARS and parse_decisions(text)["big"] == Decision("big", tuple(range(64)), "preserve")
    with pytest.raises(ValueError, match=f"accepted: at most {MAX_ADMIN_COMMENT_CHARS}"):
        with_decision("x" * MAX_ADMIN_COMMENT_CHARS, RING_YES, N1)
    for node in ("a b", "a#b", "a=b", ""):
        with pytest.raises(ValueError, match="cannot be recorded"):
            with_decision("", RING_YES, Decision(node, (0,), "preserve"))


def test_reading_a_hostile_admin_comment_stays_fast():
    hostile = ("mapa:" + "x" * 8000 + " ") * 200 + "mapa:topology=ring # n1=0-999999999 policy=p " + "#" * 10_000
    started = time.process_time()
    assert find_record(hostile) is None  # beyond the characters read (MAX_RECORD_SCAN_CHARS)
    assert parse_decisions(hostile) == {} and read_admin_comment(hostile).before == hostile.strip()
    assert time.process_time() - started < 1


# Foreign `mapa:` words in front of the record: an admin's notes, another tool's, a user's rejected directive.
# Each holds one `mapa:` word, none a directive (`mapa:` alone, before a `#` or at the end, would be one: the defaults).
_FOREIGN_WORDS = ["mapa:checked", "MAPA: checked", "Mapa:topology=blob", "mapa:ticket#12", "mapa:see-docs", "mapa:gpus=0 ok",
                  "mapa:topology=ring x"]


def _foreign(count: int) -> str:
    return " ".join(_FOREIGN_WORDS[i % len(_FOREIGN_WORDS)] for i in range(count))


@pytest.mark.parametrize("count", [32, 33, 100])
def test_many_foreign_mapa_words_in_front_do_not_hide_the_record(count):
    foreign = _foreign(count)
    assert find_record(foreign) is None and parse_decisions(foreign) == {}
    text = with_decision(foreign, RING_YES, N1)
    assert text.startswith(foreign + " mapa:topology=ring sensitive=yes # n1=0,3")
    assert find_record(text) == len(foreign) + 1 and read_admin_comment(text).before == foreign
    assert parse_decisions(text) == {"n1": N1} and record_directive(text) == RING_YES
    again = with_decision(text, RING_YES, N2)  # the next node's Prolog (or the journal's flush) finds the record
    assert again == text + " # n2=4,7 policy=preserve eff=58.900 agg=100.000 pres=216.000"
    assert with_decision(again, RING_YES, N2) == again  # already there: written the same
    assert parse_decisions(again) == {"n1": N1, "n2": N2} and split_admin_comment(again)[0] == foreign


def test_ten_thousand_foreign_mapa_words_in_front_do_not_hide_the_record():
    foreign = " ".join(["mapa:", "MAPA:"] * 5000)  # 60,000 characters, within what slurmdbd can store
    record = "mapa:topology=ring sensitive=yes # n1=0,3 policy=preserve free=0,1,2,3 eff=58.900 agg=100.000 pres=216.000 # ok"
    text = f"{foreign} {record}"
    assert len(text) <= MAX_RECORD_SCAN_CHARS
    started = time.process_time()
    assert find_record(text) == len(foreign) + 1
    assert parse_decisions(text) == {"n1": N1} and record_directive(text) == RING_YES
    assert read_admin_comment(text) == AdminComment(foreign, "mapa:topology=ring sensitive=yes", (N1.text(),), ("ok",))
    assert split_admin_comment(text) == (foreign, record)
    assert time.process_time() - started < 1
    mixed = f"{_foreign(4000)} {record}"  # other words, with `#` among them: they end segments too
    assert parse_decisions(mixed) == {"n1": N1} and record_directive(mixed) == RING_YES


def test_the_record_is_looked_for_in_a_bounded_prefix_only():
    record = "mapa:topology=ring sensitive=yes # n1=0,3 policy=preserve"
    assert find_record("x" * (MAX_RECORD_SCAN_CHARS - 1) + " " + record) is None  # starts at MAX_RECORD_SCAN_CHARS
    assert find_record("x" * (MAX_RECORD_SCAN_CHARS - 2) + " " + record) == MAX_RECORD_SCAN_CHARS - 1


@pytest.mark.parametrize("hostile", [
    " ".join(["mapa:"] * 200_000),  # no `#`: one segment, its last word's text far too long to parse
    " ".join(["mapa:x#"] * 200_000),  # a segment per word
    " ".join(["mapa:topology=ring sensitive=yes" + " gpus=2" * 70 + " #"] * 20_000),  # each one parsed, each one too many tokens
    ("mapa:" + "topology=ring " * 580 + "# ") * 200,  # each one 8 Ki characters, parsed up to its length check
    ("mapa:" + "x" * 8000 + "\u00e9 #") * 200,  # each one long, with a character no directive has
])
def test_reading_admin_comments_full_of_mapa_words_stays_fast(hostile):
    # The bounds in this file are CPU time of this process: a quadratic parse still exceeds them by
    # far, and a host loaded by other work (CI runs the cluster tests beside these) does not.
    started = time.process_time()
    assert find_record(hostile) is None and parse_decisions(hostile) == {} and record_directive(hostile) is None
    assert time.process_time() - started < 1


def test_no_directive_holds_a_token_starting_with_mapa():
    """What find_record relies on to parse only the last `mapa:` word before each `#`."""
    for body in ("mapa:topology=ring mapa:", "mapa:topology=ring\tMAPA:topology=ring", "mapa: mapa:gpus=2", "mapa:gpus=2 mapa:=x"):
        with pytest.raises(InputError):
            parse_comment(body)


def _first_record_naively(text: str) -> int | None:
    """find_record without its shortcuts: every `mapa:` word in order, the first whose text parses."""
    for marker in re.finditer(r"(?:^|(?<=[ \t\r\n\f\v]))mapa:", text, re.IGNORECASE):
        end = text.find("#", marker.start())
        try:
            parse_comment(text[marker.start() : end if end >= 0 else len(text)])
        except InputError:
            continue
        return marker.start()
    return None


_RECORD_WORDS = ["mapa:", "MAPA:", "mapa:topology=ring", "mapa:gpus=2", "mapa:topology=blob", "sensitive=yes", "gpus=2", "mapa:x",
                 "#", " # ", " ", "\t", "\n", "n1=0 policy=p", "x", "=", "mapa:topology=ring\tgpus=2", "\u00e9", "mapa:gpus=2 gpus=3"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_RECORD_WORDS) | st.text(max_size=4), max_size=60).map("".join))
def test_find_record_takes_the_first_mapa_word_that_parses(text):
    assert find_record(text) == _first_record_naively(text)


def test_sacct_and_explain_find_the_record_behind_an_admin_note():
    from slurm_mapa.slurm.admin.status import explain_job
    from slurm_mapa.slurm.config import config_from_text

    header = "JobID|JobName|Submit|Start|End|NodeList|AllocTRES|Comment|AdminComment"
    line = ("41|x|2026-11-22T05:40:00|2026-11-22T05:40:01|2026-11-22T05:40:09|dgx1|gres/gpu=2||"
            "ops: checked mapa:topology=tree sensitive=yes # dgx1=0,3 policy=preserve free=0-3,6 # ok")
    stats = ReadStats()
    (job,) = read_sacct_text([header, line], stats)
    assert (job.shape, job.sensitive, job.recorded, job.recorded_free) == ("tree", True, (0, 3), (0, 1, 2, 3, 6))
    (job,) = read_sacct_text([header, line.replace("ops: checked mapa:topology=tree", "mapa:topology=blob")], stats)
    assert job.recorded is None and stats.malformed_total == 1  # an old-style bad record is still reported
    config = config_from_text('[nodes]\n"dgx*" = "dgx1-v100"\n')
    (entry,) = explain_job(config, "ops: checked mapa:topology=ring sensitive=yes # dgx1=0,3 policy=preserve free=0-7")
    assert entry["gpus"] == [0, 3] and entry["alternatives"]
    with pytest.raises(InputError, match="no MAPA decision"):
        explain_job(config, "MAPA: checked by ops")


def test_the_record_names_the_model_and_marks_an_extrapolated_figure():
    marked = Decision("dgx1", (0, 1, 3, 5, 7, 2, 4, 6), "preserve", 182.767, 148.0, 0.0, model="mapa-dgx1-v100", extrapolated=True)
    text = with_decision("", RING_YES, marked)
    assert text.endswith("eff=182.767 agg=148.000 pres=0.000 model=mapa-dgx1-v100 extrapolated=yes")
    assert parse_decisions(text) == {"dgx1": marked}
    within = dataclasses.replace(marked, gpus=(0, 3), effective=58.925, extrapolated=False)
    assert "extrapolated" not in within.text() and parse_decisions(with_decision("", RING_YES, within))["dgx1"] == within
    # A record written before these keys existed parses as before: model unknown, not marked.
    old = "mapa:topology=ring sensitive=yes # dgx1=0,3 policy=preserve free=0-7 eff=58.925 agg=100.000 pres=422.000"
    (decision,) = parse_decisions(old).values()
    assert (decision.model, decision.extrapolated, decision.effective) == ("", False, 58.925)
    # A name that cannot be one token of the record is made one; a forged token is not taken.
    odd = Decision("n1", (0,), "preserve", model="my model #2 " + "x" * 100)
    assert parse_decisions(with_decision("", RING_YES, odd))["n1"].model == "my_model__2_" + "x" * 52
    assert parse_decisions(old + " model=a\u00e9b extrapolated=maybe")["dgx1"].model == ""
    assert parse_decisions(old + " model=a\u00e9b extrapolated=maybe")["dgx1"].extrapolated is False
    # The mark and the name count against the AdminComment's size like every other token.
    busy = Decision("big", tuple(range(64)), "preserve", 1.0, free=tuple(range(64)), running=(tuple(range(64, 128)),),
                    model="m" * 64, extrapolated=True)
    text = with_decision("x" * (MAX_ADMIN_COMMENT_CHARS - 600), RING_YES, busy)
    assert len(text) <= MAX_ADMIN_COMMENT_CHARS
    assert parse_decisions(text)["big"] == dataclasses.replace(busy, free=(), running=())


def test_the_record_says_how_far_a_search_that_ran_out_can_be_from_the_optimum():
    gapped = Decision("torus1", tuple(range(20)), "preserve", None, 400.0, 610.5, model="derived-torus2d-16", gap=57.25)
    text = with_decision("", parse_directive("topology=ring sensitive=no"), gapped)
    assert text.endswith("pres=610.500 model=derived-torus2d-16 gap=57.250")
    assert parse_decisions(text) == {"torus1": gapped}
    proven = dataclasses.replace(gapped, gap=None)
    assert "gap=" not in proven.text() and parse_decisions(with_decision("", RING_YES, proven))["torus1"].gap is None
    assert parse_decisions(text.replace("gap=57.250", "gap=-1"))["torus1"].gap is None  # not a gap
    assert parse_decisions(text.replace("gap=57.250", "gap=x"))["torus1"].gap is None


def test_explain_shows_the_recorded_model_and_mark(capsys):
    from slurm_mapa.slurm.admin.status import explain_job
    from slurm_mapa.slurm.config import config_from_text

    config = config_from_text('[nodes]\n"dgx*" = "dgx1-v100"\n"mi*" = "mi250x"\n')
    record = ("mapa:topology=ring sensitive=yes # dgx1=0,1,3,5,7,2,4,6 policy=preserve free=0-7 eff=182.767 "
              "model=mapa-dgx1-v100 extrapolated=yes # mi1=0,1 policy=preserve free=0-7 eff=235.700 model=derived-mi250x")
    entries = {entry["node"]: entry for entry in explain_job(config, record)}
    assert entries["dgx1"]["extrapolated"] is True and entries["dgx1"]["model"] == "mapa-dgx1-v100"
    assert entries["mi1"]["extrapolated"] is False and entries["mi1"]["alternatives_model"] == "derived-mi250x"
    # mi250x alternatives: 2-GCD rings inside the derived model's range, none marked
    assert entries["mi1"]["alternatives"] and not any(alt["extrapolated"] for alt in entries["mi1"]["alternatives"])
    # an old record (no model=) is priced again by the paper's model, as the hooks then did
    (old,) = explain_job(config, "mapa:topology=ring sensitive=yes # mi1=0,1 policy=preserve free=0-7 eff=58.925")
    assert old["alternatives_model"] == "mapa-paper-dgx1" and old["model"] is None  # (its name since issue 38)
    assert all(alt["extrapolated"] for alt in old["alternatives"])  # xGMI links: outside the paper's links


def test_explain_of_a_preserve_ring_says_when_an_alternative_lost_on_the_ring_rate():
    from slurm_mapa.slurm.admin.status import explain_job
    from slurm_mapa.slurm.config import config_from_text

    config = config_from_text('[nodes]\n"dgx*" = "dgx1-v100"\n')
    record = ("mapa:topology=ring sensitive=yes # dgx1=4,5,6,7 policy=preserve free=0,3-7 eff=38.056 "
              "model=derived-dgx1-v100")
    (entry,) = explain_job(config, record)
    first = entry["alternatives"][0]
    assert first["gpus"] == [0, 3, 7, 4] and first["why_not"].startswith("lower ring rate of the set"), first


def test_explain_text_says_extrapolated(capsys, monkeypatch, tmp_path):
    from slurm_mapa.slurm.admin import status as admin

    record = ("mapa:topology=ring sensitive=yes # dgx1=0,1,3,5,7,2,4,6 policy=preserve free=0-7 eff=182.767 "
              "model=mapa-dgx1-v100 extrapolated=yes # dgx2=0,3 policy=preserve free=0-7 eff=58.925 model=mapa-dgx1-v100")
    monkeypatch.setattr(admin, "Runner", lambda timeout: lambda argv: "{}")
    monkeypatch.setattr(admin, "parse_job_json", lambda text, job: {"admin_comment": record})
    config = tmp_path / "mapa.toml"
    config.write_text('[nodes]\n"dgx*" = "dgx1-v100"\n')
    assert admin.cmd_explain(type("Args", (), {"job": "7", "config": str(config), "json": False})()) == 0
    out = capsys.readouterr().out
    assert ("    predicted effective bandwidth 182.767 GB/s EXTRAPOLATED (outside the model's fitted range) "
            "(ranking model mapa-dgx1-v100; mapa-replay's 'ranked')\n") in out
    # issue 52: named as `mapa select` ('predicted', by the ranking model) and mapa-replay ('ranked') name it
    assert "    predicted effective bandwidth 58.925 GB/s (ranking model mapa-dgx1-v100; mapa-replay's 'ranked')\n" in out


# --- properties --------------------------------------------------------------------------------

_WORDS = ["mapa:", "MAPA:", "mapa:topology=ring", "mapa:topology=blob", "#", " # ", " ", "\t", "\n", "n1=0", "n2=1,2",
          "policy=preserve", "policy=x", "free=0-3", "checked", "ops", "=", "ticket=12", "é", "\ufffd", "sensitive=yes",
          "topology=tree", "x"]
_raw_texts = st.lists(st.sampled_from(_WORDS) | st.text(max_size=6), max_size=14).map("".join)
_segments = st.sampled_from(["n1=0 policy=preserve", "n2=1,2 policy=greedy free=0-3 ok", "checked by ops", "ticket=12", ""]) | _raw_texts
# An admin's text, a record, and segments after it (decisions and the admin's), as well as any mix of words.
admin_texts = _raw_texts | st.builds(
    lambda before, record, segments: " ".join(filter(None, [before, record])) + "".join(f" # {seg}" for seg in segments),
    _raw_texts, st.sampled_from(["mapa:topology=ring sensitive=no", "MAPA:", "mapa:topology=blob", ""]), st.lists(_segments, max_size=4),
)
decisions = st.builds(
    Decision,
    node=st.sampled_from(["n1", "n2", "gpu-07", "dgx1.local"]),
    gpus=st.lists(st.integers(0, 63), min_size=1, max_size=8, unique=True).map(tuple),
    policy=st.sampled_from(["preserve", "greedy", "fallback", "preserve-ahead"]),
    effective=st.none() | st.integers(0, 8000).map(lambda v: v / 8),
    free=st.lists(st.integers(0, 63), max_size=8, unique=True).map(lambda v: tuple(sorted(v))),
    running=st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=3, unique=True).map(tuple), max_size=3).map(tuple),
    model=st.sampled_from(["", "mapa-dgx1-v100", "derived-mi250x", "nccl-tests-hgx-h100", "site_model.v2+a"]),
    extrapolated=st.booleans(),
)
directives = st.sampled_from(["topology=ring sensitive=yes", "", "topology=mesh2d:2x2 gpus=4", "topology=custom edges=0-1"]).map(parse_directive)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(admin_texts, directives, decisions, decisions)
def test_with_decision_never_loses_the_admins_text(admin, directive, decision, other):
    before = read_admin_comment(admin)
    others = {n: d for n, d in parse_decisions(admin).items() if n != decision.node}
    text = with_decision(admin, directive, decision)
    after = read_admin_comment(text)
    assert after.before == before.before
    assert after.after[len(after.after) - len(before.after):] == before.after
    if find_record(admin) is None:
        assert text.startswith(admin.strip())
    assert parse_decisions(text) == {**others, decision.node: decision}
    assert record_directive(text) == directive
    assert with_decision(text, directive, decision) == text
    if other.node != decision.node:  # a second node's Prolog keeps the first one's decision
        assert parse_decisions(with_decision(text, directive, other))[decision.node] == decision


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | admin_texts)
def test_reading_any_admin_comment_never_raises(text):
    parts = read_admin_comment(text)
    assert (parts.directive is None) == (find_record(text) is None) == (record_directive(text) is None)
    parse_decisions(text)
    assert split_admin_comment(text)[0] == parts.before


# --- issue 24: the right record for every array task and het component ------------------------------
def _n(number, is_set=True):
    return {"set": is_set, "infinite": False, "number": number}


# As Slurm 24.11.5 prints them (scontrol --json show job 22 / 20, data_parser v0.0.42, trimmed to the
# fields read): `show job 22` lists every task of array 22, the last started first (its own id is 22);
# `show job 20` both components of het job 20.
ARRAY_22 = {"jobs": [
    {"job_id": 22, "array_job_id": _n(22), "array_task_id": _n(2), "het_job_id": _n(0), "het_job_offset": _n(0), "admin_comment": "c"},
    {"job_id": 25, "array_job_id": _n(22), "array_task_id": _n(1), "het_job_id": _n(0), "het_job_offset": _n(0), "admin_comment": "b"},
    {"job_id": 24, "array_job_id": _n(22), "array_task_id": _n(0), "het_job_id": _n(0), "het_job_offset": _n(0), "admin_comment": "a"},
]}
HET_20 = {"jobs": [
    {"job_id": 20, "array_job_id": _n(0), "array_task_id": _n(0, False), "het_job_id": _n(20), "het_job_offset": _n(0)},
    {"job_id": 21, "array_job_id": _n(0), "array_task_id": _n(0, False), "het_job_id": _n(20), "het_job_offset": _n(1)},
]}


def test_each_array_task_and_het_component_is_read_and_updated_alone():
    """Issue 24: `scontrol update job=22` changes every task of array 22 (task 2's own id is 22),
    and job=20 both components of het job 20; so records are picked by their own id and written
    to ARRAY_TASK or HETJOB+OFFSET."""
    import json

    from slurm_mapa.slurm.text.commands import CommandFailed, admin_comment_argv, parse_job_json, update_target

    for job_id, target, admin in (("22", "22_2", "c"), ("25", "22_1", "b"), ("24", "22_0", "a")):
        record = parse_job_json(json.dumps(ARRAY_22), job_id)
        assert (update_target(record, job_id), record["admin_comment"]) == (target, admin)
    for job_id, target in (("20", "20+0"), ("21", "20+1")):
        assert update_target(parse_job_json(json.dumps(HET_20), job_id), job_id) == target
    plain = {"job_id": 7, "array_job_id": _n(0), "array_task_id": _n(0, False), "het_job_id": _n(0), "het_job_offset": _n(0)}
    assert update_target(plain, "7") == "7"
    assert update_target({"job_id": 7, "array_job_id": 3, "array_task_id": 4}, "7") == "3_4"  # plain numbers (older parsers)
    with pytest.raises(CommandFailed, match="no record of job 99"):
        parse_job_json(json.dumps(ARRAY_22), "99")
    assert admin_comment_argv("scontrol", "22_2", "x") == ["scontrol", "update", "job=22_2", "AdminComment=x"]
    assert admin_comment_argv("scontrol", "20+1", "x")[2] == "job=20+1"
    for bad in ("22_", "20+", "1 2", "../x", "22_2_3"):
        with pytest.raises(ValueError, match="not a job id"):
            admin_comment_argv("scontrol", bad, "x")


def test_the_prolog_of_an_array_task_writes_its_own_record_only(tmp_path):
    """The Prolog of array task 22_2 (own id 22) once wrote `job=22`: every task got its record."""
    import json

    from slurm_mapa.slurm.config import HookConfig
    from slurm_mapa.slurm.hooks.prolog import run_prolog

    config = HookConfig(ledger=tmp_path / "l.json", jobs_dir=tmp_path / "jobs", log=tmp_path / "log", nodes=(("dgx*", "dgx1-v100"),))
    calls = []

    def slurm(argv):
        calls.append(list(argv))
        if argv[1:4] == ["--json", "show", "job"]:
            return json.dumps(ARRAY_22)
        if argv[1] == "update":
            return ""
        if argv[0].endswith("squeue"):  # the in-process Prolog's reconcile pass
            return "22\n25\n24\n"
        raise AssertionError(argv)

    run_prolog({"SLURM_JOB_ID": "22", "SLURMD_NODENAME": "dgx1", "SLURM_JOB_GPUS": "0",
                "SLURM_JOB_COMMENT": "mapa:topology=ring sensitive=no"}, config, slurm, [].append)
    updates = [call for call in calls if call[1] == "update"]
    assert len(updates) == 1 and updates[0][2] == "job=22_2" and "# dgx1=" in updates[0][3]
