#!/usr/bin/env bash
# Builds every image compose/ and compose/k8s/ use, with podman (or docker: CONTAINER_ENGINE):
#
#   base        localhost/rlstream-base:bookworm   Debian bookworm made with debootstrap from the
#                                                  apt mirror, imported (skipped when
#                                                  RLSTREAM_BASE_IMAGE names a pullable image)
#   rlstream    localhost/rlstream:latest          compose/Dockerfile, every role
#   rlstream-gpu localhost/rlstream-gpu:latest     compose/Dockerfile.gpu, the GPU learner
#   kafka       localhost/rlstream-kafka:3.9.1     compose/images/kafka, from localkafka's jars
#   redis       localhost/rlstream-redis:latest    compose/images/redis, Debian's redis-server
#   prometheus  localhost/rlstream-prometheus:latest  compose/images/prometheus, Debian's package
#
# Usage: compose/build-images.sh [IMAGE...]      (no argument: all of them, in that order)
#
# Each image carries the label rlstream.inputs, a hash of everything it is built from (its
# Dockerfile, its staged build context, its build arguments and its base image's id); an image
# whose label matches is not built again, so a second run takes seconds. The Python dependencies
# (torch is ~4 GB with its CUDA libraries) are built once into a wheel folder
# (RLSTREAM_WHEELS, default <cache>/wheels) that both rlstream images install from, mounted into
# the build, so they are downloaded once. Every build uses the host's network (--network host)
# and CA bundle, so pip and apt inside a build work where the host's do.
#
# Environment: CONTAINER_ENGINE (podman), RLSTREAM_BASE_IMAGE (a public base such as
# python:3.11-slim; default: the debootstrap one), DEBIAN_MIRROR (default: the host's apt mirror),
# TORCH_INDEX_URL (an index of CPU torch wheels for the CPU image; default none: PyPI's torch),
# RLSTREAM_WHEELS, RLSTREAM_CACHE (~/.cache/rlstream), RLSTREAM_BUILD_REPORT (a file to write a
# JSON line per image to: name, tag, built or cached, seconds, bytes).
set -Eeuo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
ENGINE=${CONTAINER_ENGINE:-podman}
if [ "$ENGINE" = podman ]; then
  export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/compose/podman/containers.conf}
fi
CACHE=${RLSTREAM_CACHE:-$HOME/.cache/rlstream}
WHEELS=${RLSTREAM_WHEELS:-$CACHE/wheels}
STAGE=$CACHE/build-context
SUITE=bookworm
LOCAL_BASE=localhost/rlstream-base:$SUITE
BASE=${RLSTREAM_BASE_IMAGE:-$LOCAL_BASE}
TORCH_INDEX_URL=${TORCH_INDEX_URL-}
CA=${RLSTREAM_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
KAFKA_VERSION=$(sed -n 's/^KAFKA_VERSION = "\(.*\)"/\1/p' localkafka/paths.py)
REPORT=${RLSTREAM_BUILD_REPORT:-}
if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=${PYTHON:-python3}; fi
PACKAGES=(config rlstream runtime logtools localkafka streams actor learner agents schemas)

log() { printf '== %s [%s]\n' "$*" "$(date +%H:%M:%S)" >&2; }
label_of() { "$ENGINE" image inspect --format '{{ index .Labels "rlstream.inputs" }}' "$1" 2>/dev/null || true; }
size_of() { "$ENGINE" image inspect --format '{{ .Size }}' "$1"; }
report() {  # name tag outcome seconds
  local bytes; bytes=$(size_of "$2")
  printf '%-13s %-40s %-7s %5ss %6s MB\n' "$1" "$2" "$3" "$4" "$((bytes / 1000000))" >&2
  if [ -n "$REPORT" ]; then
    printf '{"image": "%s", "tag": "%s", "outcome": "%s", "seconds": %s, "bytes": %s}\n' \
      "$1" "$2" "$3" "$4" "$bytes" >> "$REPORT"
  fi
}
hash_dir() { (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16; }

debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(grep -hs -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
  [ -n "$uri" ] || uri=$(grep -hs -m1 -E '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}')
  echo "${uri:-http://deb.debian.org/debian}"
}

build_base() {
  if [ "$BASE" != "$LOCAL_BASE" ]; then log "base: $BASE (given)"; return; fi
  local mirror inputs t0 rootfs
  mirror=$(debian_mirror)
  inputs=$(printf 'debootstrap minbase %s python3 python3-venv ca-certificates %s' "$SUITE" "$mirror" | sha256sum | cut -c1-16)
  if [ "$(label_of "$LOCAL_BASE")" = "$inputs" ]; then report base "$LOCAL_BASE" cached 0; return; fi
  command -v debootstrap >/dev/null || { echo "debootstrap not found (apt-get install debootstrap)" >&2; exit 2; }
  log "base: debootstrap $SUITE from $mirror"
  t0=$(date +%s)
  mkdir -p "$CACHE"
  rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' RETURN
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$mirror" >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | "$ENGINE" import --change "LABEL rlstream.inputs=$inputs" \
    --change 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
  report base "$LOCAL_BASE" built "$(( $(date +%s) - t0 ))"
}

# build NAME TAG DOCKERFILE CONTEXT [--build-arg ...]: build unless the label says it is current.
build() {
  local name=$1 tag=$2 dockerfile=$3 context=$4; shift 4
  local base_id inputs t0
  base_id=$("$ENGINE" image inspect --format '{{ .Id }}' "$BASE" 2>/dev/null || echo "$BASE")
  inputs=$( { sha256sum "$dockerfile" | cut -c1-64; hash_dir "$context"; echo "$base_id" "$*" docker-format; } | sha256sum | cut -c1-16)
  if [ "$(label_of "$tag")" = "$inputs" ]; then report "$name" "$tag" cached 0; return; fi
  log "$name: build $tag ($dockerfile)"
  t0=$(date +%s)
  if [ -n "${BEFORE_BUILD:-}" ]; then "$BEFORE_BUILD"; fi
  local mounts=() format=()
  [ -f "$CA" ] && mounts+=(-v "$CA:/etc/ssl/certs/ca-certificates.crt:ro")
  # podman writes OCI images by default, which have no HEALTHCHECK: keep Docker's format
  [ "$ENGINE" = podman ] && format=(--format docker)
  "$ENGINE" build "${format[@]}" --network host "${mounts[@]}" --build-arg "BASE=$BASE" --label "rlstream.inputs=$inputs" \
    -f "$dockerfile" -t "$tag" "$@" "$context" >&2
  report "$name" "$tag" built "$(( $(date +%s) - t0 ))"
}

stage_rlstream() {  # the project's build context: pyproject, README and the packages, nothing else
  local dir=$STAGE/rlstream
  rm -rf "$dir" && mkdir -p "$dir"
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -- pyproject.toml README.md "${PACKAGES[@]}"
  else
    find pyproject.toml README.md "${PACKAGES[@]}" -type f
  fi | grep -v -E '(__pycache__|\.pyc$)' | while read -r f; do [ -f "$f" ] && echo "$f"; done \
    | tar -c -T - | tar -x -C "$dir"
  echo "$dir"
}

WHEELS_CHECKED=
ensure_wheels() {  # every dependency (and the gpu extra) as a wheel in $WHEELS, fetched once
  [ -z "$WHEELS_CHECKED" ] || return 0
  WHEELS_CHECKED=1
  local reqs=$STAGE/requirements.txt
  mkdir -p "$WHEELS" "$STAGE"
  "$PY" -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["gpu"] + ["setuptools>=68", "wheel"]))' > "$reqs"
  if "$PY" -m pip install -q --dry-run --ignore-installed --no-index --find-links "$WHEELS" -r "$reqs" >/dev/null 2>&1; then
    log "wheels: complete in $WHEELS"
    return
  fi
  log "wheels: pip wheel -r $reqs -w $WHEELS (torch and its CUDA libraries: ~4 GB, once)"
  local t0; t0=$(date +%s)
  "$PY" -m pip wheel -q --find-links "$WHEELS" -w "$WHEELS" -r "$reqs" >&2
  log "wheels: done in $(( $(date +%s) - t0 ))s, $(du -sh "$WHEELS" | cut -f1)"
}

wheel_args() {
  echo -v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg PIP_NO_INDEX=1
}

build_rlstream() {  # the wheel folder is checked (and filled) only when an image is built
  local ctx; ctx=$(stage_rlstream)
  # shellcheck disable=SC2046
  BEFORE_BUILD=ensure_wheels build rlstream localhost/rlstream:latest compose/Dockerfile "$ctx" \
    --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" $(wheel_args)
}

build_rlstream_gpu() {
  local ctx; ctx=$(stage_rlstream)
  # shellcheck disable=SC2046
  BEFORE_BUILD=ensure_wheels build rlstream-gpu localhost/rlstream-gpu:latest compose/Dockerfile.gpu "$ctx" $(wheel_args)
}

build_kafka() {
  local lib=$CACHE/kafka-$KAFKA_VERSION/lib dir=$STAGE/kafka
  if [ ! -d "$lib" ] || [ -z "$(ls -A "$lib")" ]; then
    log "kafka: fetch Apache Kafka $KAFKA_VERSION's jars"
    RLSTREAM_CACHE=$CACHE python3 -m localkafka fetch >&2
  fi
  rm -rf "$dir" && mkdir -p "$dir/libs"
  cp compose/images/kafka/* "$dir/"
  cp "$lib"/*.jar "$dir/libs/"
  build kafka "localhost/rlstream-kafka:$KAFKA_VERSION" "$dir/Dockerfile" "$dir"
}

build_redis() { build redis localhost/rlstream-redis:latest compose/images/redis/Dockerfile compose/images/redis; }
build_prometheus() {
  build prometheus localhost/rlstream-prometheus:latest compose/images/prometheus/Dockerfile compose/images/prometheus
}

command -v "$ENGINE" >/dev/null || { echo "$ENGINE not found" >&2; exit 2; }
images=("$@")
[ ${#images[@]} -gt 0 ] || images=(rlstream rlstream-gpu kafka redis prometheus)
build_base  # every other image is built on it
for image in "${images[@]}"; do
  case "$image" in
    base) ;;
    rlstream) build_rlstream ;;
    rlstream-gpu) build_rlstream_gpu ;;
    kafka) build_kafka ;;
    redis) build_redis ;;
    prometheus) build_prometheus ;;
    *) echo "unknown image $image (base rlstream rlstream-gpu kafka redis prometheus)" >&2; exit 2 ;;
  esac
done
