"""The node's own credential: the node token that enrolment returned, kept in the data directory.

An agent is configured with an *enrolment token* (shared by the machines an admin provisions).
On its first start it generates a *node token*, stores it here, and enrols
(``POST /v1/nodes/enrol``) proposing it; the control plane binds it to this node, for this node
only. Every later call, across restarts, uses it:

    <data_dir>/state/node-token.json   {"name", "token", "node_id"}   mode 0600

The token is stored before enrolment is asked for, so an answer lost on the way (or a crash right
after) costs nothing: next time the agent re-registers with it. ``node_id`` is empty until the
control plane has confirmed the token once.

Written atomically with mode 0600 from the start, so no other user can read it even for a moment
and a crash leaves the old file or the new one. A file for another node name (the node was
renamed in its configuration) or one that does not parse is ignored: the agent enrols again.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.durable import atomic_write
from weightship.logs import event

__all__ = ["CREDENTIAL_FILE", "NodeCredential", "load_credential", "new_credential", "save_credential"]

log = logging.getLogger("agent.identity")

CREDENTIAL_FILE = "node-token.json"


@dataclass(frozen=True)
class NodeCredential:
    """A node token and the node it acts for."""

    name: str
    token: str
    #: the node's id once the control plane accepted the token; ``None`` before
    node_id: str | None = None


def new_credential(name: str) -> NodeCredential:
    """A fresh node token for the node ``name``, not yet known to any control plane."""
    return NodeCredential(name=name, token="ws_" + secrets.token_urlsafe(30))


def load_credential(path: Path, name: str) -> NodeCredential | None:
    """The credential stored at ``path`` for the node called ``name``, or ``None``."""
    try:
        doc = json.loads(path.read_bytes())
        node_id = doc.get("node_id")
        credential = NodeCredential(
            name=str(doc["name"]), token=str(doc["token"]), node_id=None if node_id is None else str(node_id)
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        event(log, "identity.unreadable", logging.WARNING, path=str(path), error=repr(exc), action="enrol_again")
        return None
    if credential.name != name:
        event(log, "identity.other_name", logging.WARNING, path=str(path), stored=credential.name, configured=name)
        return None
    return credential


def save_credential(path: Path, credential: NodeCredential) -> None:
    """Store ``credential`` at ``path``, readable by this user only."""
    atomic_write(path, json.dumps(asdict(credential), indent=1).encode(), mode=0o600)
