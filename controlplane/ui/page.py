"""The two whole pages under ``/ui/``: the login form, and the status page around its live sections."""

from __future__ import annotations

from controlplane.auth import Principal
from controlplane.ui.render import NODE_FILTERS, e, render_nodes, render_sections
from controlplane.ui.summary import Summary

__all__ = ["login_page", "status_page"]

_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="/ui/static/vendor/uPlot.min.css"><link rel="stylesheet" href="/ui/static/ui.css">
</head>"""


def login_page(error: str = "") -> str:
    """The login form: a token, posted once, never put in a URL."""
    message = f'<p class="error" role="alert">{e(error)}</p>' if error else ""
    return (
        _HEAD.format(title="weightship · sign in")
        + '<body class="login"><main><h1>weightship</h1><p>Sign in with an API token (any role that may read).</p>'
        + message
        + '<form method="post" action="/ui/login" autocomplete="off">'
        '<label for="token">token</label> <input id="token" name="token" type="password" required autofocus> '
        '<button type="submit">sign in</button></form></main></body></html>'
    )


def status_page(summary: Summary, principal: Principal) -> str:
    """The status page as of ``summary``; the script keeps it live."""
    sections = render_sections(summary)
    filters = "".join(f'<option value="{f}">{f}</option>' for f in NODE_FILTERS)
    return (
        _HEAD.format(title="weightship · status")
        + '<body><header><h1>weightship</h1><span id="live" class="live">connecting…</span>'
        f'<span class="who">{e(principal.name)} ({e(principal.role.value)})</span>'
        '<form method="post" action="/ui/logout"><button type="submit">sign out</button></form></header><main>'
        f'<div id="overview" class="live-section">{sections["overview"]}</div>'
        '<section class="charts"><div><h2>distribution: MiB delivered per source</h2><div id="chart-bytes"></div></div>'
        '<div><h2>serving signals per version</h2><div id="chart-serve"></div></div></section>'
        f'<h2>deployments</h2><div id="deployments" class="live-section">{sections["deployments"]}</div>'
        f'<h2>nodes with problems</h2><div id="problems" class="live-section">{sections["problems"]}</div>'
        '<h2>nodes</h2><form id="node-filter"><select name="filter">' + filters + "</select> "
        '<input name="q" placeholder="name, region or cluster" maxlength="128"></form>'
        f'<div id="nodes">{render_nodes(summary, 1, "all", "")}</div>'
        '</main><script src="/ui/static/vendor/uPlot.iife.min.js"></script><script src="/ui/static/ui.js"></script>'
        "</body></html>"
    )
