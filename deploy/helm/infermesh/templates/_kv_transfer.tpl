{{/* KV between pods: NIXL over UCX (values: kvTransfer, and a component's own
kvTransfer over it). Only the components that move KV use these: kvcache and
the engine stages. */}}

{{/* True ("true") when the component moves KV: kvcache or an engine stage
(vision, the encoder, moves none: its embeddings go to kvcache over gRPC). */}}
{{- define "infermesh.movesKV" -}}
{{- if or (eq .component "kvcache") (and (hasKey .root.Values.stages .component) (ne .component "vision")) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the vision stage offers its embeddings through NIXL
(stages.vision.nixl, with kvTransfer.nixl on): its pods then get the
kv_transfer settings and UCX's variables, and the NetworkPolicies open UCX
between them and prefill and decode (shared/stage/embedding_nixl.py). The
vision.nixl setting itself is this key's: refused under `settings`. */}}
{{- define "infermesh.visionNixl" -}}
{{- range $where, $settings := dict "settings" .Values.settings "stages.vision.settings" (dig "vision" "settings" dict .Values.stages) }}
{{- if hasKey (dig "vision" dict ($settings | default dict)) "nixl" }}
{{- fail (printf "%s.vision.nixl: set stages.vision.nixl instead (it also gives the vision pods NIXL's settings and opens UCX between them and prefill and decode)" $where) }}
{{- end }}
{{- end }}
{{- $vision := .Values.stages.vision | default dict }}
{{- if and $vision.enabled $vision.nixl .Values.kvTransfer.nixl -}}true{{- end -}}
{{- end -}}

{{/* src's keys set on dst, maps merged key by key, so a false or "" in src wins
too (sprig's merge and mergeOverwrite would let dst's true or text stand). */}}
{{- define "infermesh.deepSet" -}}
{{- range $k, $v := .src }}
{{- if and (kindIs "map" $v) (kindIs "map" (get $.dst $k)) }}
{{- include "infermesh.deepSet" (dict "dst" (get $.dst $k) "src" $v) }}
{{- else }}
{{- $_ := set $.dst $k $v }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A component's kvTransfer (kvTransfer, its own kvTransfer over it) as YAML;
(dict "root" "component" "values"). Fails where the values contradict each
other: NIXL's settings under `settings` (kvTransfer.* sets them, in one place),
GPU pods whose UCX transports cannot reach GPU memory, a malformed port range. */}}
{{- define "infermesh.kvTransfer" -}}
{{- $kv := deepCopy .root.Values.kvTransfer -}}
{{- include "infermesh.deepSet" (dict "dst" $kv "src" (.values.kvTransfer | default dict)) -}}
{{- range $where, $settings := dict "settings" .root.Values.settings (printf "%s.settings" .component) (.values.settings | default dict) }}
{{- if get ($settings | default dict) "kv_transfer" }}
{{- fail (printf "%s.kv_transfer: NIXL is set by kvTransfer.* (nixl, backends, metadataTimeoutSeconds, transferTimeoutSeconds), and per component by <component>.kvTransfer" $where) }}
{{- end }}
{{- end }}
{{- $tls := $kv.ucx.tls | default "" -}}
{{- if and $kv.nixl (gt (int (.values.gpus | default 0)) 0) (not (or (contains "cuda" $tls) (eq $tls "all") (hasPrefix "^" $tls) (eq $tls ""))) }}
{{- fail (printf "%s: gpus > 0 and kvTransfer.ucx.tls %q: UCX needs a CUDA transport to move KV out of GPU memory, e.g. \"tcp,cuda_copy\" (or rdma: \"rc,ud,sm,self,cuda_copy,tcp\"); set stages.%s.kvTransfer.ucx.tls" .component $tls .component) }}
{{- end }}
{{- with $kv.ucx.tcpPortRange }}
{{- if not (regexMatch "^[0-9]+-[0-9]+$" (toString .)) }}
{{- fail (printf "kvTransfer.ucx.tcpPortRange %q: first-last, e.g. 50100-50199" (toString .)) }}
{{- end }}
{{- end }}
{{- toYaml $kv -}}
{{- end -}}

{{/* The container env of a component that moves KV: the kv_transfer settings
and UCX's own variables. (dict "root" "component" "values") */}}
{{- define "infermesh.kvTransferEnv" -}}
{{- $kv := include "infermesh.kvTransfer" . | fromYaml -}}
- name: INFERMESH_KV_TRANSFER__NIXL
  value: {{ $kv.nixl | toString | quote }}
- name: INFERMESH_KV_TRANSFER__NIXL_BACKENDS
  value: {{ $kv.backends | quote }}
{{- with $kv.metadataTimeoutSeconds }}
- name: INFERMESH_KV_TRANSFER__NIXL_METADATA_TIMEOUT_S
  value: {{ include "infermesh.scalar" . | quote }}
{{- end }}
{{- with $kv.transferTimeoutSeconds }}
- name: INFERMESH_KV_TRANSFER__NIXL_TRANSFER_TIMEOUT_S
  value: {{ include "infermesh.scalar" . | quote }}
{{- end }}
{{- with $kv.kvcacheLandingBytes }}
- name: INFERMESH_KV_TRANSFER__KVCACHE_NIXL_BYTES
  value: {{ include "infermesh.scalar" . | quote }}
{{- end }}
{{- if $kv.nixl }}
{{- with $kv.ucx.tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with $kv.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- with $kv.ucx.tcpPortRange }}
- name: UCX_TCP_PORT_RANGE
  value: {{ . | toString | quote }}
{{- end }}
{{- range $name, $value := $kv.ucx.env }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ $name }}
  value: {{ include "infermesh.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The component's RDMA opt-in, when on: {resources, hostNetwork, ipcLock}; else {}. */}}
{{- define "infermesh.rdma" -}}
{{- if include "infermesh.movesKV" . -}}
{{- $kv := include "infermesh.kvTransfer" . | fromYaml -}}
{{- if and $kv.nixl $kv.rdma.enabled -}}
{{- toYaml $kv.rdma -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A container's securityContext: the chart's, plus IPC_LOCK where RDMA asks
for it (registering memory with an RDMA device pins it). */}}
{{- define "infermesh.securityContext" -}}
{{- $sc := deepCopy .root.Values.securityContext -}}
{{- $rdma := include "infermesh.rdma" . | fromYaml -}}
{{- if $rdma.ipcLock -}}
{{- $caps := $sc.capabilities | default dict -}}
{{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* Pod fields of the RDMA opt-in: the node's network (RDMA devices, no pod
network namespace). */}}
{{- define "infermesh.rdmaPod" -}}
{{- $rdma := include "infermesh.rdma" . | fromYaml -}}
{{- if and $rdma.hostNetwork .root.Values.networkPolicy.enabled }}
{{- fail (printf "%s: kvTransfer.rdma.hostNetwork with networkPolicy.enabled: the policies admit pods by label, and a pod on the node's network speaks with the node's address, so NATS, kvcache and the other workers would refuse it. Set networkPolicy.enabled=false and fence the nodes otherwise, or reach the RDMA NIC through a secondary pod network (Multus) instead" .component) }}
{{- end }}
{{- if $rdma.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- end -}}

{{/* NetworkPolicy ingress rule of UCX's data plane into a component, from the
pods that read from it or that it reads from (peers: a list of component names).
Nothing when NIXL is off there. UCX's TCP carries no credentials: this rule is
its only fence. */}}
{{- define "infermesh.ucxIngress" -}}
{{- $kv := include "infermesh.kvTransfer" . | fromYaml -}}
{{- if and $kv.nixl .peers }}
# UCX's data plane (NIXL): KV bytes over TCP on the ports of
# kvTransfer.ucx.tcpPortRange, unauthenticated and unencrypted, so only the
# pods that transfer with this one get in. RDMA does not pass through here.
- from:
    - podSelector:
        matchLabels:
          app.kubernetes.io/instance: {{ .root.Release.Name | quote }}
          app.kubernetes.io/part-of: infermesh
        matchExpressions:
          - key: app.kubernetes.io/component
            operator: In
            values: [{{ range $i, $p := .peers }}{{ if $i }}, {{ end }}{{ $p | quote }}{{ end }}]
  {{- with $kv.ucx.tcpPortRange }}
  {{- $range := splitList "-" (toString .) }}
  ports:
    - port: {{ index $range 0 | int }}
      endPort: {{ index $range 1 | int }}
      protocol: TCP
  {{- end }}
{{- end }}
{{- end -}}

{{/* kvShare (values.yaml): a node directory through which the engine stages'
pods of one node hand over their KV cache's memory, for the direct copy across
their PID namespaces. Mounted at the same path in every such pod. */}}
{{- define "infermesh.kvShareDir" -}}/run/infermesh/kv-share{{- end -}}

{{/* Refuses kv_share_dir under `settings` (top level or the stage's): a
directory only one pod sees shares nothing; kvShare.hostPath mounts it and sets
it. (dict "root" "component" "values") */}}
{{- define "infermesh.kvShareCheck" -}}
{{- range $where, $settings := dict "settings" .root.Values.settings (printf "stages.%s.settings" .component) (.values.settings | default dict) }}
{{- if dig "engine" "kv_share_dir" "" ($settings | default dict) }}
{{- fail (printf "%s.engine.kv_share_dir: set kvShare.hostPath instead (it mounts the node's directory in the prefill and decode pods and sets kv_share_dir to it)" $where) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The init container that gives the node's directory (DirectoryOrCreate makes
it root's, mode 0755) to the pods' user, mode 0700: the engine binds its socket
there as that user. Root with CHOWN and FOWNER only. */}}
{{- define "infermesh.kvShareInitContainer" -}}
{{- if .root.Values.kvShare.hostPath -}}
{{- $uid := .root.Values.podSecurityContext.runAsUser | default 10001 | int -}}
{{- $gid := .root.Values.podSecurityContext.runAsGroup | default $uid | int -}}
- name: kv-share
  {{- include "infermesh.image" . | nindent 2 }}
  command: ["sh", "-c", "chown {{ $uid }}:{{ $gid }} {{ include "infermesh.kvShareDir" . }} && chmod 0700 {{ include "infermesh.kvShareDir" . }}"]
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    capabilities:
      drop: [ALL]
      add: [CHOWN, FOWNER]
  volumeMounts:
    - name: kv-share
      mountPath: {{ include "infermesh.kvShareDir" . }}
{{- end -}}
{{- end -}}
