"""LoRA adapters on the server, as vLLM and llama-server users set them up.

vLLM's ``--lora-modules NAME=PATH``: a request runs the adapter its ``model`` names (``/v1/models`` lists each, its
``parent`` the base). llama-server's ``--lora PATH`` (``--lora-scaled PATH:SCALE``; ``--lora-init-without-apply``
starts every scale at 0): every request runs those adapters at the server's scales unless its ``lora`` field
(``[{"id": 0, "scale": 0.5}]``) lists its own; ``GET /lora-adapters`` lists ids, paths and scales, ``POST
/lora-adapters`` sets the scales (an adapter left out goes to 0), as llama-server's endpoint does.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse

from quickdraft.models.lora import check_choice
from quickdraft.serving.protocol import request_scales
from quickdraft.serving.routes import context_of

router = APIRouter()


@router.get("/lora-adapters")
async def list_adapters(request: Request) -> JSONResponse:
    ctx = context_of(request)
    sources = ctx.llm.model.lora.sources if ctx.adapters else []
    return JSONResponse([{"id": i, "name": name, "path": source, "scale": ctx.lora_scales.get(name, 0.0)}
                         for i, (name, source) in enumerate(zip(ctx.adapters, sources))])


@router.post("/lora-adapters")
async def set_scales(request: Request, body: Any = Body(...)) -> JSONResponse:
    """The scales every request runs by default from now on (requests already running keep theirs)."""
    ctx = context_of(request)
    scales = request_scales(body, ctx.adapters)
    check_choice(scales or None)
    ctx.lora_scales = {name: float(scales.get(name, 0.0)) for name in ctx.adapters}
    return JSONResponse({"success": True})
