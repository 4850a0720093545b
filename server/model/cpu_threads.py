"""How many intra-op threads a CPU forward pass runs on: every core this process may use, one
fewer while other processes' work preempts its passes.

Why: a forward pass is a few hundred parallel regions (``at::parallel_for`` over OpenMP), each
ending at a barrier. When another process wakes on one of the cores (the HTTP process, a client
on the same machine, a grammar compile), the thread there is preempted and every region waits
for it. In the hostile soak (``python -m benchmarks.soak``, 2 cores, the HTTP process busy
50-75 % of a core answering hostile clients) mixed passes of 14 rows took 0.8-2.8 s instead of
~40 ms and streams stalled for up to 3 s; on one thread the longest stall was 0.43 s. Quiet,
two threads decode 1.7x as fast as one (8 streams of the default model on a 2-core Zen 4), so
the count follows the load. vLLM and SGLang leave this to the operator (OMP thread binding,
cores reserved for the front end); with two cores there is nothing to reserve.

The thread count never changes a result: the native CPU kernels split work by rows or by
fixed KV partitions, whatever the number of threads (``tests/model/test_batch_invariance.py``
checks it).

Down: slow passes, each over ``SLOW_FACTOR`` times the fastest pass of its size (new tokens
and attended positions, in powers of two) seen at this thread count and over ``SLOW_S``: the
threads are being preempted. While probing one is enough; otherwise the first of a
``SLOW_WINDOW_S`` window is a hiccup, and a thread drops once the window's slow passes (two at
least) lost ``LOST_S`` in all (seconds beyond their sizes' fastest). The soak's stalled passes
were 20-70x their size's usual time (0.8-2.8 s); in a whole peers benchmark run one pass, alone,
tripped the factor. Why a loss bound and a short cool-down (2-core Zen 4, 2026-11-27): two
one-token steps that lost 60 ms each used to drop a thread for 2 s, and when a client started
on the other core (the peers' agreement check) 4 ms steps took 85 ms and the thread came back
only after the first noshare repetition had begun (3.65 prompts/s against 4.07 for the later
ones and 4.06 with ``--cpu-threads 2``). A bound on each pass's loss (0.25 s) kept two threads
under the hostile soak's steady stalls instead (1,208-1,495 well-behaved 200s in 120 s against
2,296, stream gaps p99 313 ms against 246 ms); the loss in all with a 0.5-s cool-down gave
2,330 and 182 ms.

Up: a probe, ``COOLDOWN_S`` after the drop if other processes used under ``BUSY_CORES`` of this
process's cores since the drop or the last check, ``WINDOW_S`` or more (``/proc/stat``'s
per-CPU busy ticks minus this process's CPU time); a probe that fails within ``PROBE_S``
multiplies the cool-down by 4, up to ``MAX_COOLDOWN_S``, so on a machine that stays busy a
failed probe (one slow pass) comes every five minutes. Neither others' CPU time nor this
process's run delay tells the two cases apart by itself: in the peers benchmark the HTTP
process and the client use about a core at times, as in the soak, and two threads stay 1.3-1.5x
as fast there. Without ``/proc/stat`` (not Linux) the count stays at every core.

The threads' wait at each region's end (:func:`openmp_env`): libgomp spins 300,000 times before
it sleeps, so a thread that is done keeps its core while the one still working was preempted
to the other, and a probe's pass on two threads under load took 1-2 s; spinning 10,000 times
(``GOMP_SPINCOUNT``, read once when libgomp loads) lets the preempted thread take the freed
core. Hostile soak, 300 s, 2-core Zen 4: stream gaps max 0.35-0.50 s (2.2 s with the default);
the peers benchmark and in-process decode of 1 and 8 streams are within their noise.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("server.model")

SLOW_FACTOR = 4.0  # a pass this many times its size's fastest ...
SLOW_S = 0.05  # ... and this many seconds long is slow; slow passes that lost ...
LOST_S = 0.25  # ... this many seconds in all beyond their fastest (two at least) ...
SLOW_WINDOW_S = 10.0  # ... within a window of this many seconds drop a thread
COOLDOWN_S = 0.5  # seconds at fewer threads before a probe with one more ...
MAX_COOLDOWN_S = 300.0  # ... x4 up to this by each probe that fails within PROBE_S
PROBE_S = 5.0
WINDOW_S = 0.25  # seconds between checks of the CPU counters for a probe ...
BUSY_CORES = 1.0  # ... and the others' use of our cores (in cores) that postpones it
GOMP_SPIN_COUNT = "10000"  # spins before an OpenMP thread that waits sleeps (libgomp: 300,000)
_IDLE_FIELDS = (3, 4)  # idle, iowait in a /proc/stat cpuN line (after the name)


def openmp_env() -> dict[str, str]:
    """Environment defaults for a process that will run CPU forward passes, to set before it
    starts (OpenMP reads them once, when torch loads it); a value the user set wins. Source:
    libgomp's manual, ``GOMP_SPINCOUNT``."""
    return {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)}


def _busy_ticks(cores: frozenset[int], path: str = "/proc/stat") -> int | None:
    """Busy clock ticks (all but idle and iowait) of ``cores`` since boot; None when the
    counters cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    for line in text.split(b"\n"):
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        name, *fields = line.split()
        if int(name[3:]) in cores:
            total += sum(int(v) for i, v in enumerate(fields[:8]) if i not in _IDLE_FIELDS)
    return total


class AdaptiveThreads:
    """Sets ``torch.set_num_threads`` around each CPU forward pass (:meth:`before_pass`,
    :meth:`after_pass`).

    Args:
        fixed: a thread count to keep (``--cpu-threads N``); 0 adapts as the module says.
        cores: the CPUs this process may run on (default ``os.sched_getaffinity(0)``).
        stat_path: the kernel's CPU counters (a test points it at a file it writes).
    """

    def __init__(self, fixed: int = 0, cores: frozenset[int] | None = None,
                 stat_path: str = "/proc/stat"):
        import torch

        self._torch = torch
        self.cores = frozenset(cores if cores is not None else os.sched_getaffinity(0))
        self.max_threads = fixed or len(self.cores)
        self.adaptive = fixed == 0 and len(self.cores) > 1
        self._stat_path = stat_path
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self._last = self._sample() if self.adaptive else None
        self.adaptive = self._last is not None
        self.cooldown_s = COOLDOWN_S
        self._down_at = self._up_at = -1e9  # monotonic times of the last change each way
        self._slow_at = -1e9  # of the first slow pass of the window
        self._lost = 0.0  # seconds its slow passes lost beyond their sizes' fastest
        self.other_cores = 0.0  # other processes' use of our cores in the last window
        self._fastest: dict[tuple[int, int, int], float] = {}  # (threads, sizes) -> seconds
        self._start = 0.0  # of the pass in flight
        self.threads = self.max_threads
        torch.set_num_threads(self.threads)

    def _sample(self) -> tuple[float, float, int] | None:
        ticks = _busy_ticks(self.cores, self._stat_path)
        return None if ticks is None else (time.monotonic(), time.process_time(), ticks)

    def before_pass(self) -> int:
        """Start timing a pass; bring a thread back when a probe is due. Returns the thread
        count in force."""
        if self._torch.get_num_threads() != self.threads:  # another engine in this process
            self._torch.set_num_threads(self.threads)
        if not self.adaptive:
            return self.threads
        now = time.monotonic()
        if (self.threads < self.max_threads and now - self._down_at >= self.cooldown_s
                and now - self._last[0] >= WINDOW_S):
            sample = self._sample()
            if sample is not None:
                (t0, cpu0, ticks0), (t1, cpu1, ticks1) = self._last, sample
                self._last = sample
                self.other_cores = max(0.0, ((ticks1 - ticks0) * self._tick_s
                                             - (cpu1 - cpu0)) / (t1 - t0))
                if self.other_cores < BUSY_CORES:
                    self._up_at = now
                    log.info("CPU threads %d -> %d (a probe: other processes used %.2f of "
                             "the cores)", self.threads, self.threads + 1, self.other_cores)
                    self._set(self.threads + 1)
        self._start = time.perf_counter()
        return self.threads

    def after_pass(self, tokens: int, context: int) -> None:
        """The pass started by :meth:`before_pass` is done: ``tokens`` new tokens attending to
        ``context`` positions in all (its size, in powers of two of each). A pass far slower
        than the fastest of its size at this thread count drops a thread."""
        if not self.adaptive:
            return
        seconds = time.perf_counter() - self._start
        key = (self.threads, max(tokens, 1).bit_length(), max(context, 1).bit_length())
        fastest = self._fastest.get(key)
        if fastest is None or seconds < fastest:
            self._fastest[key] = seconds
        elif self.threads > 1 and seconds > max(SLOW_FACTOR * fastest, SLOW_S):
            now = time.monotonic()
            probing = now - self._up_at < PROBE_S
            if not probing:
                first = now - self._slow_at > SLOW_WINDOW_S
                if first:  # a hiccup, or the start of a busy spell
                    self._slow_at, self._lost = now, 0.0
                self._lost += seconds - fastest
                if first or self._lost < LOST_S:
                    return
            self.cooldown_s = min(4 * self.cooldown_s, MAX_COOLDOWN_S) if probing \
                else COOLDOWN_S
            self._down_at, self._slow_at = now, -1e9
            log.info("CPU threads %d -> %d (a pass of %d tokens took %.3f s, its size's fastest "
                     "%.3f s)", self.threads, self.threads - 1, tokens, seconds, fastest)
            self._set(self.threads - 1)

    def _set(self, threads: int) -> None:
        self._last = self._sample() or self._last  # windows count from the change
        if threads != self.threads:
            self.threads = threads
            self._torch.set_num_threads(threads)
