"""NVLink facts a GPU listing and a link matrix imply: the generation of a GPU model, the NVLink
ports a GPU of that generation has, and which ``NV<n>`` pairs must go through an NVSwitch.

nvidia-smi prints a pair on an NVSwitch fabric as ``NV<n>`` like a direct link. A GPU whose
``NV`` counts add up to more NVLink ports than it has (:func:`nvlink_ports` of its generation, at
least its largest single bond) must sit on a switch; :func:`classify_switches` turns the pairs of
two such GPUs into ``NVS<n>``.
"""

from __future__ import annotations

import re

from ..core.links import parse_link

# NVLink ports per GPU, by NVLink generation (P100 4, V100 6, A100 12, H100 18, B200 18).
NVLINK_PORTS = {1: 4, 2: 6, 3: 12, 4: 18, 5: 18}
# The generation a reading without a GPU model assumes (its per-link bandwidth, 25 GB/s, is
# that of NVLink 2, 3 and 4 alike).
FALLBACK_GENERATION = 2
# Without a known generation, a GPU with more NVLinks than any GPU has ports is on a switch.
MAX_NVLINK_PORTS = max(NVLINK_PORTS.values())


# Model name words -> NVLink generation, for boards whose links carry the generation's full
# per-link rate. Sources: NVIDIA's data sheets (P100 NVLink 1; V100, Quadro GV100 NVLink 2;
# A100, A800, A30 NVLink 3; H100, H800, H200, H20, GH200 NVLink 4; B100, B200, B300, GB200,
# GB300 NVLink 5: 18 links, 1.8 TB/s per GPU both ways). Bridged workstation boards (A40,
# RTX A6000: 112.5 GB/s both ways over the bridge) are left out: the reading notes the guess instead.
_MODEL_GENERATIONS = (
    ("P100", 1),
    ("V100", 2),
    ("GV100", 2),
    ("A100", 3),
    ("A800", 3),
    ("A30", 3),
    ("H100", 4),
    ("H800", 4),
    ("H200", 4),
    ("H20", 4),
    ("GH200", 4),
    ("B100", 5),
    ("B200", 5),
    ("B300", 5),
    ("GB200", 5),
    ("GB300", 5),
)


def nvlink_ports(generation: int | None) -> int:
    """NVLink ports of one GPU of this generation (the most any GPU has when unknown)."""
    if generation is None:
        return MAX_NVLINK_PORTS
    return NVLINK_PORTS.get(generation, MAX_NVLINK_PORTS)


def nvlink_generation_of(model: str) -> int | None:
    """The NVLink generation of a GPU model name (``Tesla V100-SXM2-32GB`` -> 2), None if unknown."""
    words = re.split(r"[^A-Za-z0-9]+", model.upper())
    for word in words:
        for key, generation in _MODEL_GENERATIONS:
            if word == key or (word.startswith(key) and not word[len(key) :].isalpha()):
                return generation
    return None


def generation_guess_note(models: list[str] | tuple[str, ...] = ()) -> str:
    """What a reading without a known NVLink generation says about its bandwidths."""
    unknown = f" ({', '.join(sorted(set(models)))} is not in the model table)" if models else ""
    return (
        f"NVLink generation unknown{unknown}: read at 25 GB/s per link and direction (NVLink 2-4: V100, "
        f"A100, H100, H200, H20); NVLink 1 (P100) is 20, NVLink 5 (B200, GB200, B300, GB300) 50 - "
        f"save `nvidia-smi -L` with the matrix (or pass it with --gpu-list) to know"
    )


def classify_switches(links: dict[tuple[int, int], str], size: int, ports: int) -> dict[tuple[int, int], str]:
    """Turn ``NV<n>`` pairs between GPUs that have more NVLinks than ports into ``NVS<n>``."""
    totals = [0] * size
    largest = [0] * size
    for (a, b), token in links.items():
        link = parse_link(token)
        if link.is_nvlink:
            for gpu in (a, b):
                totals[gpu] += link.links
                largest[gpu] = max(largest[gpu], link.links)
    # A GPU has at least as many ports as its largest bond (a GPU newer than the table).
    on_switch = [totals[gpu] > max(ports, largest[gpu]) for gpu in range(size)]
    result = {}
    for (a, b), token in links.items():
        link = parse_link(token)
        if link.kind == "nvlink" and on_switch[a] and on_switch[b]:
            result[(a, b)] = f"NVS{link.links}"
        else:
            result[(a, b)] = token
    return result
