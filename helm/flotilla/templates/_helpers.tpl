{{/* The services, in start order. Each has the same value keys (values.yaml). */}}
{{- define "flotilla.services" -}}
tokenizer kvstore scheduler worker gateway
{{- end }}

{{/* Scheduler and worker pair up by replica id: StatefulSets, id = pod index. */}}
{{- define "flotilla.replicated" -}}
scheduler worker
{{- end }}

{{- define "flotilla.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-flotilla, or the release name when it already says flotilla. At most 40
characters: "<fullname>-scheduler" must stay within the 52 a StatefulSet name may have. */}}
{{- define "flotilla.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "flotilla.component" -}}
{{- printf "%s-%s" (include "flotilla.fullname" .root) .service }}
{{- end }}

{{- define "flotilla.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flotilla.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .service }}
{{- end }}

{{- define "flotilla.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 }}
{{ include "flotilla.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: flotilla
{{- end }}

{{/* NATS subject prefix: subjectNamespace, else the release name. */}}
{{- define "flotilla.subjectNamespace" -}}
{{- .Values.subjectNamespace | default .Release.Name }}
{{- end }}

{{/* The NATS URL: the bundled NATS chart's Service (its own naming rule), or externalNats.url. */}}
{{- define "flotilla.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- $nats := .Values.nats }}
{{- $name := $nats.nameOverride | default "nats" }}
{{- $fullname := "" }}
{{- if $nats.fullnameOverride }}
{{- $fullname = $nats.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains $name .Release.Name }}
{{- $fullname = .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $fullname = printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- $service := (dig "service" "name" "" $nats) | default $fullname }}
{{- $namespace := $nats.namespaceOverride | default .Release.Namespace }}
{{- printf "nats://%s.%s.svc:%v" $service $namespace (dig "config" "nats" "port" 4222 $nats) }}
{{- else }}
{{- required "flotilla: nats.enabled is false, so set externalNats.url (e.g. nats://nats.messaging.svc:4222)" .Values.externalNats.url }}
{{- end }}
{{- end }}

{{- define "flotilla.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "flotilla.fullname" .)) }}
{{- end }}

{{- define "flotilla.apiKeyEnabled" -}}
{{- if or .Values.apiKey.value .Values.apiKey.existingSecret }}true{{ end }}
{{- end }}

{{/* Checks that no template can express as a schema rule, with messages that say what to do. */}}
{{- define "flotilla.validate" -}}
{{- $_ := required "flotilla: set model.name: 'smollm2' (the default model, in the image), or the path of a .gguf file or Hugging Face model directory under model.mountPath (e.g. --set model.name=/models/Llama-3.1-8B-Instruct with model.volume)" .Values.model.name }}
{{- if and (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.name) (not .Values.model.volume) }}
{{- fail (printf "flotilla: model.name %s is under model.mountPath, but model.volume is empty: give the volume that holds the weights (e.g. {persistentVolumeClaim: {claimName: models}})" .Values.model.name) }}
{{- end }}
{{- if and (not (kindIs "invalid" .Values.scheduler.replicas)) (ne (int .Values.scheduler.replicas) (int .Values.worker.replicas)) }}
{{- fail (printf "flotilla: scheduler.replicas (%v) must equal worker.replicas (%v): one scheduler drives each worker; leave scheduler.replicas null" .Values.scheduler.replicas .Values.worker.replicas) }}
{{- end }}
{{- if and .Values.scheduler.enabled (not .Values.worker.enabled) }}
{{- fail "flotilla: scheduler.enabled without worker.enabled: each scheduler drives the worker of its replica" }}
{{- end }}
{{- $_ := include "flotilla.natsUrl" . }}
{{- end }}
