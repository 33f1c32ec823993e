"""/v1/audio/transcriptions: OpenAI's shape, served by nodes started with `node_join --transcribe`.

The head keeps the uploaded file in its blobs by sha256 (nodes.registry.media_put) and sends the node the hash and a
grant, never the bytes: a node fetches a blob it lacks once and keeps it (nodes.agent.media). The transcription is
a generation like any other for placement, failover and the durable record: the node streams one token batch per
segment, which becomes a `transcript.text.delta` event with `stream=true`.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from api.audio import AUDIO_FORMATS, RESPONSE_FORMATS, audio_format, subtitles, verbose
from api.errors import OpenAIError, invalid
from api.generation import Run
from api.specs import GenerationRequest, model_name
from api.sse import OpenAIChunks, first_event, sse_response
from fleet.dispatch import Tokens
from fleet.links import registry
from nodes.link.spec import GenerateSpec
from nodes.registry import media_put, media_ref

UNLIMITED_TOKENS = 1 << 30  # a transcription ends with its audio, never by a token count


@dataclass
class Transcript:
    """What a finished transcription answers with."""

    text: str  # what the node streamed, whole
    segments: list[dict[str, Any]]
    duration: float
    language: str

    def usage(self) -> dict[str, Any]:
        return {"type": "duration", "seconds": math.ceil(self.duration)}


def _file(request: HttpRequest):
    if not (request.content_type or "").startswith("multipart/form-data"):
        raise OpenAIError(415, "Send the audio as multipart/form-data with a `file` part (and `model`).",
                          code="unsupported_media_type")
    upload = request.FILES.get("file")
    if upload is None:
        raise invalid("You must send the audio in a `file` part.", param="file")
    if upload.size > settings.FLEET_MAX_AUDIO_BYTES:
        raise OpenAIError(413, f"The audio file has {upload.size} bytes; this head takes at most "
                          f"{settings.FLEET_MAX_AUDIO_BYTES} (FLEET_MAX_AUDIO_BYTES).", code="file_too_large",
                          param="file")
    head = upload.read(16)
    upload.seek(0)
    if audio_format(head) is None:
        raise invalid(f"The file {upload.name!r} is no audio this fleet reads; send one of: "
                      f"{', '.join(AUDIO_FORMATS)}.", param="file", code="unsupported_audio_format")
    return upload


def _options(form) -> dict[str, Any]:
    model = model_name(form.get("model"), "a speech model")
    response_format = form.get("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise invalid(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}.", param="response_format")
    granularities = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
    if any(g not in ("word", "segment") for g in granularities):
        raise invalid('timestamp_granularities may hold "word" and "segment".', param="timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise invalid("timestamp_granularities needs response_format verbose_json.", param="timestamp_granularities")
    try:
        temperature = float(form.get("temperature") or 0)
    except ValueError:
        raise invalid("temperature must be a number from 0 to 1.", param="temperature") from None
    if not 0 <= temperature <= 1:
        raise invalid("temperature must be a number from 0 to 1.", param="temperature")
    language = (form.get("language") or "").strip()
    if len(language) > 8:
        raise invalid("language is an ISO-639-1 code such as en.", param="language")
    return {"model": model, "response_format": response_format, "words": "word" in granularities,
            "temperature": temperature, "language": language, "prompt": form.get("prompt") or "",
            "stream": (form.get("stream") or "").lower() == "true"}


def transcription_request(request: HttpRequest) -> tuple[GenerationRequest, dict[str, Any]]:
    """Validate the multipart form, keep the file in the blobs, and make the generation. Blocking (parses and
    hashes the upload)."""
    upload = _file(request)
    options = _options(request.POST)
    sha256, size = media_put(upload)
    model = registry().aliases.resolve(options["model"])
    spec = GenerateSpec(gen_id=uuid.uuid4().hex, model=model, prompt=options["prompt"],
                        max_tokens=UNLIMITED_TOKENS, audio=media_ref(sha256=sha256, size=size),
                        transcribe={"language": options["language"], "word_timestamps": options["words"],
                                    "temperature": options["temperature"]})
    deadline = time.time() + settings.FLEET_DEFAULT_DEADLINE_MS / 1000  # for a lane; the node then takes its time
    gen = GenerationRequest(kind="transcription", spec=spec, deadline=deadline, stream=options["stream"],
                            api_key=request.api_key)
    return gen, options


async def serve_transcription(request: HttpRequest) -> HttpResponse:
    gen, options = await sync_to_async(transcription_request)(request)
    gen.batch = request.batch_line
    run = Run(gen, request.quota)
    segments: list[dict[str, Any]] = []
    try:
        if gen.stream:
            return sse_response(run, await first_event(run), OpenAIChunks(TranscriptShape(run)))
        while await _next(run, segments) is not None:
            pass
    except asyncio.CancelledError:
        await run.abandon()
        raise
    return _answer(run, _transcript(run, segments, options), options)


async def _next(run: Run, segments: list[dict[str, Any]]) -> Any:
    event = await run.next_event()
    if isinstance(event, Tokens):
        segments.extend(event.segments or [])
    return event


def _transcript(run: Run, segments: list[dict[str, Any]], options: dict[str, Any]) -> Transcript:
    timings = run.finished.timings if run.finished else {}
    language = next((s.get("language") for s in segments if s.get("language")), options["language"] or "en")
    return Transcript(run.text.strip(), segments, float(timings.get("audio_s", 0.0)), language)


def _answer(run: Run, transcript: Transcript, options: dict[str, Any]) -> HttpResponse:
    fmt = options["response_format"]
    if fmt in ("text", "srt", "vtt"):
        body = transcript.text if fmt == "text" else subtitles(transcript.segments, vtt=fmt == "vtt")
        response = HttpResponse(body + "\n", content_type="text/vtt" if fmt == "vtt" else "text/plain; charset=utf-8")
    elif fmt == "verbose_json":
        response = JsonResponse({**verbose(transcript.segments, language=transcript.language,
                                           duration=transcript.duration, words=options["words"]),
                                 "usage": transcript.usage()})
    else:
        response = JsonResponse({"text": transcript.text, "usage": transcript.usage()})
    response["X-Fleet-Node"] = run.node
    response["X-Fleet-Generation"] = run.request.gen_id
    return response


class TranscriptShape:
    """A streamed transcription's events for api.sse: `transcript.text.delta` a segment as it arrives, then
    `transcript.text.done` with the whole text and its usage (keep-alives, errors and `[DONE]` as for chat)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def token_chunks(self, event: Tokens) -> list[dict[str, Any]]:
        return [{"type": "transcript.text.delta", "delta": event.text}]

    def closing_chunks(self) -> list[dict[str, Any]]:
        duration = float((self.run.finished.timings if self.run.finished else {}).get("audio_s", 0.0))
        return [{"type": "transcript.text.done", "text": self.run.text.strip(),
                 "usage": Transcript(self.run.text, [], duration, "").usage()}]
