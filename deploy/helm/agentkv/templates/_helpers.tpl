{{/*
Names, labels, and the engines' vLLM command line. The engine arguments, environment and
--kv-transfer-config follow agentkv's launcher (agentkv.server.launch._launcher.build_command) flag for
flag; tests/unit/deploy/test_commands.py fails where the two part.
*/}}

{{- define "agentkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* 50 characters at most: "-service-token" and the role suffixes must still fit a 63-character name. */}}
{{- define "agentkv.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "agentkv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "agentkv.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: agentkv
{{- end }}

{{- define "agentkv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentkv.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "agentkv.engineImage" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) }}
{{- end }}

{{- define "agentkv.routerImage" -}}
{{- printf "%s:%s" .Values.routerImage.repository (default .Chart.AppVersion .Values.routerImage.tag) }}
{{- end }}

{{/* The Secret holding the retention-service token, made by the chart from serviceToken.value or named. */}}
{{- define "agentkv.serviceTokenSecret" -}}
{{- if .Values.serviceToken.existingSecret }}
{{- .Values.serviceToken.existingSecret }}
{{- else if .Values.serviceToken.value }}
{{- printf "%s-service-token" (include "agentkv.fullname" .) }}
{{- else }}
{{- fail "serviceToken: name a Secret (serviceToken.existingSecret) or give serviceToken.value; decode's retention service must not be open" }}
{{- end }}
{{- end }}

{{/* A headless Service's DNS name: the engines of one role. */}}
{{- define "agentkv.engineHost" -}}
{{- printf "%s-%s.%s.svc.cluster.local" (include "agentkv.fullname" .root) .role .root.Release.Namespace }}
{{- end }}

{{/* One role's settings: engine: with prefill: or decode: over it, as YAML (read back with fromYaml). */}}
{{- define "agentkv.engineValues" -}}
{{- $values := mergeOverwrite (deepCopy .root.Values.engine) (deepCopy (index .root.Values .role)) }}
{{- toYaml $values }}
{{- end }}

{{/*
--kv-transfer-config as the launcher's _kv_transfer_config builds it. The service host is the pod's own
address ($(POD_IP), expanded by the kubelet): prefill calls decode's retention service there, so never
0.0.0.0.
*/}}
{{- define "agentkv.kvTransferConfig" -}}
{{- $c := .cfg }}
{{- $gpu := eq .root.Values.device "gpu" }}
{{- $extra := dict "bidirectional_kv_xfer" $c.connector.bidirectional "kv_recompute_threshold" $c.connector.kvRecomputeThreshold "decoder_kv_blocks_ttl" $c.connector.decoderKvBlocksTtl "kv_lease_duration" $c.connector.kvLeaseDuration }}
{{- $_ := set $extra "agentkv_lease_s" .root.Values.leaseS }}
{{- $_ = set $extra "agentkv_max_lease_s" .root.Values.maxLeaseS }}
{{- $_ = set $extra "agentkv_prefix_check" $c.connector.prefixCheck }}
{{- $_ = set $extra "agentkv_cost_model" $c.connector.costModel }}
{{- $_ = set $extra "agentkv_service_port" (add $c.ports.http 1000) }}
{{- $_ = set $extra "agentkv_service_host" "$(POD_IP)" }}
{{- if $gpu }}
{{- $_ = set $extra "agentkv_idle_sleep_max_ms" 2.0 }}
{{- $_ = set $extra "agentkv_progress_delay_us" 0 }}
{{- $_ = set $extra "enable_cross_layers_blocks" "True" }}
{{- else }}
{{- $_ = set $extra "agentkv_worker_busy_loop_s" 0.1 }}
{{- end }}
{{- $extra = mergeOverwrite $extra (deepCopy $c.extraKvConfig) }}
{{- $cfg := dict "kv_connector" "NixlConnector" "kv_role" (ternary "kv_producer" "kv_consumer" (eq .role "prefill")) "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $extra }}
{{- $_ = set $cfg "kv_connector_module_path" "agentkv.server.engine.connector" }}
{{- if not $gpu }}
{{- $_ = set $cfg "kv_buffer_device" "cpu" }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* vLLM's arguments, in the launcher's order (build_command); the HTTP server listens on every address. */}}
{{- define "agentkv.engineArgs" -}}
{{- $c := .cfg }}
{{- $v := .root.Values }}
{{- $gpu := eq $v.device "gpu" }}
{{- $extraArgs := list }}
{{- if gt (int $c.tensorParallelSize) 1 }}
{{- $extraArgs = list "--tensor-parallel-size" (toString (int $c.tensorParallelSize)) }}
{{- end }}
{{- $extraArgs = concat $extraArgs $c.extraArgs }}
{{- $chosen := false }}
{{- range $c.extraArgs }}
{{- if or (hasPrefix "--compilation-config" .) (hasPrefix "-cc" .) (hasPrefix "-O" .) (hasPrefix "--enforce-eager" .) }}
{{- $chosen = true }}
{{- end }}
{{- end }}
- -m
- vllm.entrypoints.openai.api_server
- --model
- {{ $v.model.path | quote }}
- --host
- 0.0.0.0
- --port
- {{ int $c.ports.http | quote }}
- --max-model-len
- {{ int $v.model.maxModelLen | quote }}
- --served-model-name
- {{ default (base $v.model.path) $v.model.servedModelName | quote }}
- {{ ternary "--enable-prefix-caching" "--no-enable-prefix-caching" $c.prefixCaching }}
- --disable-uvicorn-access-log
- --seed
- "0"
- --enable-prompt-tokens-details
{{- if $c.scaleOut }}
- --enable-scale-out
{{- end }}
{{- if not $chosen }}
{{- if or $c.enforceEager (not $gpu) }}
- --enforce-eager
{{- else }}
- --compilation-config
- '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'
{{- end }}
{{- end }}
{{- $blockSize := $c.blockSize | default (ternary 64 0 $gpu) }}
{{- if $blockSize }}
- --block-size
- {{ int $blockSize | quote }}
{{- end }}
{{- if not $gpu }}
- --dtype
- bfloat16
{{- end }}
{{- if $c.toolCallParser }}
- --enable-auto-tool-choice
- --tool-call-parser
- {{ $c.toolCallParser | quote }}
{{- end }}
- --kv-transfer-config
{{- /* Single-quoted: the JSON reads as written (YAML doubles a quote inside). */}}
- '{{ include "agentkv.kvTransferConfig" . | replace "'" "''" }}'
{{- range $extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The engine container's environment: the launcher's, with the pod's address for the host. */}}
{{- define "agentkv.engineEnv" -}}
{{- $c := .cfg }}
{{- $v := .root.Values }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PYTHONUNBUFFERED
  value: "1"
- name: VLLM_NIXL_SIDE_CHANNEL_HOST
  value: $(POD_IP)
- name: VLLM_NIXL_SIDE_CHANNEL_PORT
  value: {{ int $c.ports.nixl | quote }}
- name: VLLM_LOG_STATS_INTERVAL
  value: "5"
- name: AGENTKV_TOKENIZER_CACHE
  value: {{ $c.plugin.tokenizerCache | quote }}
- name: AGENTKV_DETOKENIZER_PRIME_TOKENS
  value: {{ int $c.plugin.detokenizerPrimeTokens | quote }}
- name: AGENTKV_FORWARDED_IDS
  value: {{ $c.plugin.forwardedIds | quote }}
- name: AGENTKV_FAST_JSON
  value: {{ ternary "on" "off" $c.plugin.fastJson | quote }}
- name: AGENTKV_PREFILL_TOKEN
  value: {{ ternary "on" "off" $c.plugin.prefillToken | quote }}
{{- if eq $v.device "cpu" }}
- name: VLLM_HOST_IP
  value: $(POD_IP)
- name: VLLM_CPU_KVCACHE_SPACE
  value: {{ int $c.cpuKvCacheGiB | quote }}
- name: VLLM_NO_USAGE_STATS
  value: "1"
- name: DO_NOT_TRACK
  value: "1"
{{- $oneThread := false }}
{{- range $c.extraEnv }}{{ if eq .name "OMP_NUM_THREADS" }}{{ $oneThread = true }}{{ end }}{{ end }}
{{- if and $c.inProcessWorker $oneThread }}
- name: VLLM_ENABLE_V1_MULTIPROCESSING
  value: "0"
{{- end }}
{{- else }}
- name: UCX_CUDA_IPC_ENABLE_GET_ZCOPY
  value: "y"
- name: VLLM_USE_V2_MODEL_RUNNER
  value: "0"
{{- end }}
{{- if $c.rdma.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ $c.rdma.ucxNetDevices | quote }}
{{- end }}
- name: AGENTKV_SERVICE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "agentkv.serviceTokenSecret" .root }}
      key: {{ $v.serviceToken.key }}
{{- with $c.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
