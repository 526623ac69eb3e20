{{/* Names and labels shared by every template. */}}
{{- define "omnistage.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "omnistage.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "omnistage.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "omnistage.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "omnistage.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "omnistage.modelVolume" -}}
{{- if .Values.models.hostPath -}}
hostPath:{{ .Values.models.hostPath }}
{{- else if .Values.models.persistentVolumeClaim -}}
pvc:{{ .Values.models.persistentVolumeClaim }}
{{- else -}}
none
{{- end -}}
{{- end -}}

{{- define "omnistage.webhookService" -}}
{{- printf "%s-webhook" (include "omnistage.fullname" .) -}}
{{- end -}}
