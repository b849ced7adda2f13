#!/bin/bash
# train_main on a TPU slice through XPK (github.com/AI-Hypercomputer/xpk), which builds the
# image from this directory, writes the JobSet and submits it to a GKE cluster it made.
#
#   CLUSTER=my-cluster ZONE=us-east5-a PROJECT=my-project bash docs/recipes/xpk_tpu.sh
#
# --max-restarts lets XPK restart the pods after a preemption; train_main's save (exit 143)
# makes each restart resume. The workdir must be shared by the hosts (a gcsfuse mount or
# Filestore volume attached to the cluster: `xpk storage attach`).
set -euo pipefail

CLUSTER=${CLUSTER:?name of the GKE cluster xpk created}
ZONE=${ZONE:?e.g. us-east5-a}
PROJECT=${PROJECT:?the Google Cloud project}
TPU_TYPE=${TPU_TYPE:-v5p-16}  # XPK counts TensorCores: v5p-16 is 8 chips, 2 hosts
WORKDIR=${WORKDIR:-/runs/nnx-zoo}

xpk workload create \
  --cluster="$CLUSTER" --zone="$ZONE" --project="$PROJECT" \
  --workload="nnx-zoo-$(date +%Y%m%d-%H%M%S)" \
  --tpu-type="$TPU_TYPE" --num-slices=1 \
  --base-docker-image=python:3.11 --script-dir=. \
  --max-restarts=3 \
  --command="pip install -e '.[tpu]' && python train_main.py --config=llama3_1b --sharding_strategy=fsdp --workdir=$WORKDIR"
