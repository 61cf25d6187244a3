"""``weightship-controlplane``: run the control plane, or migrate its database.

    weightship-controlplane serve [--host 127.0.0.1] [--port 8080] [--log-level info]
    weightship-controlplane migrate [--show]

``--host`` and ``--port`` default to ``WEIGHTSHIP_HOST`` and ``WEIGHTSHIP_PORT`` when set.
Everything else is configured by environment variables (``controlplane.settings``):
``WEIGHTSHIP_DATABASE_URL``, ``WEIGHTSHIP_STORE``, ``WEIGHTSHIP_ADMIN_TOKEN``, ... ``serve``
migrates the database at start-up too, so ``migrate`` is only needed to do it ahead of a rollout
or to see where a database stands.

The public URL (``WEIGHTSHIP_PUBLIC_URL``) is where agents fetch the blob URLs this process signs.
When it is not set, ``serve`` derives it from the address it actually bound (the host name when
binding every interface), and it logs the URL it uses. A public URL that cannot reach this
process stops ``serve`` with one line and exit status 1, instead of handing agents URLs that
fail forever: not http/https, unparseable, loopback while binding another address, or loopback
or the bound host on another port where nothing listens (a proxy in front, started first, is
fine).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from controlplane.settings import Settings
from weightship.logs import event

__all__ = ["main"]

log = logging.getLogger("controlplane")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightship-controlplane", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP API (migrates the database first)")
    serve.add_argument(
        "--host", default=os.environ.get("WEIGHTSHIP_HOST", "127.0.0.1"), help="address to bind (default: %(default)s)"
    )
    serve.add_argument("--port", type=int, default=_default_port(), help="port (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    migrate = commands.add_parser("migrate", help="bring the database schema to the newest revision")
    migrate.add_argument("--show", action="store_true", help="only print the current and newest revision")
    return parser


def _default_port() -> int:
    """``WEIGHTSHIP_PORT``, else 8080; one clear line (exit 1) when it is not a port."""
    text = os.environ.get("WEIGHTSHIP_PORT", "8080").strip()
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        print(f"error: WEIGHTSHIP_PORT is {text!r}, not a port number (0-65535): fix it or unset it", file=sys.stderr)
        sys.exit(1)
    return int(text)


def _settings() -> Settings:
    """The settings from the environment, with the database and the store checked, or one ``WeightshipError``.

    A wrong URL stops the process here with one line naming the variable, instead of a traceback
    from inside the server's start-up.
    """
    from sqlalchemy import exc, make_url, text

    from controlplane.persistence.engine import make_engine
    from controlplane.persistence.store import open_store
    from weightship.errors import WeightshipError

    settings = Settings()
    fix = "set WEIGHTSHIP_DATABASE_URL to sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
    try:
        shown = make_url(settings.database_url).render_as_string(hide_password=True)
        engine = make_engine(settings.database_url)
    except (exc.ArgumentError, ValueError, ImportError) as err:
        # the URL may carry a password: name the failure, not the text
        raise WeightshipError(
            f"WEIGHTSHIP_DATABASE_URL is not a database URL this control plane can use ({type(err).__name__}); {fix}"
        ) from None
    except OSError as err:  # the directory of a SQLite file cannot be made
        raise WeightshipError(
            f"cannot open the database {shown} (WEIGHTSHIP_DATABASE_URL): {err.strerror or err} at {err.filename}; "
            f"choose a writable path, or {fix}"
        ) from None
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except exc.SQLAlchemyError as err:
        cause = getattr(err, "orig", None) or err
        raise WeightshipError(
            f"cannot open the database {shown} (WEIGHTSHIP_DATABASE_URL): {str(cause).strip().splitlines()[0]}; "
            f"check that it runs and that this process may reach it, or {fix}"
        ) from None
    finally:
        engine.dispose()
    try:
        open_store(settings)
    except WeightshipError as err:
        raise WeightshipError(f"WEIGHTSHIP_STORE: {err.message}") from None
    return settings


_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # binding these means every interface


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _derive_public_url(bind_host: str, port: int) -> str:
    """The URL at which this process is reachable when nobody said otherwise."""
    host = socket.gethostname() if bind_host in _WILDCARD_HOSTS else bind_host
    return f"http://{_url_host(host)}:{port}"


def _check_public_url(url: str, bind_host: str, port: int) -> str:
    """``url`` without a trailing slash, or a ``WeightshipError`` saying why it cannot reach this process."""
    from weightship.errors import WeightshipError

    fix = f"set WEIGHTSHIP_PUBLIC_URL to the URL agents reach this process at, e.g. http://HOST:{port}, or unset it"
    try:
        parts = urlsplit(url)
        url_port = parts.port
    except ValueError as exc:
        raise WeightshipError(f"WEIGHTSHIP_PUBLIC_URL {url!r} is not a URL ({exc}); {fix}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WeightshipError(f"WEIGHTSHIP_PUBLIC_URL {url!r} is not an http:// or https:// URL with a host; {fix}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise WeightshipError(f"WEIGHTSHIP_PUBLIC_URL {url!r} must not carry a query, fragment or user; {fix}")
    host = parts.hostname
    effective = url_port if url_port is not None else (443 if parts.scheme == "https" else 80)
    local = _is_loopback(host) or host == bind_host.strip("[]")
    if local and effective != port and not _listening(host, effective):
        # Another port on this host is right only behind a proxy there, and a proxy is started first.
        raise WeightshipError(
            f"WEIGHTSHIP_PUBLIC_URL {url!r} names port {effective} on this host, but the control plane listens on "
            f"port {port} and nothing listens on {effective}: every blob URL handed to agents would fail; {fix}"
        )
    if _is_loopback(host) and bind_host not in _WILDCARD_HOSTS and not _is_loopback(bind_host):
        raise WeightshipError(
            f"WEIGHTSHIP_PUBLIC_URL {url!r} is a loopback address, but the control plane listens only on "
            f"{bind_host}; {fix}"
        )
    return url.rstrip("/")


def _listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port`` right now."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one), or one clear error."""
    from weightship.errors import WeightshipError

    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise WeightshipError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --host/--port, "
            "or stop the process that holds it"
        ) from None
    return sock


def _tune_gc() -> None:
    """Keep garbage-collection pauses out of request latency (``controlplane.heap``)."""
    from controlplane import heap

    heap.tune()


def _serve(host: str, port: int, log_level: str) -> int:
    import uvicorn

    from controlplane.app import create_app
    from controlplane.server import DrainingServer

    sock = _bind(host, port)
    bound_port = int(sock.getsockname()[1])
    explicit = os.environ.get("WEIGHTSHIP_PUBLIC_URL", "").strip()
    try:
        public_url = _check_public_url(explicit, host, bound_port) if explicit else _derive_public_url(host, bound_port)
    except BaseException:
        sock.close()
        raise
    try:
        settings = dataclasses.replace(_settings(), public_url=public_url)
    except BaseException:
        sock.close()
        raise
    event(
        log,
        "controlplane.starting",
        host=host,
        port=bound_port,
        public_url=public_url,
        public_url_from="WEIGHTSHIP_PUBLIC_URL" if explicit else "bound_address",
        store=settings.store_url,
    )
    app = create_app(settings)
    config = uvicorn.Config(app, host=host, port=bound_port, log_level=log_level, proxy_headers=True)
    _tune_gc()
    DrainingServer(config, app).run(sockets=[sock])
    return 0


def _migrate(show: bool) -> int:
    from controlplane.persistence import migrate
    from controlplane.persistence.engine import make_engine

    engine = make_engine(_settings().database_url)
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
