#!/usr/bin/env bash
# Launch rlver_jax on every worker of a TPU VM; `./run_tpu.sh --help` says how.
set -euo pipefail

usage() {
  cat <<USAGE
usage: $0 [--dry-run] create|setup|run MODULE [ARGS...]|delete

Launch rlver_jax on every worker of a TPU VM:
  TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh create      # make the TPU VM
  TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh setup       # copy this tree, install
  TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh run rlver_jax.main --config=configs/ppo.py ...
  TPU_NAME=rlver ZONE=us-central2-b ./run_tpu.sh delete

Commands:
  create               gcloud compute tpus tpu-vm create TPU_NAME
  setup                copy this tree to every worker, make a venv there and install it
  run MODULE [ARGS...] python -m MODULE ARGS on all workers at once, one process each; JAX
                       finds its peers through the TPU metadata, and
                       rlver_jax.sharding.maybe_initialize_distributed() joins them
                       (RLVER_MULTIHOST=1)
  delete               gcloud compute tpus tpu-vm delete TPU_NAME

Options (anywhere before MODULE; after it, they are the module's):
  --dry-run            print every command it would run (gcloud, tar), run none
  -h, --help           this text

Environment: TPU_NAME, ZONE (required); PROJECT, ACCELERATOR_TYPE (v4-32),
TPU_VERSION (tpu-ubuntu2204-base).
USAGE
}

usage_error() {
  echo "run_tpu.sh: $1; usage: $0 [--dry-run] create|setup|run MODULE [ARGS...]|delete" \
    "(--help says more)" >&2
  exit 2
}

dry_run=
cmd=
# Options come before MODULE: what follows it is the module's own command line.
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    -*) usage_error "unknown option $1" ;;
    *) [ -n "$cmd" ] && break; cmd=$1 ;;
  esac
  shift
done

: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v4-32}
TPU_VERSION=${TPU_VERSION:-tpu-ubuntu2204-base}
REMOTE_DIR=rlver_jax

# Runs its arguments, or on a dry run prints them, quoted as a shell would read them back.
act() {
  if [ -n "$dry_run" ]; then
    local quoted
    quoted=$(printf '%q ' "$@")
    echo "${quoted% }"
  else
    "$@"
  fi
}

tpu() {
  local verb=$1
  shift
  act gcloud compute tpus tpu-vm "$verb" "$@" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"}
}

on_all_workers() {
  tpu ssh "$TPU_NAME" --worker=all --command "$1"
}

no_arguments() {
  [ $# -eq 0 ] || usage_error "$cmd takes no arguments (got $1)"
}

case "$cmd" in
  create)
    no_arguments "$@"
    tpu create "$TPU_NAME" --accelerator-type "$ACCELERATOR_TYPE" --version "$TPU_VERSION"
    ;;
  setup)
    no_arguments "$@"
    if [ -n "$dry_run" ]; then
      archive=/tmp/rlver_jax.XXXXXX.tgz  # named, not made
    else
      archive=$(mktemp --suffix=.tgz)
    fi
    # Local caches stay here: pytest's (the tests' compilation cache, written while a test
    # run goes on) and hypothesis' would only grow the archive, or change as tar reads them.
    act tar czf "$archive" --exclude=.venv --exclude=.venv-bench --exclude=.git \
      --exclude=__pycache__ --exclude=bench_results --exclude=.pytest_cache \
      --exclude=.hypothesis -C "$(dirname "$0")" .
    tpu scp "$archive" "$TPU_NAME:~/rlver_jax.tgz" --worker=all
    act rm -f "$archive"
    on_all_workers "mkdir -p ~/$REMOTE_DIR && tar xzf ~/rlver_jax.tgz -C ~/$REMOTE_DIR && \
      cd ~/$REMOTE_DIR && python3 -m venv .venv && . .venv/bin/activate && \
      pip install -q -U pip && pip install -q -e . 'jax[tpu]'"
    ;;
  run)
    [ $# -gt 0 ] || usage_error "run needs a MODULE"
    module=$1
    shift
    args=
    # Quoted for the remote shell; none at all is no argument (printf would make one '').
    [ $# -gt 0 ] && args=$(printf ' %q' "$@")
    # One process per worker; RLVER_MULTIHOST=1 makes each join the others through
    # jax.distributed.initialize(), which reads the slice's workers from the TPU metadata.
    on_all_workers "cd ~/$REMOTE_DIR && . .venv/bin/activate && \
      RLVER_MULTIHOST=1 python -m $module$args"
    ;;
  delete)
    no_arguments "$@"
    tpu delete "$TPU_NAME" --quiet
    ;;
  *)
    usage_error "unknown command '${cmd}'"
    ;;
esac
