"""Run the server: spawn the scheduler process, wait for its readiness, serve HTTP, watch it.

* The scheduler (and model) run in a child process (``spawn``), connected by two ZeroMQ PUSH/
  PULL sockets over ``ipc://`` paths in a private (0700) temporary directory.
* If the child dies, in-flight requests get a 503 at once, /health turns 503, and the server
  exits non-zero.
* With ``--parent-pid`` the server shuts down the same way once that process is gone.
* On SIGTERM or SIGINT (or the ``--parent-pid`` process gone) the server drains
  (:mod:`server.http.drain`): new requests get 503 + Retry-After, in-flight ones run for up to
  ``shutdown_timeout`` seconds and then end with an error event; then uvicorn stops, the child
  is terminated and reaped, and the exit code is 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time

import uvicorn
import zmq
import zmq.asyncio

from server import protocol as P
from server.config import EngineConfig
from server.front_config import HTTPConfig
from server.model.cpu_malloc import malloc_env
from server.model.cpu_threads import openmp_env
from server.reasoning import ReasoningParserError
from server.scheduler.entry import run_scheduler

log = logging.getLogger("server.launch")


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """``os.environ`` with ``extra`` set for the block (a child started inside inherits it),
    then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SchedulerDiedError(RuntimeError):
    """The scheduler process exited (while loading the model, or later)."""


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with its first SIGTERM/SIGINT turned into :meth:`drain` (uvicorn's own
    handling closes the listener at once, so new clients saw connection errors); a second
    signal is uvicorn's usual stop."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain_task: asyncio.Task | None = None  # held: the loop keeps weak references

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if not self._signalled and self.started and self._loop is not None:
            self._signalled = True  # a signal handler only schedules; the loop does the work
            self._loop.call_soon_threadsafe(self.drain)
            return
        super().handle_exit(sig, frame)

    def drain(self) -> None:
        """Begin the drain (once); uvicorn stops when it has ended."""
        if not self.app.state.drain.begin():
            return

        async def run() -> None:
            log.info("draining: in-flight requests may run %.0f s; new ones get 503",
                     self.app.state.drain.timeout)
            await self.app.state.drain.run(self.app.state.manager)
            self.should_exit = True

        self._drain_task = asyncio.get_running_loop().create_task(run())


async def _wait_ready(recv: zmq.asyncio.Socket, proc, timeout: float) -> P.Ready:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await recv.poll(200):
            msg = P.decode(await recv.recv())
            if isinstance(msg, P.Ready):
                return msg
        if not proc.is_alive():
            raise SchedulerDiedError(f"the scheduler process exited ({proc.exitcode}) while "
                                     "loading the model; see its log above")
    raise SchedulerDiedError(f"the scheduler process was not ready within {timeout:.0f} s")


async def serve(engine_config: EngineConfig, http: HTTPConfig) -> int:
    """Run until shutdown; returns the process exit code."""
    # the HTTP process's life in order (sockets, scheduler spawn, ready, serve, drain,
    # teardown): one sequence whose cleanup must see every step's resources
    ipc_dir = tempfile.mkdtemp(prefix="sgl-adapters-")
    os.chmod(ipc_dir, 0o700)
    to_sched, from_sched = f"ipc://{ipc_dir}/to_scheduler", f"ipc://{ipc_dir}/from_scheduler"
    ctx = zmq.asyncio.Context()
    send, recv = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    send.bind(to_sched)
    recv.bind(from_sched)
    proc = mp.get_context("spawn").Process(
        target=run_scheduler, args=(engine_config, to_sched, from_sched, http.log_level),
        name="sgl-scheduler")  # not a daemon: it may start tensor-parallel ranks
    preload = malloc_env(engine_config.model.cpu_malloc, engine_config.model.device)
    if preload:
        log.info("scheduler process allocator: %s", preload["LD_PRELOAD"].split()[0])
    # the child (and its own children) inherit its OpenMP threads' wait and its allocator
    with _environ({**openmp_env(), **preload}):
        proc.start()
    # The HTTP stack (FastAPI, pydantic schemas, the tokenizer: ~0.9 s) is imported while the
    # child loads the model, not before the child starts.
    from server.http.app import create_app
    from server.http.tokenizer_manager import TokenizerManager
    from server.model.files import load_tokenizer
    from server.multimodal import model_vision_spec
    from server.reasoning import ReasoningParser

    exit_code = 0
    try:
        (tokenizer, model_path), ready = await asyncio.gather(
            asyncio.to_thread(load_tokenizer, engine_config.model.path),
            _wait_ready(recv, proc, http.startup_timeout))
        manager = TokenizerManager(tokenizer, ready, send, recv, http.max_queued_requests,
                                   ReasoningParser.for_tokenizer(http.reasoning_parser, tokenizer),
                                   model_vision_spec(model_path), http.stream_stall_timeout)
        app = create_app(manager, model_name=engine_config.model.served_model_name
                         or ready.model_name, model_path=model_path, api_key=http.api_key,
                         max_body_bytes=http.max_body_bytes,
                         responses_store_size=http.responses_store_size,
                         incremental_streaming_output=http.incremental_streaming_output,
                         drain_timeout=http.shutdown_timeout,
                         server_args={"schedule_policy": engine_config.scheduler.schedule_policy,
                                      "disable_radix_cache":
                                          engine_config.cache.disable_radix_cache,
                                      "chunked_prefill_size":
                                          engine_config.scheduler.chunked_prefill_size})
        # the drain has ended every request before uvicorn stops: its own wait is a backstop
        server = _DrainingServer(uvicorn.Config(
            app, host=http.host, port=http.port, log_level=http.log_level,
            timeout_graceful_shutdown=5, access_log=False), app)
        died = asyncio.Event()

        async def watch() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            try:
                print(f"sgl-adapters server ready: http://{http.host}:{http.port} "
                      f"(model {ready.model_name}, {ready.dtype} on {ready.device}, "
                      f"{ready.attention_backend} attention, weights {ready.quantization}"
                      f"{', torch.compile' if ready.compiled else ''}, KV pool "
                      f"{ready.max_total_tokens} tokens)", flush=True)
            except OSError:  # stdout is a pipe whose reader (the launcher) is already gone:
                pass  # /health answered before this line, so it may have died; watch on
            while proc.is_alive():
                await asyncio.sleep(0.2)
                if http.parent_pid is not None and os.getppid() != http.parent_pid:
                    log.error("the process that started the server (%d) is gone; shutting "
                              "down", http.parent_pid)
                    server.drain()
                    return
            log.error("the scheduler process died (exit code %s); shutting down", proc.exitcode)
            manager.fail_all("the scheduler process died")
            died.set()
            server.should_exit = True

        watcher = asyncio.create_task(watch())
        # uvicorn routes SIGTERM/SIGINT to handle_exit (the drain), then restores the previous handlers
        # and re-raises the signal. With the default handlers that would kill this process
        # before the child is reaped; no-op handlers let the shutdown below run.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        await server.serve()
        watcher.cancel()
        exit_code = 1 if died.is_set() else 0
    except (SchedulerDiedError, ReasoningParserError) as exc:
        log.error("%s", exc)
        exit_code = 1
    finally:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: the scheduler persists a --cache-dir, then exits
            proc.join(60 if engine_config.cache.cache_dir else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return exit_code
