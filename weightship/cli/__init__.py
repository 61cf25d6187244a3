"""The ``weightship`` command line (entry point ``weightship.cli:main``).

- ``commands``: the Typer app: publish, versions, point, status, nodes, preheat, tokens, ...
- ``rollouts``: the ``weightship rollout`` group, against the control plane or ModelRollouts (``--kube``)
- ``kuberollouts``: reads ModelRollout resources and hands verbs to the operator
- ``rollout_view`` / ``rollout_steps``: the rollout view and the step list shared by both modes
- ``display``: the tables and progress bars people see
- ``runtime``: the command runner: client, output mode, exit status by error kind
- ``errors``: the wording of the control plane's problems as CLI lines
"""

from weightship.cli.commands import EXIT_CODES, CliSeams, app, main

__all__ = ["EXIT_CODES", "CliSeams", "app", "main"]
