{{/* The chart's name, the release's full name and namespace. */}}
{{- define "dispenser.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dispenser.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dispenser.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "dispenser.metadataNamespace" -}}
namespace: {{ include "dispenser.namespace" . }}
{{- end -}}

{{- define "dispenser.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dispenser.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "dispenser.labels" -}}
{{ include "dispenser.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.global.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dispenser.serviceAccountName" -}}
{{- if .Values.serviceAccount.enabled -}}
{{- default (include "dispenser.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* The image reference: [registry/]repository:tag. */}}
{{- define "dispenser.image" -}}
{{- $image := .Values.container.image -}}
{{- $registry := $image.registry | default .Values.global.image.registry -}}
{{- $ref := printf "%s:%s" $image.repository ($image.tag | default .Chart.AppVersion) -}}
{{- if $registry -}}{{ printf "%s/%s" $registry $ref }}{{- else -}}{{ $ref }}{{- end -}}
{{- end -}}

{{- define "dispenser.pullPolicy" -}}
{{- .Values.container.image.pullPolicy | default .Values.global.image.pullPolicy | default "IfNotPresent" -}}
{{- end -}}

{{/* The shutdown timeout and the grace period, checked: Kubernetes kills a
pod at the end of its grace period, so a grace period not above the
shutdown timeout cuts a stopping worker off before it has answered the
requests in flight and given its segments back. */}}
{{- define "dispenser.shutdownTimeout" -}}
{{- $t := int .Values.config.shutdownTimeoutSeconds -}}
{{- if lt $t 1 -}}
{{- fail (printf "config.shutdownTimeoutSeconds %v: want at least 1" .Values.config.shutdownTimeoutSeconds) -}}
{{- end -}}
{{- $t -}}
{{- end -}}

{{- define "dispenser.gracePeriod" -}}
{{- $t := int (include "dispenser.shutdownTimeout" .) -}}
{{- $g := add $t 15 -}}
{{- if not (kindIs "invalid" .Values.podTemplate.terminationGracePeriodSeconds) -}}
{{- $g = int .Values.podTemplate.terminationGracePeriodSeconds -}}
{{- end -}}
{{- if le $g $t -}}
{{- fail (printf "podTemplate.terminationGracePeriodSeconds %d must exceed config.shutdownTimeoutSeconds %d: Kubernetes would kill a stopping worker before it gives its segments back" $g $t) -}}
{{- end -}}
{{- $g -}}
{{- end -}}

{{/* The restricted Pod Security Standard: non-root, no privilege
escalation, no capabilities, the runtime's default seccomp profile. The
image's user is 65532. */}}
{{- define "dispenser.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "dispenser.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A Secret's key as an environment variable. */}}
{{- define "dispenser.secretEnv" -}}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      name: {{ .name | quote }}
      key: {{ .key | quote }}
{{- end -}}

{{/* The connection settings both the workers and the migrate Job need:
the PostgreSQL URL. */}}
{{- define "dispenser.postgresEnv" -}}
{{- with .Values.config.postgres }}
{{- if .secretName }}
{{ include "dispenser.secretEnv" (dict "env" "DISPENSER_POSTGRES_URL" "name" .secretName "key" .key) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The workers' environment: every DISPENSER_* variable is a flag of
`dispenser serve` (the chart's tests check each against the binary). */}}
{{- define "dispenser.env" -}}
{{- $c := .Values.config -}}
{{- if $c.nats.urlSecret.name }}
{{ include "dispenser.secretEnv" (dict "env" "DISPENSER_NATS_URL" "name" $c.nats.urlSecret.name "key" $c.nats.urlSecret.key) }}
{{- else }}
{{- if contains "@" (toString $c.nats.url) }}
{{- fail "config.nats.url holds a user, password or token, which would stand in the Deployment's spec: put the URL in a Secret (config.nats.urlSecret), or give a credentials file (config.nats.credentials)" }}
{{- end }}
- name: DISPENSER_NATS_URL
  value: {{ required "config.nats.url (or config.nats.urlSecret.name) is required: the workers need a NATS cluster" $c.nats.url | quote }}
{{- end }}
{{- if $c.nats.credentials.secretName }}
- name: DISPENSER_NATS_CREDS
  value: {{ printf "/etc/dispenser/nats-creds/%s" $c.nats.credentials.key | quote }}
{{- end }}
{{- if $c.nats.jetStream.urlSecret.name }}
{{ include "dispenser.secretEnv" (dict "env" "DISPENSER_NATS_JS_URL" "name" $c.nats.jetStream.urlSecret.name "key" $c.nats.jetStream.urlSecret.key) }}
{{- end }}
{{- if $c.nats.jetStream.credentials.secretName }}
- name: DISPENSER_NATS_JS_CREDS
  value: {{ printf "/etc/dispenser/nats-js-creds/%s" $c.nats.jetStream.credentials.key | quote }}
{{- end }}
{{- if $c.nats.tls.secretName }}
- name: DISPENSER_NATS_TLS_CA
  value: /etc/dispenser/nats-tls/ca.crt
{{- if $c.nats.tls.clientCertificate }}
- name: DISPENSER_NATS_TLS_CERT
  value: /etc/dispenser/nats-tls/tls.crt
- name: DISPENSER_NATS_TLS_KEY
  value: /etc/dispenser/nats-tls/tls.key
{{- end }}
{{- end }}
{{- include "dispenser.postgresEnv" . }}
{{- $r := int $c.bucketReplicas }}
{{- if or (lt $r 1) (gt $r 5) }}
{{- fail (printf "config.bucketReplicas %v: want 1..5" $c.bucketReplicas) }}
{{- end }}
{{- range $flag := list "SEGMENT" "ORDERED" "SNOWFLAKE" "WITNESS" }}
- name: DISPENSER_{{ $flag }}_REPLICAS
  value: {{ $r | quote }}
{{- end }}
- name: DISPENSER_SHUTDOWN_TIMEOUT
  value: {{ printf "%ds" (int (include "dispenser.shutdownTimeout" .)) | quote }}
- name: DISPENSER_METRICS_ADDR
  value: {{ printf ":%d" (int $c.metricsPort) | quote }}
- name: DISPENSER_LOG_FORMAT
  value: {{ $c.logFormat | quote }}
- name: DISPENSER_LOG_LEVEL
  value: {{ $c.logLevel | quote }}
{{- /* The variables the chart sets from its values: set again in
config.env or container.env, the later entry would win and bypass the
value's checks (the grace period above the shutdown timeout, bucket
replicas 1..5, the NATS URL required) and the database URL's Secret. */}}
{{- $owned := dict "DISPENSER_NATS_URL" "config.nats.url or config.nats.urlSecret" "DISPENSER_NATS_CREDS" "config.nats.credentials"
  "DISPENSER_NATS_JS_URL" "config.nats.jetStream.urlSecret" "DISPENSER_NATS_JS_CREDS" "config.nats.jetStream.credentials"
  "DISPENSER_NATS_TLS_CA" "config.nats.tls" "DISPENSER_NATS_TLS_CERT" "config.nats.tls" "DISPENSER_NATS_TLS_KEY" "config.nats.tls"
  "DISPENSER_POSTGRES_URL" "config.postgres.secretName (the URL holds a password: from a Secret only)"
  "DISPENSER_SEGMENT_REPLICAS" "config.bucketReplicas" "DISPENSER_ORDERED_REPLICAS" "config.bucketReplicas"
  "DISPENSER_SNOWFLAKE_REPLICAS" "config.bucketReplicas" "DISPENSER_WITNESS_REPLICAS" "config.bucketReplicas"
  "DISPENSER_SHUTDOWN_TIMEOUT" "config.shutdownTimeoutSeconds" "DISPENSER_METRICS_ADDR" "config.metricsPort"
  "DISPENSER_LOG_FORMAT" "config.logFormat" "DISPENSER_LOG_LEVEL" "config.logLevel" }}
{{- range $name, $value := $c.env }}
{{- if not (hasPrefix "DISPENSER_" $name) }}
{{- fail (printf "config.env.%s: config.env holds DISPENSER_* flags only (others go in container.env)" $name) }}
{{- end }}
{{- if hasKey $owned $name }}
{{- fail (printf "config.env.%s: the chart sets it from %s; set that value instead" $name (get $owned $name)) }}
{{- end }}
{{- if eq $name "DISPENSER_MYSQL_URL" }}
{{- fail (printf "config.env.%s: the DSN holds a password, which would stand in the Deployment's spec: give it from a Secret in container.env (DISPENSER_MYSQL_URL: {valueFrom: {secretKeyRef: ...}})" $name) }}
{{- end }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- range $name, $value := .Values.container.env }}
{{- if hasKey $owned $name }}
{{- fail (printf "container.env.%s: the chart sets it from %s; set that value instead" $name (get $owned $name)) }}
{{- end }}
- name: {{ $name }}
{{- if kindIs "map" $value }}
  {{- toYaml $value | nindent 2 }}
{{- else }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secrets the workers mount, read-only. */}}
{{- define "dispenser.volumes" -}}
{{- $n := .Values.config.nats -}}
{{- if $n.credentials.secretName }}
- name: nats-creds
  secret:
    secretName: {{ $n.credentials.secretName | quote }}
    defaultMode: 0440
{{- end }}
{{- if $n.jetStream.credentials.secretName }}
- name: nats-js-creds
  secret:
    secretName: {{ $n.jetStream.credentials.secretName | quote }}
    defaultMode: 0440
{{- end }}
{{- if $n.tls.secretName }}
- name: nats-tls
  secret:
    secretName: {{ $n.tls.secretName | quote }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "dispenser.volumeMounts" -}}
{{- $n := .Values.config.nats -}}
{{- if $n.credentials.secretName }}
- name: nats-creds
  mountPath: /etc/dispenser/nats-creds
  readOnly: true
{{- end }}
{{- if $n.jetStream.credentials.secretName }}
- name: nats-js-creds
  mountPath: /etc/dispenser/nats-js-creds
  readOnly: true
{{- end }}
{{- if $n.tls.secretName }}
- name: nats-tls
  mountPath: /etc/dispenser/nats-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* merge renders a resource from its template file and merges the
values' `merge` map over it (as the NATS chart does). */}}
{{- define "dispenser.render" -}}
{{- $doc := tpl (.ctx.Files.Get .file) .ctx | fromYaml -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "%s: %s" .file $doc.Error) -}}
{{- end -}}
{{- toYaml (mergeOverwrite $doc (deepCopy (.merge | default dict))) -}}
{{- end -}}
