"""The browser pages: a chat UI at `/` and the API reference at `/docs`, each one self-contained
HTML file in static/ (no build step, no CDN), served as they are. Both are public: the chat page
sends the API key the user types in with each API call."""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
PAGES = {"/": "chat.html", "/docs": "docs.html"}


def _page(filename: str):
    path = STATIC / filename

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=path.read_bytes(), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})
    return handler


def add_static_pages(router: web.UrlDispatcher) -> None:
    for route, filename in PAGES.items():
        router.add_get(route, _page(filename))
