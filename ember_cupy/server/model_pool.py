"""Many models behind one server (`serve --models-dir DIR`, llama.cpp's router mode): every GGUF
file and Hugging Face directory in DIR is a model, named by its file (without .gguf) or folder.
A model loads on its first request (which gets 503 + Retry-After while it loads, never a hang),
at most `models_max` stay loaded (the least recently used idle one is unloaded for another), an
idle one unloads after `idle_ttl` seconds, and one memory budget covers them all: a model's
estimate is its weights' bytes on disk plus its KV cache (`kv_bytes`); a load that can never fit
is refused, one that does not fit beside busy models waits (503)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from ember_cupy.server.async_engine import AsyncEngine, EngineState
from ember_cupy.server.errors import APIError

log = logging.getLogger("ember_cupy.server")
RETRY_AFTER_LOADING = "2"


def discover_models(models_dir: str) -> dict[str, str]:
    """name -> path of each GGUF file (the first part of a split one) and HF directory in models_dir."""
    root = Path(models_dir)
    if not root.is_dir():
        raise ValueError(f"--models-dir {models_dir!r} is not a directory")
    models = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".gguf" and ("-of-" not in entry.stem or "-00001-of-" in entry.stem):
            models[entry.stem.split("-00001-of-")[0]] = str(entry)
        elif entry.is_dir() and (entry / "config.json").is_file():
            models[entry.name] = str(entry)
    return models


def weight_files(path: str) -> list[Path]:
    """The files holding a model's weights: a GGUF file (every part of a split one), or an HF
    directory's *.safetensors."""
    p = Path(path)
    if p.is_file():
        return sorted(p.parent.glob(p.name.replace("-00001-of-", "-*-of-")))
    return sorted(p.glob("*.safetensors"))


def weight_bytes_on_disk(path: str) -> int:
    return sum(f.stat().st_size for f in weight_files(path))


@dataclass
class PooledModel:
    name: str
    path: str
    estimate: int
    engine: AsyncEngine | None = None
    app: web.Application | None = None
    load_task: asyncio.Task | None = None
    error: str | None = None
    last_used: float = field(default_factory=time.monotonic)

    @property
    def status(self) -> str:
        if self.load_task is not None and not self.load_task.done():
            return "loading"
        if self.app is not None:
            return "loaded"
        return "failed" if self.error else "unloaded"

    @property
    def busy(self) -> bool:
        return self.engine is not None and self.engine.num_in_flight > 0


class ModelPool:
    """The models of a directory and which of them are loaded. `make_app(name, path)` ->
    (AsyncEngine not yet started, the model's application), as the one-model server builds it;
    `describe(path)` -> what the file holds without loading it (ember_cupy.model.loader.describe_model)."""

    def __init__(self, models: dict[str, str], make_app, *, describe, models_max: int = 4,
                 idle_ttl: float | None = None, memory_budget: int | None = None, kv_bytes: int = 0):
        if not models:
            raise ValueError("no models: the directory holds no .gguf file and no folder with a config.json")
        if models_max < 1:
            raise ValueError(f"--models-max must be at least 1, got {models_max}")
        self.models = {n: PooledModel(n, p, weight_bytes_on_disk(p) + kv_bytes) for n, p in models.items()}
        self.make_app = make_app
        self.describe = describe
        self.models_max = models_max
        self.idle_ttl = idle_ttl
        self.memory_budget = memory_budget
        self._reaper: asyncio.Task | None = None

    # --- requests ---
    def model(self, name: str | None) -> PooledModel:
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise APIError(404 if name else 400, f"the model {name!r} does not exist; models: {sorted(self.models)}"
                           if name else f"'model' is required: this server has {len(self.models)} models",
                           param="model", code="model_not_found" if name else "missing_required_parameter")
        return self.models[name]

    def acquire(self, name: str | None) -> web.Application:
        """The model's application, or 503 + Retry-After while it loads (a first request starts the load)."""
        model = self.model(name)
        if model.status == "loaded":
            model.last_used = time.monotonic()
            return model.app
        if model.status != "loading":
            self.start_load(model)
        raise APIError(503, f"the model {model.name!r} is loading; retry shortly", code="model_loading",
                       headers={"Retry-After": RETRY_AFTER_LOADING})

    # --- loading and unloading ---
    def start_load(self, model: PooledModel) -> asyncio.Task:
        if model.status in ("loaded", "loading"):
            return model.load_task
        self._make_room(model)
        model.error = None
        model.load_task = asyncio.get_running_loop().create_task(self._load(model))
        model.load_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return model.load_task

    async def _load(self, model: PooledModel) -> None:
        log.info("loading model %s from %s (~%.0f MiB)", model.name, model.path, model.estimate / 2**20)
        started = time.monotonic()
        engine, app = self.make_app(model.name, model.path)
        await engine.start()
        if engine.state is not EngineState.READY:
            model.error = str(engine.error or engine.state.value)
            log.error("model %s failed to load: %s", model.name, model.error)
            await engine.shutdown(drain_timeout=0)
            return
        model.engine, model.app, model.last_used = engine, app, time.monotonic()
        log.info("model %s loaded in %.1f s", model.name, time.monotonic() - started)

    async def unload(self, model: PooledModel) -> None:
        engine = self._detach(model)
        if engine is not None:
            await engine.shutdown(drain_timeout=0)

    @staticmethod
    def _detach(model: PooledModel) -> AsyncEngine | None:
        """Take the model out of service at once; its engine is left to stop."""
        engine, model.engine, model.app = model.engine, None, None
        if engine is not None:
            log.info("unloading model %s", model.name)
        return engine

    def _resident(self) -> list[PooledModel]:
        return [m for m in self.models.values() if m.status in ("loaded", "loading")]

    def _make_room(self, model: PooledModel) -> None:
        """Unload least recently used idle models until `model` fits the count and the budget;
        400 if it can never fit, 503 if the models in the way are busy."""
        if self.memory_budget is not None and model.estimate > self.memory_budget:
            raise APIError(400, f"the model {model.name!r} needs ~{model.estimate / 2**20:.0f} MiB, more than the "
                           f"memory budget of {self.memory_budget / 2**20:.0f} MiB", param="model",
                           code="model_too_large")
        while not self._fits(model):
            idle = sorted((m for m in self._resident() if m.status == "loaded" and not m.busy),
                          key=lambda m: m.last_used)
            if not idle:
                raise APIError(503, f"no room to load {model.name!r}: the loaded models are busy", code="model_busy",
                               headers={"Retry-After": RETRY_AFTER_LOADING})
            engine = self._detach(idle[0])
            asyncio.get_running_loop().create_task(engine.shutdown(drain_timeout=0))

    def _fits(self, model: PooledModel) -> bool:
        resident = self._resident()
        used = sum(m.estimate for m in resident)
        within_budget = self.memory_budget is None or used + model.estimate <= self.memory_budget
        return len(resident) < self.models_max and within_budget

    # --- idle unloading ---
    def start_reaper(self) -> None:
        if self.idle_ttl is not None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(max(self.idle_ttl / 4, 0.05), 30))
            now = time.monotonic()
            for model in list(self.models.values()):
                if model.status == "loaded" and not model.busy and now - model.last_used > self.idle_ttl:
                    await self.unload(model)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for model in self.models.values():
            if model.load_task is not None and not model.load_task.done():
                model.load_task.cancel()
            await self.unload(model)

    def cards(self, created: int) -> list[dict]:
        return [{"id": m.name, "object": "model", "created": created, "owned_by": "ember-cupy", "root": m.path,
                 "parent": None, "status": {"value": m.status, **({"error": m.error} if m.error else {})}}
                for m in self.models.values()]

