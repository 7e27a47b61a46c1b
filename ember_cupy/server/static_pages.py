"""The browser pages: a chat UI at `/` and the API reference at `/docs`, each one self-contained
HTML file in static/ (no build step, no CDN), served as they are. Both are public: the chat page
sends the API key the user types in with each API call.

Each page is sent with a Content-Security-Policy that lets it run its own inline <script> and
<style> (by their SHA-256, computed from the file as served) and talk to this server only; no
other script, no framing (also X-Frame-Options), no MIME sniffing."""
from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
PAGES = {"/": "chat.html", "/docs": "docs.html"}


def _hashes(html: str, tag: str) -> str:
    """The CSP source list of every inline <tag> block of `html`: 'sha256-...' each."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
    return " ".join(f"'sha256-{d}'" for d in digests) or "'none'"


def content_security_policy(html: str) -> str:
    return (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def _page(filename: str):
    path = STATIC / filename

    async def handler(request: web.Request) -> web.Response:
        html = path.read_bytes().decode("utf-8")
        return web.Response(text=html, content_type="text/html", charset="utf-8", headers={
            "Cache-Control": "no-cache", "Content-Security-Policy": content_security_policy(html),
            "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff"})
    return handler


def add_static_pages(router: web.UrlDispatcher) -> None:
    for route, filename in PAGES.items():
        router.add_get(route, _page(filename))
