{{/* Names: <release>-infermesh, or the release name when it already says infermesh. */}}
{{- define "infermesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of one component; call with (dict "root" $ "component" "decode"). */}}
{{- define "infermesh.labels" -}}
{{ include "infermesh.selectorLabels" . }}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: infermesh
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "infermesh.selectorLabels" -}}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The address of NATS: the bundled server, or the existing one. */}}
{{- define "infermesh.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats:4222" .Release.Name | trunc 63 -}}
{{- else -}}
{{- required "nats.url is required when nats.enabled is false (e.g. nats://nats.nats.svc:4222)" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "infermesh.kvcacheAddress" -}}
{{- printf "%s-kvcache:%d" (include "infermesh.fullname" .) (int .Values.ports.kvcache) -}}
{{- end -}}

{{- define "infermesh.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.name -}}
{{- end -}}

{{/* A settings value as an env var string; YAML numbers arrive as floats, so
whole numbers are printed as integers (4294967296, not 4.294967296e+09). */}}
{{- define "infermesh.scalar" -}}
{{- if kindIs "float64" . -}}
{{- if eq (floor .) . -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* {section: {field: value}} as a list of INFERMESH_<SECTION>__<FIELD> env
entries. A null value is not set: the service keeps that setting's default. */}}
{{- define "infermesh.settingsEnv" -}}
{{- range $section, $fields := . }}
{{- range $field, $value := $fields }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "INFERMESH_%s__%s" (upper $section) (upper $field) }}
  value: {{ include "infermesh.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The same as ConfigMap data lines. */}}
{{- define "infermesh.settingsData" -}}
{{- range $section, $fields := . }}
{{- range $field, $value := $fields }}
{{- if not (kindIs "invalid" $value) }}
{{ printf "INFERMESH_%s__%s" (upper $section) (upper $field) }}: {{ include "infermesh.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The image of a component: its own image values over the global ones. */}}
{{- define "infermesh.image" -}}
{{- $img := merge (deepCopy (.values.image | default dict)) .root.Values.image -}}
{{- $tag := $img.tag | default (printf "%s-cpu" .root.Chart.AppVersion) -}}
image: {{ printf "%s:%s" $img.repository $tag | quote }}
imagePullPolicy: {{ $img.pullPolicy }}
{{- end -}}

{{/* Resources of a component, with `gpus` added as requests and limits. */}}
{{- define "infermesh.resources" -}}
{{- $res := deepCopy (.values.resources | default dict) -}}
{{- $gpus := int (.values.gpus | default 0) -}}
{{- if gt $gpus 0 -}}
{{- $gpu := dict .root.Values.gpuResourceName $gpus -}}
{{- $_ := set $res "limits" (merge (deepCopy ($res.limits | default dict)) $gpu) -}}
{{- $_ := set $res "requests" (merge (deepCopy ($res.requests | default dict)) $gpu) -}}
{{- end -}}
{{- /* RDMA devices (kvTransfer.rdma.resources), requested and limited alike. */ -}}
{{- with (include "infermesh.rdma" . | fromYaml).resources -}}
{{- $_ := set $res "limits" (merge (deepCopy ($res.limits | default dict)) .) -}}
{{- $_ := set $res "requests" (merge (deepCopy ($res.requests | default dict)) .) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Pod template metadata: labels, a checksum of the settings (a change rolls
the pods), and the Prometheus scrape annotations. */}}
{{- define "infermesh.podMetadata" -}}
labels:
  {{- include "infermesh.labels" . | nindent 2 }}
annotations:
  checksum/settings: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
  {{- if .root.Values.prometheusAnnotations }}
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .root.Values.ports.metrics | quote }}
  prometheus.io/path: /metrics
  {{- end }}
  {{- with .values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The pod-level fields every InferMesh pod shares. */}}
{{- define "infermesh.podCommon" -}}
enableServiceLinks: false
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ add (int .root.Values.drainTimeoutSeconds) (int .root.Values.kvFlushTimeoutSeconds) 30 }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "infermesh.rdmaPod" . }}
{{- end -}}

{{/* The vision stage needs a vision-language model: without a volume, the demo one. */}}
{{- define "infermesh.visionModelCheck" -}}
{{- if and (dig "vision" "enabled" false .Values.stages) (not .Values.model.volume) (not (hasSuffix "_vl" .Values.model.demo.arch)) }}
{{- fail (printf "stages.vision.enabled: the demo model (model.demo.arch %s) takes no images; give model.volume with a vision-language checkpoint, or set model.demo to {arch: qwen2_5_vl, preset: tiny-vl}" .Values.model.demo.arch) }}
{{- end }}
{{- end -}}

{{/* The init container that writes the demo model when no model volume is given. */}}
{{- define "infermesh.modelInit" -}}
{{- if not .root.Values.model.volume }}
initContainers:
  {{- include "infermesh.modelInitContainer" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The same container alone (a list item), for pods with other init containers. */}}
{{- define "infermesh.modelInitContainer" -}}
{{- if not .root.Values.model.volume -}}
- name: make-model
  {{- include "infermesh.image" . | nindent 2 }}
  command:
    - sh
    - -c
    - test -f "$INFERMESH_ENGINE__MODEL/config.json" || exec infermesh make-model "$INFERMESH_ENGINE__MODEL" --arch {{ .root.Values.model.demo.arch }} --preset {{ .root.Values.model.demo.preset }}
  envFrom:
    - configMapRef:
        name: {{ include "infermesh.fullname" .root }}-settings
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: {{ .root.Values.model.mountPath }}
{{- end }}
{{- end -}}

{{- define "infermesh.modelVolume" -}}
- name: models
{{- if .Values.model.volume }}
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The Secret of the mesh's credentials: global.authSecret, or the one this
chart makes (templates/secret.yaml). The NATS subchart computes the same name. */}}
{{- define "infermesh.authSecret" -}}
{{- dig "authSecret" "" (.Values.global | default dict) | default (printf "%s-infermesh-auth" .Release.Name | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{/* The identities of the gRPC plane, each with a token of its own in the auth
Secret (shared/runtime/rpc_auth.py IDENTITIES), space-separated. */}}
{{- define "infermesh.grpcIdentities" -}}
prefill decode vision balancer
{{- end -}}

{{/* The gRPC credentials of a component, as env entries: the peers list every
gRPC server takes, and its own token when it is one of the identities (kvcache
calls nobody). Call with (dict "root" $ "identity" "decode"). */}}
{{- define "infermesh.grpcEnv" -}}
- name: INFERMESH_WORKER__GRPC_PEERS
  valueFrom:
    secretKeyRef:
      name: {{ include "infermesh.authSecret" .root }}
      key: INFERMESH_GRPC_PEERS
{{- if has .identity (include "infermesh.grpcIdentities" .root | splitList " ") }}
- name: INFERMESH_WORKER__GRPC_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "infermesh.authSecret" .root }}
      key: {{ printf "INFERMESH_GRPC_TOKEN_%s" (upper .identity) }}
{{- end }}
{{- end -}}

{{/* A component's credentials from the Secret, as env entries: its NATS user
(named after its role, which carries the role's subject permissions) and
password, and its gRPC credentials; call with (dict "root" $ "user" "balancer"). */}}
{{- define "infermesh.authEnv" -}}
- name: INFERMESH_NATS__USER
  value: {{ .user | quote }}
- name: INFERMESH_NATS__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "infermesh.authSecret" .root }}
      key: {{ printf "NATS_%s_PASSWORD" (upper .user) }}
{{ include "infermesh.grpcEnv" (dict "root" .root "identity" .user) }}
{{- end -}}

{{/* The Secret of the gRPC plane's certificates: tls.secret, or the one this
chart makes (templates/tls-secret.yaml). */}}
{{- define "infermesh.tlsSecret" -}}
{{- $global := dig "tlsSecret" "" (.Values.global | default dict) -}}
{{- if and .Values.tls.secret .Values.nats.enabled (ne .Values.tls.secret $global) -}}
{{- fail "tls.secret with the bundled NATS: name the same Secret in global.tlsSecret too (NATS mounts its nats.crt and nats.key)" -}}
{{- end -}}
{{- .Values.tls.secret | default $global | default (printf "%s-infermesh-tls" .Release.Name | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{/* The Secret that keeps the chart's CA (certificate and key) across upgrades;
no pod mounts it (templates/tls-secret.yaml). */}}
{{- define "infermesh.tlsCASecret" -}}
{{- printf "%s-infermesh-ca" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* With tls.enabled: the settings that point a component at its certificate,
its key and the CA (mounted by infermesh.tlsVolume); call with (dict "root" $). */}}
{{- define "infermesh.tlsEnv" -}}
{{- if .root.Values.tls.enabled }}
- name: INFERMESH_WORKER__TLS_CERT
  value: /etc/infermesh/tls/tls.crt
- name: INFERMESH_WORKER__TLS_KEY
  value: /etc/infermesh/tls/tls.key
- name: INFERMESH_WORKER__TLS_CA
  value: /etc/infermesh/tls/ca.crt
{{- if .root.Values.nats.enabled }}
# The bundled NATS speaks TLS only, with a certificate of the same CA, and takes
# only clients that present one of that CA too: the component's own.
- name: INFERMESH_NATS__TLS_CA
  value: /etc/infermesh/tls/ca.crt
- name: INFERMESH_NATS__TLS_CERT
  value: /etc/infermesh/tls/tls.crt
- name: INFERMESH_NATS__TLS_KEY
  value: /etc/infermesh/tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{- define "infermesh.tlsMount" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: /etc/infermesh/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The component's own certificate and key and the CA, from the Secret; call
with (dict "root" $ "component" "decode"). */}}
{{- define "infermesh.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "infermesh.tlsSecret" .root }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: {{ printf "%s.crt" .component }}, path: tls.crt}
      - {key: {{ printf "%s.key" .component }}, path: tls.key}
{{- end }}
{{- end -}}

{{/* A gRPC health probe of port: Kubernetes' own (grpc) when the port speaks
plaintext; under mutual TLS, which kubelet's gRPC probe cannot speak, the
image's health check run in the container with its certificate (exec).
Call with (dict "root" $ "port" 50051). */}}
{{- define "infermesh.grpcProbe" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command: ["python", "deploy/docker/healthcheck.py", "grpc", "127.0.0.1:{{ .port }}"]
{{- else }}
grpc: {port: {{ .port }}}
{{- end }}
{{- end -}}

{{/* The NATS users made for a stage: one per pod ordinal up to this count,
maxInstances, else autoscaling.maxReplicas when autoscaling, else replicas.
Asking for more pods than users fails the render: a pod without a user of its
own would have no way onto NATS. Call with (dict "stage" "decode" "values" $v). */}}
{{- define "infermesh.maxInstances" -}}
{{- $v := .values -}}
{{- $wanted := int $v.replicas -}}
{{- if (dig "autoscaling" "enabled" false $v) -}}
{{- $wanted = int $v.autoscaling.maxReplicas -}}
{{- end -}}
{{- $max := $v.maxInstances | default $wanted | int -}}
{{- if gt $wanted $max -}}
{{- fail (printf "stages.%s: %d pods asked for but NATS users for %d (stages.%s.maxInstances): raise it, e.g. --set stages.%s.maxInstances=%d" .stage $wanted $max .stage .stage $wanted) -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* The Secret of every worker pod's NATS password (one key per pod name) and
the NATS config with their users (templates/nats-users.yaml); the bundled NATS
computes the same names. */}}
{{- define "infermesh.instancesSecret" -}}
{{- printf "%s-infermesh-instances" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "infermesh.natsConfSecret" -}}
{{- printf "%s-infermesh-nats" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A worker pod's identity: its pod name is its instance id and its NATS user,
whose password the init container (infermesh.instanceCredentials) copied out of
the instances Secret; its stage is its gRPC identity. Call with (dict "root" $ "stage" "decode"). */}}
{{- define "infermesh.instanceEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: INFERMESH_WORKER__INSTANCE_ID
  value: $(POD_NAME)
- name: INFERMESH_NATS__USER
  value: $(POD_NAME)
- name: INFERMESH_NATS__PASSWORD_FILE
  value: /var/run/infermesh/nats/password
{{ include "infermesh.grpcEnv" (dict "root" .root "identity" .stage) }}
{{- end -}}

{{/* The init container that hands a worker pod its own NATS password and no
other: only it mounts the Secret of every instance's password; it copies the
key named after the pod into a memory volume that the worker mounts. A pod
ordinal beyond the users made stops here, saying what to raise. Call with
(dict "root" $ "stage" "decode" "values" $v "max" 4). */}}
{{- define "infermesh.instanceCredentials" -}}
- name: nats-credentials
  {{- include "infermesh.image" . | nindent 2 }}
  command:
    - sh
    - -c
    - |
      src="/etc/infermesh/nats-users/$POD_NAME"
      if [ ! -s "$src" ]; then
        echo "no NATS user for $POD_NAME: the chart made {{ .max }} for stage {{ .stage }} (ordinals 0..{{ sub (int .max) 1 }}); helm upgrade --set stages.{{ .stage }}.maxInstances=<more>" >&2
        exit 1
      fi
      cp "$src" /var/run/infermesh/nats/password
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: nats-users
      mountPath: /etc/infermesh/nats-users
      readOnly: true
    - name: nats-credentials
      mountPath: /var/run/infermesh/nats
{{- end -}}
