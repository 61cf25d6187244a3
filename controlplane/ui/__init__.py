"""The read-only status page at ``/ui/``: a fleet and its rollouts at a glance, live in a browser.

- ``sessions``: the login session (opaque id in an HttpOnly cookie, the principal server-side);
- ``summary``: what the page shows, read with the read routes' own query functions;
- ``hub``: one broadcaster per process, fed by the change feed that wakes the agents, so open
  pages cost no query of their own;
- ``render`` and ``page``: server-rendered HTML; ``static/``: the page script, styles and the
  vendored chart library (uPlot);
- ``routes``: ``/ui/`` itself, login and logout, the event stream, node pages.

See ``docs/ui.md``.
"""

from __future__ import annotations

from controlplane.ui.routes import install

__all__ = ["install"]
