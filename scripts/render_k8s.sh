#!/usr/bin/env bash
# Rewrite deploy/k8s/*.yaml (plain manifests for kustomize) from the Helm chart:
# `scripts/render_k8s.sh` (needs helm: `make helm`). tests/e2e/test_k8s.py checks that the
# files match a fresh render wherever helm is installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
helm=${HELM:-$root/.cache/helm/bin/helm}
out=${1:-$root/deploy/k8s/base}
"$helm" template fleetgate "$root/deploy/helm/fleetgate" --namespace fleetgate \
  -f "$root/deploy/k8s/values.yaml" \
  | python3 "$root/scripts/split_manifests.py" "$out"
