#!/usr/bin/env bash
# Launch rlver_jax on every worker of a TPU VM.
#
#   TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh create      # make the TPU VM
#   TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh setup       # copy this tree, install
#   TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh run rlver_jax.generate --checkpoint ...
#   TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh delete
#
# Environment: TPU_NAME, ZONE (required); PROJECT, ACCELERATOR_TYPE (v4-32),
# TPU_VERSION (tpu-ubuntu2204-base). `run MODULE ARGS...` runs `python -m MODULE ARGS`
# on all workers at once, one process each; JAX finds its peers through the TPU metadata,
# and rlver_jax.sharding.maybe_initialize_distributed() joins them (RLVER_MULTIHOST=1).
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v4-32}
TPU_VERSION=${TPU_VERSION:-tpu-ubuntu2204-base}
REMOTE_DIR=rlver_jax

tpu() {
  local verb=$1
  shift
  gcloud compute tpus tpu-vm "$verb" "$@" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"}
}

on_all_workers() {
  tpu ssh "$TPU_NAME" --worker=all --command "$1"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  create)
    tpu create "$TPU_NAME" --accelerator-type "$ACCELERATOR_TYPE" --version "$TPU_VERSION"
    ;;
  setup)
    archive=$(mktemp --suffix=.tgz)
    # Local caches stay here: pytest's (the tests' compilation cache, written while a test
    # run goes on) and hypothesis' would only grow the archive, or change as tar reads them.
    tar czf "$archive" --exclude=.venv --exclude=.venv-bench --exclude=.git \
      --exclude=__pycache__ --exclude=bench_results --exclude=.pytest_cache \
      --exclude=.hypothesis -C "$(dirname "$0")" .
    tpu scp "$archive" "$TPU_NAME:~/rlver_jax.tgz" --worker=all
    rm -f "$archive"
    on_all_workers "mkdir -p ~/$REMOTE_DIR && tar xzf ~/rlver_jax.tgz -C ~/$REMOTE_DIR && \
      cd ~/$REMOTE_DIR && python3 -m venv .venv && . .venv/bin/activate && \
      pip install -q -U pip && pip install -q -e . 'jax[tpu]'"
    ;;
  run)
    module=${1:?usage: run_tpu.sh run MODULE [ARGS...]}
    shift
    args=$(printf ' %q' "$@")
    # One process per worker; RLVER_MULTIHOST=1 makes each join the others through
    # jax.distributed.initialize(), which reads the slice's workers from the TPU metadata.
    on_all_workers "cd ~/$REMOTE_DIR && . .venv/bin/activate && \
      RLVER_MULTIHOST=1 python -m $module$args"
    ;;
  delete)
    tpu delete "$TPU_NAME" --quiet
    ;;
  *)
    echo "usage: $0 create|setup|run MODULE [ARGS...]|delete" >&2
    exit 2
    ;;
esac
