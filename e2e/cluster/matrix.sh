#!/usr/bin/env bash
# The version matrix and the control-plane upgrade on a real one-node
# cluster (root): builds every Kubernetes release below, runs the
# real-cluster suite on each, then the upgrade test from the oldest to the
# newest on one etcd. Run it before a change to the version logic lands
# (carve_kube's layouts, the chart's gates, the harness's per-release flags).
# CI runs the suite on the newest release only.
set -euo pipefail
cd "$(dirname "$0")/../.."
releases=(1.34.4 1.35.4 1.36.3 1.37.2)
e2e/cluster/build.sh "${releases[@]}"
export CARVE_CLUSTER_REQUIRED=1
for r in "${releases[@]}"; do
    echo "=== real-cluster suite on Kubernetes $r"
    CARVE_KUBE_VERSION=$r cargo test -p carve-e2e --test real_cluster carve_on_a_real_one_node_cluster -- --nocapture
done
echo "=== control-plane upgrade ${releases[*]}"
CARVE_CLUSTER_UPGRADE=$(IFS=,; echo "${releases[*]}") \
    cargo test -p carve-e2e --test real_cluster control_plane_upgrade_on_a_real_cluster -- --nocapture
