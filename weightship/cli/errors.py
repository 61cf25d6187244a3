"""What the ``weightship`` CLI says for each problem the control plane reports, in CLI terms.

The control plane's messages (``detail``) speak to users of the REST API: they name routes and
JSON fields. A person at the CLI needs commands and flags instead (``weightship versions MODEL``,
``--to``). So the CLI words the common problems itself, from the problem's stable ``code`` and
its fields (``model``, ``deployment``, ``epoch``...); a code not listed here keeps the server's
message. A field the answer lacks shows as its placeholder (``MODEL``), never as ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from weightship.errors import Field, WeightshipError

__all__ = ["WORDING", "cli_message"]

Fields = Mapping[str, Field]


def _get(fields: Fields, name: str, placeholder: str) -> str:
    value = fields.get(name)
    return placeholder if value is None or value == "" else str(value)


def _model_not_found(f: Fields) -> str:
    model = _get(f, "model", "MODEL")
    return (
        f"model '{model}' does not exist: list models with `weightship models`, "
        f"or publish a first version with `weightship publish DIR --model {model}`"
    )


def _version_not_found(f: Fields) -> str:
    model, version = _get(f, "model", "MODEL"), _get(f, "version", "VERSION")
    return (
        f"model '{model}' has no version '{version}': list its versions and labels with `weightship versions {model}`"
    )


def _deployment_not_found(f: Fields) -> str:
    name = _get(f, "deployment", "NAME")
    return (
        f"deployment '{name}' does not exist: list deployments with `weightship deploy list`, "
        f"or create it with `weightship deploy create {name} --model MODEL`"
    )


def _deployment_exists(f: Fields) -> str:
    name = _get(f, "deployment", "NAME")
    return f"deployment '{name}' already exists: see it with `weightship status {name}`, or choose another name"


def _label_taken(f: Fields) -> str:
    model, label = _get(f, "model", "MODEL"), _get(f, "label", "LABEL")
    return (
        f"label '{label}' of model '{model}' already names another version ({_get(f, 'digest', 'another digest')}); "
        f"labels never move: choose a new --label (see `weightship versions {model}`)"
    )


def _pointer_stale(f: Fields) -> str:
    name, epoch = _get(f, "deployment", "NAME"), _get(f, "epoch", "a newer epoch")
    return (
        f"deployment '{name}' is now at epoch {epoch}, not {_get(f, 'expected_epoch', 'the one expected')}: "
        f"someone else changed it first, so nothing was changed; look with `weightship status {name}` "
        "and run the command again"
    )


def _version_not_ready(f: Fields) -> str:
    model, version = _get(f, "model", "MODEL"), _get(f, "version", "VERSION")
    return (
        f"version '{version}' of model '{model}' is {_get(f, 'state', 'not ready')}, not ready; only ready versions "
        f"can be served: pick one from `weightship versions {model}`"
    )


def _version_of_other_model(f: Fields) -> str:
    model = _get(f, "model", "MODEL")
    return (
        f"version '{_get(f, 'version', 'VERSION')}' belongs to model '{_get(f, 'version_model', 'another model')}', "
        f"but this deployment serves '{model}': pick one from `weightship versions {model}`"
    )


def _no_previous_stable(f: Fields) -> str:
    name = _get(f, "deployment", "NAME")
    return (
        f"deployment '{name}' has no previous stable version to roll back to: name one with "
        f"`weightship rollback {name} --to VERSION`"
    )


def _already_stable(f: Fields) -> str:
    name, version = _get(f, "deployment", "NAME"), _get(f, "version", "VERSION")
    return (
        f"deployment '{name}' already serves {version} as stable, so there is nothing to roll back to; "
        f"to drop its canary run `weightship deploy set {name} --stable {version}`"
    )


def _canary_is_stable(f: Fields) -> str:
    return (
        f"--canary and --stable name the same version ({_get(f, 'version', 'VERSION')}): leave out --canary "
        "and --share to serve it everywhere"
    )


def _share_without_canary(_f: Fields) -> str:
    return "--share needs --canary: give both (e.g. --canary v8 --share 0.1) or neither"


def _token_missing(_f: Fields) -> str:
    return (
        "no token given: pass --token TOKEN or set WEIGHTSHIP_TOKEN "
        "(an admin mints one with `weightship token create NAME --role ROLE`)"
    )


def _token_malformed(_f: Fields) -> str:
    return "the token given is not a weightship token: pass --token ws_... or set WEIGHTSHIP_TOKEN to one"


def _token_invalid(_f: Fields) -> str:
    return (
        "the token given (--token or WEIGHTSHIP_TOKEN) is not valid (unknown or revoked): ask an admin for a new one "
        "(`weightship token create NAME --role ROLE`)"
    )


def _role_refused(f: Fields) -> str:
    return (
        f"token '{_get(f, 'token', 'TOKEN')}' has role '{_get(f, 'role', 'ROLE')}', but this command needs one of: "
        f"{_get(f, 'roles_needed', 'another role')}; run it with such a token (--token or WEIGHTSHIP_TOKEN)"
    )


#: CLI wording by problem ``code``
WORDING: dict[str, Callable[[Fields], str]] = {
    "model_not_found": _model_not_found,
    "version_not_found": _version_not_found,
    "deployment_not_found": _deployment_not_found,
    "deployment_exists": _deployment_exists,
    "label_taken": _label_taken,
    "pointer_stale": _pointer_stale,
    "version_not_ready": _version_not_ready,
    "version_of_other_model": _version_of_other_model,
    "no_previous_stable": _no_previous_stable,
    "already_stable": _already_stable,
    "canary_is_stable": _canary_is_stable,
    "share_without_canary": _share_without_canary,
    "token_missing": _token_missing,
    "token_malformed": _token_malformed,
    "token_invalid": _token_invalid,
    "role_refused": _role_refused,
}


def cli_message(error: WeightshipError) -> str:
    """What the CLI prints for ``error``: its CLI wording when its code has one, else its own message."""
    wording = WORDING.get(error.code)
    return wording(error.fields) if wording is not None else error.message
