{{/*
A node group (prefill, decode or mixed): (dict "root" $ "role" "prefill|decode|mixed").
Nodes dial the master's control Service and register themselves, so the replica count is all
it takes to add or remove nodes. Removing one runs the preStop drain first.
*/}}
{{- define "pd-cluster.node.deployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $component := dict "root" $root "component" $role }}
{{- /* Roles that take KV from prefill nodes advertise a data plane at their pod IP. */}}
{{- $dataPlane := has $role (list "decode" "mixed") }}
{{- $grace := $v.terminationGracePeriodSeconds | default (add (int $v.drainTimeoutSeconds) 30) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pd-cluster.fullname" $root }}-{{ $role }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pd-cluster.componentLabels" $component | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  {{- with $v.strategy }}
  strategy:
    {{- /* Kubernetes refuses rollingUpdate beside Recreate, and the default values carry one. */}}
    {{- toYaml (ternary (omit . "rollingUpdate") . (eq (toString .type) "Recreate")) | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pd-cluster.componentSelectorLabels" $component | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pd-cluster.componentLabels" $component | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pd-cluster.serviceAccountName" $root }}
      automountServiceAccountToken: false
      # Longer than the drain, so that in-flight requests finish before the kill.
      terminationGracePeriodSeconds: {{ $grace }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pd-cluster.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - {{ $role }}
            - --master
            - {{ include "pd-cluster.masterURL" $root | quote }}
            - --model
            - {{ include "pd-cluster.modelArg" $root | quote }}
            - --device
            - {{ $v.device | quote }}
            {{- if gt (int $v.tp) 1 }}
            - --tp
            - {{ $v.tp | toString | quote }}
            {{- end }}
            {{- if not (kindIs "invalid" $v.gpuMemoryFraction) }}
            - --gpu-memory-fraction
            - {{ $v.gpuMemoryFraction | toString | quote }}
            {{- end }}
            - --node-id
            - $(POD_NAME)
            - --status-port
            - {{ $v.statusPort | quote }}
            {{- if $dataPlane }}
            - --data-host
            - $(POD_IP)
            - --data-port
            - {{ $v.dataPort | quote }}
            {{- end }}
            {{- with include "pd-cluster.tlsArgs" $component | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- $engine := mergeOverwrite (deepCopy ($root.Values.engine | default dict)) (deepCopy ($v.engine | default dict)) }}
            {{- with include "pd-cluster.engineArgs" $engine | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- include "pd-cluster.commonEnv" $root | nindent 12 }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: status
              containerPort: {{ $v.statusPort }}
              protocol: TCP
            {{- if $dataPlane }}
            - name: kv-data
              containerPort: {{ $v.dataPort }}
              protocol: TCP
            {{- end }}
          startupProbe:
            {{- include "pd-cluster.httpProbe" (dict "path" "/livez" "port" "status" "timing" $v.probes.startup) | nindent 12 }}
          readinessProbe:
            {{- include "pd-cluster.httpProbe" (dict "path" "/readyz" "port" "status" "timing" $v.probes.readiness) | nindent 12 }}
          livenessProbe:
            {{- include "pd-cluster.httpProbe" (dict "path" "/livez" "port" "status" "timing" $v.probes.liveness) | nindent 12 }}
          lifecycle:
            preStop:
              exec:
                command:
                  - pd-cluster
                  - node-drain
                  - --status-port
                  - {{ $v.statusPort | quote }}
                  - --timeout
                  - {{ $v.drainTimeoutSeconds | quote }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- $resources := deepCopy ($v.resources | default dict) }}
          {{- /* gpu is per rank: a node of tp ranks takes tp times as many, all on one Kubernetes node. */}}
          {{- $gpus := mul (int $v.gpu) (int $v.tp) }}
          {{- if gt $gpus 0 }}
          {{- $limits := get $resources "limits" | default dict }}
          {{- $_ := set $limits $root.Values.gpuResourceName $gpus }}
          {{- $_ := set $resources "limits" $limits }}
          {{- end }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "pd-cluster.volumeMounts" $root | nindent 12 }}
            - name: shm
              mountPath: /dev/shm
      volumes:
        {{- include "pd-cluster.volumes" $root | nindent 8 }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.shm.sizeLimit }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{- define "pd-cluster.node.pdb" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $component := dict "root" $root "component" .role }}
{{- if $v.podDisruptionBudget.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pd-cluster.fullname" $root }}-{{ .role }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pd-cluster.componentLabels" $component | nindent 4 }}
spec:
  maxUnavailable: {{ $v.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pd-cluster.componentSelectorLabels" $component | nindent 6 }}
{{- end }}
{{- end }}
