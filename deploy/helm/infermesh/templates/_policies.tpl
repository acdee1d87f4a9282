{{/* HorizontalPodAutoscaler of a Deployment; (dict "root" "component" "values" "kind"). */}}
{{- define "infermesh.hpa" -}}
{{- if .values.autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "infermesh.fullname" .root }}-{{ .component }}
  labels:
    {{- include "infermesh.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ include "infermesh.fullname" .root }}-{{ .component }}
  minReplicas: {{ .values.autoscaling.minReplicas }}
  maxReplicas: {{ .values.autoscaling.maxReplicas }}
  metrics:
    {{- toYaml .values.autoscaling.metrics | nindent 4 }}
  {{- with .values.autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* PodDisruptionBudget of a component: minAvailable when set, else maxUnavailable. */}}
{{- define "infermesh.pdb" -}}
{{- if .values.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "infermesh.fullname" .root }}-{{ .component }}
  labels:
    {{- include "infermesh.labels" . | nindent 4 }}
spec:
  {{- if hasKey .values.pdb "minAvailable" }}
  minAvailable: {{ .values.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "infermesh.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}
