"""The CPU thread count follows the load (server.model.cpu_threads): two slow passes drop a
thread, one does not, nor do stalls that lose less in all than a drop costs; a probe brings it
back after the cool-down unless other processes keep the cores busy; a failed probe lengthens
the cool-down; a fixed count never moves. The clock and the kernel's CPU counters are fakes the
test drives."""

from __future__ import annotations

import types

import pytest
import torch

from server.model import cpu_threads as ct


class Machine:
    """A fake clock and /proc/stat for two CPUs; ``others`` is the other processes' use of
    them (in cores) while time passes."""

    def __init__(self, tmp_path, monkeypatch):
        self.now, self.cpu, self.ticks, self.others = 1000.0, 0.0, 0, 0.0
        self.stat = tmp_path / "stat"
        self._write()
        monkeypatch.setattr(ct, "time", types.SimpleNamespace(
            monotonic=lambda: self.now, perf_counter=lambda: self.now,
            process_time=lambda: self.cpu))
        monkeypatch.setattr(ct.os, "sysconf", lambda name: 100)  # ticks per second

    def _write(self) -> None:
        half = self.ticks // 2
        self.stat.write_text(f"cpu  {self.ticks} 0 0 0 0 0 0 0 0 0\n"
                             f"cpu0 {half} 0 0 500 7 0 0 0 0 0\n"
                             f"cpu1 {self.ticks - half} 0 0 500 7 0 0 0 0 0\n"
                             "intr 1 2 3\nprocs_running 2\n")

    def wait(self, seconds: float, ours: float = 1.0) -> None:
        """Let ``seconds`` pass with this process using ``ours`` cores."""
        self.now += seconds
        self.cpu += ours * seconds
        self.ticks += round((ours + self.others) * seconds * 100)
        self._write()

    def run_pass(self, threads: ct.AdaptiveThreads, seconds: float, tokens: int = 16) -> int:
        threads.before_pass()
        self.wait(seconds)
        threads.after_pass(tokens, 100)
        return threads.threads


@pytest.fixture
def machine(tmp_path, monkeypatch):
    yield Machine(tmp_path, monkeypatch)
    torch.set_num_threads(len(ct.os.sched_getaffinity(0)))


def test_two_slow_passes_drop_a_thread_and_one_does_not(machine):
    t = ct.AdaptiveThreads(cores=frozenset({0, 1}), stat_path=str(machine.stat))
    assert t.adaptive and t.threads == 2 and torch.get_num_threads() == 2
    for _ in range(3):
        machine.run_pass(t, 0.02)  # the fastest of its size: 20 ms
    assert machine.run_pass(t, 0.5) == 2  # one slow pass: a hiccup
    machine.wait(11)
    assert machine.run_pass(t, 0.5) == 2  # another, 11 s later: still a hiccup
    assert machine.run_pass(t, 0.02) == 2
    assert machine.run_pass(t, 0.3) == 1  # a second within 10 s (> 4x; 0.76 s lost): down
    assert torch.get_num_threads() == 1


def test_a_burst_of_short_stalls_keeps_the_threads_and_a_steady_one_drops_one(machine):
    # one-token steps of 4 ms stalled to 64 ms while a burst of prompts arrived: 16x their
    # size's fastest, but the 120 ms two of them lost is far less than a drop costs
    t = ct.AdaptiveThreads(cores=frozenset({0, 1}), stat_path=str(machine.stat))
    machine.run_pass(t, 0.004, tokens=1)
    assert machine.run_pass(t, 0.064, tokens=1) == 2
    assert machine.run_pass(t, 0.064, tokens=1) == 2
    machine.wait(ct.SLOW_WINDOW_S + 1)  # stalls that keep coming: 60 ms lost each
    for _ in range(4):  # 0.24 s lost in all, under LOST_S
        assert machine.run_pass(t, 0.064, tokens=1) == 2
    assert machine.run_pass(t, 0.064, tokens=1) == 1  # 0.30 s: down


def test_a_pass_of_another_size_is_not_slow(machine):
    t = ct.AdaptiveThreads(cores=frozenset({0, 1}), stat_path=str(machine.stat))
    machine.run_pass(t, 0.02, tokens=1)
    for _ in range(2):  # a 1000-token prefill is 50x a one-token decode: its own size class
        assert machine.run_pass(t, 1.0, tokens=1000) == 2


def _dropped(machine) -> ct.AdaptiveThreads:
    t = ct.AdaptiveThreads(cores=frozenset({0, 1}), stat_path=str(machine.stat))
    machine.run_pass(t, 0.02)
    machine.run_pass(t, 0.5)
    assert machine.run_pass(t, 0.5) == 1
    return t


def test_a_probe_after_the_cooldown_brings_the_thread_back(machine):
    t = _dropped(machine)
    machine.wait(ct.COOLDOWN_S / 2)
    assert machine.run_pass(t, 0.03) == 1  # cooling down
    machine.wait(ct.COOLDOWN_S)
    assert machine.run_pass(t, 0.02) == 2 and torch.get_num_threads() == 2
    machine.wait(ct.PROBE_S + 1)
    assert machine.run_pass(t, 0.5) == 2  # the probe held: a later slow pass is a hiccup


def test_busy_cores_postpone_the_probe_and_a_failed_probe_backs_off(machine):
    t = _dropped(machine)
    machine.others = 1.5  # other processes keep 1.5 cores busy
    machine.wait(3 * ct.COOLDOWN_S)
    assert machine.run_pass(t, 0.03) == 1 and t.other_cores > ct.BUSY_CORES
    machine.others = 0.2
    machine.wait(ct.WINDOW_S)
    assert machine.run_pass(t, 0.02) == 2  # the probe
    assert machine.run_pass(t, 0.5) == 1  # one slow pass while probing fails it
    assert t.cooldown_s == 4 * ct.COOLDOWN_S
    machine.wait(2 * ct.COOLDOWN_S)
    assert machine.run_pass(t, 0.03) == 1  # the longer cool-down


def test_a_fixed_count_never_moves_and_is_restored_before_each_pass(machine):
    t = ct.AdaptiveThreads(fixed=1, cores=frozenset({0, 1}), stat_path=str(machine.stat))
    assert not t.adaptive and torch.get_num_threads() == 1
    torch.set_num_threads(2)  # another engine in this process
    for _ in range(3):
        assert machine.run_pass(t, 0.02) == 1 and torch.get_num_threads() == 1
        machine.run_pass(t, 0.9)
    assert t.threads == 1


def test_without_the_counters_the_count_stays_at_every_core(machine, tmp_path):
    t = ct.AdaptiveThreads(cores=frozenset({0, 1}), stat_path=str(tmp_path / "missing"))
    assert not t.adaptive and t.threads == 2


def test_openmp_env_keeps_the_users_spin_count(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert ct.openmp_env() == {"GOMP_SPINCOUNT": ct.GOMP_SPIN_COUNT}
    monkeypatch.setenv("GOMP_SPINCOUNT", "INFINITE")
    assert ct.openmp_env() == {"GOMP_SPINCOUNT": "INFINITE"}
