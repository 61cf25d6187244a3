"""The ``weightship`` command line: publish versions, point deployments, watch the fleet.

Global options come before the command (``weightship --json versions llama``) and fall back
to the environment: ``--url`` / ``WEIGHTSHIP_URL``, ``--token`` / ``WEIGHTSHIP_TOKEN``. People
get tables and progress bars on the terminal; ``--json`` prints one JSON document on stdout
for scripts (errors then go to stderr as an ``ErrorBody``).

Every error a user can meet ends the command with one red line on stderr saying what happened
and what to do, and an exit status by kind (see ``EXIT_CODES``); never a traceback. The line
names CLI commands and flags, not REST routes: the control plane's common problems are worded
here by their ``code`` (``weightship.cli.errors``).

Test seam: pass ``obj=CliSeams(transport=...)`` to ``CliRunner.invoke`` to route every request
through an ``httpx`` transport of the test's choosing.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console, Group, RenderableType
from rich.progress import Progress
from rich.text import Text

from weightship.chunks import DEFAULT_CHUNK_SIZE
from weightship.cli import display
from weightship.cli.rollouts import rollout_app
from weightship.cli.runtime import EXIT_CODES, CliSeams
from weightship.cli.runtime import Run as _Run
from weightship.cli.runtime import command as _command
from weightship.cli.runtime import out as _out
from weightship.cli.runtime import run_of as _run
from weightship.client import DEFAULT_URL, Backoff, Client
from weightship.errors import ConflictError, NotFoundError, PreconditionFailed, TemporaryError, ValidationError
from weightship.manifest import SIGNATURE_FILE, check_manifest_bytes, parse_manifest
from weightship.schemas import Preheat, Role
from weightship.signing import sign_manifest
from weightship.sizes import parse_size

__all__ = ["EXIT_CODES", "CliSeams", "app", "main"]

app = typer.Typer(
    name="weightship",
    help="Publish model versions, point deployments at them, roll back, and watch the fleet.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
deploy_app = typer.Typer(help="Create deployments and move their serving pointer.", no_args_is_help=True)
token_app = typer.Typer(help="Mint, list and revoke API tokens (admin).", no_args_is_help=True)
app.add_typer(deploy_app, name="deploy")
app.add_typer(token_app, name="token")
app.add_typer(rollout_app, name="rollout")


@app.callback()
def _options(
    ctx: typer.Context,
    url: Annotated[str, typer.Option("--url", envvar="WEIGHTSHIP_URL", help="Control plane base URL.")] = DEFAULT_URL,
    token: Annotated[
        str | None, typer.Option("--token", envvar="WEIGHTSHIP_TOKEN", help="Bearer token.", show_default=False)
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")] = False,
) -> None:
    seams = ctx.obj if isinstance(ctx.obj, CliSeams) else CliSeams()
    ctx.obj = _Run(url=url, token=token, json=json_output, seams=seams)


def _parse_size(text: str) -> int:
    """``64MiB``, ``64M``, ``1g``, ``65536`` -> bytes, through the one size parser (binary units)."""
    try:
        return parse_size(text)
    except ValidationError as exc:
        raise typer.BadParameter(exc.message) from None


def _split_ref(text: str) -> tuple[str, str]:
    model, sep, ref = text.partition("@")
    if not sep or not model or not ref:
        raise ValidationError(f"{text!r} names no version: write MODEL@LABEL or MODEL@sha256:<64 hex>")
    return model, ref


# --- publishing and the registry -----------------------------------------------------------------


@app.command()
@_command
def publish(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(help="Model directory to publish.", show_default=False)],
    model: Annotated[str, typer.Option("--model", "-m", help="Model name.", show_default=False)],
    label: Annotated[
        list[str] | None, typer.Option("--label", "-l", help="Label for the version (repeatable).")
    ] = None,
    chunk_size: Annotated[
        str, typer.Option("--chunk-size", help="Chunk size, a power of two (e.g. 64MiB).")
    ] = f"{DEFAULT_CHUNK_SIZE // 2**20}MiB",
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Allow pickle-format files (they run code when loaded).")
    ] = False,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, max=64, help="Parts uploaded at once.")] = 8,
    signature: Annotated[
        list[Path] | None,
        typer.Option("--signature", help="A model-signing signature of DIRECTORY (repeatable; default DIRECTORY/model.sig)."),
    ] = None,
    sign_key: Annotated[
        Path | None,
        typer.Option("--sign-key", help="Sign at publish with this EC private key (PEM), in the model-signing format."),
    ] = None,
) -> None:
    """Publish DIRECTORY as an immutable version: upload only what the store lacks, then commit.

    URL, token, role and labels are checked before anything is hashed. Hidden names (such as
    .gitattributes) and DIRECTORY/model.sig are not part of a version; they are listed as skipped.
    DIRECTORY/model.sig (from `model_signing sign`), each --signature and a signature made with
    --sign-key are committed with the version and checked against the signing policy.
    """
    run = _run(ctx)
    size = _parse_size(chunk_size)
    signatures = [_read_file(p, "--signature") for p in signature or []]
    if not signature and (directory / SIGNATURE_FILE).is_file():
        signatures.append(_read_file(directory / SIGNATURE_FILE, "DIRECTORY/model.sig"))
    key = _read_file(sign_key, "--sign-key") if sign_key is not None else None
    with run.client() as client, contextlib.ExitStack() as stack:
        progress = None
        if not run.json:
            columns = display.RichPublishProgress.columns()
            bars = stack.enter_context(Progress(*columns, console=Console(stderr=True)))
            progress = display.RichPublishProgress(bars)
        result = client.publish_directory(
            directory,
            model,
            label or [],
            chunk_size=size,
            allow_pickle=allow_pickle,
            concurrency=concurrency,
            progress=progress,
            backoff=Backoff(sleep=run.seams.sleep),
            signatures=signatures,
            sign_key=key,
        )
    data = {
        "model": result.version.model,
        "digest": result.version.digest,
        "labels": result.version.labels,
        "files": result.files,
        "bytes_total": result.bytes_total,
        "bytes_uploaded": result.bytes_uploaded,
        "bytes_deduplicated": result.bytes_deduplicated,
        "bytes_resumed": result.bytes_resumed,
        "parts_uploaded": result.parts_uploaded,
        "hash_seconds": round(result.hash_seconds, 4),
        "hash_bytes_per_second": round(result.hash_bytes_per_second),
        "upload_seconds": round(result.upload_seconds, 4),
        "commit_seconds": round(result.commit_seconds, 4),
        "upload_id": result.upload_id,
        "skipped": list(result.skipped),
        "signatures": result.signatures,
        "sign_seconds": round(result.sign_seconds, 4),
        "version": result.version,
    }
    _out(run, data, lambda: display.publish_summary(result))


@app.command()
@_command
def models(ctx: typer.Context) -> None:
    """List models."""
    run = _run(ctx)
    with run.client() as client:
        found = client.list_models()
    _out(run, found, lambda: display.models_table(found))


@app.command()
@_command
def versions(ctx: typer.Context, model: Annotated[str, typer.Argument(help="Model name.", show_default=False)]) -> None:
    """List the versions of MODEL."""
    run = _run(ctx)
    with run.client() as client:
        found = client.list_versions(model)
    _out(run, found, lambda: display.versions_table(model, found))


@app.command()
@_command
def show(
    ctx: typer.Context,
    ref: Annotated[
        str, typer.Argument(metavar="MODEL@REF", help="MODEL@LABEL or MODEL@sha256:<hex>.", show_default=False)
    ],
) -> None:
    """Show one version and its files; the manifest is checked against the version's digest."""
    run = _run(ctx)
    model, version_ref = _split_ref(ref)
    with run.client() as client:
        version = client.get_version(model, version_ref)
        raw = client.get_manifest(model, version.digest)
    check_manifest_bytes(
        raw,
        version.digest,
        f"the manifest served for {model}@{version_ref}",
        "do not deploy it, and report this control plane as corrupt",
    )
    manifest = parse_manifest(raw)
    data = {"version": version, "manifest": manifest.to_json()}
    _out(run, data, lambda: _group(display.version_table(version), display.manifest_table(manifest)))


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValidationError(f"{what} {str(path)!r} cannot be read ({exc.strerror}); check the path") from exc


@app.command()
@_command
def sign(
    ctx: typer.Context,
    ref: Annotated[
        str, typer.Argument(metavar="MODEL@REF", help="MODEL@LABEL or MODEL@sha256:<hex>.", show_default=False)
    ],
    key: Annotated[
        Path | None, typer.Option("--key", help="EC private key (PEM) to sign the version's manifest with.")
    ] = None,
    signature: Annotated[
        list[Path] | None, typer.Option("--signature", help="An existing model-signing signature to add (repeatable).")
    ] = None,
) -> None:
    """Add a signature to a published version (a second approver, a new key): stored write-once, never removed."""
    run = _run(ctx)
    model, version_ref = _split_ref(ref)
    bundles = [_read_file(p, "--signature") for p in signature or []]
    if key is None and not bundles:
        raise ValidationError("nothing to add: give --key KEY (to sign now) or --signature FILE")
    with run.client() as client:
        version = client.get_version(model, version_ref)
        if key is not None:
            raw = client.get_manifest(model, version.digest)
            check_manifest_bytes(raw, version.digest, f"the manifest served for {model}@{version_ref}", "do not sign it")
            bundles.append(sign_manifest(parse_manifest(raw), _read_file(key, "--key")))
        found = client.add_signatures(model, version.digest, bundles)
    data = {"model": found.model, "digest": found.digest, "signatures": len(found.signatures)}
    _out(run, data, lambda: Text(f"{found.model}@{found.digest}: {len(found.signatures)} signature(s)"))


def _group(*parts: RenderableType) -> RenderableType:
    return Group(*parts)


# --- deployments -----------------------------------------------------------------------------------


@deploy_app.command("create")
@_command
def deploy_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)],
    model: Annotated[str, typer.Option("--model", "-m", help="Model it serves.", show_default=False)],
    warm_pool: Annotated[
        str | None,
        typer.Option(
            "--warm-pool",
            metavar="LABELS",
            help="Warm pool: nodes matching k=v,... keep stable and canary staged ('*': every node).",
        ),
    ] = None,
) -> None:
    """Create deployment NAME of a model; it serves nothing until `deploy set`."""
    run = _run(ctx)
    pool = _parse_selector(warm_pool, "--warm-pool") if warm_pool is not None else None
    with run.client() as client:
        created = client.create_deployment(name, model, warm_pool=pool)
    _out(run, created, lambda: display.deployment_table(created))


@deploy_app.command("warm-pool")
@_command
def deploy_warm_pool(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)],
    selector: Annotated[
        str | None,
        typer.Option("--selector", metavar="LABELS", help="Nodes matching k=v,... ('*': every node).", show_default=False),
    ] = None,
    off: Annotated[bool, typer.Option("--off", help="Drop the warm pool.")] = False,
) -> None:
    """Declare NAME's warm pool: matching nodes keep its stable and canary versions staged, not served."""
    run = _run(ctx)
    if (selector is None) == (not off):
        raise ValidationError("give either --selector k=v,... or --off")
    pool = _parse_selector(selector, "--selector") if selector is not None else None
    with run.client() as client:
        changed = client.set_warm_pool(name, pool)
    _out(run, changed, lambda: display.deployment_table(changed))


def _parse_selector(text: str, flag: str) -> dict[str, str]:
    """``k=v,k2=v2`` (or ``*``, or empty: every node) as a selector."""
    found: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part or part == "*":
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValidationError(f"{flag} takes node labels as k=v,... (e.g. {flag} cluster=c1,gpu_type=h100); got {part!r}")
        found[key.strip()] = value.strip()
    return found


@deploy_app.command("list")
@_command
def deploy_list(ctx: typer.Context) -> None:
    """List deployments and their pointers."""
    run = _run(ctx)
    with run.client() as client:
        found = client.list_deployments()
    _out(run, found, lambda: display.deployments_table(found))


@deploy_app.command("set")
@_command
def deploy_set(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)],
    stable: Annotated[
        str, typer.Option("--stable", help="Stable version: label or sha256 digest.", show_default=False)
    ],
    canary: Annotated[str | None, typer.Option("--canary", help="Canary version: label or digest.")] = None,
    share: Annotated[
        float | None, typer.Option("--share", min=0.0, max=1.0, help="Canary share of nodes, 0..1.")
    ] = None,
    expect_epoch: Annotated[
        int | None,
        typer.Option("--expect-epoch", help="Only change it if it is still at this epoch (default: as read now)."),
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Why; goes into the audit history.")] = "",
) -> None:
    """Point deployment NAME at a stable version (and optionally a canary), compare-and-swap on its epoch."""
    run = _run(ctx)
    if (canary is None) != (share is None):
        raise ValidationError("--canary and --share go together: give both (e.g. --canary v8 --share 0.1) or neither")
    with run.client() as client:
        epoch = expect_epoch if expect_epoch is not None else client.get_deployment(name).epoch
        try:
            updated = client.set_pointer(
                name, stable, expected_epoch=epoch, canary=canary, canary_share=share or 0.0, reason=reason
            )
        except PreconditionFailed:
            raise PreconditionFailed(
                f"deployment {name!r} is no longer at epoch {epoch}: someone else changed it first, so this change "
                f"was not applied; re-read it with `weightship status {name}` and run the change again"
            ) from None
    _out(run, updated, lambda: display.deployment_table(updated))


@app.command()
@_command
def rollback(
    ctx: typer.Context,
    deployment: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)],
    to: Annotated[
        str | None, typer.Option("--to", help="Label or digest to roll back to (default: previous stable).")
    ] = None,
    reason: Annotated[str, typer.Option("--reason", help="Why; goes into the audit history.")] = "",
    expect_epoch: Annotated[int | None, typer.Option("--expect-epoch", help="Only if still at this epoch.")] = None,
) -> None:
    """Point DEPLOYMENT back at its previous stable version (or --to another ready one)."""
    run = _run(ctx)
    started = time.monotonic()
    with run.client() as client:
        try:
            updated = client.rollback(deployment, to=to, reason=reason, expected_epoch=expect_epoch)
        except PreconditionFailed:
            raise PreconditionFailed(
                f"deployment {deployment!r} is no longer at epoch {expect_epoch}: someone else changed it first, so "
                f"it was not rolled back; re-read it with `weightship status {deployment}` and decide again"
            ) from None
    seconds = time.monotonic() - started
    data = {"deployment": updated, "seconds": round(seconds, 4)}

    def human() -> RenderableType:
        line = (
            f"[bold green]rolled back[/bold green] {deployment}: stable is now "
            f"{display.short_digest(updated.stable)} (was {display.short_digest(updated.previous_stable)}), "
            f"epoch {updated.epoch}, in {seconds * 1000:.0f} ms"
        )
        return _group(line, display.deployment_table(updated))

    _out(run, data, human)


@app.command()
@_command
def history(
    ctx: typer.Context,
    deployment: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)],
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Newest changes to show.")] = 100,
) -> None:
    """Show the pointer changes of DEPLOYMENT: who, why, from, to."""
    run = _run(ctx)
    with run.client() as client:
        events = client.history(deployment, limit=limit)
    _out(run, events, lambda: display.history_table(deployment, events))


@app.command()
@_command
def status(
    ctx: typer.Context, deployment: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)]
) -> None:
    """Show DEPLOYMENT's pointer and, per version, how many nodes are ready, fetching, failed, serving."""
    run = _run(ctx)
    with run.client() as client:
        found = client.deployment_status(deployment)
    _out(run, found, lambda: display.status_view(found))


@app.command()
@_command
def preheat(
    ctx: typer.Context,
    deployment: Annotated[str, typer.Argument(help="Deployment name.", show_default=False)],
    version: Annotated[
        str | None, typer.Argument(help="Version to stage: label or sha256 digest.", show_default=False)
    ] = None,
    selector: Annotated[
        str | None,
        typer.Option("--selector", metavar="LABELS", help="Only nodes matching k=v,... (default: every node)."),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until every matched node holds it verified.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Longest --wait, in seconds.")] = 3600,
    list_them: Annotated[bool, typer.Option("--list", help="List DEPLOYMENT's preheats with progress.")] = False,
    cancel: Annotated[str | None, typer.Option("--cancel", metavar="ID", help="Cancel preheat ID.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")] = False,
) -> None:
    """Stage VERSION on DEPLOYMENT's nodes (and any matching node) without switching; --list, --cancel ID."""
    run = _run(ctx)
    run.json = run.json or json_output
    if sum((version is not None, list_them, cancel is not None)) != 1:
        raise ValidationError("give exactly one of VERSION, --list or --cancel ID")
    with run.client() as client:
        if cancel is not None:
            client.cancel_preheat(deployment, cancel)
            _out(run, {"cancelled": cancel}, lambda: Text(f"preheat {cancel} of {deployment} cancelled"))
            return
        if version is None:
            found = client.list_preheats(deployment)
            _out(run, found, lambda: display.preheats_table(deployment, found))
            return
        made = client.preheat(deployment, version, _parse_selector(selector or "", "--selector"))
        if wait:
            made = _wait_staged(run, client, deployment, made, timeout)
    _out(run, made, lambda: display.preheats_table(deployment, [made]))


def _wait_staged(run: _Run, client: Client, deployment: str, made: Preheat, timeout: float) -> Preheat:
    """Poll the preheat's progress until every matched node staged it (or one failed, or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        now = next((p for p in client.list_preheats(deployment) if p.id == made.id), None)
        if now is None:
            raise NotFoundError(f"preheat {made.id} of {deployment} was cancelled while waiting")
        if now.nodes_failed:
            raise ConflictError(
                f"preheat {now.id} of {deployment}: {now.nodes_failed} of {now.nodes_matched} nodes failed to stage "
                f"{now.digest}; see 'weightship nodes' and retry with 'weightship preheat {deployment} {now.version}'"
            )
        if now.nodes_staged >= now.nodes_matched:
            return now
        if time.monotonic() >= deadline:
            raise TemporaryError(
                f"preheat {now.id} of {deployment}: {now.nodes_staged} of {now.nodes_matched} nodes staged after "
                f"{timeout:.0f} s; it still stands: follow it with 'weightship preheat {deployment} --list'"
            )
        if not run.json:
            display.console(stderr=True).print(
                f"staged on {now.nodes_staged}/{now.nodes_matched} nodes ({now.nodes_fetching} fetching)"
            )
        run.seams.sleep(1.0)


@app.command()
@_command
def nodes(
    ctx: typer.Context,
    deployment: Annotated[
        str | None, typer.Option("--deployment", "-d", help="Only nodes serving this deployment.")
    ] = None,
) -> None:
    """List registered nodes: where they are, what they serve, what they hold."""
    run = _run(ctx)
    with run.client() as client:
        found = client.list_nodes(deployment)
    _out(run, found, lambda: display.nodes_table(found))


# --- tokens ------------------------------------------------------------------------------------------


@token_app.command("create")
@_command
def token_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Who or what the token is for.", show_default=False)],
    role: Annotated[Role, typer.Option("--role", "-r", help="What it may do.", show_default=False)],
    deployment: Annotated[
        list[str] | None,
        typer.Option(
            "--deployment",
            "-d",
            help="Enrolment tokens (--role agent): a deployment the nodes it enrols are assigned; repeat for more. "
            "Without it: every deployment.",
            show_default=False,
        ),
    ] = None,
    node_role: Annotated[
        str | None,
        typer.Option(
            "--node-role",
            help="Enrolment tokens (--role agent): the role the nodes it enrols get, node or cache. Default: node.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Mint a token; its secret is printed once."""
    run = _run(ctx)
    if node_role not in (None, "node", "cache"):
        raise typer.BadParameter(f"--node-role must be node or cache, not {node_role!r}")
    bound: Literal["node", "cache"] | None = "cache" if node_role == "cache" else "node" if node_role else None
    with run.client() as client:
        created = client.create_token(name, role, deployments=deployment or None, node_role=bound)
    _out(run, created, lambda: display.token_created(created))


@token_app.command("list")
@_command
def token_list(ctx: typer.Context) -> None:
    """List tokens (never their secrets)."""
    run = _run(ctx)
    with run.client() as client:
        found = client.list_tokens()
    _out(run, found, lambda: display.tokens_table(found))


@token_app.command("revoke")
@_command
def token_revoke(
    ctx: typer.Context, token_id: Annotated[str, typer.Argument(metavar="ID", help="Token id.", show_default=False)]
) -> None:
    """Revoke a token; calls with it fail from now on."""
    run = _run(ctx)
    with run.client() as client:
        client.revoke_token(token_id)
    _out(run, {"revoked": token_id}, lambda: Text(f"revoked token {token_id}"))


def main() -> None:
    """Entry point of the ``weightship`` console script."""
    app(prog_name="weightship")
