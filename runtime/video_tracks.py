"""Counts a video container's tracks from its header boxes (MP4) or elements (WebM), so that a
file of thousands of streams is refused before FFmpeg opens it (which costs ~0.1 ms a stream).

Only the levels down to the tracks are walked; anything malformed is left to the demuxer.
"""

from __future__ import annotations

import struct

MP4_CONTAINERS = (b"moov",)  # the boxes holding `trak` boxes
MP4_TRACK = b"trak"
EBML_SEGMENT, EBML_TRACKS, EBML_TRACK_ENTRY = 0x18538067, 0x1654AE6B, 0xAE
MAX_VINT = 8  # EBML variable-size integers are 1 to 8 bytes long


def mp4_tracks(data: bytes) -> int:
    """`trak` boxes in the `moov` box (ISO/IEC 14496-12 §4.2: 32-bit size, type, 64-bit size when
    the size is 1, to the end when 0)."""
    count = 0
    for kind, start, end in mp4_boxes(data, 0, len(data)):
        if kind in MP4_CONTAINERS:
            count += sum(1 for inner, _, _ in mp4_boxes(data, start, end) if inner == MP4_TRACK)
    return count


def mp4_boxes(data: bytes, at: int, end: int):
    """(type, body start, body end) of each box between `at` and `end`, until one is malformed."""
    while at + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, at)
        header = 8
        if size == 1 and at + 16 <= end:
            size, header = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = end - at
        if size < header or at + size > end:
            return
        yield kind, at + header, at + size
        at += size


def webm_tracks(data: bytes) -> int:
    """TrackEntry elements in the Segment's Tracks elements (Matroska's EBML)."""
    count = 0
    for element, start, end in ebml_elements(data, 0, len(data)):
        if element != EBML_SEGMENT:
            continue
        for inner, inner_start, inner_end in ebml_elements(data, start, end):
            if inner == EBML_TRACKS:
                entries = ebml_elements(data, inner_start, inner_end)
                count += sum(1 for entry, _, _ in entries if entry == EBML_TRACK_ENTRY)
    return count


def ebml_elements(data: bytes, at: int, end: int):
    """(ID, body start, body end) of each element between `at` and `end`; an element of unknown
    size runs to `end`. Stops at the first malformed one."""
    while at < end:
        element = vint(data, at, end, keep_marker=True)
        if element is None:
            return
        element_id, at = element
        size = vint(data, at, end, keep_marker=False)
        if size is None:
            return
        length, at = size
        body_end = end if length is None else at + length
        if body_end > end:
            body_end = end  # a truncated element: its first children may still be whole
        yield element_id, at, body_end
        at = body_end


def vint(data: bytes, at: int, end: int, keep_marker: bool) -> tuple[int | None, int] | None:
    """An EBML variable-size integer at `at`: (value, next position), the value None for the
    reserved all-ones size (unknown); None where it is malformed."""
    if at >= end or data[at] == 0:
        return None
    width = MAX_VINT - data[at].bit_length() + 1
    if at + width > end:
        return None
    value = int.from_bytes(data[at : at + width], "big")
    if keep_marker:
        return value, at + width
    value &= (1 << (7 * width)) - 1
    unknown = value == (1 << (7 * width)) - 1
    return (None if unknown else value), at + width
