"""The HTTP face of a ModelPool: the one-model server's endpoints, each request handed to the
application of the model its body names (loaded on demand), plus llama.cpp's router endpoints:
GET /v1/models (every model, with its status), POST /models/load and /models/unload
({"model": name}). /health answers for the router; /metrics joins the loaded models' series.
Ollama's routes too: those naming a model go to it (`name:latest` is `name`), GET /api/tags lists
every model of the directory (described from its file headers), /api/ps the loaded ones, and
keep_alive 0 on a request that asks nothing unloads its model (`ollama stop`).
llama-server's /completion and /apply-template go to the model their body names, GET /props to
the one `?model=` names."""
from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ember_cupy.server import ollama_models
from ember_cupy.server.api import ServerSettings, base_app
from ember_cupy.server.errors import APIError
from ember_cupy.server.model_pool import ModelPool
from ember_cupy.server.ollama_replies import loaded
from ember_cupy.server.ollama_requests import served_name
from ember_cupy.server.protocol import validate
from ember_cupy.server.protocol.ollama import OllamaChatRequest, OllamaGenerateRequest
from ember_cupy.server.validation import read_json_body

# the endpoints whose JSON body names the model
MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/messages",
                "/v1/messages/count_tokens", "/tokenize", "/detokenize")
OLLAMA_MODEL_ROUTES = ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show", "/api/pull")
LLAMACPP_MODEL_ROUTES = ("/completion", "/completions", "/apply-template")   # llama-server's, any Content-Type
POOL_KEY = web.AppKey("model_pool", ModelPool)


def build_router_app(pool: ModelPool, settings: ServerSettings) -> web.Application:
    app = base_app(settings)
    app[POOL_KEY] = pool
    router = _Router(pool)
    for path in MODEL_ROUTES + OLLAMA_MODEL_ROUTES + LLAMACPP_MODEL_ROUTES:
        app.router.add_post(path, router.forward)
    app.router.add_get("/props", router.props)
    app.router.add_get("/api/tags", router.ollama_tags)
    app.router.add_get("/api/ps", router.ollama_ps)
    app.router.add_get("/api/version", router.ollama_version)
    app.router.add_get("/v1/responses/{response_id}", router.stored_response)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/models/load", router.load)
    app.router.add_post("/models/unload", router.unload)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    app[POOL_KEY].start_reaper()


async def _stop(app: web.Application) -> None:
    await app[POOL_KEY].close()


class _Router:
    def __init__(self, pool: ModelPool):
        self.pool = pool
        self.created = int(time.time())
        self.facts: dict[str, object] = {}     # path -> ModelFacts of a model read while unloaded

    async def forward(self, request: web.Request) -> web.StreamResponse:
        ollama = request.path.startswith("/api/")
        # aiohttp keeps the bytes: the model's handler reads them again
        body = await read_json_body(request, any_content_type=ollama or request.path in LLAMACPP_MODEL_ROUTES)
        name = body.get("model") or (body.get("name") if ollama else None)
        if ollama and isinstance(name, str):
            name = served_name(name, list(self.pool.models)) or name
            if _asks_unload(request.path, body):
                return await self._ollama_unload(request.path, name, body)
        app = self.pool.acquire(name if isinstance(name, str) else None)
        return await _handle(app, request)

    async def _ollama_unload(self, path: str, name: str, body: dict) -> web.Response:
        """Ollama's unload (`ollama stop`): keep_alive 0 on a request that asks nothing."""
        kind = "chat" if path == "/api/chat" else "generate"
        validate(OllamaChatRequest if kind == "chat" else OllamaGenerateRequest, body)   # a 400 as the model's app
        await self.pool.unload(self.pool.model(name))
        return web.json_response(loaded(kind, body["model"], reason="unload"))

    async def props(self, request: web.Request) -> web.StreamResponse:
        """llama-server's router form: GET /props?model=NAME."""
        return await _handle(self.pool.acquire(request.query.get("model")), request)

    async def ollama_tags(self, request: web.Request) -> web.Response:
        entries = []
        for model in self.pool.models.values():
            facts = model.engine.model_info() if model.status == "loaded" else await self._facts(model.path)
            served = ollama_models.ServedFile(model.path)
            entries.append(ollama_models.tags_entry(model.name, model.path, facts, served))
        return web.json_response({"models": entries})

    async def ollama_ps(self, request: web.Request) -> web.Response:
        entries = [ollama_models.running_entry(m.name, m.engine.model_info(), ollama_models.ServedFile(m.path))
                   for m in self.pool.models.values() if m.status == "loaded"]
        return web.json_response({"models": entries})

    async def ollama_version(self, request: web.Request) -> web.Response:
        from ember_cupy.server.ollama_api import OLLAMA_API_VERSION
        return web.json_response({"version": OLLAMA_API_VERSION})

    async def _facts(self, path: str):
        """A model's facts from its file headers (read once, off the loop: a GGUF's vocabulary is big)."""
        if path not in self.facts:
            try:
                self.facts[path] = await asyncio.to_thread(self.pool.describe, path)
            except (ValueError, OSError) as exc:
                raise APIError(500, f"{path}: {exc}", code="model_unreadable") from None
        return self.facts[path]

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """A stored response lives with the model that made it: the loaded ones are asked in turn."""
        for model in self.pool.models.values():
            if model.app is not None:
                try:
                    return await _handle(model.app, request)
                except APIError as error:
                    if error.status != 404:
                        raise
        raise APIError(404, f"no stored response {request.match_info['response_id']!r} in a loaded model",
                       param="response_id", code="not_found")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.pool.cards(self.created)})

    async def load(self, request: web.Request) -> web.Response:
        model = self.pool.model(await _model_name(request))
        task = self.pool.start_load(model)
        if task is not None:
            await task
        if model.status != "loaded":
            raise APIError(500, f"the model {model.name!r} failed to load: {model.error}", code="model_load_failed")
        return web.json_response({"success": True, "model": model.name, "status": model.status})

    async def unload(self, request: web.Request) -> web.Response:
        model = self.pool.model(await _model_name(request))
        await self.pool.unload(model)
        return web.json_response({"success": True, "model": model.name, "status": model.status})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "models": {m.name: m.status for m in self.pool.models.values()}})

    async def metrics(self, request: web.Request) -> web.Response:
        texts = [m.engine.metrics.render().decode() for m in self.pool.models.values()
                 if m.engine is not None and m.engine.metrics is not None]
        return web.Response(body=join_expositions(texts).encode(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _asks_unload(path: str, body: dict) -> bool:
    """keep_alive 0 (or "0s", "0m"...) on an /api/generate or /api/chat that asks for nothing."""
    keep_alive = body.get("keep_alive")
    zero = keep_alive == 0 and not isinstance(keep_alive, bool) or (
        isinstance(keep_alive, str) and keep_alive.rstrip("smh").strip() in ("0", "0.0"))
    nothing = not body.get("messages") if path == "/api/chat" else not body.get("prompt") and not body.get("context")
    return path in ("/api/chat", "/api/generate") and zero and nothing and isinstance(body.get("model"), str)


async def _model_name(request: web.Request) -> str:
    name = (await read_json_body(request)).get("model")
    if not isinstance(name, str):
        raise APIError(400, "'model' (a string) is required", param="model", code="missing_required_parameter")
    return name


async def _handle(app: web.Application, request: web.Request) -> web.StreamResponse:
    match = await app.router.resolve(request)
    if match.http_exception is not None:
        raise match.http_exception
    return await match.handler(request)


def join_expositions(texts: list[str]) -> str:
    """Prometheus text of several registries as one: each family's HELP/TYPE once, its samples
    from all (the models' series differ by their model_name label)."""
    families: dict[str, list[str]] = {}
    for text in texts:
        current = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                block = families.setdefault(current, [])
                if line not in block:
                    block.append(line)
            elif line and current is not None:
                families[current].append(line)
    return "".join(line + "\n" for block in families.values() for line in block)
