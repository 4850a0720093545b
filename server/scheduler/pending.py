"""Requests accepted but not yet queued: waiting for their grammar to compile or their images to
be preprocessed, both on worker threads, so the scheduler loop keeps stepping meanwhile (a
regex can take seconds to compile, a 4096x4096 image ~0.3 s to decode and resize).

:class:`PendingRequests` is part of the engine core (``Engine.pending``): the scheduler process
hands it each request and, once per loop iteration, takes back the ones that became ready
(queued) or failed (refused). A request whose compile or preprocessing is not done
``COMPILE_TIMEOUT_S`` seconds after it arrived is refused (a compile is left to finish and be
cached). Errors: GrammarError, InvalidRequestError, SamplingParamsError (the refusals, raised by
:meth:`submit` or returned by :meth:`admit_ready`).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from server.constrained.grammar import COMPILE_TIMEOUT_S, GrammarCompiler
from server.constrained.spec import GrammarError
from server.sampling_params import SamplingParams, SamplingParamsError
from server.scheduler.request import Req
from server.scheduler.validation import InvalidRequestError

REFUSALS = (InvalidRequestError, SamplingParamsError, GrammarError)  # a request's own fault


@dataclass
class _Parked:
    input_ids: list[int]
    params: SamplingParams
    options: dict[str, Any]  # make_request's other keyword arguments
    grammar: concurrent.futures.Future | None
    pixels: concurrent.futures.Future | None
    since: float = field(default_factory=time.monotonic)  # seconds, monotonic clock


class PendingRequests:
    """Args: make_request (``Engine.make_request``), queue (``Scheduler.add_request``),
    grammars (returns the engine's GrammarCompiler, built on first use), preprocess (the
    images' ``preprocess_async``: encoded bytes -> a future of pixel values)."""

    def __init__(self, make_request: Callable[..., Req], queue: Callable[[Req], None],
                 grammars: Callable[[], GrammarCompiler],
                 preprocess: Callable[[Sequence[bytes]], concurrent.futures.Future]):
        self._make, self._queue = make_request, queue
        self._grammars, self._preprocess = grammars, preprocess
        self._parked: dict[str, _Parked] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, rid: str) -> bool:
        return rid in self._parked

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams,
               images: Sequence[tuple[int, int, bytes]] = (), **options: Any) -> Req | None:
        """Queue a request (returns it), or park it until its grammar and images are ready
        (returns None; :meth:`admit_ready` queues it later). ``images``: (offset, radix key,
        encoded bytes) each; ``options``: the rest of ``make_request``'s keyword arguments.
        Raises a refusal (nothing kept) when the request can never run."""
        grammar = (self._grammars().compile_async(params.grammar)
                   if params.grammar is not None else None)
        pixels = self._preprocess([data for _, _, data in images]) if images else None
        parked = _Parked(input_ids, params, {**options, "rid": rid, "images": list(images)},
                         grammar, pixels)
        if (grammar is None or grammar.done()) and pixels is None:
            return self._admit(parked, None)
        self._parked[rid] = parked
        return None

    def admit_ready(self) -> list[tuple[str, Req | Exception]]:
        """Queue the parked requests whose grammar and images are ready; refuse those whose
        compile or preprocessing failed or ran over the budget. Returns (rid, the queued Req
        or the refusal) for each one that left."""
        now, done = time.monotonic(), []
        for rid, parked in list(self._parked.items()):
            ready = all(f is None or f.done() for f in (parked.grammar, parked.pixels))
            if not (ready or now - parked.since > COMPILE_TIMEOUT_S):
                continue
            del self._parked[rid]
            try:
                if parked.grammar is not None:
                    GrammarCompiler.result(parked.grammar, parked.params.grammar, timeout=0)
                try:
                    pixels = parked.pixels.result(timeout=0) if parked.pixels else None
                except concurrent.futures.TimeoutError:
                    raise InvalidRequestError("image_data", "preprocessing the images took over "
                                              f"{COMPILE_TIMEOUT_S:.0f} s") from None
                done.append((rid, self._admit(parked, pixels)))
            except REFUSALS as exc:
                done.append((rid, exc))
        return done

    def drop(self, rid: str) -> bool:
        """Forget a parked request (its client went away); False if none was parked."""
        return self._parked.pop(rid, None) is not None

    def uses_adapter(self, name: str) -> bool:
        """Whether a parked request runs with LoRA adapter ``name`` (it may not be unloaded)."""
        return any(p.options.get("lora") == name for p in self._parked.values())

    def _admit(self, parked: _Parked, pixels: list | None) -> Req:
        req = self._make(parked.input_ids, parked.params, pixels=pixels, **parked.options)
        self._queue(req)
        return req
