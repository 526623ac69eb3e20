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

{{- define "omnistage.peeringName" -}}
{{- default (include "omnistage.fullname" .) .Values.operator.leaderElection.peeringName -}}
{{- end -}}

{{- /* The namespaces the operator serves, comma-separated: watchNamespaces, else the release namespace;
empty with clusterWide (every namespace, which excludes a list). */}}
{{- define "omnistage.watchedNamespaces" -}}
{{- if .Values.clusterWide -}}
{{- if .Values.watchNamespaces -}}
{{- fail "clusterWide: true serves every namespace: leave watchNamespaces empty with it" -}}
{{- end -}}
{{- else if .Values.watchNamespaces -}}
{{- join "," .Values.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- /* The operator image: repository@digest when a digest pins it, else repository:tag (appVersion by default). */}}
{{- define "omnistage.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- /* The Secret holding the CA the operator signs the pipelines' certificates with (tls.issuer chart). */}}
{{- define "omnistage.pipelineCaSecret" -}}
{{- default (printf "%s-pipeline-ca" (include "omnistage.fullname" .)) .Values.tls.caSecretName -}}
{{- end -}}

{{- /* The Secret the operator's webhook serving certificate is mounted from. */}}
{{- define "omnistage.webhookSecret" -}}
{{- default (printf "%s-cert" (include "omnistage.webhookService" .)) .Values.webhook.existingSecret -}}
{{- end -}}

{{- /* Rules for the OmniPipelines and their children in a namespace: a Role per watched namespace, or the
ClusterRole. Secrets, never listed or watched: create and, by name, get/patch each pipeline's UCX data-plane
key Secret (every TLS mode) and, with tls.issuer chart, get/patch/delete its certificate Secrets;
cert-manager Certificates instead with tls.issuer certManager. */}}
{{- define "omnistage.pipelineRules" -}}
- apiGroups: [omnistage.io]
  resources: [omnipipelines]
  verbs: [get, list, watch]
- apiGroups: [omnistage.io]
  resources: [omnipipelines/status]
  verbs: [get, patch]
- apiGroups: [omnistage.io]
  resources: [omnipipelines/finalizers]   # ownerReferences with blockOwnerDeletion
  verbs: [update]
- apiGroups: [""]
  resources: [configmaps, services, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# The stage planner (autoscaling) sets stage replicas as an HPA does.
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch, update]
# It scrapes only the pods its Deployments' ReplicaSets made (ownerReferences), not any pod with the labels.
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [get, list]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# Each orchestrator's Role and RoleBinding (read endpoints). No escalate or bind verb: the API server
# lets the operator write only Roles with rules it holds itself, and bind only those.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [endpoints]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# Each pipeline's UCX data-plane key Secret (every TLS mode), and under the chart issuer each pod's certificate
# Secret: read by name, never listed or watched. create cannot be limited by name (the names are per pipeline).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch{{ if and .Values.tls.enabled (eq .Values.tls.issuer "chart") }}, delete{{ end }}]
{{- if and .Values.tls.enabled (ne .Values.tls.issuer "chart") }}
- apiGroups: [cert-manager.io]
  resources: [certificates]
  verbs: [get, list, watch, create, patch, delete]
{{- end }}
{{- end -}}

