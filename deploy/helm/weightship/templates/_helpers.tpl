{{/* Names, labels and the rules every template shares. */}}

{{- define "weightship.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "weightship.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "weightship.labels" -}}
{{ include "weightship.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "weightship.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "weightship.controlplaneUrl" -}}
{{- if .Values.controlplane.publicUrl -}}
{{- .Values.controlplane.publicUrl | trimSuffix "/" -}}
{{- else -}}
{{- printf "http://%s-controlplane.%s.svc:%v" (include "weightship.fullname" .) .Release.Namespace .Values.controlplane.port -}}
{{- end -}}
{{- end -}}

{{/* ServiceAccount name of a component: (dict "root" $ "component" "agent" "sa" .Values.agent.serviceAccount) */}}
{{- define "weightship.serviceAccountName" -}}
{{- if .sa.create -}}
{{- .sa.name | default (printf "%s-%s" (include "weightship.fullname" .root) .component) -}}
{{- else -}}
{{- .sa.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/*
One environment variable, only when its value is given: an empty string or null renders
nothing, so the program's embedded default applies instead of an empty override.
(dict "name" "WEIGHTSHIP_X" "value" .Values.x)
*/}}
{{- define "weightship.optionalEnv" -}}
{{- if not (or (kindIs "invalid" .value) (eq (toString .value) "")) }}
- name: {{ .name }}
  value: {{ .value | toString | quote }}
{{- end }}
{{- end -}}

{{/* The security context of every weightship container but the agent's ownership step. */}}
{{- define "weightship.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{- define "weightship.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* The database URL, from its Secret; shared by the server and its migrations. */}}
{{- define "weightship.databaseEnv" -}}
- name: WEIGHTSHIP_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "controlplane.database.secretName is required: name an existing Secret whose key `url` holds postgresql+psycopg://USER:PASSWORD@HOST:5432/DB (docs/kubernetes.md)" .Values.controlplane.database.secretName }}
      key: {{ .Values.controlplane.database.key }}
{{- end -}}

{{/* The Secret of bootstrap credentials: the user's, or the one the chart creates (bootstrap-secret.yaml). */}}
{{- define "weightship.bootstrapSecret" -}}
{{- .Values.bootstrap.existingSecret | default (printf "%s-bootstrap" (include "weightship.fullname" .)) -}}
{{- end -}}

{{/* The agent's enrolment token, mounted as a file (never in the environment or a process listing). */}}
{{- define "weightship.enrolmentVolume" -}}
- name: enrolment
  secret:
    {{- if .Values.agent.enrolmentSecretName }}
    secretName: {{ .Values.agent.enrolmentSecretName }}
    defaultMode: 0440
    items: [{key: {{ .Values.agent.enrolmentSecretKey }}, path: token}]
    {{- else }}
    secretName: {{ include "weightship.bootstrapSecret" . }}
    defaultMode: 0440
    items: [{key: agent, path: token}]
    {{- end }}
{{- end -}}

{{/* The caches' enrolment token (the bootstrap Secret's `cache`): a cache's role is bound to the token minted for it. */}}
{{- define "weightship.cacheEnrolmentVolume" -}}
- name: enrolment
  secret:
    secretName: {{ include "weightship.bootstrapSecret" . }}
    defaultMode: 0440
    items: [{key: cache, path: token}]
{{- end -}}

{{/*
Replicas of one component prefer different nodes, then different zones; "preferred" so that a
small cluster still schedules them all. (dict "root" $ "component" "controlplane" "affinity" .Values.x.affinity)
*/}}
{{- define "weightship.affinity" -}}
{{- if .affinity }}
{{- toYaml .affinity }}
{{- else }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "weightship.selectorLabels" . | nindent 12 }}
    - weight: 50
      podAffinityTerm:
        topologyKey: topology.kubernetes.io/zone
        labelSelector:
          matchLabels:
            {{- include "weightship.selectorLabels" . | nindent 12 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget: (dict "root" $ "component" "controlplane" "name" "x-controlplane" "pdb" .Values.x.podDisruptionBudget) */}}
{{- define "weightship.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "weightship.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "weightship.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A cache tier's in-cluster URL: (dict "root" $ "tier" "cluster") */}}
{{- define "weightship.cacheUrl" -}}
{{- $tier := index .root.Values.caches .tier -}}
{{- printf "http://%s-cache-%s.%s.svc:%v" (include "weightship.fullname" .root) .tier .root.Release.Namespace $tier.port -}}
{{- end -}}

{{/* What the operator may do where ModelRollouts live: nothing it does not need. */}}
{{- define "weightship.operatorRules" -}}
# Exactly what the operator sends (tests/kubernetes/test_rbac.py fails on a request this does not
# allow and on a verb no request uses): it watches ModelRollouts, reads one, and writes only its status.
- apiGroups: [weightship.io]
  resources: [modelrollouts]
  verbs: [get, list, watch]
- apiGroups: [weightship.io]
  resources: [modelrollouts/status]
  verbs: [patch]
# One ReplicaSet per version digest: created, scaled, relabelled, and deleted after the rollback window.
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [list, create, patch, delete]
# Events on ModelRollouts (core v1 Events, as kopf posts them).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if eq .Values.operator.trafficRouter "service" }}
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, update, patch]
{{- end }}
{{- if eq .Values.operator.trafficRouter "gatewayapi" }}
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, watch, update, patch]
{{- end }}
{{- end -}}

{{/*
Signed versions (docs/signing.md): whether a policy is configured, and its env, mount and volume (agents,
caches and the control plane read the same file).
The policy comes from values (a ConfigMap the chart renders), an existing ConfigMap or an existing Secret.
*/}}
{{- define "weightship.signingEnabled" -}}
{{- $s := .Values.signing -}}
{{- if or $s.policy $s.existingConfigMap $s.existingSecret }}true{{ end -}}
{{- end }}

{{- define "weightship.signingEnv" -}}
{{- if include "weightship.signingEnabled" . }}
- {name: WEIGHTSHIP_AGENT_SIGNING_POLICY, value: {{ printf "/etc/weightship/signing/%s" .Values.signing.key | quote }}}
{{- end }}
{{- end }}

{{- /* The control plane checks the same policy at publish and before a pointer moves. */}}
{{- define "weightship.controlplaneSigningEnv" -}}
{{- if include "weightship.signingEnabled" . }}
- {name: WEIGHTSHIP_SIGNING_POLICY, value: {{ printf "/etc/weightship/signing/%s" .Values.signing.key | quote }}}
{{- end }}
{{- end }}

{{- define "weightship.signingMount" -}}
{{- if include "weightship.signingEnabled" . }}
- {name: signing-policy, mountPath: /etc/weightship/signing, readOnly: true}
{{- end }}
{{- end }}

{{- define "weightship.signingVolume" -}}
{{- $s := .Values.signing -}}
{{- if $s.existingSecret }}
- name: signing-policy
  secret: {secretName: {{ $s.existingSecret }}, defaultMode: 0444}
{{- else if $s.existingConfigMap }}
- name: signing-policy
  configMap: {name: {{ $s.existingConfigMap }}, defaultMode: 0444}
{{- else if $s.policy }}
- name: signing-policy
  configMap: {name: {{ include "weightship.fullname" . }}-signing-policy, defaultMode: 0444}
{{- end }}
{{- end }}
