#!/usr/bin/env bash
# Build and run the Dockerfile's images, with Docker when its daemon answers and otherwise with
# Debian's buildah and podman (no daemon; as root). `make images` and tests/test_images.py use it.
#
# Usage:
#   scripts/images.sh builder              print the builder this machine uses: docker or buildah
#   scripts/images.sh tools                install buildah, podman, runc and mmdebstrap when missing (Debian, root)
#   scripts/images.sh base                 make the local Debian base image when missing or out of date
#   scripts/images.sh build [main|serve|all]   build the images (default: all)
#   scripts/images.sh run [RUN OPTIONS] IMAGE [COMMAND...]   run a container with this machine's settings
#   scripts/images.sh rm NAME...           remove containers (stopped or not), quietly
#
# Environment: IMAGE_REPO, IMAGE_TAG (default ghcr.io/weightship/weightship and pyproject's version);
# TORCH_INDEX_URL for the serve image: an index URL, or a local directory of wheels holding
# torch==2.13.0 (buildah only: it is mounted into the build as an index); IMAGES_BUILDER=docker|buildah
# to choose; IMAGES_BASE to name the base image buildah builds on.
#
# Without Docker the images build on a Debian bookworm base made here with mmdebstrap from this
# machine's own Debian mirror (python3, python3-venv, python-is-python3, ca-certificates, passwd),
# holding this machine's CA bundle and pip index settings, so pip inside the build reaches the
# package index as pip does here (also where TLS is inspected). Layers are stored under
# /var/lib/containers and cached from one build to the next on the same machine: with the overlay
# driver where this kernel mounts overlayfs there (a cached build takes seconds), else with vfs (a
# full copy of the tree per layer: a cached build takes a minute or more). IMAGES_STORAGE_DRIVER=
# overlay|vfs chooses; a store made with one driver is kept with it.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
IMAGE_REPO=${IMAGE_REPO:-ghcr.io/weightship/weightship}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
IMAGES_BASE=${IMAGES_BASE:-localhost/weightship-base:bookworm}
CACHE_REPO=localhost/weightship-cache
CONTAINERS=/var/lib/containers
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates,passwd
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

say() { echo "images: $*" >&2; }
die() { say "$*"; exit 1; }

docker_answers() { command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; }

# overlay when the kernel mounts it on the store's filesystem (as root), else vfs.
storage_driver() {
  [ -n "${IMAGES_STORAGE_DRIVER:-}" ] && { echo "$IMAGES_STORAGE_DRIVER"; return; }
  [ -d "$CONTAINERS/storage/vfs" ] && { echo vfs; return; }
  [ -d "$CONTAINERS/storage/overlay" ] && { echo overlay; return; }
  local probe
  mkdir -p "$CONTAINERS" && probe=$(mktemp -d -p "$CONTAINERS") || { echo vfs; return; }
  mkdir -p "$probe"/{lower,upper,work,merged}
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
    "$probe/merged" 2>/dev/null; then
    umount "$probe/merged"
    echo overlay
  else
    echo vfs
  fi
  rm -rf "$probe"
}

builder() {
  case ${IMAGES_BUILDER:-} in
    docker|buildah) echo "$IMAGES_BUILDER"; return ;;
    "") ;;
    *) die "IMAGES_BUILDER=$IMAGES_BUILDER is not a builder; use docker or buildah, or leave it unset" ;;
  esac
  if docker_answers; then echo docker; else echo buildah; fi
}

tools() {
  local missing=() pkg
  for pkg in buildah podman runc mmdebstrap; do
    command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 ||
    die "no Docker daemon answers and ${missing[*]} are missing; install them (Debian: apt-get install ${missing[*]}) as root, or start dockerd"
  say "installing ${missing[*]} from Debian"
  apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
}

# This machine's Debian mirror entries for bookworm, as one-line sources (apt knows them after `apt-get update`).
debian_sources() {
  apt-get indextargets --format '$(TARGET_OF) $(REPO_URI) $(RELEASE) $(COMPONENT)' 'Origin: Debian' 'Created-By: Packages' |
    grep -E '^deb [^ ]+ bookworm(-updates|-security)? ' | sort -u
}

# pip settings for the base: the system CA bundle, and this machine's index when it is not the default.
pip_conf() {
  local pip index extra
  pip=$root/.venv/bin/pip
  [ -x "$pip" ] || pip="python3 -m pip"
  index=${PIP_INDEX_URL:-$($pip config get global.index-url 2>/dev/null || true)}
  extra=${PIP_EXTRA_INDEX_URL:-$($pip config get global.extra-index-url 2>/dev/null || true)}
  echo "[global]"
  echo "cert = /etc/ssl/certs/ca-certificates.crt"
  # Only network indexes: this machine's local ones (file://) do not exist inside the build.
  case $index in http://*|https://*) echo "index-url = $index" ;; esac
  extra=$(tr ' ' '\n' <<<"$extra" | grep -E '^https?://' | tr '\n' ' ' || true)
  [ -n "${extra// /}" ] && echo "extra-index-url = $extra"
  return 0
}

base() {
  local sources conf inputs have pipconf
  [ -f "$HOST_CA_BUNDLE" ] || die "no CA bundle at $HOST_CA_BUNDLE; install ca-certificates"
  [ -d /var/lib/apt/lists ] && [ -n "$(debian_sources)" ] || apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
  sources=$(debian_sources)
  [ -n "$sources" ] || die "apt on this machine knows no Debian bookworm mirror (apt-get indextargets); add one to /etc/apt/sources.list.d"
  conf=$(pip_conf)
  inputs=$(printf '%s\n' "$BASE_PACKAGES" "$sources" "$conf" "$(sha256sum <"$HOST_CA_BUNDLE")" | sha256sum | cut -c1-16)
  have=$(podman "${STORAGE[@]}" image inspect --format '{{ index .Labels "weightship.base.inputs" }}' "$IMAGES_BASE" 2>/dev/null || true)
  if [ "$have" = "$inputs" ]; then say "base $IMAGES_BASE is up to date"; return; fi
  say "making base $IMAGES_BASE with mmdebstrap from: $(tr '\n' ';' <<<"$sources")"
  pipconf=$scratch/pip.conf
  printf '%s\n' "$conf" >"$pipconf"
  local args=()
  while read -r line; do args+=("$line"); done <<<"$sources"
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="copy-in $HOST_CA_BUNDLE /etc/ssl/certs" \
    --customize-hook="upload $pipconf /etc/pip.conf" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm - "${args[@]}" |
    podman "${STORAGE[@]}" import --quiet \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' \
      --change "LABEL weightship.base.inputs=$inputs" \
      --change 'CMD ["/bin/bash"]' \
      - "$IMAGES_BASE" >/dev/null
  say "base $IMAGES_BASE made"
}

# torch wheels in a local directory become a one-project index mounted into the serve build.
torch_wheel_index() {
  local wheels=$1 index=$2 whl name
  mkdir -p "$index/torch"
  {
    echo '<!DOCTYPE html><html><body>'
    for whl in "$wheels"/torch-*.whl; do
      [ -e "$whl" ] || continue
      name=$(basename "$whl")
      echo "<a href=\"file:///torch-wheels/$name#sha256=$(sha256sum "$whl" | cut -d' ' -f1)\">$name</a>"
    done
    echo '</body></html>'
  } >"$index/torch/index.html"
  grep -q '\.whl' "$index/torch/index.html" || die "no torch-*.whl in $wheels; give TORCH_INDEX_URL a directory holding torch==2.13.0's wheel, or an index URL"
}

build() {
  local what=${1:-all} how
  how=$(builder)
  case $what in main|serve|all) ;; *) die "build $what: build main, serve or all" ;; esac
  local targets=()
  [ "$what" != serve ] && targets+=("weightship:$IMAGE_REPO:$IMAGE_TAG")
  [ "$what" != main ] && targets+=("serve:$IMAGE_REPO-serve:$IMAGE_TAG")
  local t target tag started
  # An index that does not answer would make pip take torch from the extra index (PyPI): the
  # multi-GB CUDA build, by surprise.
  if [ "$what" != main ] && [ ! -d "$TORCH_INDEX_URL" ] && command -v curl >/dev/null 2>&1 &&
    ! curl -fsS -o /dev/null --max-time 30 "${TORCH_INDEX_URL%/}/torch/" 2>/dev/null; then
    die "TORCH_INDEX_URL=$TORCH_INDEX_URL does not answer from this machine (${TORCH_INDEX_URL%/}/torch/); give a reachable index, or a local directory holding torch==2.13.0's wheel (make images SERVE_TORCH_INDEX=DIR)"
  fi
  if [ "$how" = docker ]; then
    [ -d "$TORCH_INDEX_URL" ] && [ "$what" != main ] &&
      die "TORCH_INDEX_URL=$TORCH_INDEX_URL is a local directory, which docker build cannot mount; give an index URL or build with buildah"
    for t in "${targets[@]}"; do
      target=${t%%:*} tag=${t#*:}
      say "docker build --target $target -t $tag"
      docker build --target "$target" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" -t "$tag" "$root" >&2
    done
    return
  fi
  tools
  base
  local torch=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
  if [ -d "$TORCH_INDEX_URL" ] && [ "$what" != main ]; then
    torch_wheel_index "$TORCH_INDEX_URL" "$scratch/index"
    torch=(--build-arg TORCH_INDEX_URL=file:///torch-index
      --volume "$scratch/index:/torch-index:ro" --volume "$(cd "$TORCH_INDEX_URL" && pwd):/torch-wheels:ro")
  fi
  # One snapshot of the files the image takes (.dockerignore's `!` lines), so that every stage is
  # built from the same tree even while it is being edited.
  local context=$scratch/context
  mkdir -p "$context"
  (cd "$root" && sed -n 's/^!//p' .dockerignore | xargs cp -a --parents -t "$context" Dockerfile .dockerignore)
  # The build stages are tagged too, so that pruning the untagged images of earlier builds (vfs
  # keeps a full copy of every layer) keeps the cache of this one.
  say "storage driver ${STORAGE[1]}"
  local stages=("build:$CACHE_REPO:build")
  [ "$what" != main ] && stages+=("build-serve:$CACHE_REPO:build-serve")
  for t in "${stages[@]}" "${targets[@]}"; do
    target=${t%%:*} tag=${t#*:}
    say "buildah build --target $target -t $tag (on $IMAGES_BASE)"
    started=$(date +%s)
    buildah build "${STORAGE[@]}" --isolation chroot --layers --force-rm --pull=false \
      --build-arg PYTHON_IMAGE="$IMAGES_BASE" "${torch[@]}" \
      --target "$target" -t "$tag" "$context" >&2
    say "built $tag in $(($(date +%s) - started)) s, $(podman "${STORAGE[@]}" image inspect --format '{{.Size}}' "$tag") bytes"
  done
  podman "${STORAGE[@]}" image prune --force >/dev/null
}

run() {
  if [ "$(builder)" = docker ]; then
    exec docker run --rm --network host "$@"
  fi
  # The default rlimits and systemd cgroups are refused on this kind of machine: name them.
  exec podman "${STORAGE[@]}" --runtime runc --cgroup-manager cgroupfs --events-backend file \
    run --rm --network host --ulimit nofile=16384:16384 --ulimit nproc=8192:8192 "$@"
}

cmd=${1:-}
shift || true
STORAGE=(--storage-driver "$(storage_driver)")
case $cmd in
  builder) builder ;;
  tools) tools ;;
  base) scratch=$(mktemp -d) && trap 'rm -rf "$scratch"' EXIT && tools && base ;;
  build) scratch=$(mktemp -d) && trap 'rm -rf "$scratch"' EXIT && build "$@" ;;
  run) run "$@" ;;
  rm) if [ "$(builder)" = docker ]; then docker rm -f "$@"; else podman "${STORAGE[@]}" rm -f "$@"; fi >/dev/null 2>&1 || true ;;
  *) sed -n '5,12p' "$0" >&2; exit 2 ;;
esac
