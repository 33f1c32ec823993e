"""Audio for /v1/audio/transcriptions: which files are read, and the transcript in each `response_format`.

The head does not decode audio (the node does, with PyAV): it checks a file's leading bytes against the containers
the node reads, so an unsupported file is a 400 before any node is asked.
"""

from __future__ import annotations

from typing import Any

# What the node reads (nodes.agent.engine.speech.AUDIO_FORMATS), as OpenAI names them.
AUDIO_FORMATS = ("flac", "m4a", "mp3", "mp4", "mpeg", "mpga", "oga", "ogg", "wav", "webm")
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


def audio_format(head: bytes) -> str | None:
    """The container of a file from its first bytes (at least 12), or None when it is none the node reads."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    return None


def transcript_text(segments: list[dict[str, Any]]) -> str:
    return "".join(s["text"] for s in segments).strip()


def verbose(segments: list[dict[str, Any]], *, language: str, duration: float, words: bool) -> dict[str, Any]:
    """OpenAI's verbose_json: the text, language, duration and segments (and words when asked for)."""
    body: dict[str, Any] = {"task": "transcribe", "language": _language_name(language), "duration": duration,
                            "text": transcript_text(segments),
                            "segments": [_segment(i, s) for i, s in enumerate(segments)]}
    if words:
        body["words"] = [w for s in segments for w in s.get("words", [])]
    return body


def _segment(index: int, s: dict[str, Any]) -> dict[str, Any]:
    return {"id": index, "seek": 0, "start": s["start"], "end": s["end"], "text": s["text"],
            "tokens": s.get("tokens", []), "temperature": s.get("temperature", 0.0),
            "avg_logprob": s.get("avg_logprob", 0.0), "compression_ratio": s.get("compression_ratio", 0.0),
            "no_speech_prob": s.get("no_speech_prob", 0.0)}


def subtitles(segments: list[dict[str, Any]], *, vtt: bool) -> str:
    """The segments as SubRip (srt) or WebVTT cues."""
    cues = []
    for index, s in enumerate(segments, 1):
        span = f"{_stamp(s['start'], vtt)} --> {_stamp(s['end'], vtt)}"
        cues.append(f"{span}\n{s['text'].strip()}\n" if vtt else f"{index}\n{span}\n{s['text'].strip()}\n")
    return ("WEBVTT\n\n" if vtt else "") + "\n".join(cues)


def _stamp(seconds: float, vtt: bool) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{'.' if vtt else ','}{millis:03d}"


def _language_name(code: str) -> str:
    return {"en": "english"}.get(code, code)
