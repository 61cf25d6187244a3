"""The ``ModelRollout`` resource as a contract between the operator and its users.

The operator (``controlplane.k8s``) and the CLI (``weightship rollout ... --kube``) both speak it,
so it lives here, in the shared contract; the operator imports these names from this module.

- the resource: group ``weightship.io``, version ``v1alpha1``, plural ``modelrollouts``
  (``kubectl get mro``);
- the labels and annotations the operator puts on the ReplicaSets of a rollout (which rollout,
  which version digest, which role);
- the verb protocol: a user (or ``weightship rollout promote --kube``) sets the annotation
  ``weightship.io/verb`` to ``<verb>@<nonce>`` (any suffix after ``@`` makes a repeat distinct);
  the operator applies it once and records it in ``status.handledVerb`` with the outcome in
  ``status.verbResult``: ``verb_done(value)`` when it was applied, else the reason it was refused
  (which names the verb that fits).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ANNOTATION_DIGEST",
    "ANNOTATION_VERB",
    "GROUP",
    "LABEL_DIGEST",
    "LABEL_ROLE",
    "LABEL_ROLLOUT",
    "LABEL_TEMPLATE_HASH",
    "PLURAL",
    "VERBS",
    "VERSION",
    "RolloutVerb",
    "verb_done",
]

GROUP = "weightship.io"
VERSION = "v1alpha1"
PLURAL = "modelrollouts"

#: On ReplicaSets and their pods: which rollout they belong to and which version they serve.
LABEL_ROLLOUT = "weightship.io/rollout"
#: The digest's first 32 hex digits (a label value holds at most 63 characters; the full digest
#: is in the ``weightship.io/digest`` annotation and the pods' ``WEIGHTSHIP_DIGEST`` variable).
LABEL_DIGEST = "weightship.io/digest"
#: On ReplicaSets only (never on pods, so changing it restarts nothing): stable, canary, previous, retired.
LABEL_ROLE = "weightship.io/role"
#: On ReplicaSets and their pods: a hash of the rollout's pod template (as a Deployment's
#: ``pod-template-hash``), so a template edit makes a new ReplicaSet for the same version.
LABEL_TEMPLATE_HASH = "weightship.io/template-hash"
ANNOTATION_DIGEST = "weightship.io/digest"
#: ``kubectl annotate mro/chat weightship.io/verb=promote-full@1`` (any suffix after ``@`` makes a repeat distinct).
ANNOTATION_VERB = "weightship.io/verb"

#: A rollout verb as the REST API, the CLI and the annotation spell it.
RolloutVerb = Literal["promote", "promote-full", "pause", "resume", "abort", "retry"]
#: The verbs the operator and the control plane understand.
VERBS: tuple[RolloutVerb, ...] = get_args(RolloutVerb)


def verb_done(value: str) -> str:
    """What ``status.verbResult`` says once the operator applied the verb annotation ``value``."""
    return f"{value}: done"
