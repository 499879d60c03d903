"""What a terminal session adds around a command's output when an admin saves or pastes it.

The readers of saved `nvidia-smi topo -m`, `rocm-smi --showtopo` and `amd-smi topology` texts
accept the command line before the output (in any prompt) themselves; this module handles the
shell's next prompt after it, which a copy from a terminal usually ends with.
"""

from __future__ import annotations

import re

# A shell prompt alone on a line: "$", "#", "%", "root@node:~#", "[user@node ~]$",
# "(base) user@node:~/x$", "user@node ~ %", "PS C:\\Users\\admin>". Nothing may follow the prompt
# character: a line with a command after it is not a bare prompt.
_BARE_PROMPT = re.compile(
    r"^(?:\([\w.-]+\)\s+)?"  # a virtual environment: "(base) "
    r"(?:PS [A-Za-z]:\\[^>]*>"  # PowerShell
    r"|(?:\[[^\]\n]{1,200}\]|[\w.-]+@[\w.-]+(?:[: ][^\s$#%>]*)?(?: [^\s$#%>]+)?)?\s?[$#%>])$"
)


def is_bare_prompt(line: str) -> bool:
    return bool(_BARE_PROMPT.match(line.strip()))


def without_trailing_prompt(text: str) -> str:
    """``text`` without a bare shell prompt as its last non-blank line (line numbers unchanged)."""
    lines = text.splitlines(keepends=True)
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    if last >= 0 and is_bare_prompt(lines[last]):
        return "".join(lines[:last])
    return text
