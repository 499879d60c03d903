"""Text files a user names on the command line: read as strict UTF-8, refused in one line otherwise.

:func:`read_text` gives the text, or InputError naming the file, what is wrong with it (missing,
unreadable, empty, larger than a limit, a byte that is not UTF-8) and what is accepted, so that
no command shows a UnicodeDecodeError traceback for a binary or mistaken file.
"""

from __future__ import annotations

from .errors import InputError


def decode_utf8(raw: bytes, source: str, accepted: str) -> str:
    """``raw`` as UTF-8 text, or InputError naming ``source``, the first bad byte and what is accepted."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{source}: byte {raw[error.start]:#04x} at offset {error.start} is not UTF-8 text; "
                         f"accepted: {accepted}") from None


def read_text(path: str, *, what: str, accepted: str, max_bytes: int | None = None, allow_empty: bool = False) -> str:
    """The UTF-8 text of the file ``path`` (``what`` says which file it is, e.g. ``model file``).

    InputError, one line with the file and ``accepted``, for a missing or unreadable file, one
    larger than ``max_bytes``, bytes that are not UTF-8, or (unless ``allow_empty``) a file with
    nothing but white space.
    """
    source = f"{what} {path!r}"
    try:
        with open(path, "rb") as handle:
            raw = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
    except OSError as error:
        raise InputError(f"cannot read {source}: {error.strerror or error}; accepted: {accepted}") from None
    if max_bytes is not None and len(raw) > max_bytes:
        raise InputError(f"{source} is larger than {max_bytes} bytes; accepted: {accepted}")
    text = decode_utf8(raw, source, accepted)
    if not allow_empty and not text.strip():
        raise InputError(f"{source} is empty; accepted: {accepted}")
    return text
