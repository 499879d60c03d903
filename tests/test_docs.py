"""The documentation's commands and examples agree with what the code does (issue 27)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from slurm_mapa.cli import main as mapa_main
from slurm_mapa.hardware.presets import PRESETS
from slurm_mapa.slurm.config import HookConfig
from slurm_mapa.slurm.text.decision import Decision, parse_decisions
from slurm_mapa.slurm.admin.install import needed_hook_timeout
from slurm_mapa.slurm.admin.install import slurm_conf_lines

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _doc(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


# --- item 1: the gres-conf examples run as written --------------------------------------------

def _gres_conf_examples() -> list[tuple[str, str]]:
    found = []
    for name in ("admin.md", "hardware.md"):
        text = " ".join(_doc(name).split())  # examples may wrap
        for command in re.findall(r"`(mapa gres-conf --topology [^`\[\]|]*)`", text):
            found.append((name, command))
    return found


def test_the_docs_have_gres_conf_examples():
    commands = [command for _, command in _gres_conf_examples()]
    assert any("--cores 40 --sockets 2" in c for c in commands)
    assert {name for name, _ in _gres_conf_examples()} == {"admin.md", "hardware.md"}


@pytest.mark.parametrize("doc, command", _gres_conf_examples())
def test_documented_gres_conf_commands_run_and_print_the_documented_line(doc, command, capsys):
    argv = shlex.split(command)[1:]
    assert mapa_main(argv) == 0, f"{doc}: `{command}` fails: {capsys.readouterr().err}"
    out = capsys.readouterr().out
    # the line both docs show for GPU 0 of the DGX-1
    assert "Name=gpu File=/dev/nvidia0 Cores=0-19 Links=-1,1,1,2,2,0,0,0\n" in out


def test_the_dgx1_core_count_alone_is_refused_with_a_hint(capsys):
    """Without --threads-per-core, 40 cores cannot hold the DGX-1's 80 CPUs (what the old example ran into)."""
    assert mapa_main(["gres-conf", "--topology", "dgx1-v100", "--cores", "40", "--sockets", "2"]) == 2
    assert "threads per core" in capsys.readouterr().err


# --- item 2: every preset is named in docs/engine.md ------------------------------------------

def test_engine_md_lists_every_preset():
    text = _doc("engine.md")
    missing = [name for name in PRESETS if f"`{name}`" not in text]
    assert not missing, f"docs/engine.md does not name the presets {missing}"


# --- item 3: the decision record example is what the Prolog writes ---------------------------

def _record_example() -> str:
    text = " ".join(_doc("admin.md").split())
    examples = re.findall(r"`(mapa:topology=[^`]*# dgx1=[^`]*)`", text)
    assert len(examples) == 1, examples
    return examples[0]


def test_admin_md_decision_record_parses_and_has_every_field_the_writer_writes():
    example = _record_example()
    decisions = parse_decisions(example)
    assert list(decisions) == ["dgx1"]
    decision = decisions["dgx1"]
    # What the Prolog's decision (hooks.decide) writes under the default config: Slurm's GPUs and
    # the affinity rule, the free GPUs and the three bandwidths.
    default = HookConfig()
    assert decision.policy == default.policy
    assert decision.affinity == f"prefer:{default.affinity_max_loss:g}" == "prefer:0.1"
    assert decision.free and decision.slurm_gpus and len(decision.slurm_gpus) == len(decision.gpus)
    assert None not in (decision.effective, decision.aggregated, decision.preserved)
    segment = example.split("#", 1)[1].strip()
    keys = [token.partition("=")[0] for token in segment.split()[1:]]
    assert keys == ["policy", "free", "slurm", "affinity", "eff", "agg", "pres", "model"]
    # written back, it is the same text: the example is in the writer's own form
    assert decision.text() == segment


def test_admin_md_decision_record_is_the_decision_made_today():
    from slurm_mapa.core.affinity import cpus_of_slurms_gpus, select_with_affinity
    from slurm_mapa.core.explain import reported_allocation
    from slurm_mapa.hardware.load import model_for_topology
    from slurm_mapa.hardware.presets import preset
    from slurm_mapa.slurm.text.decision import affinity_token
    from slurm_mapa.slurm.text.directive import parse_comment, to_request

    example = _record_example()
    recorded = parse_decisions(example)["dgx1"]
    config = HookConfig()
    graph = preset("dgx1-v100")
    model = model_for_topology(graph)  # the node's default model, as the Prolog's
    request = to_request(parse_comment(example.split("#", 1)[0]), len(recorded.slurm_gpus))
    result, _ = select_with_affinity(
        config.policy, graph, recorded.free, request, cpus_of_slurms_gpus(graph, recorded.slurm_gpus), config.affinity_mode,
        max_loss=config.affinity_max_loss, model=model, configured=config.configured_policies(), running=(),
    )
    p = reported_allocation(graph, request, result, model).placement
    made = Decision("dgx1", p.gpus, config.policy, p.effective_bandwidth, p.aggregated_bandwidth, p.preserved_bandwidth,
                    free=recorded.free, slurm_gpus=recorded.slurm_gpus,
                    affinity=affinity_token(config.affinity_mode, config.affinity_max_loss), model=model.name)
    assert made.text() == example.split("#", 1)[1].strip()


# --- item 4: docs/admin.md section 2 is what `mapa hooks` prints ------------------------------

def _slurm_conf_block() -> str:
    text = _doc("admin.md")
    section = text[text.index("## 2. slurm.conf\n"):]
    block = re.search(r"\n\n((?:    .*\n)+)", section).group(1)
    return "".join(line[4:] + "\n" for line in block.splitlines())


def test_admin_md_slurm_conf_block_is_what_mapa_hooks_prints(tmp_path, capsys):
    block = _slurm_conf_block()
    assert block == slurm_conf_lines("/usr/local/sbin", needed_hook_timeout(HookConfig()))
    for setting in ("JobSubmitPlugins=lua", "PrologFlags=Alloc", "PrologEpilogTimeout=60",
                    "AccountingStorageTRES=gres/gpu", "AccountingStoreFlags=job_comment"):
        assert setting in block
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                      'health = "off"\nisolation = "off"\n')
    sbin = tmp_path / "sbin"
    assert mapa_main(["hooks", str(sbin), "--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert printed.replace(str(sbin.resolve()), "/usr/local/sbin") == block


def test_mapa_hooks_asks_for_the_timeout_a_long_prolog_budget_needs(tmp_path, capsys):
    config = tmp_path / "mapa.toml"
    config.write_text(f'ledger = "{tmp_path}/ledger.json"\njobs_dir = "{tmp_path}/jobs"\nlog = "{tmp_path}/log"\n'
                      'health = "off"\nisolation = "off"\nprolog_budget = 20.0\n')
    assert mapa_main(["hooks", str(tmp_path / "sbin"), "--config", str(config)]) == 0
    needed = needed_hook_timeout(HookConfig(prolog_budget=20.0))
    assert f"PrologEpilogTimeout={needed} " in capsys.readouterr().out


# --- item 7: documented commands use the project's Python -------------------------------------

def test_documented_commands_do_not_run_a_bare_python_against_the_project():
    bare = re.compile(r"(?:^\s+|`)python3? (?!-m venv)(?:-m |-c |benchmarks/|scripts/|tests/)")
    offenders = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if bare.search(line) and "pip download" not in line:
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_users_md_shows_the_sbatch_error_the_validator_prints_now():
    """Issue 52: the plugin names the script line ('line 3:'); docs/users.md's example lacked it.
    The Python validator words its errors as job_submit.lua does (tests/slurm hold them together)."""
    import re as _re

    from slurm_mapa.errors import InputError
    from slurm_mapa.slurm.text.directive import parse_directive_lines

    text = (DOCS / "users.md").read_text()
    script = "#!/bin/bash\n#SBATCH --gres=gpu:4\n#MAPA topology=rnig sensitive=yes\nsrun python train.py\n"
    try:
        parse_directive_lines(script)
    except InputError as error:
        message = str(error)
    else:
        raise AssertionError("the misspelt directive was accepted")
    shown = _re.search(r"sbatch: error: (MAPA: .*unknown topology 'rnig'.*)", text)
    assert shown and shown.group(1) == message, (shown and shown.group(1), message)
