"""Suite-wide checks on the live test servers (a pytest plugin, loaded by tests/conftest.py).

* **Bounded generations.** After each test, every running :class:`tests.live_server.ServerProcess`
  is asked for ``unbounded_requests`` (requests that gave no max_tokens, so their length was up to
  the model: thousands of tokens on one CPU, a handful on another). A test that sent one fails,
  named, unless it is marked ``unbounded_ok`` (a test of that default itself, on a small
  context).
* **Timeouts that say why.** pytest-timeout's per-test limit (``timeout`` in pyproject.toml) is
  handled here in the main thread: the test fails with its name, each live server's requests in
  flight (``/server_info``'s ``requests``: lengths, max_new_tokens, seconds) and the last lines
  of its log, instead of a bare "Timeout".
"""

from __future__ import annotations

import signal
import threading

import pytest

from tests.live_server import live_servers

LOG_TAIL = 30  # server log lines shown with a timeout


def pytest_configure(config):
    config.addinivalue_line("markers", "unbounded_ok: the test sends requests without "
                            "max_tokens on purpose (it checks that default, on a small context)")


@pytest.fixture(autouse=True)
def _generations_are_bounded(request):
    yield
    allowed = request.node.get_closest_marker("unbounded_ok") is not None
    for server in live_servers():
        try:
            count = server.server_info()["unbounded_requests"]
        except Exception:  # noqa: BLE001 - a server a fault test broke on purpose
            continue
        new, server.unbounded_seen = count - server.unbounded_seen, count
        if new > 0 and not allowed:
            pytest.fail(f"{new} request(s) to the server at {server.url} gave no max_tokens: "
                        "their length (and this test's duration) would depend on how long the "
                        "model's greedy text runs; set a max_tokens suited to what the test "
                        "checks", pytrace=False)


def server_report() -> str:
    """Each live server's requests in flight and log tail, as text."""
    parts = []
    for server in live_servers():
        try:
            requests = server.server_info(timeout=5.0)["requests"]
        except Exception as exc:  # noqa: BLE001 - a report must not fail
            requests = f"(/server_info did not answer: {exc})"
        parts.append(f"--- server {server.url} (args {' '.join(server.args)})\n"
                     f"requests in flight: {requests}\n"
                     f"log tail:\n{''.join(server.log[-LOG_TAIL:])}")
    return "\n".join(parts) or "(no live test server)"


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own thread method

    def on_timeout(signum, frame):
        __tracebackhide__ = True
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        pytest.fail(f"{item.nodeid} timed out after {settings.timeout} s\n{server_report()}",
                    pytrace=True)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
