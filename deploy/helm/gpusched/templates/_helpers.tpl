{{/* Labels every object of the release carries; `component` is added per workload. */}}
{{- define "gpusched.labels" -}}
app.kubernetes.io/name: gpusched
app.kubernetes.io/part-of: gpusched
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* What selects a workload's pods: never changes across upgrades. */}}
{{- define "gpusched.selector" -}}
app.kubernetes.io/name: gpusched
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* image@digest when a digest is given, else image:tag. */}}
{{- define "gpusched.image" -}}
{{- if .Values.image.digest -}}
{{ printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}
{{- end }}

{{/* The pod security context every gpusched pod runs with (restricted standard). */}}
{{- define "gpusched.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "gpusched.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* The volumes of the CA certificates (only ca.crt of each Secret) and a client cert. */}}
{{- define "gpusched.tlsVolumes" -}}
{{- if .Values.nats.tls.caSecret }}
- name: nats-ca
  secret:
    secretName: {{ .Values.nats.tls.caSecret }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- if .Values.nats.tls.clientSecret }}
- name: nats-client
  secret:
    secretName: {{ .Values.nats.tls.clientSecret }}
    defaultMode: 0440
    items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
{{- end }}
{{- if .Values.database.tls.caSecret }}
- name: database-ca
  secret:
    secretName: {{ .Values.database.tls.caSecret }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- end }}

{{- define "gpusched.tlsMounts" -}}
{{- if .Values.nats.tls.caSecret }}
- {name: nats-ca, mountPath: /var/run/secrets/gpusched/nats-ca, readOnly: true}
{{- end }}
{{- if .Values.nats.tls.clientSecret }}
- {name: nats-client, mountPath: /var/run/secrets/gpusched/nats-client, readOnly: true}
{{- end }}
{{- if .Values.database.tls.caSecret }}
- {name: database-ca, mountPath: /var/run/secrets/gpusched/database-ca, readOnly: true}
{{- end }}
{{- end }}
