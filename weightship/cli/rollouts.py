"""``weightship rollout``: start a rollout, watch it, and promote, pause, resume, abort or retry it.

Two kinds of rollout, one set of commands:

- a **fleet** rollout, run by the control plane over the agents: TARGET is the deployment, the
  rollout is its current one (``--rollout ID`` for another); calls go through ``weightship.client``;
- a Kubernetes **ModelRollout** (``--kube``, implied by ``--context`` or ``--namespace``): TARGET is
  the resource's name; ``weightship.cli.kuberollouts`` reads it and hands verbs to the operator through
  the verb annotation, waiting (``--wait``) for the operator's answer.

Both show the same view (``weightship.cli.rollout_view``) and the same ``--json`` shape (the
``Rollout`` schema). A verb the rollout's state does not allow is refused with the reason, which
names the verb that fits, and exit status 3. ``status --watch`` follows the rollout until it
completes (exit 0) or degrades (exit 1), or ``--timeout`` passes (exit 5); under ``--json`` it
prints one JSON line each time the rollout changes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from weightship.cli import display
from weightship.cli.kuberollouts import KubeRollouts
from weightship.cli.rollout_view import rollout_view, rollouts_table
from weightship.cli.runtime import Run, command, jsonable, out, run_of
from weightship.client import Client
from weightship.errors import TemporaryError, ValidationError, WeightshipError
from weightship.schemas import Rollout

__all__ = ["rollout_app"]

rollout_app = typer.Typer(
    help="Roll a version out step by step: start, status (--watch), promote, pause, resume, abort, retry, list. "
    "Works on fleet rollouts and, with --kube, on Kubernetes ModelRollouts.",
    no_args_is_help=True,
)

Target = Annotated[
    str,
    typer.Argument(
        metavar="TARGET", help="Deployment name (fleet), or ModelRollout name (--kube).", show_default=False
    ),
]
RolloutId = Annotated[
    str, typer.Option("--rollout", help="Fleet rollout id (default: the deployment's current rollout).")
]
Kube = Annotated[bool, typer.Option("--kube", help="TARGET is a Kubernetes ModelRollout, not a deployment.")]
KubeContext = Annotated[
    str | None,
    typer.Option(
        "--context", help="kubeconfig context (implies --kube; default: the current one).", show_default=False
    ),
]
KubeNamespace = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        "-n",
        help="Namespace (implies --kube; default: the context's, else default).",
        show_default=False,
    ),
]
Kubeconfig = Annotated[
    str | None,
    typer.Option(
        "--kubeconfig", help="kubeconfig file (default: KUBECONFIG, else ~/.kube/config).", show_default=False
    ),
]
Wait = Annotated[
    float, typer.Option("--wait", min=0.0, help="--kube: seconds to wait for the operator to answer a verb.")
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts (as `weightship --json`).")]


class _Rollouts(Protocol):
    """A rollout to read and act on: a fleet rollout or a ModelRollout."""

    unit: str

    def get(self) -> Rollout:
        """The rollout now."""

    def act(self, verb: str) -> Rollout:
        """Apply ``verb``; the rollout after it."""

    def hint(self, verb: str) -> str:
        """The command that runs ``verb`` on this rollout."""


@dataclass
class _Fleet:
    client: Client
    deployment: str
    rollout_id: str
    unit: str = "nodes"

    def get(self) -> Rollout:
        return self.client.get_rollout(self.deployment, self.rollout_id)

    def act(self, verb: str) -> Rollout:
        return self.client.act_on_rollout(self.deployment, verb, self.rollout_id)

    def hint(self, verb: str) -> str:
        return f"`weightship rollout {verb} {self.deployment}`"


@dataclass
class _Kube:
    kube: KubeRollouts
    name: str
    wait: float
    unit: str = "pods"

    def get(self) -> Rollout:
        return self.kube.get(self.name)

    def act(self, verb: str) -> Rollout:
        return self.kube.act(self.name, verb, wait=self.wait)

    def hint(self, verb: str) -> str:
        return f"`weightship rollout {verb} {self.name} --kube --namespace {self.kube.namespace}`"


def _run_json(ctx: typer.Context, json_output: bool) -> Run:
    run = run_of(ctx)
    run.json = run.json or json_output
    return run


def _kube_wanted(kube: bool, context: str | None, namespace: str | None, kubeconfig: str | None) -> bool:
    return kube or context is not None or namespace is not None or kubeconfig is not None


@contextmanager
def _target(
    run: Run,
    target: str,
    rollout_id: str,
    kube: bool,
    context: str | None,
    namespace: str | None,
    kubeconfig: str | None,
    wait: float = 30.0,
) -> Iterator[_Rollouts]:
    if _kube_wanted(kube, context, namespace, kubeconfig):
        if rollout_id != "current":
            raise ValidationError("--rollout names a fleet rollout; with --kube, TARGET names the ModelRollout")
        clock, sleep = run.seams.clock, run.seams.sleep
        with KubeRollouts.connect(
            context=context, namespace=namespace, kubeconfig=kubeconfig, sleep=sleep, clock=clock
        ) as kube_api:
            yield _Kube(kube_api, target, wait)
        return
    with run.client() as client:
        yield _Fleet(client, target, rollout_id)


def _acted(verb: str, rollout: Rollout, unit: str) -> RenderableType:
    return Group(Text.assemble((f"{verb}: ", "bold green"), "done"), rollout_view(rollout, unit=unit))


# --- start -------------------------------------------------------------------------------------------


def _shorthand(text: str) -> dict[str, Any]:
    kind, _, value = text.partition("=")
    try:
        if kind == "setWeight" and value:
            return {"setWeight": int(value)}
        if kind == "pause":
            return {"pause": {"duration": value} if value else {}}
        if kind == "prefetch":
            return {"prefetch": {"percent": int(value)} if value else {}}
    except ValueError:
        pass
    raise ValidationError(
        f"--step {text!r} is not a step: write setWeight=25, pause=10m, pause (until promoted) or prefetch=100; "
        "analysis steps go in a --spec file"
    )


def _load_spec(path: str) -> dict[str, Any]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValidationError(f"--spec {path}: not JSON ({exc}); write the rollout spec as a JSON object") from None
    if not isinstance(data, dict):
        raise ValidationError(f"--spec {path}: expected a JSON object with steps, got {type(data).__name__}")
    return data


@rollout_app.command("start")
@command
def start(
    ctx: typer.Context,
    deployment: Annotated[str, typer.Argument(help="Deployment to roll out on.", show_default=False)],
    version: Annotated[str, typer.Argument(help="Version to roll out: label or sha256 digest.", show_default=False)],
    spec_file: Annotated[
        str | None,
        typer.Option("--spec", help="Rollout spec as a JSON file (- for stdin): steps, analysis, deadline."),
    ] = None,
    step: Annotated[
        list[str] | None,
        typer.Option("--step", help="A step, in order (repeatable): setWeight=25, pause=10m, pause, prefetch=100."),
    ] = None,
    progress_deadline: Annotated[
        int | None, typer.Option("--progress-deadline", min=1, help="Seconds a step may wait for the fleet.")
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Then follow it, as `rollout status --watch`.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="--watch: seconds between reads.")] = 2.0,
    timeout: Annotated[float, typer.Option("--timeout", min=0.0, help="--watch: give up after (0: never).")] = 0.0,
    json_output: Json = False,
) -> None:
    """Start rolling VERSION out on DEPLOYMENT, step by step (refused while another rollout of it is active)."""
    run = _run_json(ctx, json_output)
    spec = _load_spec(spec_file) if spec_file else {}
    if spec.get("version") not in (None, version):
        raise ValidationError(
            f"--spec {spec_file} names version {spec['version']!r} but the command names {version!r}: "
            "drop version from the file"
        )
    spec["version"] = version
    if step:
        if "steps" in spec:
            raise ValidationError("give the steps either with --step or in the --spec file, not both")
        spec["steps"] = [_shorthand(s) for s in step]
    if progress_deadline is not None:
        spec["progressDeadlineSeconds"] = progress_deadline
    with run.client() as client:
        created = client.start_rollout(deployment, spec)
        if watch:
            _watch(run, _Fleet(client, deployment, created.id), interval, timeout)
            return
    out(run, created, lambda: _acted("started", created, "nodes"))


# --- status, list --------------------------------------------------------------------------------------


def _watch(run: Run, rollouts: _Rollouts, interval: float, timeout: float) -> None:
    """Show the rollout each time it changes until it completes, degrades, or ``timeout`` passes."""
    deadline = run.seams.clock() + timeout if timeout else None
    console = display.console()
    live = Live(console=console, auto_refresh=False) if not run.json and console.is_terminal else None
    last = None
    with live or _nothing():
        while True:
            current = rollouts.get()
            data = jsonable(current)
            key = json.dumps({k: v for k, v in data.items() if k != "updated_at"}, sort_keys=True)
            if key != last:
                last = key
                if run.json:
                    sys.stdout.write(json.dumps(data, sort_keys=True) + "\n")
                    sys.stdout.flush()
                elif live is not None:
                    live.update(rollout_view(current, unit=rollouts.unit), refresh=True)
                else:
                    console.print(rollout_view(current, unit=rollouts.unit), Text(""))
            if current.phase in ("Degraded", "Invalid"):
                raise WeightshipError(
                    f"rollout {current.id} of {current.deployment} is {current.phase}: {current.message or 'no reason given'}; "
                    f"traffic stays on stable {display.short_digest(current.stable)}; once fixed, run {rollouts.hint('retry')}",
                    code="rollout_degraded",
                )
            if current.completed:
                return
            if deadline is not None and run.seams.clock() >= deadline:
                raise TemporaryError(
                    f"rollout {current.id} of {current.deployment} is still {current.phase} "
                    f"(step {current.step_index + 1}/{current.steps_total}) after {timeout:g} s; "
                    f"it goes on without you: follow it again with {rollouts.hint('status --watch')}"
                )
            run.seams.sleep(interval)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@rollout_app.command("status")
@command
def status(
    ctx: typer.Context,
    target: Target,
    rollout_id: RolloutId = "current",
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Follow it until it completes (exit 0) or degrades (exit 1).")
    ] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="--watch: seconds between reads.")] = 2.0,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.0, help="--watch: give up after this many seconds (exit 5; 0: never).")
    ] = 0.0,
    kube: Kube = False,
    context: KubeContext = None,
    namespace: KubeNamespace = None,
    kubeconfig: Kubeconfig = None,
    json_output: Json = False,
) -> None:
    """Show a rollout: phase, steps, weight, analysis runs and their measurements, nodes per version."""
    run = _run_json(ctx, json_output)
    with _target(run, target, rollout_id, kube, context, namespace, kubeconfig) as rollouts:
        if watch:
            _watch(run, rollouts, interval, timeout)
            return
        found = rollouts.get()
        out(run, found, lambda: rollout_view(found, unit=rollouts.unit))


@rollout_app.command("list")
@command
def list_rollouts(
    ctx: typer.Context,
    deployment: Annotated[
        str | None, typer.Argument(help="Only this deployment's rollouts (fleet).", show_default=False)
    ] = None,
    active: Annotated[bool, typer.Option("--active", help="Only rollouts still in progress.")] = False,
    kube: Kube = False,
    context: KubeContext = None,
    namespace: KubeNamespace = None,
    kubeconfig: Kubeconfig = None,
    json_output: Json = False,
) -> None:
    """List rollouts, newest first: of one deployment, across deployments, or ModelRollouts of a namespace."""
    run = _run_json(ctx, json_output)
    if _kube_wanted(kube, context, namespace, kubeconfig):
        with KubeRollouts.connect(context=context, namespace=namespace, kubeconfig=kubeconfig) as kube_api:
            found = [r for r in kube_api.list() if not (active and r.completed)]
    else:
        with run.client() as client:
            found = client.list_rollouts(deployment, active=active)
    out(run, found, lambda: rollouts_table(found))


# --- verbs ---------------------------------------------------------------------------------------------


def _verb(
    ctx: typer.Context,
    verb: str,
    target: str,
    rollout_id: str,
    kube: bool,
    context: str | None,
    namespace: str | None,
    kubeconfig: str | None,
    wait: float,
    json_output: bool,
) -> None:
    run = _run_json(ctx, json_output)
    with _target(run, target, rollout_id, kube, context, namespace, kubeconfig, wait) as rollouts:
        after = rollouts.act(verb)
        out(run, after, lambda: _acted(verb, after, rollouts.unit))


@rollout_app.command("promote")
@command
def promote(
    ctx: typer.Context,
    target: Target,
    full: Annotated[
        bool, typer.Option("--full", help="Skip every remaining step: all traffic to the version now.")
    ] = False,
    rollout_id: RolloutId = "current",
    kube: Kube = False,
    context: KubeContext = None,
    namespace: KubeNamespace = None,
    kubeconfig: Kubeconfig = None,
    wait: Wait = 30.0,
    json_output: Json = False,
) -> None:
    """Move a rollout to its next step (ends a pause), or with --full straight to the end."""
    verb = "promote-full" if full else "promote"
    _verb(ctx, verb, target, rollout_id, kube, context, namespace, kubeconfig, wait, json_output)


def _simple_verb(verb: str, doc: str) -> None:
    """Register ``weightship rollout VERB``: a verb without options of its own."""

    @rollout_app.command(verb, help=doc)
    @command
    def run_verb(
        ctx: typer.Context,
        target: Target,
        rollout_id: RolloutId = "current",
        kube: Kube = False,
        context: KubeContext = None,
        namespace: KubeNamespace = None,
        kubeconfig: Kubeconfig = None,
        wait: Wait = 30.0,
        json_output: Json = False,
    ) -> None:
        _verb(ctx, verb, target, rollout_id, kube, context, namespace, kubeconfig, wait, json_output)


_simple_verb("pause", "Hold a rollout where it is (traffic stays as it is) until `rollout resume`.")
_simple_verb("resume", "Let a paused rollout go on from where it was paused.")
_simple_verb(
    "abort", "Send all traffic back to the stable version at once; the rollout stays Degraded until `rollout retry`."
)
_simple_verb("retry", "Start an aborted or failed rollout again from its first step (a new attempt).")
