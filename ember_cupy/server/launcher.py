"""Running the server: in the foreground with graceful SIGINT/SIGTERM shutdown, or in a
background thread (tests, embedding)."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading

from aiohttp import web

from ember_cupy.server.listen_address import ListenError, check_can_listen, listen_error  # noqa: F401 (re-exported)
from ember_cupy.server.api import START_TASK_KEY, ServerSettings, build_app, wait_engine_started
from ember_cupy.server.async_engine import AsyncEngine, EngineState
from ember_cupy.server.http_handler import AppRunner
from ember_cupy.server.thread_policy import apply_server_thread_policy

log = logging.getLogger("ember_cupy.server")


class Server:
    """One app on one socket. `await start()`, `await stop()`; `port` once started. `app`: another
    application than the one engine's (the many-model router, server/model_router.py; engine None)."""

    def __init__(self, engine: AsyncEngine | None, settings: ServerSettings, app: web.Application | None = None):
        self.engine = engine
        self.settings = settings
        self.app = app if app is not None else build_app(engine, settings)
        # aiohttp closes a connection whose request has not fully arrived keepalive_timeout seconds
        # after it opened (or after its previous response): that bounds slow headers (slowloris);
        # read_json_body bounds slow bodies with the same timeout, and the unread rest of a body is
        # drained (so the client sees the response) for at most that long too.
        # AppRunner: aiohttp's own HTTP errors in OpenAI's shape, one log line each.
        self.runner = AppRunner(self.app, handler_cancellation=True, access_log=None,
                                shutdown_timeout=max(5.0, settings.drain_timeout + 5.0),
                                keepalive_timeout=settings.read_timeout,
                                lingering_time=min(10.0, settings.read_timeout))
        self.port: int | None = None

    async def start(self) -> None:
        apply_server_thread_policy()
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.settings.host, self.settings.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def wait_ready(self) -> None:
        await wait_engine_started(self.app)

    async def stop(self, drain_timeout: float | None = None) -> None:
        """Stop admitting (503), let in-flight requests finish for drain_timeout seconds,
        abort the rest, close the socket."""
        drain = self.settings.drain_timeout if drain_timeout is None else drain_timeout
        task = self.app.get(START_TASK_KEY)
        if task is not None and not task.done():
            task.cancel()
        if self.engine is not None:
            await self.engine.shutdown(drain_timeout=drain)
        await self.runner.cleanup()


async def serve(engine: AsyncEngine | None, settings: ServerSettings, on_listening=None,
                app: web.Application | None = None) -> int:
    """Serve until SIGINT/SIGTERM; returns an exit status (0 graceful, 1 engine failed to load).
    Raises ListenError when the address cannot be bound. `app` with engine None: the router."""
    server = Server(engine, settings, app)
    try:
        await server.start()
    except OSError as exc:
        await server.stop(drain_timeout=0)
        raise listen_error(settings.host, settings.port, exc) from None
    log.info("listening on http://%s:%d", settings.host, server.port)
    if on_listening:
        on_listening(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopper = loop.create_task(stop.wait())
    start = server.app.get(START_TASK_KEY)
    waits = {stopper} | ({start} if start is not None else set())
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if start is not None and start in done and engine is not None and engine.state is EngineState.DEAD:
        log.error("exiting: the engine did not load (logged above)")
        status = 1
    else:
        if start in done:
            log.info("ready: model %s", settings.served_model_names[0])
            await stopper
        if engine is not None:
            log.info("shutting down: finishing %d in-flight request(s), at most %.0f s",
                     engine.num_in_flight, settings.drain_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    stopper.cancel()
    await server.stop()
    log.info("stopped")
    return status


class BackgroundServer:
    """A server on its own event loop in a daemon thread. Blocks in start() until ready."""

    def __init__(self, engine: AsyncEngine | None, settings: ServerSettings, app: web.Application | None = None):
        self.engine = engine
        self.settings = settings
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.server: Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="ember-server")

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.server.port}"

    def start(self, timeout: float = 120, wait_ready: bool = True) -> BackgroundServer:
        """Listen; with wait_ready, also wait until the engine is loaded (or failed to load)."""
        self._thread.start()

        async def boot():
            self.server = Server(self.engine, self.settings, self.app)
            await self.server.start()
            if wait_ready:
                await self.server.wait_ready()
        asyncio.run_coroutine_threadsafe(boot(), self.loop).result(timeout)
        return self

    def call(self, fn, timeout: float = 60):
        """Run fn() on the server's loop thread (fn may be a coroutine function)."""
        async def run():
            result = fn()
            return await result if asyncio.iscoroutine(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, drain_timeout: float = 0.0) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(drain_timeout), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
