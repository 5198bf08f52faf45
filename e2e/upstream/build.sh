#!/usr/bin/env bash
# Builds e2e/upstream/alloc (kube-scheduler's own DRA allocator,
# k8s.io/dynamic-resource-allocation/structured, driven over a sequence of
# claims) once per release of that module, pinned, into a cache:
#
#   <cache>/alloc-v<V>/alloc     built against k8s.io/dynamic-resource-allocation v0.<V>
#                                (the staging module of Kubernetes 1.<V>)
#
# The releases: the newest patch of each minor carve supports that the Go
# module proxy serves, and the patch that fixed the counting of shared
# devices' counters (1.36.2) beside the last one without it (1.36.1).
# Keep in step with RELEASES in e2e/tests/upstream_allocator.rs.
# A binary is rebuilt only when its directory is removed. Prints the cache
# directory's path last.
#
#   e2e/upstream/build.sh                 # the releases below
#   e2e/upstream/build.sh 1.35.4          # only these
#
# Environment: CARVE_CLUSTER_CACHE (default ~/.cache/carve-cluster), shared
# with e2e/cluster/build.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(1.34.13 1.35.10 1.36.1 1.36.2 1.36.6 1.37.2)
cache=${CARVE_CLUSTER_CACHE:-$HOME/.cache/carve-cluster}
mkdir -p "$cache"
command -v go >/dev/null || { echo "upstream/build.sh: go not found" >&2; exit 1; }
export CGO_ENABLED=0 GOFLAGS=-mod=mod

for v in "${releases[@]}"; do
    dir="$cache/alloc-v$v"
    [ -x "$dir/alloc" ] && continue
    start=$SECONDS
    printf '%s upstream/build.sh: allocator of Kubernetes %s\n' "$(date +%T)" "$v" >&2
    m=k8s.io/dynamic-resource-allocation
    mv_=v0.${v#1.}
    mod=$(go mod download -json "$m@$mv_" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
    [ -f "$mod" ] || { echo "upstream/build.sh: the Go module proxy did not serve $m@$mv_" >&2; exit 1; }
    rm -rf "$dir/src"
    mkdir -p "$dir/src"
    cp "$here/alloc/"*.go "$dir/src/"
    {
        echo "module carve.dev/e2e/alloc"
        echo
        grep -m1 '^go ' "$mod"
        echo
        echo "require $m $mv_"
    } >"$dir/src/go.mod"
    tags=""
    case $v in 1.34.*) tags=carve_dra_v134 ;; esac
    (cd "$dir/src" && go mod tidy && go build -tags "$tags" -ldflags "-s -w" -o "$dir/alloc.tmp" .)
    mv "$dir/alloc.tmp" "$dir/alloc"
    printf '%s upstream/build.sh: %s built in %d s\n' "$(date +%T)" "$v" $((SECONDS - start)) >&2
done
echo "$cache"
