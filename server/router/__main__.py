"""``python -m server.router --worker-urls URL [URL ...]``: the data-parallel router.

Workers are ordinary servers (``python -m server``), on this machine or others; the router
passes the native and OpenAI APIs through to them (see :mod:`server.router.router`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from server.router.policy import POLICIES


def build_parser() -> argparse.ArgumentParser:
    """``python -m server.router``'s command line (the standalone router; ``python -m server
    --dp-size N`` starts one itself)."""
    p = argparse.ArgumentParser(prog="python -m server.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-urls", nargs="*", default=[], help="base URLs of the workers "
                   "(more can be added at run time: POST /workers with {'url': ...})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="cache_aware "
                   "(longest matched prefix unless the load is unbalanced; default), "
                   "round_robin, least_load")
    p.add_argument("--chars-per-token", type=float, default=4.0, help="characters per token "
                   "when a worker's KV capacity sizes its prefix tree")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between "
                   "health checks of each worker")
    p.add_argument("--parent-pid", type=int, default=None, help="exit once the process with "
                   "this pid is gone (launchers and tests set it)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def run_router(urls: list[str], host: str, port: int, policy: str = "cache_aware",
               chars_per_token: float = 4.0, health_interval: float = 2.0,
               log_level: str = "info", parent_pid: int | None = None) -> int:
    """Serve the router until SIGTERM/SIGINT (or until ``parent_pid`` is gone); returns the
    exit code."""
    import uvicorn

    from server.router.app import create_router_app
    from server.router.router import Router

    router = Router(urls, policy, chars_per_token, health_interval, parent_pid=parent_pid)
    print(f"sgl-adapters router ready: http://{host}:{port} ({policy}, {len(urls)} workers)",
          flush=True)
    uvicorn.run(create_router_app(router), host=host, port=port, log_level=log_level,
                access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv) and run the router; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_router(args.worker_urls, args.host, args.port, args.policy,
                      args.chars_per_token, args.health_interval, args.log_level,
                      args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
