#!/usr/bin/env bash
# Train LoRA on a TPU VM from shards in GCS: create (or reuse) the VM, install the
# `train` extra with jax[tpu] at setup.py's jax pin, read the shards from gs:// (or
# mount the bucket with gcsfuse), run `prepack train` with a mesh, copy the run's outputs
# back to GCS.
#
#   gcp/tpu_vm.sh --project P --zone us-central1-a --shards gs://B/sets/alpaca/L2048 \
#       --model gemma3-270m --steps 1000 --batch-size 32 --results gs://B/runs/alpaca-l2048 [--dry-run]
#
# Shards for another max length: one command, then point --shards at the new folder:
#   python gcp/launch_dataflow.py --project P --input 'gs://B/raw/*.jsonl' --format alpaca \
#       --output gs://B/sets/alpaca --max-length 4096
#   gcp/tpu_vm.sh ... --shards gs://B/sets/alpaca/L4096
#
# Anything after `--` goes to `prepack train` unchanged (e.g. -- --lora-rank 16 --eval-shards ...).
# --dry-run prints every command (local and remote) and runs none of them.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
  # The header comment (line 2 up to the first line that is not a comment) is the help text.
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
  cat <<'EOF'

options:
  --project P            GCP project (default: $GOOGLE_CLOUD_PROJECT)
  --zone Z               TPU zone, in the bucket's region (default us-central1-a)
  --name NAME            TPU VM name (default prepack-tpu); reused if it exists
  --accelerator TYPE     e.g. v5litepod-8 (default), v5litepod-4, v6e-8, v4-8
  --runtime VERSION      TPU software version (default: from --accelerator)
  --spot                 create a Spot VM (much cheaper, can be preempted)
  --service-account SA   the VM's service account (needs read on the bucket, write on --results)
  --shards URL           gs://BUCKET/PATH/L<L> published shard set (required)
  --read MODE            gcs (default: the loader downloads each shard once into a local cache,
                         sha256-checked) or gcsfuse (mount the bucket read-only; for sets larger than the disk)
  --gcsfuse-file-cache   also cache whole shard files on the VM's disk (fast from the 2nd read; needs disk)
  --model M              prepack train --model (default gemma3-270m)
  --mesh SPEC            e.g. fsdp=8,tp=1 (default: fsdp=<chips>,tp=1)
  --batch-size B         global rows per step (default 32; must divide by fsdp)
  --steps N              (default 1000)
  --results URL          gs:// folder for the run's outputs (metrics, and whatever prepack train writes)
  --detach               run training under nohup on the VM and return; tail ~/prepack-run/train.log
  --dry-run              print the commands, run nothing
EOF
}

# ----------------------------------------------------------------------------- options
PROJECT="${GOOGLE_CLOUD_PROJECT:-${CLOUDSDK_CORE_PROJECT:-}}"
ZONE="us-central1-a"
NAME="prepack-tpu"
ACCELERATOR="v5litepod-8"
RUNTIME=""
SPOT=0
SERVICE_ACCOUNT=""
SHARDS=""
READ_MODE="gcs"
FILE_CACHE=0
MODEL="gemma3-270m"
MESH=""
BATCH_SIZE=32
STEPS=1000
RESULTS=""
DETACH=0
DRY_RUN=0
TRAIN_EXTRA=()

need() { [[ $# -ge 2 && -n "$2" ]] || { echo "tpu_vm.sh: $1 needs a value" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --project) need "$@"; PROJECT="$2"; shift 2 ;;
    --zone) need "$@"; ZONE="$2"; shift 2 ;;
    --name) need "$@"; NAME="$2"; shift 2 ;;
    --accelerator) need "$@"; ACCELERATOR="$2"; shift 2 ;;
    --runtime) need "$@"; RUNTIME="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --service-account) need "$@"; SERVICE_ACCOUNT="$2"; shift 2 ;;
    --shards) need "$@"; SHARDS="${2%/}"; shift 2 ;;
    --read) need "$@"; READ_MODE="$2"; shift 2 ;;
    --gcsfuse-file-cache) FILE_CACHE=1; shift ;;
    --model) need "$@"; MODEL="$2"; shift 2 ;;
    --mesh) need "$@"; MESH="$2"; shift 2 ;;
    --batch-size) need "$@"; BATCH_SIZE="$2"; shift 2 ;;
    --steps) need "$@"; STEPS="$2"; shift 2 ;;
    --results) need "$@"; RESULTS="${2%/}"; shift 2 ;;
    --detach) DETACH=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; TRAIN_EXTRA=("$@"); break ;;
    *) echo "tpu_vm.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "tpu_vm.sh: $*" >&2; exit 2; }
[[ -n "$PROJECT" ]] || die "--project is required (or set GOOGLE_CLOUD_PROJECT)"
[[ "$SHARDS" == gs://*/* ]] || die "--shards must be a gs://BUCKET/PATH shard set folder, got '${SHARDS}'"
[[ -z "$RESULTS" || "$RESULTS" == gs://* ]] || die "--results must be a gs:// folder, got '${RESULTS}'"
[[ "$READ_MODE" == gcsfuse || "$READ_MODE" == gcs ]] || die "--read must be gcsfuse or gcs, got '${READ_MODE}'"
[[ "$BATCH_SIZE" =~ ^[1-9][0-9]*$ && "$STEPS" =~ ^[1-9][0-9]*$ ]] || die "--batch-size and --steps must be positive integers"
[[ "$ZONE" == *-*-* ]] || die "--zone looks wrong: '${ZONE}' (e.g. us-central1-a)"

# Chips per slice from the accelerator name: v5e/v6e names count chips, v4/v5p count
# TensorCores (2 per chip).
chips_of() {
  local n="${1##*-}"
  case "$1" in
    v4-*|v5p-*) echo $(( n / 2 )) ;;
    *) echo "$n" ;;
  esac
}
runtime_of() {
  case "$1" in
    v5litepod-*) echo "v2-alpha-tpuv5-lite" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v4-*) echo "tpu-ubuntu2204-base" ;;
    *) die "no default --runtime for --accelerator $1; pass --runtime" ;;
  esac
}
[[ "${ACCELERATOR##*-}" =~ ^[0-9]+$ ]] || die "--accelerator looks wrong: '${ACCELERATOR}' (e.g. v5litepod-8)"
CHIPS="$(chips_of "$ACCELERATOR")"
[[ -n "$RUNTIME" ]] || RUNTIME="$(runtime_of "$ACCELERATOR")"
[[ -n "$MESH" ]] || MESH="fsdp=${CHIPS},tp=1"

# The TPU hosts install exactly the jax that the train extra pins, with its TPU runtime.
JAX_VERSION="$(sed -n 's/^[[:space:]]*"jax==\([0-9][0-9.]*\)",.*/\1/p' "$REPO_ROOT/setup.py" | head -n1)"
[[ -n "$JAX_VERSION" ]] || die "could not read the jax pin from $REPO_ROOT/setup.py"
UV_VERSION="0.13.9"  # the installer only; pinned so every host resolves the same way

BUCKET="${SHARDS#gs://}"; BUCKET="${BUCKET%%/*}"
KEY="${SHARDS#gs://"${BUCKET}"/}"
MOUNT="/mnt/gcs/${BUCKET}"
if [[ "$READ_MODE" == gcsfuse ]]; then TRAIN_SHARDS="${MOUNT}/${KEY}"; else TRAIN_SHARDS="$SHARDS"; fi
SRC_TARBALL="tunix-prepack-src.tar.gz"
GCLOUD_TPU=(gcloud compute tpus tpu-vm)
WHERE=(--zone "$ZONE" --project "$PROJECT")

# ----------------------------------------------------------------------------- helpers
run() {  # a local command
  if (( DRY_RUN )); then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}
remote() {  # remote WORKER TITLE SCRIPT: the script runs under bash -euo pipefail on the VM
  local worker="$1" title="$2" script="$3"
  if (( DRY_RUN )); then
    printf '+ %s ssh %s --zone %s --project %s --worker=%s --command "bash -euo pipefail -c <script>"   # %s\n' \
      "${GCLOUD_TPU[*]}" "$NAME" "$ZONE" "$PROJECT" "$worker" "$title"
    printf '%s\n' "$script" | sed 's/^/    | /'
  else
    echo "tpu_vm.sh: ${title} (worker ${worker})" >&2
    "${GCLOUD_TPU[@]}" ssh "$NAME" "${WHERE[@]}" --worker="$worker" \
      --command "bash -euo pipefail -c $(printf '%q' "$script")"
  fi
}

# ----------------------------------------------------------------------------- 1. the VM
create=("${GCLOUD_TPU[@]}" create "$NAME" "${WHERE[@]}" --accelerator-type "$ACCELERATOR" --version "$RUNTIME")
(( SPOT )) && create+=(--spot)
[[ -n "$SERVICE_ACCOUNT" ]] && create+=(--service-account "$SERVICE_ACCOUNT" --scopes cloud-platform)
if (( DRY_RUN )); then
  echo "# 1. reuse the TPU VM if it exists, else create it (${ACCELERATOR}: ${CHIPS} chips, runtime ${RUNTIME})"
  run "${GCLOUD_TPU[@]}" describe "$NAME" "${WHERE[@]}" --format 'value(state)'
  run "${create[@]}"
else
  command -v gcloud >/dev/null || die "gcloud is not installed (https://cloud.google.com/sdk/docs/install)"
  state="$("${GCLOUD_TPU[@]}" describe "$NAME" "${WHERE[@]}" --format 'value(state)' 2>/dev/null || true)"
  if [[ -z "$state" ]]; then
    echo "tpu_vm.sh: creating ${NAME} (${ACCELERATOR}, ${RUNTIME}) in ${ZONE}" >&2
    "${create[@]}"
  elif [[ "$state" == STOPPED ]]; then
    echo "tpu_vm.sh: starting stopped VM ${NAME}" >&2
    "${GCLOUD_TPU[@]}" start "$NAME" "${WHERE[@]}"
  else
    echo "tpu_vm.sh: reusing ${NAME} (state ${state})" >&2
  fi
fi

# ----------------------------------------------------------------------------- 2. the code
# The committed tree (git archive HEAD): what runs on the TPU is what is in git.
(( DRY_RUN )) && echo "# 2. ship the committed source to every host"
if (( ! DRY_RUN )) && [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  echo "tpu_vm.sh: warning: uncommitted changes are not shipped (git archive HEAD)" >&2
fi
LOCAL_TARBALL="${TMPDIR:-/tmp}/${SRC_TARBALL}"
run git -C "$REPO_ROOT" archive --format=tar.gz -o "$LOCAL_TARBALL" HEAD
run "${GCLOUD_TPU[@]}" scp "$LOCAL_TARBALL" "${NAME}:~/${SRC_TARBALL}" "${WHERE[@]}" --worker=all

# ----------------------------------------------------------------------------- 3. install
# TPU VM images ship Python 3.10; the package needs 3.11 (array-record, grain), so uv
# provides a managed 3.11 in a venv. jax[tpu] at the train extra's jax pin brings the
# matching libtpu from PyPI.
(( DRY_RUN )) && echo "# 3. install the train extra and jax[tpu]==${JAX_VERSION} on every host"
remote all "install tunix-prepack[train] + jax[tpu]==${JAX_VERSION}" "
python3 -m pip install --user --quiet 'uv==${UV_VERSION}'
rm -rf ~/tunix-prepack && mkdir -p ~/tunix-prepack && tar xzf ~/${SRC_TARBALL} -C ~/tunix-prepack
[ -x ~/prepack-venv/bin/python ] || ~/.local/bin/uv venv --python 3.11 ~/prepack-venv
~/.local/bin/uv pip install --python ~/prepack-venv/bin/python \"\$HOME/tunix-prepack[train]\" 'jax[tpu]==${JAX_VERSION}'
~/prepack-venv/bin/python -c 'import jax; print(jax.__version__, jax.devices()[0].platform, jax.device_count(), \"devices\")'"

# ----------------------------------------------------------------------------- 4. the data
if [[ "$READ_MODE" == gcsfuse ]]; then
  # Read-only, with the metadata caches Grain's GCS tutorial and MaxText use for random
  # access (stat/type/list caches never expire: a published shard set never changes).
  fuse_flags="-o ro --implicit-dirs --type-cache-max-size-mb=-1 --stat-cache-max-size-mb=-1 --kernel-list-cache-ttl-secs=-1 --metadata-cache-ttl-secs=-1 --app-name=tunix-prepack"
  if (( FILE_CACHE )); then
    # Whole shard files land on local disk on first read (also for range reads), so later
    # epochs read locally. Needs free disk for the shard set.
    fuse_flags+=" --cache-dir=/tmp/gcsfuse-cache --file-cache-max-size-mb=-1 --file-cache-cache-file-for-range-read=true"
  fi
  (( DRY_RUN )) && echo "# 4. mount gs://${BUCKET} read-only at ${MOUNT} on every host (gcsfuse)"
  remote all "mount gs://${BUCKET} at ${MOUNT}" "
if ! command -v gcsfuse >/dev/null; then
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  sudo apt-get update -qq && sudo apt-get install -y -qq gcsfuse
fi
sudo mkdir -p ${MOUNT} && sudo chown \$(id -u):\$(id -g) ${MOUNT}
mountpoint -q ${MOUNT} || gcsfuse ${fuse_flags} ${BUCKET} ${MOUNT}
test -f ${TRAIN_SHARDS}/manifest.json || { echo 'no manifest.json in ${TRAIN_SHARDS}: not a published shard set' >&2; exit 1; }"
else
  (( DRY_RUN )) && echo "# 4. no mount: the loader reads ${SHARDS} directly (manifest via google-cloud-storage, records via array_record)"
fi

# ----------------------------------------------------------------------------- 5. train
# shellcheck disable=SC2088  # the ~ is for the remote shell, which expands it
train_cmd="~/prepack-venv/bin/prepack train --shards $(printf '%q' "$TRAIN_SHARDS") --model $(printf '%q' "$MODEL") --mesh $(printf '%q' "$MESH") --batch-size ${BATCH_SIZE} --steps ${STEPS} --metrics-out ~/prepack-run/metrics.jsonl"
for a in "${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"}"; do train_cmd+=" $(printf '%q' "$a")"; done
(( DRY_RUN )) && echo "# 5. train on all hosts at once (multi-host slices run the same program; the loader splits rows by host)"
if (( DETACH )); then
  remote all "start prepack train (detached)" "
mkdir -p ~/prepack-run && cd ~/tunix-prepack
nohup ${train_cmd} > ~/prepack-run/train.log 2>&1 &
echo \"training in the background; follow it with: tail -f ~/prepack-run/train.log\""
else
  remote all "prepack train" "
mkdir -p ~/prepack-run && cd ~/tunix-prepack
${train_cmd} 2>&1 | tee ~/prepack-run/train.log"
fi

# ----------------------------------------------------------------------------- 6. results
if [[ -n "$RESULTS" ]]; then
  if (( DETACH )); then
    echo "# 6. after training ends, copy the outputs: ${GCLOUD_TPU[*]} ssh ${NAME} --zone ${ZONE} --project ${PROJECT} --worker=0 --command 'gcloud storage cp -r ~/prepack-run ${RESULTS}/'"
  else
    (( DRY_RUN )) && echo "# 6. copy the run's outputs (metrics, log, and anything prepack train wrote under ~/prepack-run) to ${RESULTS}"
    remote 0 "upload ~/prepack-run to ${RESULTS}" "gcloud storage cp -r ~/prepack-run/* ${RESULTS}/"
  fi
fi
(( DRY_RUN )) && echo "# delete the VM when done (billed while it exists): ${GCLOUD_TPU[*]} delete ${NAME} --zone ${ZONE} --project ${PROJECT}"
exit 0
