{{/*
Names. Kubernetes names are limited to 63 characters (DNS-1123 label).
*/}}
{{- define "daedalus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "daedalus.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The fullname and a suffix, "<fullname>-<suffix>", the fullname cut so that the whole fits a 63-character DNS label
(a Service, a ConfigMap): include "daedalus.suffixed" (list . "metrics"). Cutting the whole instead could cut the
suffix off and give two objects (the dashboards' ConfigMaps) one name.
*/}}
{{- define "daedalus.suffixed" -}}
{{- $suffix := index . 1 }}
{{- $prefix := include "daedalus.fullname" (index . 0) | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $suffix }}
{{- end }}

{{/*
Name of the cluster-scoped objects (ClusterRole, ClusterRoleBinding): the fullname and the release's namespace, so
that two releases of the same name in two namespaces (one namespaced operator per team) do not claim one object.
RBAC names are path segments, not DNS labels: no 63-character limit.
*/}}
{{- define "daedalus.clusterName" -}}
{{- printf "%s-%s" (include "daedalus.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "daedalus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "daedalus.labels" -}}
helm.sh/chart: {{ include "daedalus.chart" . }}
{{ include "daedalus.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: daedalus
{{- end }}

{{/* Labels selecting the operator pod (immutable once deployed). */}}
{{- define "daedalus.selectorLabels" -}}
app.kubernetes.io/name: {{ include "daedalus.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "daedalus.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "daedalus.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "daedalus.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
RBAC rules for namespaced resources the operator touches (least privilege, no wildcards). Used by the ClusterRole in
cluster-wide mode and by one Role per watched namespace otherwise. Keep in sync with operator/daedalus_operator/.
*/}}
{{- define "daedalus.namespacedRules" -}}
# Only the verbs the operator uses: kopf reads with list/watch and writes with PATCH (finalizer, progress and
# diff-base annotations) and POSTs core/v1 Events; the operator's own client (operator/daedalus_operator/kube.py)
# GETs, POSTs, PATCHes and DELETEs. Nothing uses PUT (update) or events.k8s.io.
# RLTrainingJobs: watched by kopf, read fresh before each status write.
- apiGroups: ["daedalus.dev"]
  resources: ["rltrainingjobs"]
  verbs: ["get", "list", "watch", "patch"]
# The status write (a JSON merge patch of /status).
- apiGroups: ["daedalus.dev"]
  resources: ["rltrainingjobs/status"]
  verbs: ["patch"]
# Children carry an owner reference with blockOwnerDeletion: true; with the OwnerReferencesPermissionEnforcement
# admission plugin creating them needs update on the owner's finalizers subresource.
- apiGroups: ["daedalus.dev"]
  resources: ["rltrainingjobs/finalizers"]
  verbs: ["update"]
# Children: the job's RayCluster (kopf index; one GET right after creating it; deleted to recreate it) and, with
# serving enabled, the RayService (kopf index; created once, deleted by the finalizer). Never patched. Each is read
# back by name after a create answered 409, or before the finalizer deletes it, to check it is the job's.
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["ray.io"]
  resources: ["rayservices"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Children: the resolved trainer config (created, read back and patched when the spec changes, deleted by the
# finalizer) and the control-token Secret (created once, its token read back, deleted by the finalizer). By name
# only: no list or watch of other workloads' Secrets and ConfigMaps.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
# The job's Ray pods (kopf index), to map them onto nodes and notice lost heads/workers.
# delete: move pods off nodes HyperPod is replacing or a drain is emptying (KubeRay recreates them elsewhere).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "delete"]
# Kubernetes Events for every transition (kopf posts them through core/v1).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# NetworkPolicy admitting only the operator to the Ray dashboard and control ports (by name: created, read back and
# patched when the operator's settings change it, deleted by the finalizer).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
# PodDisruptionBudget holding a drain's evictions of the training pods until the operator has checkpointed
# (spec.resilience.checkpointOnDrain; created, read back by name to check it is the job's before it is taken as
# such or deleted, deleted when the field turns false and by the finalizer).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "delete"]
{{- end }}

{{/* Cluster-scoped resources: needed in both modes. */}}
{{- define "daedalus.clusterRules" -}}
# Node health (HyperPod label sagemaker.amazonaws.com/node-health-status) under the job's pods (kopf index).
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
# kopf lists and watches CRDs to notice resources it serves appearing or going.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
Command-line arguments of `daedalus operator` (operator/daedalus_operator/main.py; tests/charts parse them with its
argument parser). The operator writes each job's NetworkPolicy: it admits the pods with these labels in this
namespace to the Ray dashboard and the trainer's port, and the --metrics-namespace namespaces to port 9400 only.
*/}}
{{- define "daedalus.operatorArgs" -}}
- --liveness=http://0.0.0.0:{{ .Values.operator.healthPort }}/healthz
- --metrics-port={{ .Values.operator.metricsPort }}
{{- if .Values.operator.peering.enabled }}
- --peering={{ .Values.operator.peering.name }}
- --priority={{ .Values.operator.peering.priority }}
{{- else }}
- --standalone
{{- end }}
{{- if .Values.operator.watchNamespaces }}
{{- range .Values.operator.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
- --operator-namespace={{ .Release.Namespace }}
{{- range $key, $value := (include "daedalus.selectorLabels" . | fromYaml) }}
- --operator-pod-label={{ $key }}={{ $value }}
{{- end }}
{{- range .Values.metrics.prometheusNamespaces }}
- --metrics-namespace={{ . }}
{{- end }}
{{- if eq .Values.operator.logLevel "debug" }}
- --verbose
{{- end }}
{{- range .Values.operator.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
