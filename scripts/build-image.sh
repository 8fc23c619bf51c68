#!/usr/bin/env bash
# Builds the eldr-router image (docker/Dockerfile) with podman, without a container registry, and
# smoke-tests it (docker/Dockerfile.smoke, docker/smoke-test.sh). `make image` runs this; it needs
# root (debootstrap, rootful podman) and the machine's Debian mirror, nothing else.
#
#   scripts/build-image.sh [--tag NAME] [--keep-base | --refresh-base]
#
#   --tag NAME       the image's name (default eldr-router:0.1.0)
#   --keep-base      reuse the cached base images whatever their age (no debootstrap, no network
#                    for the base; the build stages still install packages from the mirror)
#   --refresh-base   debootstrap the base images again now (then every stage rebuilds)
#
# Steps:
#   1. installs podman, crun and debootstrap when missing (apt). Root with `--isolation chroot`
#      needs nothing else: no user namespaces (uidmap), no network namespace (slirp4netns,
#      netavark: RUN steps share the host's network), kernel overlayfs (no fuse-overlayfs);
#   2. base images: `debootstrap --variant=minbase bookworm` from the machine's Debian mirror (read
#      from /etc/apt/sources.list*), apt sources for bookworm, bookworm-updates and
#      bookworm-security as in Debian's official images, upgraded, apt caches dropped. One minbase
#      root file system serves both names of docker/Dockerfile: localhost/debian:bookworm as is,
#      and localhost/debian:bookworm-slim with the official slim variant's dpkg excludes (no
#      documentation, manual pages or translations). Cached as tarballs under $ELDR_IMAGE_CACHE
#      (default /var/cache/eldr-image) and re-created when older than $ELDR_BASE_MAX_AGE_DAYS
#      (default 30) unless --keep-base;
#   3. podman build --isolation chroot --format docker (the Docker format keeps the HEALTHCHECK,
#      which OCI images drop) and docker/Dockerfile.dockerignore named as the ignore file (podman
#      4.3 finds <Dockerfile>.dockerignore by itself too, as BuildKit does; naming it does not
#      depend on that). The compile's ccache directory is the Dockerfile's cache mount, which
#      buildah keeps in /var/tmp/buildah-cache (`buildah prune` or `podman system reset` empty
#      it), so a rebuild after a source change recompiles only what changed;
#   4. the smoke test: a throw-away image FROM the built one that runs, as the image's USER, the
#      image's ENTRYPOINT and CMD with a small artifact at the paths the CMD names, and checks the
#      health probe, the HEALTHCHECK, the metrics page, the user ids and the SIGTERM exit. The
#      build fails when a check fails; the tagged image is left in place for inspection;
#   5. prints the image's size and the time of each step.
# Podman's storage keeps the base images, the image, and its build stage as
# localhost/eldr-router-build-stage (the next run's layer cache); unnamed images that earlier runs
# left are pruned (`podman image prune`).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=eldr-router:0.1.0
BASE_POLICY=age
while (($# > 0)); do
  case "$1" in
    --tag) TAG=${2:?--tag needs a name}; shift 2 ;;
    --tag=*) TAG=${1#--tag=}; shift ;;
    --keep-base) BASE_POLICY=keep; shift ;;
    --refresh-base) BASE_POLICY=refresh; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

CACHE=${ELDR_IMAGE_CACHE:-/var/cache/eldr-image}
MAX_AGE_DAYS=${ELDR_BASE_MAX_AGE_DAYS:-30}
RELEASE=bookworm
BASE_FULL=localhost/debian:$RELEASE
BASE_SLIM=localhost/debian:$RELEASE-slim
BUILD_STAGE_TAG=localhost/eldr-router-build-stage:latest

log() { echo "build-image: $*"; }
die() { echo "build-image: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap and rootful podman); run it with sudo"

STARTED=$(date +%s)
declare -a TIMINGS=()
step_started=$STARTED
step_done() {
  local now
  now=$(date +%s)
  TIMINGS+=("$(printf '%-34s %5ds' "$1" $((now - step_started)))")
  step_started=$now
}

# ---- 1. tools ----
missing=()
for pkg in podman crun debootstrap python3; do
  [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true) == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]} > 0)); then
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
step_done "tools"

# ---- 2. base images ----
# The first URI of an enabled `deb` source serving the suite, from one-line and deb822 files.
mirror_for_suite() {
  local suite=$1 file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -r "$file" ]] || continue
    if [[ "$file" == *.sources ]]; then
      awk -v suite="$suite" 'BEGIN { RS = ""; FS = "\n" }
        {
          types = ""; uris = ""; suites = ""; enabled = 1
          for (i = 1; i <= NF; i++) {
            if ($i ~ /^[ \t]*#/) continue
            split($i, kv, ":"); key = tolower(kv[1]); value = substr($i, length(kv[1]) + 2)
            if (key == "types") types = value
            else if (key == "uris") uris = value
            else if (key == "suites") suites = value
            else if (key == "enabled" && value ~ /no/) enabled = 0
          }
          if (enabled && (" " types " ") ~ /[ \t]deb[ \t]/ && (" " suites " ") ~ ("[ \t]" suite "[ \t]")) {
            split(uris, u, /[ \t]+/); for (j in u) if (u[j] != "") { print u[j]; exit }
          }
        }' "$file"
    else
      awk -v suite="$suite" '$1 == "deb" {
          i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
          if ($(i + 1) == suite) { print $i; exit }
        }' "$file"
    fi
  done | head -n 1
}

base_age_days() {
  [[ -r "$CACHE/base/stamp" ]] || { echo 99999; return; }
  echo $((($(date +%s) - $(stat -c %Y "$CACHE/base/stamp")) / 86400))
}

make_base_tarballs() {
  local mirror security rootfs stamp
  mirror=$(mirror_for_suite "$RELEASE")
  security=$(mirror_for_suite "$RELEASE-security")
  mirror=${mirror:-http://deb.debian.org/debian}
  security=${security:-http://deb.debian.org/debian-security}
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  mkdir -p "$CACHE/base"
  rootfs="$CACHE/base/rootfs.tmp"
  rm -rf "$rootfs"
  log "debootstrap --variant=minbase $RELEASE from $mirror"
  debootstrap --variant=minbase "$RELEASE" "$rootfs" "$mirror" >"$CACHE/base/debootstrap.log" 2>&1 ||
    die "debootstrap failed; see $CACHE/base/debootstrap.log"
  rm -f "$rootfs/etc/apt/sources.list"
  cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $RELEASE $RELEASE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $RELEASE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # As in Debian's container images: package scripts never start services (prometheus' postinst
  # would), and apt fetches no translations.
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
  echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
  log "upgrading the base from $RELEASE-updates and $RELEASE-security"
  chroot "$rootfs" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get upgrade -y -qq && apt-get clean' \
    >>"$CACHE/base/debootstrap.log" 2>&1 || die "apt-get upgrade in the base failed; see $CACHE/base/debootstrap.log"
  # The host's files that debootstrap copied in, and caches: the container engine provides
  # resolv.conf and hostname at run time.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/log/bootstrap.log "$rootfs"/etc/hostname
  : >"$rootfs/etc/resolv.conf"
  tar -C "$rootfs" --numeric-owner -cf "$CACHE/base/$RELEASE.tar.tmp" .
  # The slim variant (debuerreotype-slimify): dpkg skips documentation, manual pages and
  # translations from now on, and the installed ones go (copyright files and locale.alias stay).
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
EOF
  find "$rootfs/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  rm -rf "$rootfs"/usr/share/{groff,info,linda,man}/* "$rootfs"/usr/share/lintian/overrides/*
  tar -C "$rootfs" --numeric-owner -cf "$CACHE/base/$RELEASE-slim.tar.tmp" .
  rm -rf "$rootfs"
  mv "$CACHE/base/$RELEASE.tar.tmp" "$CACHE/base/$RELEASE.tar"
  mv "$CACHE/base/$RELEASE-slim.tar.tmp" "$CACHE/base/$RELEASE-slim.tar"
  echo "$stamp $mirror $security" >"$CACHE/base/stamp"
}

# Imports a cached tarball under NAME unless NAME already holds this very tarball.
import_base() {
  local name=$1 tarball=$2 stamp current
  stamp=$(awk '{print $1}' "$CACHE/base/stamp")
  current=$(podman image inspect --format '{{index .Labels "org.eldr.base"}}' "$name" 2>/dev/null || true)
  if [[ "$current" == "$stamp debootstrap minbase $RELEASE"* ]]; then
    return 0
  fi
  log "podman import $tarball as $name"
  podman import --quiet \
    --change 'CMD ["bash"]' \
    --change "LABEL org.eldr.base=\"$stamp debootstrap minbase $RELEASE $(basename "$tarball" .tar) $(awk '{print $2}' "$CACHE/base/stamp")\"" \
    "$tarball" "$name" >/dev/null
}

age=$(base_age_days)
if [[ "$BASE_POLICY" == refresh || ! -r "$CACHE/base/$RELEASE.tar" || ! -r "$CACHE/base/$RELEASE-slim.tar" ]] ||
  [[ "$BASE_POLICY" == age && $age -gt $MAX_AGE_DAYS ]]; then
  make_base_tarballs
else
  log "reusing the base images of $(awk '{print $1}' "$CACHE/base/stamp") ($age days old)"
fi
import_base "$BASE_FULL" "$CACHE/base/$RELEASE.tar"
import_base "$BASE_SLIM" "$CACHE/base/$RELEASE-slim.tar"
step_done "base images"

# ---- 3. the image ----
build_args=(--isolation chroot --format docker --pull=never --layers --ignorefile docker/Dockerfile.dockerignore -f docker/Dockerfile)
log "podman build ${build_args[*]} -t $TAG ."
podman build "${build_args[@]}" -t "$TAG" .
# The build stage (2.7 GB: toolchain, libraries, /build) is the layer cache of the next run: named,
# it survives the pruning of the chains that earlier runs left (each as large) without a name.
podman build "${build_args[@]}" --quiet --target build -t "$BUILD_STAGE_TAG" . >/dev/null
podman image prune --force >/dev/null
step_done "podman build"

# ---- 4. smoke test ----
# What the image declares, as shell words for the smoke script: ENTRYPOINT + CMD, HEALTHCHECK.
inspect() { podman image inspect --format "$1" "$TAG"; }
command_words=$(python3 -c 'import json, shlex, sys
print(shlex.join((json.loads(sys.argv[1]) or []) + (json.loads(sys.argv[2]) or [])))' \
  "$(inspect '{{json .Config.Entrypoint}}')" "$(inspect '{{json .Config.Cmd}}')")
healthcheck_words=$(python3 -c 'import json, shlex, sys
test = (json.loads(sys.argv[1]) or {}).get("Test") or []
if test[:1] == ["CMD"]: print(shlex.join(test[1:]))
elif test[:1] == ["CMD-SHELL"]: print(shlex.join(["/bin/sh", "-c", test[1]]))' "$(inspect '{{json .HealthCheck}}')")
image_user=$(inspect '{{.Config.User}}')
image_user=${image_user:-0:0}
iidfile=$(mktemp)
trap 'rm -f "$iidfile"' EXIT
log "smoke test of $TAG (user $image_user)"
podman build --isolation chroot --pull=never --no-cache --iidfile "$iidfile" \
  --build-arg IMAGE="$TAG" --build-arg IMAGE_USER="$image_user" \
  --build-arg ELDR_COMMAND="$command_words" --build-arg ELDR_HEALTHCHECK="$healthcheck_words" \
  -f docker/Dockerfile.smoke docker/ || die "the smoke test of $TAG failed (output above)"
podman rmi "$(cat "$iidfile")" >/dev/null
step_done "smoke test"

# ---- 5. figures ----
size=$(podman image inspect --format '{{.Size}}' "$TAG")
log "image $TAG: $(podman image inspect --format '{{.Id}}' "$TAG" | cut -c1-12), size $size bytes ($((size / 1000000)) MB)"
printf 'build-image:   %s\n' "${TIMINGS[@]}"
log "total $(($(date +%s) - STARTED)) s"
