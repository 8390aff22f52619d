{{/*
Shared named templates: names, labels, images, the rendered job file, and the pod pieces every
kuberl component uses (security contexts, volumes, gRPC probes, environment).
*/}}

{{- define "kuberl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The resource name prefix: <release>-<chart>, or <release> when it already names the chart. */}}
{{- define "kuberl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kuberl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "kuberl.labels" -}}
helm.sh/chart: {{ include "kuberl.chart" . }}
{{ include "kuberl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kuberl
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuberl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "buffer"). */}}
{{- define "kuberl.componentLabels" -}}
{{ include "kuberl.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kuberl.componentSelectorLabels" -}}
{{ include "kuberl.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kuberl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kuberl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference from one entry of .Values.images: (dict "root" $ "image" .Values.images.kuberl). */}}
{{- define "kuberl.image" -}}
{{- $repo := .image.repository }}
{{- if .image.registry }}{{ $repo = printf "%s/%s" .image.registry .image.repository }}{{ end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repo .image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .root.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* Service DNS names and addresses. */}}
{{- define "kuberl.redisHost" -}}
{{- if .Values.redis.enabled }}{{ include "kuberl.fullname" . }}-redis{{ else }}{{ required "externalRedis.host is required when redis.enabled is false" .Values.externalRedis.host }}{{ end }}
{{- end }}

{{- define "kuberl.redisPort" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.port }}{{ else }}{{ .Values.externalRedis.port }}{{ end }}
{{- end }}

{{- define "kuberl.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "kuberl.redisHost" . }}:{{ .Values.redis.port }}/0
{{- else -}}
{{ ternary "rediss" "redis" .Values.externalRedis.tls.enabled }}://{{ include "kuberl.redisHost" . }}:{{ .Values.externalRedis.port }}/{{ .Values.externalRedis.db }}
{{- end -}}
{{- end }}

{{/* The Secret and key holding the Redis password, or nothing when there is no password. */}}
{{- define "kuberl.redisSecretName" -}}
{{- if .Values.redis.enabled }}
{{- default (printf "%s-redis" (include "kuberl.fullname" .)) .Values.redis.auth.existingSecret }}
{{- else if .Values.externalRedis.existingSecret }}
{{- .Values.externalRedis.existingSecret }}
{{- else if .Values.externalRedis.password }}
{{- printf "%s-external-redis" (include "kuberl.fullname" .) }}
{{- end }}
{{- end }}

{{- define "kuberl.redisSecretKey" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.auth.existingSecretPasswordKey }}{{ else }}{{ .Values.externalRedis.existingSecretPasswordKey }}{{ end }}
{{- end }}

{{- define "kuberl.trainerHeadless" -}}
{{ include "kuberl.fullname" . }}-trainer-headless
{{- end }}

{{/*
The checkpoint claim the chart creates. A claim's access modes and StorageClass can never change,
so its name carries them: `<fullname>-checkpoints` for ReadWriteOnce on the cluster's default
class, else `-<modes>` (rwx, rox, rwop) and `-<class>` appended. An upgrade that changes either
(e.g. to ReadWriteMany for trainer.nodes > 1) then creates a new claim instead of changing the old
one, which the API server refuses (the upgrade would fail half-applied).
*/}}
{{- define "kuberl.checkpointClaim" -}}
{{- $checkpoints := .Values.trainer.checkpoints }}
{{- $short := dict "ReadWriteOnce" "rwo" "ReadWriteMany" "rwx" "ReadOnlyMany" "rox" "ReadWriteOncePod" "rwop" }}
{{- $modes := list }}
{{- range $checkpoints.accessModes }}{{ $modes = append $modes (get $short .) }}{{ end }}
{{- $name := printf "%s-checkpoints" (include "kuberl.fullname" .) }}
{{- if ne ($modes | join "-") "rwo" }}{{ $name = printf "%s-%s" $name ($modes | join "-") }}{{ end }}
{{- with $checkpoints.storageClass }}{{ $name = printf "%s-%s" $name . }}{{ end }}
{{- $name }}
{{- end }}

{{/*
The rollout Deployment's `replicas`: rollout.replicas without autoscaling. With autoscaling, the
live Deployment's count ((dict "root" $ "live" <lookup result>)): an upgrade that dropped the field
would reset the Deployment to 1 pod until the autoscaler reacts (Helm's patch removes what the new
manifest no longer has), and keeping the live count leaves the autoscaler's choice alone. Nothing
when there is no live Deployment (a fresh install, or `helm template`, whose lookup sees no
cluster): the autoscaler sets it.
*/}}
{{- define "kuberl.rolloutReplicas" -}}
{{- $rollout := .root.Values.rollout }}
{{- if not $rollout.autoscaling.enabled }}
{{- $rollout.replicas }}
{{- else if and .live (hasKey (default dict .live.spec) "replicas") }}
{{- int64 .live.spec.replicas }}
{{- end }}
{{- end }}

{{/* The PriorityClass the chart creates for the trainer (trainer.priorityClass.create), or nothing. */}}
{{- define "kuberl.trainerPriorityClass" -}}
{{- if .Values.trainer.priorityClass.create }}
{{- default (printf "%s-trainer" (include "kuberl.fullname" .)) .Values.trainer.priorityClass.name }}
{{- end }}
{{- end }}

{{/* Address of trainer rank 0 (pod 0 of the StatefulSet) through the headless Service. */}}
{{- define "kuberl.trainerMaster" -}}
{{ include "kuberl.fullname" . }}-trainer-0.{{ include "kuberl.trainerHeadless" . }}.{{ .Release.Namespace }}.svc
{{- end }}

{{/*
model.path as a Hugging Face id (`<owner>/<name>`, no leading `/`), or nothing when it is a path.
The chart downloads such a model into model.volume once (model-download.yaml) and hands every
service the local folder instead (kuberl.modelPath).
*/}}
{{- define "kuberl.modelHubId" -}}
{{- if regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$" (default "" .Values.model.path) }}
{{- .Values.model.path }}
{{- end }}
{{- end }}

{{/* The policy's folder in the pods: model.path, or for a Hugging Face id its download folder `<model.mountPath>/<id>` on the models volume. */}}
{{- define "kuberl.modelPath" -}}
{{- with include "kuberl.modelHubId" . }}
{{- if not $.Values.model.volume }}
{{- fail (printf "model.path %q is a Hugging Face id: the chart downloads it once into model.volume, which is empty. Set model.volume to a claim the download Job can write and every model-reading pod can mount (ReadWriteMany when they run on several nodes), or set model.path to a folder already on a volume" $.Values.model.path) }}
{{- end }}
{{- printf "%s/%s" (trimSuffix "/" $.Values.model.mountPath) . }}
{{- else }}
{{- .Values.model.path }}
{{- end }}
{{- end }}

{{/* What the download writes to `<folder>/.kuberl-download-complete` once every file is in place: `<id>@<revision>`. */}}
{{- define "kuberl.modelMarker" -}}
{{ include "kuberl.modelHubId" . }}@{{ .Values.model.download.revision }}
{{- end }}

{{/*
An init container that waits until the model download is complete (its marker names this id and
revision), for every pod that mounts the models volume: (dict "root" $ "image" <image values>).
Nothing when model.path is not a Hugging Face id.
*/}}
{{- define "kuberl.waitForModel" -}}
{{- if include "kuberl.modelHubId" .root }}
{{- $marker := printf "%s/.kuberl-download-complete" (include "kuberl.modelPath" .root) }}
- name: wait-for-model
  image: {{ include "kuberl.image" (dict "root" .root "image" .image) }}
  imagePullPolicy: {{ .root.Values.images.pullPolicy }}
  command:
    - /bin/sh
    - -c
    - |
      until grep -qxF '{{ include "kuberl.modelMarker" .root }}' {{ $marker }} 2>/dev/null; do
        echo "waiting for the model-download Job to complete {{ $marker }}"
        sleep 10
      done
  resources:
    requests:
      cpu: 10m
      memory: 16Mi
    limits:
      memory: 64Mi
  securityContext:
    {{- include "kuberl.securityContext" (dict "root" .root "override" dict) | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ .root.Values.model.mountPath }}
      readOnly: true
{{- end }}
{{- end }}

{{/* "true" when rollout pods run SGLang with its Prometheus metrics on (`--enable-metrics`). */}}
{{- define "kuberl.sglangMetrics" -}}
{{- if and .Values.rollout.sglang.enabled .Values.rollout.sglang.metrics }}true{{ end }}
{{- end }}

{{/* "true" when the job trains LoRA adapters (`job.model.lora` is a section, `{}` included). */}}
{{- define "kuberl.lora" -}}
{{- if kindIs "map" (dig "model" "lora" nil (default dict .Values.job)) }}true{{ end }}
{{- end }}

{{/*
launch_server flags of a LoRA job's SGLang server, as the replica's own launch passes them
(kuberl.rollout.engine.sglang.lora_launch_args; the defaults are model.lora's, and
tests/helm/test_sglang_lora.py checks both agree): LoRA on, room for adapters of the job's rank on
its target modules, two adapters per batch (the version served and the one before it).
*/}}
{{- define "kuberl.sglangLoraArgs" -}}
{{- if include "kuberl.lora" . }}
{{- $lora := .Values.job.model.lora }}
- --enable-lora
- --max-lora-rank
- {{ hasKey $lora "rank" | ternary $lora.rank 16 | quote }}
- --lora-target-modules
{{- range (hasKey $lora "target_modules" | ternary $lora.target_modules (list "q_proj" "k_proj" "v_proj" "o_proj" "gate_proj" "up_proj" "down_proj")) }}
- {{ . | quote }}
{{- end }}
- --max-loras-per-batch
- "2"
{{- end }}
{{- end }}

{{/*
rollout.sglang.extraArgs may not repeat a flag the chart sets from its own values: SGLang takes
the last one given, so a repeat would silently override (a LoRA rank or target list the trainer
does not use, a port the replica does not call).
*/}}
{{- define "kuberl.sglangExtraArgsCheck" -}}
{{- $owned := dict "--model-path" "rollout.sglang.model (or model.path)" "--tp-size" "rollout.sglang.tpSize" "--mem-fraction-static" "rollout.sglang.memFractionStatic" "--host" "nothing: the chart listens on 0.0.0.0" "--port" "rollout.sglang.port" "--enable-metrics" "rollout.sglang.metrics" "--enable-lora" "job.model.lora" "--max-lora-rank" "job.model.lora.rank" "--lora-target-modules" "job.model.lora.target_modules" "--max-loras-per-batch" "nothing: kuberl keeps two adapters per batch, the version served and the one before" }}
{{- range .Values.rollout.sglang.extraArgs }}
{{- $flag := index (splitList "=" (toString .)) 0 }}
{{- if hasKey $owned $flag }}
{{- fail (printf "rollout.sglang.extraArgs: %s is set by the chart; remove it from extraArgs and set %s" $flag (get $owned $flag)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The model SGLang serves. */}}
{{- define "kuberl.sglangModel" -}}
{{- $model := default (include "kuberl.modelPath" .) .Values.rollout.sglang.model }}
{{- required "rollout.sglang.model or model.path is required when rollout.sglang.enabled (SGLang needs a model path or Hugging Face id)" $model }}
{{- end }}

{{/*
The job file every service reads: values.job with the chart's wiring merged over it (endpoints,
Redis URL, listeners, volumes, weight-sync's bound per version, the SGLang engine). The ConfigMap
and the pods' checksum annotation both use it.
*/}}
{{- define "kuberl.jobConfig" -}}
{{- $fullname := include "kuberl.fullname" . }}
{{- $job := deepCopy (default dict .Values.job) }}
{{- $wiring := dict
  "endpoints" (dict
    "buffer" (printf "%s-buffer:%v" $fullname .Values.buffer.port)
    "reward" (printf "%s-reward:%v" $fullname .Values.reward.port)
    "weight_sync" (printf "%s-weight-sync:%v" $fullname .Values.weightSync.port)
    "trainer" (printf "%s:%v" (include "kuberl.trainerMaster" .) .Values.trainer.port))
  "redis" (dict "url" (include "kuberl.redisUrl" .) "password_env" "REDIS_PASSWORD")
  "buffer" (dict "server" (dict "host" "0.0.0.0" "port" .Values.buffer.port "metrics_port" .Values.buffer.metricsPort))
  "reward" (dict "server" (dict "host" "0.0.0.0" "port" .Values.reward.port "metrics_port" .Values.reward.metricsPort))
  "weight_sync" (dict "server" (dict "host" "0.0.0.0" "port" .Values.weightSync.port "metrics_port" .Values.weightSync.metricsPort) "snapshot_dir" "/var/lib/kuberl/snapshots/files" "shm_dir" "/var/lib/kuberl/snapshots/versions")
  "trainer" (dict "server" (dict "host" "0.0.0.0" "port" .Values.trainer.port "metrics_port" .Values.trainer.metricsPort) "checkpoint_dir" .Values.trainer.checkpoints.mountPath)
  "rollout" (dict "server" (dict "host" "0.0.0.0" "port" .Values.rollout.port "metrics_port" .Values.rollout.metricsPort) "peer_port" .Values.rollout.peerPort)
}}
{{- if .Values.model.path }}
{{- $_ := set $wiring "model" (dict "path" (include "kuberl.modelPath" .)) }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $_ := set $wiring "tls" (include "kuberl.tlsSettings" . | fromYaml) }}
{{- end }}
{{- /* A version may take at most the weight-sync volume's size limit shared by the versions kept and the one being written, so an upload is refused before the volume outgrows what the kubelet allows (it would evict the pod, versions and all). The job's own value wins; 2 is the job model's retain_versions default (tests/helm checks they agree). */}}
{{- $jobWeightSync := dig "weight_sync" dict $job }}
{{- with .Values.weightSync.snapshotSizeLimit }}
{{- if not (hasKey $jobWeightSync "max_version_bytes") }}
{{- $size := include "kuberl.quantityBytes" (dict "value" . "name" "weightSync.snapshotSizeLimit") | int64 }}
{{- $retain := dig "retain_versions" 2 $jobWeightSync }}
{{- $bound := div $size (add1 $retain) }}
{{- if lt $bound 1 }}
{{- fail (printf "weightSync.snapshotSizeLimit %v leaves no room for a version: it is shared by job.weight_sync.retain_versions=%v versions kept and the one being written; give the volume the model's size in its dtype x (retain_versions + 1)" . $retain) }}
{{- end }}
{{- $_ := set (get $wiring "weight_sync") "max_version_bytes" $bound }}
{{- end }}
{{- end }}
{{- if .Values.rollout.sglang.enabled }}
{{- $engine := dict }}
{{- $jobEngine := dig "rollout" "engine" dict $job }}
{{- if eq (default "" (get $jobEngine "kind")) "sglang" }}
{{- $engine = deepCopy $jobEngine }}
{{- else if hasKey (default dict (get $job "rollout")) "engine" }}
{{- $_ := unset (get $job "rollout") "engine" }}
{{- end }}
{{- $_ := set $engine "kind" "sglang" }}
{{- $_ := set $engine "url" (printf "http://127.0.0.1:%v" .Values.rollout.sglang.port) }}
{{- $_ := set $engine "launch" false }}
{{- $_ := set $engine "tp_size" .Values.rollout.sglang.tpSize }}
{{- $_ := set $engine "mem_fraction_static" .Values.rollout.sglang.memFractionStatic }}
{{- $_ := set $engine "snapshot_dir" (include "kuberl.sglangSnapshotDir" .) }}
{{- $_ := set (get $wiring "rollout") "engine" $engine }}
{{- /* SGLang engines take a version by NCCL or from a snapshot: unless the job chose a device, the relay gets a GPU (kuberl.weightSyncGpu) so that NCCL is offered at all. A LoRA job's adapters never go by NCCL: no GPU for the relay. */}}
{{- if and (not (hasKey $jobWeightSync "device")) (has "nccl" (include "kuberl.weightSyncTransports" $jobWeightSync | fromJsonArray)) (not (include "kuberl.lora" .)) }}
{{- $_ := set (get $wiring "weight_sync") "device" "cuda" }}
{{- end }}
{{- end }}
{{- $merged := mergeOverwrite $job $wiring }}
{{- if and .Values.rollout.sglang.enabled (not (dig "model" "path" "" $merged)) }}
{{- fail "rollout.sglang.enabled needs the policy's weights in model.path (or job.model.path): without it the trainer and the rollout worker build a tiny random model while SGLang serves another one (rollout.sglang.model must be the same weights as model.path)" }}
{{- end }}
{{- toYaml $merged }}
{{- end }}

{{/*
A Kubernetes quantity as a whole number of bytes (dict "value" q "name" "the value's path"): plain
bytes, or an integer with a binary (Ki Mi Gi Ti Pi) or decimal (k M G T P) suffix. Anything else
(a fraction, milli, an exponent, `K`, which Kubernetes does not accept) fails the render naming the
value, rather than guessing a size.
*/}}
{{- define "kuberl.quantityBytes" -}}
{{- $value := .value }}
{{- if kindIs "float64" $value }}
{{- /* YAML and JSON numbers arrive as float64: a whole one is plain bytes. */}}
{{- $value = ternary (printf "%.0f" $value) (toString $value) (eq $value (floor $value)) }}
{{- end }}
{{- $text := toString $value }}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 }}
{{- if not (regexMatch "^(0|[1-9][0-9]{0,17})(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$" $text) }}
{{- fail (printf "%s %q is not a quantity the chart can size: write a whole number of bytes, optionally with a binary (Ki, Mi, Gi, Ti, Pi) or decimal (k, M, G, T, P) suffix, e.g. 64Gi or 1536Mi" .name $text) }}
{{- end }}
{{- $number := regexFind "^[0-9]+" $text }}
{{- $unit := get $units (trimPrefix $number $text) }}
{{- $bytes := mul (int64 $number) $unit }}
{{- if ne (div $bytes $unit) (int64 $number) }}
{{- fail (printf "%s %q is more bytes than a 64-bit integer holds" .name $text) }}
{{- end }}
{{- $bytes }}
{{- end }}

{{/* The folder, in both containers of a rollout pod, where SGLang weight snapshots are written and read (/update_weights_from_disk). */}}
{{- define "kuberl.sglangSnapshotDir" -}}
/var/lib/kuberl/sglang-weights
{{- end }}

{{/* A job's weight_sync.transports as JSON, or the job model's default list when it sets none. */}}
{{- define "kuberl.weightSyncTransports" -}}
{{- get . "transports" | default (list "cuda_ipc" "nccl" "shm" "gloo" "snapshot") | toJson }}
{{- end }}

{{/* "true" when weight-sync relays over NCCL and so needs a GPU: the rendered job's weight_sync.device is a CUDA device and nccl is among its transports. */}}
{{- define "kuberl.weightSyncGpu" -}}
{{- $weightSync := (include "kuberl.jobConfig" . | fromYaml).weight_sync }}
{{- if and (hasPrefix "cuda" (toString (get $weightSync "device"))) (has "nccl" (include "kuberl.weightSyncTransports" $weightSync | fromJsonArray)) }}true{{ end }}
{{- end }}

{{/* Pod annotations that restart pods when the job file changes. */}}
{{- define "kuberl.checksumAnnotations" -}}
checksum/job: {{ include "kuberl.jobConfig" . | sha256sum }}
{{- end }}

{{/* Pod-level settings shared by every kuberl pod (not Redis). */}}
{{- define "kuberl.podCommon" -}}
serviceAccountName: {{ include "kuberl.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
enableServiceLinks: false
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
Scheduling of one component: (dict "root" $ "values" .Values.buffer "gpu" false), optionally
"priorityClassName" (a class the chart made for it). Priority class: the component's, else the
one the chart made, else the global one. Runtime class, affinity and topology spread: the
component's own.
*/}}
{{- define "kuberl.scheduling" -}}
{{- $nodeSelector := .values.nodeSelector }}
{{- $tolerations := .values.tolerations }}
{{- if not .gpu }}
{{- $nodeSelector = default .root.Values.nodeSelector .values.nodeSelector }}
{{- $tolerations = default .root.Values.tolerations .values.tolerations }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with default .root.Values.priorityClassName (default .priorityClassName .values.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end }}

{{/*
The disk-backed emptyDirs of every kuberl pod (the ones kuberl.jobVolume makes), by the value
path an error should name.
*/}}
{{- define "kuberl.jobVolumeSizes" -}}
{{- toYaml (dict "the tmp volume" "1Gi" "the work volume" "10Gi") }}
{{- end }}

{{/*
A container's resources with `ephemeral-storage` requested and limited to what its pod's
disk-backed emptyDirs may hold (the sum of their sizeLimits) plus 1Gi for container logs, unless
the resources set it: (dict "resources" .Values.x.resources "sizes" (dict "value path" "64Gi")).
Given to one container per pod, it is the pod's whole budget: the scheduler places the pod where
that much disk is free, and the kubelet evicts on disk pressure pods above their requests first.
An empty size (no limit) adds nothing.
*/}}
{{- define "kuberl.withEphemeralStorage" -}}
{{- $resources := deepCopy (default dict .resources) }}
{{- $bytes := int64 1073741824 }}
{{- range $name, $size := .sizes }}
{{- if $size }}
{{- $bytes = add $bytes (include "kuberl.quantityBytes" (dict "value" $size "name" $name) | int64) }}
{{- end }}
{{- end }}
{{- $quantity := printf "%dMi" (div (add $bytes 1048575) 1048576) }}
{{- if eq (mod $bytes 1073741824) 0 }}{{ $quantity = printf "%dGi" (div $bytes 1073741824) }}{{ end }}
{{- range $kind := list "requests" "limits" }}
{{- $section := default dict (get $resources $kind) }}
{{- if not (hasKey $section "ephemeral-storage") }}
{{- $_ := set $section "ephemeral-storage" $quantity }}
{{- end }}
{{- $_ := set $resources $kind $section }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
A container's securityContext: the global `securityContext` with the container's own keys set over
it, a key at a time (a key it names replaces the global one's value; `false` counts, unlike Helm's
merge): (dict "root" $ "override" .Values.rollout.sglang.securityContext).
*/}}
{{- define "kuberl.securityContext" -}}
{{- $context := deepCopy (default dict .root.Values.securityContext) }}
{{- range $key, $value := default dict .override }}
{{- $_ := set $context $key $value }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{/*
A volume its pods only read (the model, the datasets): (dict "name" "model" "source" .Values.model.volume).
A source type with a `readOnly` field gets `readOnly: true`: the volume is then attached and
mounted read-only, and the kubelet skips changing its group to the pod's fsGroup, a walk over
every file that can take hours on a large model volume at its first mount.
*/}}
{{- define "kuberl.readOnlyVolume" -}}
{{- $source := deepCopy .source }}
{{- $withReadOnly := list "persistentVolumeClaim" "nfs" "csi" "cephfs" "rbd" "iscsi" "fc" "glusterfs" "azureDisk" "azureFile" "gcePersistentDisk" "awsElasticBlockStore" "cinder" "flexVolume" "portworxVolume" "quobyte" "scaleIO" "storageos" }}
{{- range $type, $settings := $source }}
{{- if and (has $type $withReadOnly) (kindIs "map" $settings) }}
{{- $_ := set $settings "readOnly" true }}
{{- end }}
{{- end -}}
- name: {{ .name }}
  {{- toYaml $source | nindent 2 }}
{{- end }}

{{/* Environment of every kuberl container. */}}
{{/*
gRPC TLS: the job file's `tls` section when .Values.tls.enabled, the files from the Secret mounted
at /etc/kuberl-tls. The same settings go into every container's environment (KUBERL_TLS__*), so
`kuberl health` in probes and in the helm test pod speaks TLS too.
*/}}
{{- define "kuberl.tlsServerName" -}}
{{- default (printf "%s-grpc" (include "kuberl.fullname" .)) .Values.tls.serverName }}
{{- end }}

{{- define "kuberl.tlsSettings" -}}
{{- $roles := include "kuberl.tlsRoles" . }}
{{- if not (or .Values.tls.secretName $roles) }}
{{- fail "tls.enabled needs tls.secretName: a Secret with tls.crt, tls.key and ca.crt (e.g. from a cert-manager Certificate, see docs/security.md)" }}
{{- end -}}
enabled: true
ca_file: /etc/kuberl-tls/ca.crt
cert_file: /etc/kuberl-tls/tls.crt
key_file: /etc/kuberl-tls/tls.key
require_client_cert: {{ .Values.tls.requireClientCert }}
server_name_override: {{ include "kuberl.tlsServerName" . | quote }}
{{- if $roles }}
roles: true
{{- end }}
{{- end }}

{{/*
"true" when per-RPC roles are on (tls.roles.enabled), after checking what they need: mutual TLS,
and a cert-manager issuer. Each rollout replica's certificate must name its pod
(spiffe://kuberl/<job>/rollout/<pod name>, the engine id weight-sync checks), which no Secret
made ahead can do for a Deployment's pods; cert-manager's csi-driver issues one per pod.
*/}}
{{- define "kuberl.tlsRoles" -}}
{{- if .Values.tls.roles.enabled }}
{{- if not (and .Values.tls.enabled .Values.tls.requireClientCert) }}
{{- fail "tls.roles.enabled reads each caller's certificate: it needs mutual TLS, set tls.enabled: true and tls.requireClientCert: true" }}
{{- end }}
{{- if not .Values.tls.certManager.issuerRef.name }}
{{- fail "tls.roles.enabled needs tls.certManager.issuerRef.name (a cert-manager Issuer or ClusterIssuer): every rollout replica needs its own certificate naming its pod (spiffe://kuberl/<job>/rollout/<pod name>), which cert-manager's csi-driver issues; tls.componentSecrets may replace the Certificates of buffer, reward, weightSync and trainer, not the rollout's" }}
{{- end -}}
true
{{- end }}
{{- end }}

{{/* The URI SAN of a component's certificate (kuberl.common.roles.Identity): (dict "root" $ "role" "weight_sync" ["instance" "..."]). */}}
{{- define "kuberl.tlsIdentity" -}}
spiffe://kuberl/{{ dig "job" "name" "kuberl" .root.Values.job }}/{{ .role }}{{ with .instance }}/{{ . }}{{ end }}
{{- end }}

{{/* The Secret of a component's own certificate under roles: (dict "root" $ "role" "weight_sync"). */}}
{{- define "kuberl.tlsComponentSecret" -}}
{{- $key := .role | camelcase | untitle }}
{{- default (printf "%s-%s-tls" (include "kuberl.fullname" .root) (.role | replace "_" "-")) (index .root.Values.tls.componentSecrets $key) }}
{{- end }}

{{/* The cert-manager issuerRef of the per-component certificates. */}}
{{- define "kuberl.tlsIssuerRef" -}}
{{- $ref := .Values.tls.certManager.issuerRef -}}
name: {{ $ref.name }}
kind: {{ default "Issuer" $ref.kind }}
group: {{ default "cert-manager.io" $ref.group }}
{{- end }}

{{- define "kuberl.tlsEnv" -}}
{{- if .Values.tls.enabled }}
{{- range $key, $value := include "kuberl.tlsSettings" . | fromYaml }}
- name: KUBERL_TLS__{{ upper $key }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kuberl.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: grpc-tls
  mountPath: /etc/kuberl-tls
  readOnly: true
{{- end }}
{{- end }}

{{/*
The certificate volume of a kuberl pod: (dict "root" $ "role" "<component>", the roles.py name).
The shared tls.secretName, or under roles the component's own Secret; rollout pods get a
csi-driver volume whose certificate names the pod (the replica id is the pod name).
*/}}
{{- define "kuberl.tlsVolume" -}}
{{- $root := .root }}
{{- if $root.Values.tls.enabled }}
- name: grpc-tls
{{- if not (include "kuberl.tlsRoles" $root) }}
  secret:
    secretName: {{ $root.Values.tls.secretName }}
    defaultMode: 0440
{{- else if eq .role "rollout" }}
{{- $ref := include "kuberl.tlsIssuerRef" $root | fromYaml }}
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $ref.name | quote }}
      csi.cert-manager.io/issuer-kind: {{ $ref.kind | quote }}
      csi.cert-manager.io/issuer-group: {{ $ref.group | quote }}
      csi.cert-manager.io/dns-names: {{ include "kuberl.tlsServerName" $root | quote }}
      csi.cert-manager.io/uri-sans: {{ include "kuberl.tlsIdentity" (dict "root" $root "role" "rollout" "instance" "${POD_NAME}") | quote }}
      csi.cert-manager.io/key-usages: "digital signature,key encipherment,server auth,client auth"
      {{- with $root.Values.podSecurityContext.fsGroup }}
      csi.cert-manager.io/fs-group: {{ . | quote }}
      {{- end }}
{{- else }}
  secret:
    secretName: {{ include "kuberl.tlsComponentSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "kuberl.env" -}}
- name: KUBERL_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: TMPDIR
  value: /tmp
{{- include "kuberl.tlsEnv" . }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* REDIS_PASSWORD from the Redis Secret, when there is one. */}}
{{- define "kuberl.redisPasswordEnv" -}}
{{- $secret := include "kuberl.redisSecretName" . }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "kuberl.redisSecretKey" . }}
{{- end }}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: SSL_CERT_FILE
  value: /etc/kuberl/redis-ca/ca.crt
{{- end }}
{{- end }}

{{/*
The volumes of every kuberl container: the job file, /tmp, and a writable working directory
(relative paths of the job, e.g. the cache of a locally built model, land there; the root
filesystem is read-only), and the gRPC certificate: (dict "root" $ "role" "<component>").
*/}}
{{- define "kuberl.jobVolume" -}}
- name: job
  configMap:
    name: {{ include "kuberl.fullname" .root }}-job
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: work
  emptyDir:
    sizeLimit: 10Gi
{{- include "kuberl.tlsVolume" . }}
{{- end }}

{{- define "kuberl.jobVolumeMount" -}}
- name: job
  mountPath: /etc/kuberl
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: work
  mountPath: /var/lib/kuberl/work
{{- include "kuberl.tlsVolumeMount" . }}
{{- end }}

{{- define "kuberl.workingDir" -}}
workingDir: /var/lib/kuberl/work
{{- end }}

{{/* The kuberl command of a service: (dict "root" $ "service" "buffer"). */}}
{{- define "kuberl.serveArgs" -}}
- serve
- {{ .service }}
- --config
- /etc/kuberl/job.yaml
{{- end }}

{{/*
Native gRPC probes on grpc.health.v1 (every kuberl server serves it), which says SERVING only
once the service's start-up is done: (dict "root" $ "port" 50051 ["startupFailures" N]).
*/}}
{{/*
Startup, readiness and liveness probes on grpc.health.v1: the kubelet's own gRPC probe, or with
tls.enabled (the kubelet's probe speaks only plaintext) `kuberl health` over TLS in the container.
*/}}
{{- define "kuberl.healthCheck" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command: ["kuberl", "health", "--timeout", {{ .timeout | quote }}, "127.0.0.1:{{ .port }}"]
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end }}

{{- define "kuberl.grpcProbes" -}}
{{- $probes := .root.Values.probes }}
startupProbe:
  {{- include "kuberl.healthCheck" (dict "root" .root "port" .port "timeout" $probes.readiness.timeoutSeconds) | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: {{ $probes.readiness.timeoutSeconds }}
  failureThreshold: {{ max $probes.startupFailureThreshold (default 0 .startupFailures) }}
readinessProbe:
  {{- include "kuberl.healthCheck" (dict "root" .root "port" .port "timeout" $probes.readiness.timeoutSeconds) | nindent 2 }}
  {{- toYaml $probes.readiness | nindent 2 }}
livenessProbe:
  {{- include "kuberl.healthCheck" (dict "root" .root "port" .port "timeout" $probes.liveness.timeoutSeconds) | nindent 2 }}
  {{- toYaml $probes.liveness | nindent 2 }}
{{- end }}

{{- define "kuberl.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
- name: metrics
  containerPort: {{ .metricsPort }}
  protocol: TCP
{{- end }}

{{/* A ClusterIP Service with the grpc and metrics ports: (dict "root" $ "component" "buffer" "name" "buffer" "values" .Values.buffer), optionally "extraPorts" (ServicePort list). */}}
{{- define "kuberl.service" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "kuberl.fullname" .root }}-{{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kuberl.componentLabels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "kuberl.componentSelectorLabels" (dict "root" .root "component" .component) | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .values.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ .values.metricsPort }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- with .extraPorts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* A PodDisruptionBudget: (dict "root" $ "component" "buffer" "name" "buffer" "pdb" .Values.buffer.pdb). */}}
{{- define "kuberl.pdb" -}}
{{- if .pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kuberl.fullname" .root }}-{{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kuberl.componentLabels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kuberl.componentSelectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
{{- end }}
{{- end }}

{{/*
A stateless kuberl gRPC service (buffer, reward, weight-sync): Deployment, Service and PDB.
(dict "root" $ "component" "weight-sync" "service" "weight_sync" "values" .Values.weightSync
      "replicas" 1 "recreate" true "redis" false "data" false "model" false "volumes" list "mounts" list)
Optional: "image" (default images.kuberl), "gpu" (schedule with the component's own
nodeSelector and tolerations only, as GPU pods are) and "volumeSizes" (sizeLimits of the disk
emptyDirs among "volumes", by value path, for the pod's ephemeral-storage).
*/}}
{{- define "kuberl.serviceDeployment" -}}
{{- $root := .root }}
{{- $values := .values }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kuberl.fullname" $root }}-{{ .component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kuberl.componentLabels" (dict "root" $root "component" .component) | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  revisionHistoryLimit: 5
  {{- if .recreate }}
  strategy:
    type: Recreate
  {{- else }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  {{- end }}
  selector:
    matchLabels:
      {{- include "kuberl.componentSelectorLabels" (dict "root" $root "component" .component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kuberl.componentSelectorLabels" (dict "root" $root "component" .component) | nindent 8 }}
        {{- with $root.Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "kuberl.checksumAnnotations" $root | nindent 8 }}
        {{- with merge (deepCopy (default dict $values.podAnnotations)) $root.Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "kuberl.podCommon" $root | nindent 6 }}
      {{- include "kuberl.scheduling" (dict "root" $root "values" $values "gpu" .gpu) | nindent 6 }}
      terminationGracePeriodSeconds: 30
      {{- with and .model $root.Values.model.volume (include "kuberl.waitForModel" (dict "root" $root "image" (default $root.Values.images.kuberl .image))) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "kuberl.image" (dict "root" $root "image" (default $root.Values.images.kuberl .image)) }}
          imagePullPolicy: {{ $root.Values.images.pullPolicy }}
          {{- include "kuberl.workingDir" $root | nindent 10 }}
          args:
            {{- include "kuberl.serveArgs" (dict "root" $root "service" .service) | nindent 12 }}
          ports:
            {{- include "kuberl.containerPorts" $values | nindent 12 }}
          env:
            {{- include "kuberl.env" $root | nindent 12 }}
            {{- if .redis }}
            {{- include "kuberl.redisPasswordEnv" $root | nindent 12 }}
            {{- end }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "kuberl.grpcProbes" (dict "root" $root "port" $values.port) | nindent 10 }}
          resources:
            {{- include "kuberl.withEphemeralStorage" (dict "resources" $values.resources "sizes" (merge (include "kuberl.jobVolumeSizes" $root | fromYaml) (default dict .volumeSizes))) | nindent 12 }}
          securityContext:
            {{- include "kuberl.securityContext" (dict "root" $root "override" $values.securityContext) | nindent 12 }}
          volumeMounts:
            {{- include "kuberl.jobVolumeMount" $root | nindent 12 }}
            {{- if and .redis (not $root.Values.redis.enabled) $root.Values.externalRedis.tls.caSecret }}
            - name: redis-ca
              mountPath: /etc/kuberl/redis-ca
              readOnly: true
            {{- end }}
            {{- if and .data $root.Values.data.volume }}
            - name: data
              mountPath: {{ $root.Values.data.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and .model $root.Values.model.volume }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
            {{- with .mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "kuberl.jobVolume" (dict "root" $root "role" (.component | replace "-" "_")) | nindent 8 }}
        {{- if and .redis (not $root.Values.redis.enabled) $root.Values.externalRedis.tls.caSecret }}
        - name: redis-ca
          secret:
            secretName: {{ $root.Values.externalRedis.tls.caSecret }}
        {{- end }}
        {{- if and .data $root.Values.data.volume }}
        {{- include "kuberl.readOnlyVolume" (dict "name" "data" "source" $root.Values.data.volume) | nindent 8 }}
        {{- end }}
        {{- if and .model $root.Values.model.volume }}
        {{- include "kuberl.readOnlyVolume" (dict "name" "model" "source" $root.Values.model.volume) | nindent 8 }}
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
---
{{ include "kuberl.service" (dict "root" $root "component" .component "name" .component "values" $values) }}
{{- $pdb := include "kuberl.pdb" (dict "root" $root "component" .component "name" .component "pdb" $values.pdb) }}
{{- if $pdb }}
---
{{ $pdb }}
{{- end }}
{{- end }}

{{/*
The rollout backlog the autoscalers follow: groups the buffer would let rollout generate right now,
i.e. job.buffer.max_inflight_groups minus the groups waiting for or in training (what the buffer's
backpressure counts besides leased prompts). Buffer gauges describe the whole job and every buffer
replica reports them, hence max across replicas. (dict "namespace" "ns" "maxInflight" 64)
*/}}
{{- define "kuberl.backlogQuery" -}}
{{- $sel := printf "kind=~\"train|sft\",namespace=\"%s\"" .namespace -}}
clamp_min({{ .maxInflight }} - sum(max by (kind) (kuberl_buffer_groups_pending{ {{- $sel -}} })) - sum(max by (kind) (kuberl_buffer_groups_in_batches{ {{- $sel -}} })), 0)
{{- end }}

{{/* job.buffer.max_inflight_groups, or the job model's default (tests/helm checks they agree). */}}
{{- define "kuberl.maxInflight" -}}
{{- dig "buffer" "max_inflight_groups" 64 (.Values.job | default dict) }}
{{- end }}
