"""/v1/files and /v1/batches in OpenAI's shapes: parse, call one service in api.batches, shape the answer."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from api import batches
from api.errors import invalid
from api.v1 import json_body, openai_view


def _limit(request: HttpRequest, default: int, most: int) -> int:
    raw = request.GET.get("limit") or str(default)
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid(f"limit must be a whole number from 1 to {most}.", param="limit")
    return int(raw)


@openai_view("GET", "POST")
async def files(request: HttpRequest) -> HttpResponse:
    owner = request.api_key.owner
    if request.method == "GET":
        page = await sync_to_async(batches.file_list)(owner=owner, purpose=request.GET.get("purpose"),
                                                      limit=_limit(request, 100, 10_000),
                                                      after=request.GET.get("after") or None)
        return JsonResponse(page)
    upload = request.FILES.get("file")
    if upload is None:
        raise invalid("Send the file as multipart/form-data with a `file` part and `purpose=batch`.", param="file")
    row = await sync_to_async(batches.file_create)(owner=owner, filename=upload.name or "", content=upload.read(),
                                                   purpose=request.POST.get("purpose", ""))
    return JsonResponse(batches.file_object(row))


@openai_view("GET", "DELETE")
async def file_detail(request: HttpRequest, file_id: str) -> HttpResponse:
    owner = request.api_key.owner
    if request.method == "DELETE":
        return JsonResponse(await sync_to_async(batches.file_delete)(owner=owner, ref=file_id))
    return JsonResponse(batches.file_object(await sync_to_async(batches.file_get)(owner=owner, ref=file_id)))


@openai_view("GET")
async def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    row = await sync_to_async(batches.file_get)(owner=request.api_key.owner, ref=file_id)
    return HttpResponse(bytes(row.content), content_type="application/jsonl")


@openai_view("GET", "POST")
async def batch_collection(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return JsonResponse(await sync_to_async(batches.batch_list)(
            owner=request.api_key.owner, limit=_limit(request, 20, 100), after=request.GET.get("after") or None))
    row = await sync_to_async(batches.batch_create)(api_key=request.api_key, body=json_body(request))
    return JsonResponse(batches.batch_object(row))


@openai_view("GET")
async def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    return JsonResponse(batches.batch_object(await sync_to_async(batches.batch_get)(owner=request.api_key.owner,
                                                                                    ref=batch_id)))


@openai_view("POST")
async def batch_cancel(request: HttpRequest, batch_id: str) -> HttpResponse:
    return JsonResponse(batches.batch_object(await sync_to_async(batches.batch_cancel)(owner=request.api_key.owner,
                                                                                       ref=batch_id)))
