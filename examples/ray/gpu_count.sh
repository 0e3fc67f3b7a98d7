# Sourced by start_head.sh and start_worker.sh (not run on its own): sets NUM_GPUS, the GPUs given to Ray.
# NUM_GPUS if set (a whole number; 0 is fine for a node without GPUs), else what `nvidia-smi -L` lists. No silent 0:
# a node where the count cannot be detected (no nvidia-smi, or it fails or lists none) is an error unless NUM_GPUS
# says so. SCRIPT_NAME names the calling script in the messages.
if [[ -z "${NUM_GPUS:-}" ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "$SCRIPT_NAME: nvidia-smi is not on PATH, so the GPU count cannot be detected: set NUM_GPUS" \
      "(NUM_GPUS=0 for a node without GPUs)" >&2
    exit 2
  fi
  if ! gpu_list="$(nvidia-smi -L 2>&1)"; then
    echo "$SCRIPT_NAME: \`nvidia-smi -L\` failed (${gpu_list:-no output}): set NUM_GPUS (NUM_GPUS=0 for no GPUs)" >&2
    exit 2
  fi
  NUM_GPUS="$(grep -c '^GPU' <<<"$gpu_list" || true)"
  if ((NUM_GPUS == 0)); then
    echo "$SCRIPT_NAME: nvidia-smi lists no GPUs: set NUM_GPUS (NUM_GPUS=0 to start without GPUs)" >&2
    exit 2
  fi
  echo "$SCRIPT_NAME: detected $NUM_GPUS GPUs with nvidia-smi" >&2
elif [[ ! "$NUM_GPUS" =~ ^[0-9]+$ ]]; then
  echo "$SCRIPT_NAME: NUM_GPUS=$NUM_GPUS is not a whole number" >&2
  exit 2
else
  echo "$SCRIPT_NAME: using NUM_GPUS=$NUM_GPUS GPUs" >&2
fi
