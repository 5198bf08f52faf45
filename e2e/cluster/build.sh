#!/usr/bin/env bash
# Builds the real programs of carve's one-node cluster suite from their Go
# modules, pinned, into a cache that keeps each version's binaries:
#
#   <cache>/kube-v<K>/kube       kube-apiserver, kube-controller-manager,
#                                kube-scheduler and kubelet of k8s.io/kubernetes
#                                v<K> (one binary, the component its first argument)
#   <cache>/etcd-v<E>/etcd       go.etcd.io/etcd/server/v3
#   <cache>/containerd-v<C>/     containerd, containerd-shim-runc-v2, ctr
#   <cache>/runc-v<R>/runc       github.com/opencontainers/runc, the OCI runtime
#                                containerd's own CI pins for containerd v<C>
#                                (script/setup/runc-version); Debian 12's runc
#                                1.1.5 and crun 1.8.1 cannot run its specs
#   <cache>/helm-v<H>/helm       helm.sh/helm/v4
#
# A binary is rebuilt only when its version changes (or its directory is
# removed); the Go build cache (GOCACHE) makes a rebuild of another version
# share what it can. Prints the cache directory's path last.
#
#   e2e/cluster/build.sh                 # the default versions below
#   e2e/cluster/build.sh 1.34.4 1.36.3   # also these Kubernetes versions
#
# Environment: CARVE_CLUSTER_CACHE (default ~/.cache/carve-cluster).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Pinned versions. KUBE is the newest the Go module proxy serves; each of
# the others is the newest release of its line that builds with this Go.
# Keep in step with e2e/src/cluster/versions.rs.
KUBE=${CARVE_KUBE_VERSION:-1.37.2}
ETCD=3.6.16
CONTAINERD=2.2.9
RUNC=1.3.6
HELM=4.3.1

cache=${CARVE_CLUSTER_CACHE:-$HOME/.cache/carve-cluster}
mkdir -p "$cache"
command -v go >/dev/null || { echo "build.sh: go not found (Go 1.26 or newer is needed to build the cluster)" >&2; exit 1; }
export CGO_ENABLED=0 GOFLAGS=-mod=mod

log() { printf '%s build.sh: %s\n' "$(date +%T)" "$*" >&2; }

# A wrapper module in <dir>/src: main.go from go/<name>, go.mod written by
# the caller; `go mod tidy` resolves the rest of the graph.
wrapper() {
    local name=$1 dir=$2
    rm -rf "$dir/src"
    mkdir -p "$dir/src"
    cp "$here/go/$name/main.go" "$dir/src/"
}

# The go.mod file of module $1 at version $2, from the module cache (fetched
# from the proxy if need be).
gomod() {
    local f
    f=$(go mod download -json "$1@$2" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
    [ -f "$f" ] || { echo "build.sh: the Go module proxy did not serve $1@$2" >&2; exit 1; }
    echo "$f"
}

# `go install ARGS...` into DIR through a temporary GOBIN, so that a failed
# build leaves no binary that a later run would take as built. ARGS may
# give -ldflags again (the last one counts).
install_into() {
    local dir=$1
    shift
    rm -rf "$dir/bin.tmp"
    mkdir -p "$dir/bin.tmp"
    GOBIN="$dir/bin.tmp" go install -ldflags "-s -w" "$@"
    mv "$dir/bin.tmp"/* "$dir/"
    rmdir "$dir/bin.tmp"
}

build_kube() {
    local v=$1 dir="$cache/kube-v$1"
    [ -x "$dir/kube" ] && return
    log "kube v$v: building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet"
    local start=$SECONDS
    wrapper kube "$dir"
    # k8s.io/kubernetes requires its staging modules at v0.0.0 and maps them
    # to ./staging with replace directives, which do not apply to a module
    # that depends on it: pin each to the v0 release of the same minor and
    # patch, read from that release's own go.mod.
    local mod
    mod=$(gomod k8s.io/kubernetes "v$v")
    {
        echo "module carve.dev/e2e/kube"
        echo
        grep -m1 '^go ' "$mod"
        echo
        echo "require k8s.io/kubernetes v$v"
        echo
        echo "replace ("
        grep '=> ./staging/' "$mod" | sed 's/^[[:space:]]*\(k8s.io\/[^ ]*\) => .*/\1/' |
            while read -r m; do echo "	$m => $m v0.${v#1.}"; done
        echo ")"
    } >"$dir/src/go.mod"
    (cd "$dir/src" && go mod tidy)
    # The version the binaries report (/version, the kubelet's node status)
    # as k8s.io/kubernetes's own build stamps it (hack/lib/version.sh).
    local minor=${v#1.}
    minor=${minor%%.*}
    local ld="-s -w" p
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld="$ld -X $p.gitVersion=v$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    done
    (cd "$dir/src" && go build -ldflags "$ld" -o "$dir/kube.tmp" .)
    mv "$dir/kube.tmp" "$dir/kube"
    log "kube v$v: built in $((SECONDS - start)) s"
}

build_etcd() {
    local dir="$cache/etcd-v$ETCD"
    [ -x "$dir/etcd" ] && return
    log "etcd v$ETCD: building"
    local start=$SECONDS
    wrapper etcd "$dir"
    local mod
    mod=$(gomod go.etcd.io/etcd/server/v3 "v$ETCD")
    { echo "module carve.dev/e2e/etcd"; echo; grep -m1 "^go " "$mod"; echo; echo "require go.etcd.io/etcd/server/v3 v$ETCD"; } >"$dir/src/go.mod"
    (cd "$dir/src" && go mod tidy && go build -ldflags "-s -w" -o "$dir/etcd.tmp" .)
    mv "$dir/etcd.tmp" "$dir/etcd"
    log "etcd v$ETCD: built in $((SECONDS - start)) s"
}

build_containerd() {
    local dir="$cache/containerd-v$CONTAINERD"
    [ -x "$dir/containerd" ] && return
    log "containerd v$CONTAINERD: building containerd, containerd-shim-runc-v2, ctr"
    local start=$SECONDS
    # containerd's go.mod has no replace directives: `go install` builds it.
    # Tags as containerd's Makefile and BUILDING.md give them for a build
    # without the btrfs, devmapper and zfs snapshotters and without systemd
    # and tracing; the shim as the Makefile builds it (no_grpc).
    local m=github.com/containerd/containerd/v2
    install_into "$dir" -ldflags "-s -w -X $m/version.Version=v$CONTAINERD" \
        -tags "no_btrfs no_devmapper no_zfs no_systemd no_tracing" \
        "$m/cmd/containerd@v$CONTAINERD" "$m/cmd/ctr@v$CONTAINERD"
    install_into "$dir" -tags no_grpc "$m/cmd/containerd-shim-runc-v2@v$CONTAINERD"
    log "containerd v$CONTAINERD: built in $((SECONDS - start)) s"
}

build_runc() {
    local dir="$cache/runc-v$RUNC"
    [ -x "$dir/runc" ] && return
    log "runc v$RUNC: building"
    local start=$SECONDS
    # runc's nsenter is C (cgo, the machine's gcc); the seccomp tag (as
    # runc's Makefile builds it) links Debian's libseccomp: containerd puts
    # its default seccomp profile on every pod sandbox.
    CGO_ENABLED=1 install_into "$dir" -tags "seccomp urfave_cli_no_docs" \
        "github.com/opencontainers/runc@v$RUNC"
    log "runc v$RUNC: built in $((SECONDS - start)) s"
}

build_helm() {
    local dir="$cache/helm-v$HELM"
    [ -x "$dir/helm" ] && return
    log "helm v$HELM: building"
    local start=$SECONDS
    install_into "$dir" "helm.sh/helm/v4/cmd/helm@v$HELM"
    log "helm v$HELM: built in $((SECONDS - start)) s"
}

build_etcd
build_containerd
build_runc
build_helm
build_kube "$KUBE"
for v in "$@"; do build_kube "$v"; done
echo "$cache"
