"""A text data file checked before any rank starts: it exists, can be read, holds some text and is
UTF-8. Streamed in blocks (no whole-file copy in memory), so it is cheap next to the run; what the
formats add (JSON lines, fields) is checked where the file is parsed."""

from __future__ import annotations

import codecs
import os

from galaxy.errors import DataError

BLOCK = 1 << 20


def check_text_file(path: str, what: str) -> None:
    """Raise ``DataError`` naming ``what`` (e.g. "config key 'data' (--data)") unless ``path`` is a
    readable, UTF-8 file holding at least one non-blank character."""
    if not os.path.exists(path):
        raise DataError(f"{what}: file '{path}' does not exist; pass an existing file")
    if not os.path.isfile(path):
        raise DataError(f"{what}: '{path}' is not a file; pass a file, not a directory")
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset, line, text_seen = 0, 1, False
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(BLOCK)
                final = not block
                try:
                    text = decoder.decode(block, final=final)
                except UnicodeDecodeError as e:
                    pending = len(e.object) - len(block)  # bytes of a sequence begun in the block before
                    at = offset - pending + e.start
                    line += e.object[:e.start].count(b"\n")
                    raise DataError(f"{what}: file '{path}' is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset "
                                    f"{at}, line {line}); re-encode it as UTF-8") from None
                line += text.count("\n")
                text_seen = text_seen or not text.isspace() and text != ""
                offset += len(block)
                if final:
                    break
    except OSError as e:
        raise DataError(f"{what}: file '{path}' cannot be read ({e.strerror or e}); check its permissions") from None
    if not text_seen:
        raise DataError(f"{what}: file '{path}' is empty{' (only blank lines)' if offset else ''}; "
                        "add at least one non-blank line")
