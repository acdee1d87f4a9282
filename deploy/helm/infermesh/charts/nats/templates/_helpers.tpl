{{/* The name the parent chart dials: <release>-nats. */}}
{{- define "nats.fullname" -}}
{{- printf "%s-nats" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "nats.labels" -}}
app.kubernetes.io/name: nats
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: infermesh
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "nats.selectorLabels" -}}
app.kubernetes.io/name: nats
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The parent's credentials Secret (global.authSecret, or <release>-infermesh-auth). */}}
{{- define "nats.authSecret" -}}
{{- dig "authSecret" "" (.Values.global | default dict) | default (printf "%s-infermesh-auth" .Release.Name | trunc 63 | trimSuffix "-") -}}
{{- end -}}

{{/* The parent's NATS config Secret (its templates/nats-users.yaml). */}}
{{- define "nats.confSecret" -}}
{{- printf "%s-infermesh-nats" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The parent's certificates (global.tlsSecret, or <release>-infermesh-tls). */}}
{{- define "nats.tlsSecret" -}}
{{- dig "tlsSecret" "" (.Values.global | default dict) | default (printf "%s-infermesh-tls" .Release.Name | trunc 63 | trimSuffix "-") -}}
{{- end -}}
