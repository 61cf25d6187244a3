"""The Kubernetes driver of the rollout engine: a kopf operator for the ``ModelRollout`` resource.

``kubectl apply`` a ``ModelRollout`` (CRD in ``deploy/helm/weightship/crds/modelrollout.yaml``) and
this operator drives the model-server pods through the same engine as the fleet driver
(``controlplane.rollouts``): the engine decides, this package only observes and acts.

- ``rollout.py`` — the resource: names, labels, and the checked spec of one ``ModelRollout``;
- ``replicasets.py`` — one ReplicaSet per version digest, built from the pod template, and how a
  canary share becomes replica counts;
- ``kube.py`` — the Kubernetes API as this operator uses it (the ``kubernetes`` client), with
  409 conflicts and other API errors mapped to ours;
- ``leader.py`` — leader election on a ``coordination.k8s.io/v1`` Lease;
- ``driver.py`` — one reconcile: observe, run the engine, act, converge the ReplicaSets, store
  the status (and show a failed reconcile on the resource);
- ``status.py`` — the status fields and conditions people and ``kubectl`` read;
- ``versions.py`` — what the operator asks the control plane (labels, the pointer and its audit);
- ``analysis.py`` — the built-in analysis provider, measured by the control plane by digest;
- ``workers.py`` — one worker per ModelRollout, on a timer and on changes, with no finalizer;
- ``operator.py`` — the kopf wiring (``python -m controlplane.k8s``, ``weightship-operator``).
"""
