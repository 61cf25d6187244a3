"""``weightship-controlplane``: run the control plane, or migrate its database.

    weightship-controlplane serve [--host 127.0.0.1] [--port 8080] [--log-level info]
    weightship-controlplane migrate [--show]

``--host`` and ``--port`` default to ``WEIGHTSHIP_HOST`` and ``WEIGHTSHIP_PORT`` when set.
Everything else is configured by environment variables (``controlplane.settings``):
``WEIGHTSHIP_DATABASE_URL``, ``WEIGHTSHIP_STORE``, ``WEIGHTSHIP_ADMIN_TOKEN``, ... ``serve``
migrates the database at start-up too, so ``migrate`` is only needed to do it ahead of a rollout
or to see where a database stands.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

log = logging.getLogger("controlplane")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightship-controlplane", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP API (migrates the database first)")
    serve.add_argument(
        "--host", default=os.environ.get("WEIGHTSHIP_HOST", "127.0.0.1"), help="address to bind (default: %(default)s)"
    )
    serve.add_argument(
        "--port", type=int, default=int(os.environ.get("WEIGHTSHIP_PORT", "8080")), help="port (default: %(default)s)"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    migrate = commands.add_parser("migrate", help="bring the database schema to the newest revision")
    migrate.add_argument("--show", action="store_true", help="only print the current and newest revision")
    return parser


def _serve(host: str, port: int, log_level: str) -> int:
    import uvicorn

    from controlplane.app import create_app
    from controlplane.settings import Settings

    settings = Settings()
    log.info("controlplane_starting host=%s port=%d store=%s", host, port, settings.store_url)
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, proxy_headers=True)
    return 0


def _migrate(show: bool) -> int:
    from controlplane import migrate
    from controlplane.db import make_engine
    from controlplane.settings import Settings

    engine = make_engine(Settings().database_url)
    try:
        before = migrate.current_revision(engine)
        if not show:
            migrate.upgrade(engine)
        after = migrate.current_revision(engine)
    finally:
        engine.dispose()
    print(f"database: {engine.url.render_as_string(hide_password=True)}")
    print(f"revision: {before or 'empty'} -> {after or 'empty'} (newest: {migrate.head_revision()})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``weightship-controlplane``."""
    args = _parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if level != "DEBUG":
        logging.getLogger("alembic").setLevel(logging.WARNING)  # its INFO lines narrate plugin set-up
    from weightship.errors import WeightshipError

    try:
        if args.command == "serve":
            return _serve(args.host, args.port, args.log_level)
        return _migrate(args.show)
    except WeightshipError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
