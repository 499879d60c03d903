"""``mapa topo discover``, ``mapa topo show`` and ``mapa gres-conf``.

:func:`add_commands` adds them to the ``mapa`` CLI's subparsers; each handler is
``(args) -> int``, stored as ``args.func``, prints to stdout and raises InputError on bad input
(the CLI's one error handler reports it). Subprocess and file I/O live here, at the edge;
parsing and formatting are the pure functions of the sibling modules.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

from ..errors import InputError
from ..textfile import read_text
from .gres import PRESET_CPU_LAYOUTS, CpuLayout, gres_conf_text
from .nvidia_smi import parse_discovery
from .nvidia_smi_format import format_topo_matrix
from .load import MAX_TOPOLOGY_FILE_BYTES, load_topology_file
from .presets import PRESETS, preset
from .topofile import Topology, topology_to_dict, topology_to_toml


def add_commands(subparsers: argparse._SubParsersAction, topo_subparsers: argparse._SubParsersAction | None = None) -> None:
    """Add ``topo discover``, ``topo show`` and ``gres-conf`` to the ``mapa`` subparsers.

    When the CLI already has a ``topo`` command, pass its subparsers as ``topo_subparsers``.
    Handlers are stored as both ``args.func`` and ``args.handler``.
    """
    if topo_subparsers is None:
        topo = subparsers.add_parser("topo", help="discover and show GPU server topologies")
        topo_subparsers = topo.add_subparsers(dest="topo_command", metavar="{discover,show}")
        topo_subparsers.required = True
    topo_commands = topo_subparsers

    discover = topo_commands.add_parser(
        "discover",
        help="read this machine's GPU topology and print a topology file",
        description="Read the GPU topology (NVML, nvidia-smi, or a saved `nvidia-smi topo -m` text) and print "
        "a topology file an admin can keep under version control.",
    )
    discover.add_argument("--source", choices=("nvml", "nvidia-smi", "amdsmi", "rocm-smi", "file"), default="nvidia-smi",
                          help="how to read the GPUs: NVML, `nvidia-smi topo -m`, AMD SMI, `rocm-smi`, or a saved text "
                               "(--file) (default nvidia-smi)")
    discover.add_argument(
        "--file",
        help="with --source file: a saved `nvidia-smi topo -m`, `rocm-smi --showtopo --shownodesbw` or "
        "`amd-smi topology` output (the format is detected)",
    )
    discover.add_argument("--gpu-list", help="with --source file: a saved `nvidia-smi -L` output (GPU model, UUIDs)")
    discover.add_argument("--nvidia-smi", default="nvidia-smi", dest="nvidia_smi", help="the nvidia-smi to run")
    discover.add_argument("--rocm-smi", default="rocm-smi", dest="rocm_smi", help="the rocm-smi to run")
    discover.add_argument("--name", help="the topology's name (default: the host name)")
    output = discover.add_mutually_exclusive_group()
    output.add_argument("--toml", action="store_const", const="toml", dest="format", help="TOML (the default)")
    output.add_argument("--json", action="store_const", const="json", dest="format", help="JSON")
    discover.add_argument("-o", "--output", help="write to this file instead of stdout")
    discover.set_defaults(func=cmd_discover, handler=cmd_discover, format="toml")

    show = topo_commands.add_parser(
        "show", help="print a topology: a preset or a topology file", description="Print a topology's link matrix."
    )
    show.add_argument(
        "topology",
        nargs="?",
        help="a preset name, a topology file (.toml) or a saved `nvidia-smi topo -m`, `rocm-smi --showtopo "
        "--shownodesbw` or `amd-smi topology` (detected)",
    )
    show.add_argument("--topology", dest="topology_option", help="the same, as an option")
    show.add_argument("--json", action="store_true", help="JSON: the topology file's fields plus the bandwidth matrix (GB/s)")
    show.add_argument("--nvidia-smi-format", action="store_true", help="print it as `nvidia-smi topo -m` would")
    show.add_argument("--rocm-smi-format", action="store_true",
                      help="print it as `rocm-smi --showtopo --shownodesbw` would (AMD topologies)")
    show.set_defaults(func=cmd_show, handler=cmd_show)

    gres = subparsers.add_parser(
        "gres-conf",
        help="print gres.conf lines for a node",
        description="Print gres.conf for a GPU server: Name=gpu File=/dev/nvidiaN per GPU, Cores= from the CPU "
        "affinity, Links= from the NVLinks. Without --topology, the local GPUs are read with nvidia-smi.",
    )
    gres.add_argument("--topology", help="a preset name, a topology file (.toml) or a saved `nvidia-smi topo -m`")
    gres.add_argument("--nvidia-smi", default="nvidia-smi", dest="nvidia_smi", help="the nvidia-smi to run")
    gres.add_argument("--source", choices=("nvidia-smi", "rocm-smi", "amdsmi"), default="nvidia-smi",
                      help="without --topology: how to read the local GPUs (default nvidia-smi)")
    gres.add_argument("--rocm-smi", default="rocm-smi", dest="rocm_smi", help="the rocm-smi to run")
    gres.add_argument("--node", help="prefix each line with NodeName=NODE")
    gres.add_argument("--type", dest="gres_type", help="Type= for every line (e.g. a100)")
    gres.add_argument("--cores", type=int, help="the node's core count in slurm.conf (Sockets x CoresPerSocket)")
    gres.add_argument("--sockets", type=int, default=None, help="sockets of the node (Cores= cover whole sockets; default 1)")
    gres.add_argument("--threads-per-core", type=int, default=None, help="hardware threads per core (default 1)")
    gres.add_argument(
        "--cpu-numbering",
        choices=("split", "packed"),
        default=None,
        help="split: core c's threads are CPUs c, c+cores, ... (x86); packed: c*threads+t (POWER)",
    )
    gres.add_argument("--no-cores", action="store_true", help="leave Cores= out")
    gres.add_argument("--no-links", action="store_true", help="leave Links= out")
    gres.add_argument(
        "--write-presets",
        metavar="DIR",
        help="write <preset>.toml and <preset>.gres.conf for every preset into DIR instead",
    )
    gres.set_defaults(func=cmd_gres_conf, handler=cmd_gres_conf)


# --- edges: files and nvidia-smi ------------------------------------------------------------


TOPOLOGY_TEXT = ("the saved text output of `nvidia-smi topo -m`, `rocm-smi --showtopo --shownodesbw` or "
                 "`amd-smi topology` (UTF-8)")
GPU_LIST_TEXT = "the saved text output of `nvidia-smi -L` (UTF-8)"


def _read(path: str, what: str = "--file", accepted: str = TOPOLOGY_TEXT) -> str:
    return read_text(path, what=what, accepted=accepted, max_bytes=MAX_TOPOLOGY_FILE_BYTES)


OFFLINE_HINT = "use --source file --file <saved output>"


def _run_nvidia_smi(executable: str, *arguments: str, offline_hint: str = OFFLINE_HINT) -> str:
    try:
        done = subprocess.run([executable, *arguments], capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        raise InputError(f"{executable} not found; install the GPU driver's tools or {offline_hint}") from None
    except subprocess.TimeoutExpired:
        raise InputError(f"`{executable} {' '.join(arguments)}` did not answer within 120 s") from None
    if done.returncode != 0:
        raise InputError(
            f"`{executable} {' '.join(arguments)}` failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def _read_local_cpulist(bdf: str) -> str | None:
    """sysfs ``local_cpulist`` of a PCI device (AMD SMI has no CPU affinity query)."""
    try:
        text = Path(f"/sys/bus/pci/devices/{bdf}/local_cpulist").read_text().strip()
    except OSError:
        return None
    return text or None


def _warn(lines: tuple[str, ...] | list[str], prefix: str = "warning") -> None:
    for line in lines:
        print(f"mapa: {prefix}: {line}", file=sys.stderr)


def discover_topology(source: str, *, name: str, nvidia_smi: str = "nvidia-smi", file: str | None = None,
                      gpu_list: str | None = None, rocm_smi: str = "rocm-smi", offline_hint: str = OFFLINE_HINT) -> Topology:
    """The local GPUs' topology from ``source``; ``offline_hint``: what the calling command offers
    instead when the tool is not installed (its own option for a saved output)."""
    if source == "nvml":
        from .nvml import discover, load_pynvml, nvml_session

        with nvml_session(load_pynvml()) as nvml:
            found = discover(nvml, name=name)
        _warn(found.warnings)
        return found.topology
    if source == "amdsmi":
        from .amd import amdsmi_session, discover as discover_amd, load_amdsmi

        with amdsmi_session(load_amdsmi()) as amdsmi:
            found_amd = discover_amd(amdsmi, name=name, cpulist_of=_read_local_cpulist)
        _warn(found_amd.warnings)
        return found_amd.topology
    if source == "rocm-smi":
        from .rocm_smi import parse_amd_topology

        amd = parse_amd_topology(_run_nvidia_smi(rocm_smi, "--showtopo", "--shownodesbw", offline_hint=offline_hint), name=name)
        _warn(amd.notes, "note")
        return Topology(graph=amd.graph, vendor="amd", notes=amd.notes)
    if source == "file":
        if not file:
            raise InputError("--source file needs --file <saved `nvidia-smi topo -m` or `rocm-smi --showtopo` output>")
        text = _read(file)
        from .rocm_smi import detect_amd_tool, parse_amd_topology

        if detect_amd_tool(text):
            if gpu_list:
                raise InputError("--gpu-list is an `nvidia-smi -L` output; it does not go with a rocm-smi/amd-smi file")
            amd = parse_amd_topology(text, name=name, source=file)
            _warn(amd.notes, "note")
            return Topology(graph=amd.graph, pci_bus_ids=amd.pci_bus_ids, vendor="amd", notes=amd.notes)
        list_text = _read(gpu_list, "--gpu-list", GPU_LIST_TEXT) if gpu_list else None
        try:
            result = parse_discovery(text, list_text, name=name)
        except InputError as error:
            raise InputError(f"{file}: {error}") from None
        from .nvidia_smi import parse_gpu_list

        uuids = tuple(entry.uuid for entry in parse_gpu_list(list_text)) if list_text else None
        _warn(result.notes, "note")
        return Topology(graph=result.graph, uuids=uuids, notes=result.notes)
    topo_text = _run_nvidia_smi(nvidia_smi, "topo", "-m", offline_hint=offline_hint)
    list_text = _run_nvidia_smi(nvidia_smi, "-L", offline_hint=offline_hint)
    result = parse_discovery(topo_text, list_text, name=name)
    from .nvidia_smi import parse_gpu_list

    uuids = tuple(entry.uuid for entry in parse_gpu_list(list_text))
    _warn(result.notes, "note")
    return Topology(graph=result.graph, uuids=uuids, notes=result.notes)


def _emit(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)


# --- handlers --------------------------------------------------------------------------------


def cmd_discover(args: argparse.Namespace) -> int:
    name = args.name or socket.gethostname().split(".")[0] or "node"
    topology = discover_topology(
        args.source, name=name, nvidia_smi=args.nvidia_smi, file=args.file, gpu_list=args.gpu_list,
        rocm_smi=args.rocm_smi,
    )
    if args.format == "json":
        text = json.dumps(topology_to_dict(topology), indent=2) + "\n"
    else:
        text = topology_to_toml(topology, comment=f"Discovered by `mapa topo discover --source {args.source}`.")
    _emit(text, args.output)
    return 0


def show_text(topology: Topology) -> str:
    """A readable view: the link matrix, domains, CPU affinity, the bandwidth of each class
    (fastest first) and the notes on what the source could not say."""
    graph = topology.graph
    width = max(5, *(len(graph.link(a, b).token) + 1 for a, b in graph.pairs())) if graph.size > 1 else 5
    if topology.gpu_vendor == "amd":
        speed = f"xGMI {graph.bandwidths.xgmi_per_link:g} GB/s per link"
    else:
        speed = f"NVLink generation {graph.bandwidths.nvlink_generation}"
        if any("NVLink generation unknown" in note for note in topology.notes):
            speed += " (a guess, see the note)"
    out = [f"{graph.name}: {graph.size} GPUs, {speed}"]
    if graph.description:
        out.append(graph.description)
    out.append("")
    out.append("      " + "".join(f"{'GPU' + str(b):>{width}}" for b in graph.gpus) + "  domain  CPU affinity")
    for a in graph.gpus:
        cells = "".join(f"{('X' if a == b else graph.link(a, b).token):>{width}}" for b in graph.gpus)
        affinity = graph.cpu_affinity[a] if graph.cpu_affinity else "-"
        out.append(f"{'GPU' + str(a):<6}{cells}  {graph.domains[a]:>6}  {affinity}")
    out.append("")
    classes = sorted({graph.link(a, b) for a, b in graph.pairs()}, key=lambda link: (-graph.bandwidths.of(link), link))
    out.append("bandwidth (GB/s): " + ", ".join(f"{link.token} {graph.bandwidths.of(link):g}" for link in classes))
    if len(classes) == 1 and graph.size > 1:
        out.append("every GPU pair has the same link class: MAPA has nothing to choose on this node while all links are up")
    for note in topology.notes:
        out.append(f"note: {note}")
    return "\n".join(out) + "\n"


def cmd_show(args: argparse.Namespace) -> int:
    spec = args.topology_option or args.topology
    if not spec:
        raise InputError(f"mapa topo show needs a preset ({', '.join(PRESETS)}) or a topology file")
    topology = load_topology_file(spec)
    if args.json:
        shown = topology_to_dict(topology) | {"bandwidth_gbps": topology.graph.bandwidth_matrix()}
        sys.stdout.write(json.dumps(shown, indent=2) + "\n")
    elif args.nvidia_smi_format or args.rocm_smi_format:
        amd = topology.gpu_vendor == "amd"
        if args.nvidia_smi_format and amd:
            raise InputError(f"{topology.graph.name} is an AMD (xGMI) topology, which nvidia-smi cannot print; use --rocm-smi-format")
        if args.rocm_smi_format and not amd:
            raise InputError(f"{topology.graph.name} is not an AMD (xGMI) topology; use --nvidia-smi-format")
        if amd:
            from .rocm_smi import format_showtopo

            sys.stdout.write(format_showtopo(topology.graph))
        else:
            sys.stdout.write(format_topo_matrix(topology.graph))
    else:
        sys.stdout.write(show_text(topology))
    return 0


def _layout(args: argparse.Namespace, preset_name: str | None) -> CpuLayout | None:
    if args.no_cores:
        return None
    if args.cores is not None:
        return CpuLayout(
            cores=args.cores,
            threads_per_core=args.threads_per_core or 1,
            numbering=args.cpu_numbering or "split",
            sockets=args.sockets or 1,
        )
    if args.threads_per_core is not None or args.cpu_numbering is not None:
        raise InputError("--threads-per-core and --cpu-numbering need --cores (the node's core count)")
    return PRESET_CPU_LAYOUTS.get(preset_name) if preset_name else None


def write_preset_files(directory: str) -> list[str]:
    """Write ``<preset>.toml`` and ``<preset>.gres.conf`` for every preset; returns the paths."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PRESETS:
        topology = Topology(graph=preset(name))
        toml_path = target / f"{name}.toml"
        toml_path.write_text(
            topology_to_toml(topology, comment=f"Preset {name}, written by `mapa gres-conf --write-presets`.")
        )
        gres_path = target / f"{name}.gres.conf"
        gres_path.write_text(
            gres_conf_text(topology, layout=PRESET_CPU_LAYOUTS.get(name), generated_by=f"mapa gres-conf --topology {name}")
        )
        written += [str(toml_path), str(gres_path)]
    return written


def cmd_gres_conf(args: argparse.Namespace) -> int:
    if args.write_presets:
        for path in write_preset_files(args.write_presets):
            print(path)
        return 0
    if args.topology:
        topology = load_topology_file(args.topology)
        preset_name = args.topology if args.topology in PRESETS else None
        origin = f"mapa gres-conf --topology {args.topology}"
    else:
        name = socket.gethostname().split(".")[0] or "node"
        topology = discover_topology(args.source, name=name, nvidia_smi=args.nvidia_smi, rocm_smi=args.rocm_smi,
                                     offline_hint="use --topology with a preset name, a topology file or a saved `nvidia-smi topo -m` output")
        preset_name = None
        origin = f"mapa gres-conf ({args.source})"
    sys.stdout.write(
        gres_conf_text(
            topology,
            layout=_layout(args, preset_name),
            gres_type=args.gres_type,
            links=not args.no_links,
            node_name=args.node,
            generated_by=origin,
        )
    )
    return 0
