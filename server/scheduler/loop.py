"""The scheduler process: receive -> step -> forward -> update -> send, forever.

It owns the model (through an in-process :class:`server.engine.Engine`) and talks to the HTTP
process over two ZeroMQ PUSH/PULL sockets carrying :mod:`server.protocol` messages.

Isolation: a request the scheduler refuses gets a ReqError; a failure while running a batch ends
only that batch's requests (finish reason "error" with the message) and the loop goes on; an
undecodable frame is logged and dropped (answered with a 500 ReqError when it names a
request). Invariant violations are logged and counted (reported in ServerInfoReply), never
fatal.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch
import zmq

from server import protocol as P
from server.config import EngineConfig
from server.engine import Engine
from server.model.lora_files import LoraError
from server.model.lora_registry import LoraBusyError
from server.scheduler.outputs import TokenDelta
from server.scheduler.pending import REFUSALS
from server.scheduler.request import LogprobOptions, Req

log = logging.getLogger("server.scheduler")

IDLE_POLL_MS = 50
COMPILE_POLL_MS = 5  # idle poll while grammars compile or images are preprocessed
INVARIANT_CHECK_EVERY = 64  # steps


class _Sent:
    """How many logprob entries of a request were already sent."""

    __slots__ = ("out", "out_top", "inp", "inp_top")

    def __init__(self) -> None:
        self.out = self.out_top = self.inp = self.inp_top = 0


class SchedulerLoop:
    """Args: engine; recv (PULL) and send (PUSH) sockets, already connected."""

    def __init__(self, engine: Engine, recv: zmq.Socket, send: zmq.Socket):
        self.engine = engine
        self.recv = recv
        self.send = send
        self.live: dict[str, tuple[Req, _Sent]] = {}
        self.invariant_violations = 0
        self.steps = 0
        self.stopping = False  # set by SIGTERM: leave the loop, persist the cache, exit

    # ------------------------------------------------------------------ messages
    def _handle(self, msg: P.Message) -> None:
        sched = self.engine.scheduler
        if isinstance(msg, P.GenerateReq):
            self._add(msg)
        elif isinstance(msg, P.AbortReq):
            if self.engine.pending.drop(msg.rid):
                return  # never queued: nothing to free
            delta = (sched.stop(msg.rid, msg.stop) if msg.stop is not None
                     else sched.abort(msg.rid, msg.message))
            if delta is not None:
                self._send_outputs([delta])
        elif isinstance(msg, P.FlushCacheReq):
            self.send.send(P.encode(P.FlushCacheReply(ok=sched.flush_cache())))
        elif isinstance(msg, (P.LoadLoraReq, P.UnloadLoraReq)):
            self.send.send(P.encode(self._lora(msg)))
        elif isinstance(msg, P.ServerInfoReq):
            self._check_invariants()
            self.send.send(P.encode(P.ServerInfoReply(
                metrics=sched.metrics(), invariant_violations=self.invariant_violations)))
        else:
            log.warning("unexpected message %s dropped", type(msg).__name__)

    def _lora(self, msg: P.LoadLoraReq | P.UnloadLoraReq) -> P.LoraReply:
        """Load or unload an adapter between steps (reading a PEFT file blocks the loop for
        the time it takes: milliseconds for a rank-16 adapter of a 1B model)."""
        engine, status = self.engine, 200
        try:
            if isinstance(msg, P.LoadLoraReq):
                engine.load_lora(msg.name, msg.path)
            elif self.engine.pending.uses_adapter(msg.name):
                raise LoraBusyError(f"adapter {msg.name!r} has requests in flight; unload it "
                                    "when they finish")  # parked for a grammar or images
            else:
                engine.unload_lora(msg.name)
            message = ""
        except KeyError:
            message, status = f"LoRA adapter {msg.name!r} is not loaded", 404
        except LoraError as exc:
            message, status = str(exc), 409 if isinstance(exc, LoraBusyError) else 400
        return P.LoraReply(ok=status == 200, loras=engine.loras.served(), message=message,
                           status=status)

    def _add(self, msg: P.GenerateReq) -> None:
        """Queue a request, or leave it with the engine's pending requests until its grammar
        compiles and its images are preprocessed (:mod:`server.scheduler.pending`: on worker
        threads, so other requests keep decoding meanwhile)."""
        try:
            req = self.engine.pending.submit(
                msg.rid, msg.input_ids, msg.sampling,
                [(im.offset, im.key, im.data) for im in msg.images],
                logprobs=LogprobOptions(msg.return_logprob, msg.logprob_start_len,
                                        msg.top_logprobs_num),
                cache_salt=msg.cache_salt, reasoning=msg.reasoning, embed=msg.embed,
                lora=msg.lora, priority=msg.priority)
        except REFUSALS as exc:
            return self._refuse(msg.rid, exc)
        if req is not None:
            self.live[msg.rid] = (req, _Sent())

    def _admit_pending(self) -> None:
        for rid, result in self.engine.pending.admit_ready():
            if isinstance(result, Req):
                self.live[rid] = (result, _Sent())
            else:
                self._refuse(rid, result)

    def _refuse(self, rid: str, exc: Exception) -> None:
        self.send.send(P.encode(P.ReqError(rid, str(exc), getattr(exc, "param", None),
                                           getattr(exc, "status", 400))))

    def _drain(self, block: bool) -> None:
        if block and not self.recv.poll(COMPILE_POLL_MS if self.engine.pending else IDLE_POLL_MS):
            return
        while True:
            try:
                frame = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frame)
            except P.ProtocolError as exc:
                log.warning("dropped a bad frame: %s", exc)
                rid = P.refused_request_id(frame)
                if rid is not None:  # a request after all: answer it, never leave it waiting
                    self.send.send(P.encode(P.ReqError(
                        rid, f"the scheduler could not read this request: {exc}", status=500)))
                continue
            self._handle(msg)

    # ------------------------------------------------------------------ outputs
    def _send_outputs(self, deltas: list[TokenDelta]) -> None:
        outs = []
        for d in deltas:
            entry = self.live.get(d.rid)
            if entry is None:
                continue
            req, sent = entry
            out = P.ReqOutput(
                rid=d.rid, new_token_ids=d.new_token_ids,
                finish_reason=d.finish_reason.to_dict() if d.finish_reason else None,
                prompt_tokens=len(req.input_ids), completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                output_token_logprobs=req.output_token_logprobs[sent.out:],
                output_top_logprobs=req.output_top_logprobs[sent.out_top:],
                input_token_logprobs=req.input_token_logprobs[sent.inp:],
                input_top_logprobs=req.input_top_logprobs[sent.inp_top:],
                embedding=req.embedding if d.finish_reason is not None else None)
            sent.out, sent.out_top = len(req.output_token_logprobs), len(req.output_top_logprobs)
            sent.inp, sent.inp_top = len(req.input_token_logprobs), len(req.input_top_logprobs)
            if d.finish_reason is not None:
                del self.live[d.rid]
            outs.append(out)
        if outs:
            self.send.send(P.encode(P.BatchOutput(outs)))

    def _check_invariants(self) -> None:
        try:
            self.engine.scheduler.check_invariants()
        except AssertionError as exc:
            self.invariant_violations += 1
            log.error("KV invariant violated: %s", exc)

    # ------------------------------------------------------------------ the loop
    def run_once(self) -> None:
        """One iteration: take messages (blocking while idle), admit parked requests that are
        ready, run one :meth:`Engine.step` and send its outputs."""
        sched = self.engine.scheduler
        self._drain(block=not sched.has_work)
        if self.engine.pending:
            self._admit_pending()
        if not sched.has_work:
            return
        deltas = self.engine.step()  # a failing batch ends with errors inside it
        if deltas is None:
            if sched.reading_ahead:
                time.sleep(0.001)  # cached pages are coming from disk: do not spin
            return
        self._send_outputs(deltas)
        self.steps += 1
        if self.steps % INVARIANT_CHECK_EVERY == 0 or not sched.has_work:
            self._check_invariants()

    def serve_forever(self) -> None:
        """Loop until the parent (HTTP) process is gone: a SIGKILLed server must not leave an
        orphaned scheduler holding the model in memory."""
        parent = os.getppid()
        while os.getppid() == parent and not self.stopping:
            self.run_once()
            self.engine.check_parallel()  # a dead tensor-parallel rank stops the server
        if not self.stopping:
            log.error("the HTTP process is gone; the scheduler exits")
        self.engine.cache.persist()  # --cache-dir: what is cached survives the restart


def run_scheduler_process(config: EngineConfig, to_scheduler: str, from_scheduler: str,
                          log_level: str = "info") -> None:
    """Entry point of the child process: load the model, announce Ready, serve forever."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(to_scheduler)
    send = ctx.socket(zmq.PUSH)
    send.connect(from_scheduler)
    # Compute threads = the cores this process may run on (the HTTP process stays light).
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    start = time.perf_counter()
    engine = Engine(config=config)
    mc = engine.config.model
    quant = engine.runner.quant_report.summary()
    spec = engine.arch.encoder
    ngram = engine.config.scheduler.speculative_ngram
    log.info("model %s loaded in %.1f s (%s on %s, %s attention, weights %s, KV pool %d tokens "
             "in %s, %s, n-gram drafts %s)", engine.model_name, time.perf_counter() - start,
             mc.dtype, mc.device, mc.attention_backend, quant,
             engine.config.cache.max_total_tokens, mc.kv_cache_dtype,
             "batch-invariant" if engine.runner.batch_invariant else "not batch-invariant",
             f"up to {ngram} tokens" if ngram else "off")
    # The grammar compiler (xgrammar's import, the vocabulary's masks, the compile forkserver:
    # ~2 s of CPU) is ready before the server is: prepared behind the first requests it slowed
    # their passes 25x (a 3-ms decode step took 70-80 ms while the forkserver imported on the
    # other core), dropped a compute thread, and cost the peers' first noshare repetition 8%.
    engine.prepare_grammars().join()
    send.send(P.encode(P.Ready(
        model_name=engine.model_name, vocab_size=engine.arch.vocab_size,
        context_len=engine.context_len, max_total_tokens=engine.config.cache.max_total_tokens,
        dtype=mc.dtype, device=mc.device, kv_cache_dtype=mc.kv_cache_dtype,
        kv_bytes_per_token=engine.kv_pool.bytes_per_token(),
        attention_backend=mc.attention_backend, quantization=quant, compiled=engine.runner.compiled,
        batch_invariant=engine.runner.batch_invariant, speculative_ngram=ngram,
        hidden_size=engine.arch.hidden_size, embedding_only=engine.arch.embedding_only,
        pooling=engine.arch.pooling.method, num_labels=spec.num_labels if spec else 0,
        loras=engine.loras.served())))
    loop = SchedulerLoop(engine, recv, send)

    def stop(*_) -> None:
        loop.stopping = True

    signal.signal(signal.SIGTERM, stop)
    loop.serve_forever()
    engine.close()  # tensor-parallel ranks stop and are joined
    # Skip the interpreter's teardown of torch & co. (~0.75 s of every stop): what needed
    # saving is saved (the cache dir persisted, the ranks joined, the logs flushed below).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
