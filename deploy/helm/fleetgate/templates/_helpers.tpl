{{/* Names and labels shared by every template. */}}
{{- define "fleetgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fleetgate.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "fleetgate.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fleetgate.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "fleetgate.fullname" .)) -}}
{{- end -}}

{{/* The registry's URL: the external one, else the chart's own Redis. */}}
{{- define "fleetgate.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "fleetgate.fullname" .) -}}
{{- else -}}
{{- fail "set redis.url (redis://, rediss://, redis+sentinel://...) or redis.enabled=true" -}}
{{- end -}}
{{- end -}}

{{/* Environment every fleetgate process reads: the registry and its secret, from the Secret. */}}
{{- /* With an existing Secret and redis.url set, the URL is given as it is (it must then
hold no password); else it comes from the Secret's redis-url key. */ -}}
{{- define "fleetgate.registryEnv" -}}
- name: FLEETGATE_REDIS_URL
{{- if and .Values.secrets.existingSecret (or .Values.redis.url .Values.redis.enabled) }}
  value: {{ include "fleetgate.redisUrl" . | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "fleetgate.secretName" . }}
      key: {{ .Values.secrets.keys.redisUrl }}
{{- end }}
- name: FLEETGATE_REDIS_PREFIX
  value: {{ .Values.redis.prefix | quote }}
- name: FLEETGATE_REGISTRATION_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "fleetgate.secretName" . }}
      key: {{ .Values.secrets.keys.registrationSecret }}
      optional: true
{{- end -}}

{{/* The model name a pool serves (what clients send as "model"). */}}
{{- define "fleetgate.poolModel" -}}
{{- .pool.servedModelName | default (base (.pool.model | default "fleetgate-demo-7b")) -}}
{{- end -}}
