{{/* Names, labels and the pieces every pod shares. */}}

{{- define "pd-cluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Leaves room for the longest suffix ("-prefill", "-control") within 63 characters. */}}
{{- define "pd-cluster.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pd-cluster.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pd-cluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-cluster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pd-cluster.labels" -}}
helm.sh/chart: {{ include "pd-cluster.chart" . }}
{{ include "pd-cluster.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pd-cluster
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "master|prefill|decode|mixed"). */}}
{{- define "pd-cluster.componentSelectorLabels" -}}
{{ include "pd-cluster.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pd-cluster.componentLabels" -}}
{{ include "pd-cluster.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The node groups, each a Deployment of its own (space-separated: splitList " "). */}}
{{- define "pd-cluster.nodeRoles" -}}
prefill decode mixed
{{- end }}

{{- define "pd-cluster.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pd-cluster.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pd-cluster.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{- define "pd-cluster.secretName" -}}
{{- default (printf "%s-tokens" (include "pd-cluster.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The client-facing API Service (ready masters only). */}}
{{- define "pd-cluster.apiServiceName" -}}
{{- include "pd-cluster.fullname" . }}
{{- end }}

{{/*
The Service nodes dial. It publishes the master before it is ready: the master turns ready only
once nodes have registered, and they can only register through this Service.
*/}}
{{- define "pd-cluster.controlServiceName" -}}
{{- printf "%s-control" (include "pd-cluster.fullname" .) }}
{{- end }}

{{- define "pd-cluster.masterURL" -}}
{{- printf "%s://%s:%d" (ternary "https" "http" .Values.tls.enabled) (include "pd-cluster.controlServiceName" .) (int .Values.master.port) }}
{{- end }}

{{/*
The name prefill nodes check decode and mixed nodes' data-plane certificates against
(--data-tls-name): they dial pod IPs, which no certificate made ahead can name. No Service has it.
*/}}
{{- define "pd-cluster.dataTLSName" -}}
{{- printf "%s-data" (include "pd-cluster.fullname" .) }}
{{- end }}

{{/* A file of the TLS Secret as mounted: (dict "root" $ "file" "tls.crt|tls.key|ca.crt"). */}}
{{- define "pd-cluster.tlsFile" -}}
{{- printf "%s/%s" (clean .root.Values.tls.mountPath) .file }}
{{- end }}

{{/*
TLS flags of a component (dict "root" $ "component" "master|prefill|decode|mixed"), one a line as
YAML list items; none when tls.enabled is off. The master serves HTTPS and wss:// with the
certificate; nodes check it with the CA; decode and mixed nodes serve their data plane with it;
prefill nodes check those against pd-cluster.dataTLSName.
*/}}
{{- define "pd-cluster.tlsArgs" -}}
{{- $root := .root }}
{{- if $root.Values.tls.enabled }}
{{- if ne .component "master" }}
- --tls-ca
- {{ include "pd-cluster.tlsFile" (dict "root" $root "file" "ca.crt") | quote }}
- --data-tls
{{- end }}
{{- if has .component (list "master" "decode" "mixed") }}
- --tls-cert
- {{ include "pd-cluster.tlsFile" (dict "root" $root "file" "tls.crt") | quote }}
- --tls-key
- {{ include "pd-cluster.tlsFile" (dict "root" $root "file" "tls.key") | quote }}
{{- end }}
{{- if eq .component "prefill" }}
- --data-tls-name
- {{ include "pd-cluster.dataTLSName" $root | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The value of --model. */}}
{{- define "pd-cluster.modelArg" -}}
{{- if eq .Values.model.source "default" }}default{{ else }}{{ .Values.model.mountPath }}{{ end }}
{{- end }}

{{/*
A node's engine flags from a map of them (values' `engine`, a group's own over it): each key is a
flag's name in camelCase, and a value that is set becomes that flag: true `--name`, false
`--no-name`, a list `--name 1,2` (empty: none), else `--name value`; null leaves the node's default.
*/}}
{{- define "pd-cluster.engineArgs" -}}
{{- range $key, $value := . }}
{{- $flag := printf "--%s" (kebabcase $key) }}
{{- if kindIs "bool" $value }}
- {{ ternary $flag (printf "--no-%s" (kebabcase $key)) $value | quote }}
{{- else if kindIs "slice" $value }}
- {{ $flag | quote }}
- {{ $value | join "," | default "none" | quote }}
{{- else if not (kindIs "invalid" $value) }}
- {{ $flag | quote }}
- {{ include "pd-cluster.argValue" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A value as text; a whole number without an exponent (numbers read from YAML are floats: 4e+06). */}}
{{- define "pd-cluster.argValue" -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* Fail early on combinations the schema cannot express. */}}
{{- define "pd-cluster.validate" -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) }}
{{- fail "model.source=hostPath needs model.hostPath.path" }}
{{- end }}
{{- /* Messages name the value, never show it: a token must not reach a terminal or a CI log. */}}
{{- range $key := list "clusterToken" "adminToken" }}
{{- $token := index $.Values.auth $key | default "" | toString }}
{{- if and $.Values.auth.existingSecret $token }}
{{- fail (printf "auth.%s is not used with auth.existingSecret: put the token in that Secret (under auth.%sKey) and leave auth.%s empty" $key $key $key) }}
{{- end }}
{{- if and $token (or (lt (len $token) 16) (regexMatch "\\s" $token)) }}
{{- fail (printf "auth.%s must be empty (a random token is then generated and kept across upgrades) or 16 characters or more without spaces" $key) }}
{{- end }}
{{- end }}
{{- if and .Values.master.service.nodePort (eq .Values.master.service.type "ClusterIP") }}
{{- fail "master.service.nodePort needs master.service.type NodePort or LoadBalancer" }}
{{- end }}
{{- /* Kubernetes refuses two volumes mounted at one path. */}}
{{- $mounts := list "/tmp" "/dev/shm" (clean .Values.model.cache.mountPath) }}
{{- if ne .Values.model.source "default" }}
{{- $mounts = append $mounts (clean .Values.model.mountPath) }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $mounts = append $mounts (clean .Values.tls.mountPath) }}
{{- end }}
{{- if ne (len $mounts) (len (uniq $mounts)) }}
{{- fail "model.cache.mountPath, model.mountPath (of a pvc or hostPath model) and tls.mountPath (with tls.enabled) must differ from each other, /tmp and /dev/shm" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: a Secret of type kubernetes.io/tls holding tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- range $role := include "pd-cluster.nodeRoles" $ | splitList " " }}
{{- $v := index $.Values $role }}
{{- if and $v.terminationGracePeriodSeconds (le (int $v.terminationGracePeriodSeconds) (int $v.drainTimeoutSeconds)) }}
{{- fail (printf "%s.terminationGracePeriodSeconds must exceed %s.drainTimeoutSeconds, or the drain is cut short" $role $role) }}
{{- end }}
{{- if and (eq $v.device "cuda") (lt (int $v.gpu) 1) }}
{{- fail (printf "%s.device=cuda needs %s.gpu >= 1 (or device: cpu)" $role $role) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Env every container gets: the cluster token (from the Secret only), cache and scratch paths. */}}
{{- define "pd-cluster.commonEnv" -}}
- name: PD_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pd-cluster.secretName" . }}
      key: {{ .Values.auth.clusterTokenKey }}
- name: PD_CLUSTER_HOME
  value: {{ .Values.model.cache.mountPath | quote }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
- name: PYTHONUNBUFFERED
  value: "1"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes every pod mounts: model (pvc/hostPath), cache, tmp. Nodes add shm. */}}
{{- define "pd-cluster.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmp.sizeLimit }}
- name: cache
{{- if .Values.model.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.cache.sizeLimit }}
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    # 0440: readable by the pod's fsGroup (podSecurityContext), not by other users.
    defaultMode: 288
{{- end }}
{{- end }}

{{- define "pd-cluster.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: {{ .Values.model.cache.mountPath }}
{{- if ne .Values.model.source "default" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
A probe: (dict "path" "/livez" "port" "http" "timing" .Values.master.probes.liveness), with
"scheme" "HTTPS" for a port that serves TLS (the kubelet does not check the certificate).
*/}}
{{- define "pd-cluster.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
  {{- with .scheme }}
  scheme: {{ . }}
  {{- end }}
{{- toYaml .timing | nindent 0 }}
{{- end }}
