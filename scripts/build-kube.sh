#!/usr/bin/env bash
# Build a real kube-apiserver and kube-controller-manager for the API-server test tier (tests/cluster/).
#
# Source: Debian's `kubernetes` source package (bookworm: 1.20.5+really1.20.2), built with Debian's golang-go
# (1.19), plus Debian's etcd-server (3.4) from apt. Kubernetes 1.20 was released with Go 1.15; two vendored
# libraries misbehave under a newer Go and are fixed here exactly as upstream fixed them:
#  1. github.com/modern-go/reflect2 v1.0.1: Go >= 1.18 changed reflect.mapiterinit to take the iterator as an
#     argument; the old binding crashes the apiserver at the first map-valued (custom resource) write.
#     Fix = upstream reflect2 v1.0.2 (go_above_118.go / go_below_118.go and the full runtime `hiter` layout).
#  2. go-openapi/validate and its kube-openapi fork (type.go): `reflect.DeepEqual(reflect.Zero(T), ValueOf(v))`
#     became true for "" with Go >= 1.16, so every empty string in a custom resource (and every `default: ""`
#     in a CRD schema) is rejected as "must be of type string: null". Fix = kube-openapi PR #230 /
#     go-openapi/validate PR #138 (check `data == nil` only), as in Kubernetes 1.21 (kubernetes issue #99804).
#
# Result: ${DAEDALUS_CACHE:-~/.cache/daedalus}/kube-<version>/bin/{kube-apiserver,kube-controller-manager}
# and a stamp file kube-<version>/stamp. Binaries never go into the working tree. Only these two commands are
# built (`make WHAT=...` also builds the code generators that produce pkg/generated/openapi, which the Debian
# tarball does not ship).
#
# Idempotent: when the stamp and both binaries are present it only makes sure etcd is installed and exits 0.
# Exit status: 0 built or already present; 1 impossible here (the message says why: not Debian, no root for
# apt-get, no deb-src entry, not enough disk, build error).
#
# Environment:
#   DAEDALUS_CACHE        cache root (default ~/.cache/daedalus)
#   DAEDALUS_KUBE_VERSION upstream version expected from the Debian source package (default 1.20.2)
#   DAEDALUS_BUILD_NICE   niceness of the compile (default 10; the machine is shared)
#   DAEDALUS_KEEP_BUILD=1 keep the source/build tree under the cache (default: removed after a success)
#   DAEDALUS_FORCE_BUILD=1 rebuild even when the stamp exists
# When the build is impossible the reason is also written to $CACHE/kube-<version>.unavailable.
set -euo pipefail

# The whole script is one function, parsed before it runs: editing this file during a build is safe.
main() {

CACHE=${DAEDALUS_CACHE:-$HOME/.cache/daedalus}
KUBE_VERSION=${DAEDALUS_KUBE_VERSION:-1.20.2}
NICE=${DAEDALUS_BUILD_NICE:-10}
DEST="$CACHE/kube-$KUBE_VERSION"
WORK="$CACHE/build-kube-$KUBE_VERSION"
SRC_LIST=/etc/apt/sources.list.d/daedalus-deb-src.sources
START=$(date +%s)

log() { echo "build-kube: $*"; }
REASON_FILE="$CACHE/kube-$KUBE_VERSION.unavailable"   # read by tests/cluster to explain a skip
die() {
  echo "build-kube: IMPOSSIBLE: $*" >&2
  { mkdir -p "$CACHE" && echo "$*" >"$REASON_FILE"; } 2>/dev/null || true
  exit 1
}
elapsed() { echo $(( $(date +%s) - START )); }

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=(sudo -n); fi
fi
apt_get() {
  if [[ $(id -u) -ne 0 && ${#SUDO[@]} -eq 0 ]]; then
    die "apt-get $* needs root (or password-less sudo); run this script as root once"
  fi
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get "$@"
}

ensure_etcd() {
  if ! command -v etcd >/dev/null; then
    log "installing etcd-server (apt)"
    apt_get install -y -q --no-install-recommends etcd-server >/dev/null || die "apt-get install etcd-server failed"
  fi
  log "etcd: $(etcd --version | head -n1)"
}

mkdir -p "$CACHE"
exec 9>"$CACHE/.build-kube.lock"
flock 9   # one build at a time (parallel `make` runs wait here)

if [[ ${DAEDALUS_FORCE_BUILD:-0} != 1 && -f "$DEST/stamp" && -x "$DEST/bin/kube-apiserver" \
      && -x "$DEST/bin/kube-controller-manager" ]]; then
  ensure_etcd
  log "already built: $DEST ($(grep '^debian_version=' "$DEST/stamp" | cut -d= -f2)); nothing to do ($(elapsed) s)"
  exit 0
fi

[[ -r /etc/os-release ]] || die "no /etc/os-release: this build needs Debian (bookworm ships kubernetes 1.20.2 sources)"
# shellcheck disable=SC1091
. /etc/os-release
[[ ${ID:-} == debian ]] || die "this build needs Debian's kubernetes source package; this machine is '${ID:-unknown}'"
CODENAME=${VERSION_CODENAME:-}
[[ -n $CODENAME ]] || die "VERSION_CODENAME missing from /etc/os-release"
command -v apt-get >/dev/null || die "apt-get not found"

avail_kb=$(df -Pk "$CACHE" | awk 'NR==2 {print $4}')
(( avail_kb > 4 * 1024 * 1024 )) || die "less than 4 GiB free under $CACHE (source + Go build cache need ~3.5 GiB)"

log "installing build dependencies (apt): golang-go etcd-server dpkg-dev make rsync jq patch xz-utils"
apt_get update -qq >/dev/null 2>&1 || log "warning: apt-get update failed; trying with the current lists"
apt_get install -y -q --no-install-recommends golang-go etcd-server dpkg-dev make rsync jq patch xz-utils \
  >/dev/null || die "apt-get install of the build dependencies failed"
export PATH=/usr/lib/go/bin:$PATH
log "go: $(go version)"
ensure_etcd

# apt-get source needs deb-src entries for this suite. Reuse the mirror the machine already uses.
if ! apt-cache showsrc kubernetes 2>/dev/null | grep '^Version:' >/dev/null; then
  # URIs of active entries only (deb822 "URIs:" or one-line "deb ..."), never commented-out ones.
  active_uris=$(grep -rhoE '^(URIs:[[:space:]]*|deb[[:space:]]+(\[[^]]*\][[:space:]]+)?)[a-z]+://[^[:space:]]+' \
                  $(find /etc/apt/sources.list /etc/apt/sources.list.d -maxdepth 1 -type f \
                      \( -name '*.list' -o -name '*.sources' \) ! -name "$(basename "$SRC_LIST")" 2>/dev/null) \
                  /dev/null 2>/dev/null | grep -oE '[a-z]+://[^[:space:]]+' || true)
  mirror=$(grep -E '/debian/?$' <<<"$active_uris" | head -n1 || true)
  security=$(grep -E '/debian-security/?$' <<<"$active_uris" | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  security=${security:-http://deb.debian.org/debian-security}
  log "adding deb-src entries for $CODENAME ($mirror, $security) in $SRC_LIST"
  cat <<EOF | "${SUDO[@]}" tee "$SRC_LIST" >/dev/null
# Added by daedalus scripts/build-kube.sh: source packages for 'apt-get source kubernetes'.
Types: deb-src
URIs: $mirror
Suites: $CODENAME $CODENAME-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: $security
Suites: $CODENAME-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  apt_get update -qq >/dev/null 2>&1 || log "warning: apt-get update failed after adding deb-src"
fi
DEB_VERSION=$(apt-cache showsrc kubernetes 2>/dev/null | awk '/^Version:/ {print $2}' | sort -V | tail -n1)
[[ -n $DEB_VERSION ]] || die "Debian '$CODENAME' has no 'kubernetes' source package (bookworm has 1.20.2)"
upstream=${DEB_VERSION#*:}; upstream=${upstream%-*}; upstream=${upstream##*really}
[[ $upstream == "$KUBE_VERSION" ]] \
  || die "Debian's kubernetes source is $DEB_VERSION (upstream $upstream), expected $KUBE_VERSION;" \
         "set DAEDALUS_KUBE_VERSION to try it"
log "source: Debian kubernetes $DEB_VERSION"

rm -rf "$WORK"; mkdir -p "$WORK"
cd "$WORK"
apt-get source -q kubernetes="$DEB_VERSION" >"$WORK/apt-source.log" 2>&1 \
  || { tail -n 20 "$WORK/apt-source.log" >&2; die "apt-get source kubernetes=$DEB_VERSION failed"; }
SRC=$(find "$WORK" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -n1)
[[ -n $SRC && -f $SRC/Makefile ]] || die "unpacked source tree not found under $WORK"
cd "$SRC"
log "source unpacked in $(elapsed) s: $SRC"

log "applying the reflect2 fix for Go >= 1.18 (upstream modern-go/reflect2 v1.0.2)"
patch -p1 --forward --quiet <<'PATCH' || die "the reflect2 patch did not apply (has Debian changed the vendored copy?)"
diff -ruN a/vendor/github.com/modern-go/reflect2/go_above_118.go b/vendor/github.com/modern-go/reflect2/go_above_118.go
--- a/vendor/github.com/modern-go/reflect2/go_above_118.go
+++ b/vendor/github.com/modern-go/reflect2/go_above_118.go
@@ -0,0 +1,24 @@
+//go:build go1.18
+// +build go1.18
+
+package reflect2
+
+import (
+	"unsafe"
+)
+
+// m escapes into the return value, but the caller of mapiterinit
+// doesn't let the return value escape.
+//go:noescape
+//go:linkname mapiterinit reflect.mapiterinit
+func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer, it *hiter)
+
+func (type2 *UnsafeMapType) UnsafeIterate(obj unsafe.Pointer) MapIterator {
+	var it hiter
+	mapiterinit(type2.rtype, *(*unsafe.Pointer)(obj), &it)
+	return &UnsafeMapIterator{
+		hiter:      &it,
+		pKeyRType:  type2.pKeyRType,
+		pElemRType: type2.pElemRType,
+	}
+}
diff -ruN a/vendor/github.com/modern-go/reflect2/go_below_118.go b/vendor/github.com/modern-go/reflect2/go_below_118.go
--- a/vendor/github.com/modern-go/reflect2/go_below_118.go
+++ b/vendor/github.com/modern-go/reflect2/go_below_118.go
@@ -0,0 +1,22 @@
+//go:build !go1.18
+// +build !go1.18
+
+package reflect2
+
+import (
+	"unsafe"
+)
+
+// m escapes into the return value, but the caller of mapiterinit
+// doesn't let the return value escape.
+//go:noescape
+//go:linkname mapiterinit reflect.mapiterinit
+func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer) (val *hiter)
+
+func (type2 *UnsafeMapType) UnsafeIterate(obj unsafe.Pointer) MapIterator {
+	return &UnsafeMapIterator{
+		hiter:      mapiterinit(type2.rtype, *(*unsafe.Pointer)(obj)),
+		pKeyRType:  type2.pKeyRType,
+		pElemRType: type2.pElemRType,
+	}
+}
diff -ruN a/vendor/github.com/modern-go/reflect2/unsafe_link.go b/vendor/github.com/modern-go/reflect2/unsafe_link.go
--- a/vendor/github.com/modern-go/reflect2/unsafe_link.go
+++ b/vendor/github.com/modern-go/reflect2/unsafe_link.go
@@ -25,12 +25,6 @@
 //go:noescape
 func mapaccess(rtype unsafe.Pointer, m unsafe.Pointer, key unsafe.Pointer) (val unsafe.Pointer)
 
-// m escapes into the return value, but the caller of mapiterinit
-// doesn't let the return value escape.
-//go:noescape
-//go:linkname mapiterinit reflect.mapiterinit
-func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer) *hiter
-
 //go:noescape
 //go:linkname mapiternext reflect.mapiternext
 func mapiternext(it *hiter)
@@ -42,9 +36,21 @@
 // If you modify hiter, also change cmd/internal/gc/reflect.go to indicate
 // the layout of this structure.
 type hiter struct {
-	key   unsafe.Pointer // Must be in first position.  Write nil to indicate iteration end (see cmd/internal/gc/range.go).
-	value unsafe.Pointer // Must be in second position (see cmd/internal/gc/range.go).
-	// rest fields are ignored
+	key         unsafe.Pointer
+	value       unsafe.Pointer
+	t           unsafe.Pointer
+	h           unsafe.Pointer
+	buckets     unsafe.Pointer
+	bptr        unsafe.Pointer
+	overflow    *[]unsafe.Pointer
+	oldoverflow *[]unsafe.Pointer
+	startBucket uintptr
+	offset      uint8
+	wrapped     bool
+	B           uint8
+	i           uint8
+	bucket      uintptr
+	checkBucket uintptr
 }
 
 // add returns p+x.
diff -ruN a/vendor/github.com/modern-go/reflect2/unsafe_map.go b/vendor/github.com/modern-go/reflect2/unsafe_map.go
--- a/vendor/github.com/modern-go/reflect2/unsafe_map.go
+++ b/vendor/github.com/modern-go/reflect2/unsafe_map.go
@@ -107,14 +107,6 @@
 	return type2.UnsafeIterate(objEFace.data)
 }
 
-func (type2 *UnsafeMapType) UnsafeIterate(obj unsafe.Pointer) MapIterator {
-	return &UnsafeMapIterator{
-		hiter:      mapiterinit(type2.rtype, *(*unsafe.Pointer)(obj)),
-		pKeyRType:  type2.pKeyRType,
-		pElemRType: type2.pElemRType,
-	}
-}
-
 type UnsafeMapIterator struct {
 	*hiter
 	pKeyRType  unsafe.Pointer
PATCH

log "applying the empty-string validation fix for Go >= 1.16 (kube-openapi PR #230)"
local zero_check='if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {'
local f
for f in vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go vendor/github.com/go-openapi/validate/type.go; do
  [[ $(grep -cF "$zero_check" "$f") == 1 ]] || die "$f: the zero-value check to fix was not found exactly once"
  sed -i "s/$(sed 's/[][\\/.*^$]/\\&/g' <<<"$zero_check")/if data == nil {/" "$f"
  ! grep -qF "$zero_check" "$f" || die "$f: the zero-value fix did not apply"
done

# debian/rules builds the same way: GOPATH symlink + `make WHAT=...`, CGO off.
mkdir -p .go/src/k8s.io "$WORK/home" "$WORK/gocache"
[[ -L .go/src/k8s.io/kubernetes ]] || ln -s ../../.. .go/src/k8s.io/kubernetes
log "building kube-apiserver and kube-controller-manager (nice $NICE; ~6 min on 2 idle cores, up to ~25 min when they are busy; once, then cached)"
build_start=$(date +%s)
if ! env GOPATH="$SRC/.go" CGO_ENABLED=0 GOPROXY=off GOFLAGS=-mod=vendor HOME="$WORK/home" \
       GOCACHE="$WORK/gocache" nice -n "$NICE" \
       make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" >"$WORK/make.log" 2>&1; then
  tail -n 40 "$WORK/make.log" >&2
  die "make failed (full log: $WORK/make.log)"
fi
log "compiled in $(( $(date +%s) - build_start )) s"

tmp="$DEST.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin"
for b in kube-apiserver kube-controller-manager; do
  install -m 0755 "_output/bin/$b" "$tmp/bin/$b"
done
reported=$("$tmp/bin/kube-apiserver" --version)
[[ $reported == "Kubernetes v$KUBE_VERSION" ]] || die "built kube-apiserver reports '$reported', expected v$KUBE_VERSION"
"$tmp/bin/kube-controller-manager" --version >/dev/null || die "built kube-controller-manager does not run"
{
  echo "kube_version=$KUBE_VERSION"
  echo "debian_version=$DEB_VERSION"
  echo "go_version=$(go version | awk '{print $3}')"
  echo "etcd_version=$(etcd --version | awk 'NR==1 {print $3}')"
  echo "fixes=reflect2-v1.0.2-mapiterinit,kube-openapi-230-zero-value"
  echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "build_seconds=$(elapsed)"
  (cd "$tmp/bin" && sha256sum kube-apiserver kube-controller-manager | sed 's/^/sha256 /')
} >"$tmp/stamp"
rm -rf "$DEST"; mv "$tmp" "$DEST"; rm -f "$REASON_FILE"
cd "$CACHE"
if [[ ${DAEDALUS_KEEP_BUILD:-0} != 1 ]]; then rm -rf "$WORK"; fi
log "installed $reported into $DEST/bin in $(elapsed) s (stamp: $DEST/stamp)"
}

main "$@"
