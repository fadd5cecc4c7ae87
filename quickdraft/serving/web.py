"""The chat page at ``/``: static files shipped in the package (``serving/web/``), nothing fetched at run time.
The page holds no secret (an API key is asked for in the browser and kept for its tab), so it is served without
one; ``quickdraft serve --no-web`` leaves it out."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

FILES = Path(__file__).resolve().parent / "web"
CONTENT_TYPES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PAGE_PATHS = ("/",) + tuple(f"/web/{name}" for name in CONTENT_TYPES)  # what the browser loads, before any key
HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer"}
router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> Response:
    return FileResponse(FILES / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/web/{name}")
async def asset(name: str) -> Response:
    if name not in CONTENT_TYPES:  # the page's own files only: no path reaches outside them
        return Response(status_code=404)
    return FileResponse(FILES / name, media_type=CONTENT_TYPES[name], headers=HEADERS)
