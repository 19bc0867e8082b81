"""A WAL torn by a crash: what SQLite drops on open, said before it does.

SQLite discards, silently, every WAL frame after the last whole
transaction; scanning the same checksum chain here logs what was dropped.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

log = logging.getLogger("handoff.journal")

WAL_HEADER = struct.Struct(">IIIIIIII")
FRAME_HEADER = struct.Struct(">IIIIII")


def report_torn_tail(path: Path) -> None:
    """Log what SQLite is about to discard from the end of the WAL.

    SQLite drops every WAL frame after the last one that commits a
    transaction and passes its checksum chain (a write torn by a crash); it
    does so silently. Scanning the same chain here says what was dropped. No
    acknowledgement was ever built on it: nothing leaves before its commit.
    """
    wal = path.with_name(path.name + "-wal")
    try:
        data = wal.read_bytes()
    except FileNotFoundError:
        return
    if len(data) < WAL_HEADER.size:
        if data:
            log.error("journal tail torn: a %d-byte WAL header is dropped", len(data))
        return
    magic, _, page_size, _, salt1, salt2, c1, c2 = WAL_HEADER.unpack_from(data)
    if magic not in (0x377F0682, 0x377F0683):
        return
    word = "<" if magic == 0x377F0682 else ">"
    s0, s1 = _checksum(data[:24], word, 0, 0)
    if (s0, s1) != (c1, c2):
        return  # an invalid header: SQLite ignores the whole file (nothing was committed)
    frame = FRAME_HEADER.size + page_size
    offset, committed_end, frames, whole = WAL_HEADER.size, WAL_HEADER.size, 0, 0
    while offset + frame <= len(data):
        _, commit_size, fsalt1, fsalt2, fc1, fc2 = FRAME_HEADER.unpack_from(data, offset)
        if (fsalt1, fsalt2) != (salt1, salt2):
            break  # a frame of an earlier pass over the file: the normal end
        s0, s1 = _checksum(data[offset : offset + 8], word, s0, s1)
        s0, s1 = _checksum(data[offset + FRAME_HEADER.size : offset + frame], word, s0, s1)
        if (s0, s1) != (fc1, fc2):
            break
        frames += 1
        offset += frame
        if commit_size:
            committed_end, whole = offset, frames
    dropped_frames = frames - whole
    # After the chain, frames of this pass (its salts, a bad checksum) are
    # torn; frames of an earlier pass over the file are leftovers.
    end_of_pass = offset
    while end_of_pass + frame <= len(data):
        _, _, fsalt1, fsalt2, _, _ = FRAME_HEADER.unpack_from(data, end_of_pass)
        if (fsalt1, fsalt2) != (salt1, salt2):
            break
        dropped_frames += 1
        end_of_pass += frame
    partial = len(data) - end_of_pass if len(data) - end_of_pass < frame else 0
    if dropped_frames or partial:
        log.error(
            "journal tail torn by a crash: %d WAL frames (%d bytes) after the last whole "
            "transaction%s are dropped; they held calls never acknowledged",
            dropped_frames,
            end_of_pass + partial - committed_end,
            f" and a partial frame of {partial} bytes" if partial else "",
        )


def _checksum(data: bytes, word: str, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum (https://sqlite.org/fileformat.html#checksum_algorithm)."""
    values = struct.unpack(f"{word}{len(data) // 4}I", data)
    for i in range(0, len(values), 2):
        s0 = (s0 + values[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + values[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1
