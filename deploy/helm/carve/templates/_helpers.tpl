{{/*
Helpers shared by the templates. e2e/tests/deploy_manifests.rs renders and
lints the chart with Helm's own SDK (PyPI helm-python-sdk).
*/}}

{{- define "carve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "carve.fullname" -}}
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

{{- define "carve.serviceAccountName" -}}
{{- default (include "carve.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "carve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "carve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- end -}}

{{- define "carve.labels" -}}
app.kubernetes.io/name: {{ include "carve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The kubelet's root directory without a trailing slash. */}}
{{- define "carve.kubeletRootDir" -}}
{{- .Values.kubeletPlugin.kubeletRootDir | trimSuffix "/" -}}
{{- end -}}

{{- define "carve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
carve.validate fails the render on value combinations that cannot work.
values.schema.json rejects the same combinations; this is the second line for
`helm template --skip-schema-validation` and for messages that name the fix.
*/}}
{{- define "carve.validate" -}}
{{- if and .Values.mps.enabled (not .Values.mps.controlBinary) -}}
{{- fail "mps.enabled is true but mps.controlBinary is empty: set it to the path of nvidia-cuda-mps-control inside the container, or set mps.enabled=false" -}}
{{- end -}}
{{- if and .Values.mps.enabled (not .Values.kubeletPlugin.privileged) -}}
{{- fail "mps.enabled is true but kubeletPlugin.privileged is false: MPS needs privileged (compute-mode changes on the GPU device files and Bidirectional mount propagation of the MPS shm tmpfs)" -}}
{{- end -}}
{{- if .Values.nvml.simulator.enabled -}}
{{- if not .Values.nvml.simulator.config.procRoot -}}
{{- fail "nvml.simulator.enabled is true but nvml.simulator.config.procRoot is empty: give the simulator's configuration (nodeName, gpus, stateFile, procRoot)" -}}
{{- end -}}
{{- range $key := list "stateFile" "procRoot" -}}
{{- if not (hasPrefix "/var/lib/carve/" (index $.Values.nvml.simulator.config $key | default "")) -}}
{{- fail (printf "nvml.simulator.config.%s must lie under /var/lib/carve/, the plugin's only writable directory" $key) -}}
{{- end -}}
{{- end -}}
{{- if ne .Values.kubeletPlugin.procDriverNvidia .Values.nvml.simulator.config.procRoot -}}
{{- fail (printf "kubeletPlugin.procDriverNvidia (%s) differs from nvml.simulator.config.procRoot (%s): the plugin must read the simulator's capability files" .Values.kubeletPlugin.procDriverNvidia .Values.nvml.simulator.config.procRoot) -}}
{{- end -}}
{{- end -}}
{{- if and (not .Values.nvml.simulator.enabled) (not .Values.kubeletPlugin.privileged) -}}
{{- fail "kubeletPlugin.privileged is false without nvml.simulator.enabled: creating MIG instances through the real NVML needs a privileged container" -}}
{{- end -}}
{{- end -}}

{{/* The --mig-policy value: "<default>[,<gpu index>=<policy>...]". */}}
{{- define "carve.migPolicy" -}}
{{- .Values.migPolicy.default -}}
{{- range .Values.migPolicy.perGpu -}}
{{- printf ",%v=%s" .gpu .policy -}}
{{- end -}}
{{- end -}}

{{/* --sharing: the shared device kinds to publish (mps, mig-mps, timeslice). */}}
{{- define "carve.sharing" -}}
{{- if .Values.mps.enabled -}}
mps{{- if .Values.mps.migInstances -}},mig-mps{{- end -}}
{{- end -}}
{{- if .Values.timeslice.enabled -}}
{{- if .Values.mps.enabled -}},{{- end -}}timeslice
{{- end -}}
{{- end -}}

{{/* "true" when MPS daemons run in a cgroup of their own (mps.daemonCgroup
set, not none): then hostPID, the host cgroup mount and the flag. Empty
otherwise (a false condition in `if include`). */}}
{{- define "carve.mpsDaemonCgroup" -}}
{{- if and .Values.mps.enabled (ne (.Values.mps.daemonCgroup | default "none") "none") -}}
true
{{- end -}}
{{- end -}}

{{/*
The plugin needs the host's cgroup tree (read-write, as --cgroup-root) when
MPS daemons get cgroups of their own there, or when hard memory limits go on
pod cgroups through nvidia-smi (the pod cgroups are in the host's tree only).
*/}}
{{- define "carve.hostCgroup" -}}
{{- if or (include "carve.mpsDaemonCgroup" .) (and .Values.mps.enabled .Values.mps.nvidiaSmi) -}}
true
{{- end -}}
{{- end -}}
