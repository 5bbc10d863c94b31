"""How long an audio file plays, read from its own bytes, for a platform whose voice message needs its duration
(WeCom refuses a voice over 60 s; DingTalk's ``sampleAudio`` carries it). None for a format not read here."""
from __future__ import annotations

import struct

AMR_NB_MAGIC = b"#!AMR\n"
#: An AMR-NB frame's size in bytes (its 1-byte header included), by the mode in the header's bits 3-6:
#: 4.75 to 12.2 kbit/s, SID, and the rest (reserved, no data) the header alone (3GPP TS 26.101; ffmpeg's amr.c).
AMR_NB_FRAME_BYTES = (13, 14, 16, 18, 20, 21, 27, 32, 6, 1, 1, 1, 1, 1, 1, 1)
AMR_FRAME_SECS = 0.02


def amr_seconds(data: bytes) -> float | None:
    """How long an AMR-NB file (``#!AMR\\n`` and its frames) plays: 20 ms a frame, each frame's size by the
    mode in its header. None for anything else (AMR-WB, another format)."""
    if not data.startswith(AMR_NB_MAGIC):
        return None
    frames, at = 0, len(AMR_NB_MAGIC)
    while at < len(data):
        at += AMR_NB_FRAME_BYTES[(data[at] >> 3) & 0x0F]
        frames += 1
    return frames * AMR_FRAME_SECS


def wav_seconds(data: bytes) -> float | None:
    """How long a WAV file (RIFF ``WAVE``) plays: its ``data`` chunk's size over the byte rate its ``fmt `` chunk
    names (a ``data`` size left unset by a streaming writer counts as the rest of the file). None for anything
    else, or a WAV without the two."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at, byte_rate = 12, 0
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack_from("<I", data, at + 4)[0]
        body = at + 8
        if chunk == b"fmt " and size >= 16 and body + 16 <= len(data):
            byte_rate = struct.unpack_from("<I", data, body + 8)[0]
        elif chunk == b"data":
            if not byte_rate:
                return None
            size = min(size, len(data) - body)
            return size / byte_rate
        at = body + size + (size & 1)  # chunks are padded to an even size
    return None
