#!/usr/bin/env bash
# The shared libraries that ELDR's binaries need at run time, as the Debian packages that ship them.
#
# The container's runtime stage installs exactly the packages of docker/runtime-packages.txt; this
# script derives that list from the built binaries, checks it, and installs it:
#
#   runtime-libs.sh packages BINARY...          print the Debian packages that own every shared
#                                               library `ldd` resolves for the binaries (the whole
#                                               dependency closure, the dynamic loader included),
#                                               sorted, one per line
#   runtime-libs.sh check LIST BINARY...        exit 0 when LIST names exactly those packages (plus
#                                               its entries marked `# extra:`); otherwise print what
#                                               is missing and what is superfluous, and exit 1
#   runtime-libs.sh install LIST [--dry-run]    apt-get install the packages of LIST without
#                                               recommends and drop the apt lists (the image's
#                                               runtime stage); --dry-run only simulates
#
# LIST format: one package per line; `#` starts a comment. A package that no binary links but the
# image needs all the same (certificates, ...) carries the comment `# extra: <why>` on its line.
# Exit codes: 0 success, 1 check mismatch, 2 usage or resolution error (a library that `ldd`
# cannot find, or that no installed Debian package owns).
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

die() {
  echo "runtime-libs: $*" >&2
  exit 2
}

# Every shared library path of the binaries' closure, one per line, sorted and unique.
library_paths() {
  local binary output
  for binary in "$@"; do
    [[ -f "$binary" && -x "$binary" ]] || die "not an executable file: $binary"
    output=$(LC_ALL=C ldd "$binary" 2>&1) || die "ldd failed on $binary: $output"
    if grep -q 'not a dynamic executable' <<<"$output"; then
      continue  # a static binary needs no library
    fi
    if grep -q '=> not found' <<<"$output"; then
      die "$binary: libraries not found: $(grep '=> not found' <<<"$output" | awk '{print $1}' | xargs)"
    fi
    # Lines are `name => /path (addr)`, `/path (addr)` (the loader) or `linux-vdso.so.1 (addr)`
    # (provided by the kernel, no file).
    awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"$output"
  done | sort -u
}

# The Debian package owning each path. dpkg records some files under /lib and others under /usr/lib
# (merged /usr), and alternatives (libblas.so.3 -> /etc/alternatives/...) are not files of any
# package, so each library is looked up under its own path, its resolved path, and both with the
# /usr prefix toggled. One dpkg call answers all of them.
packages_of() {
  local -a paths candidates
  local path real variant
  mapfile -t paths
  ((${#paths[@]} > 0)) || return 0
  declare -A wanted_by=()  # candidate path -> library path it stands for
  for path in "${paths[@]}"; do
    real=$(readlink -f "$path")
    for variant in "$path" "$real"; do
      for candidate in "$variant" "/usr$variant" "${variant#/usr}"; do
        [[ -n "${wanted_by[$candidate]:-}" ]] && continue
        wanted_by[$candidate]="$path"
        candidates+=("$candidate")
      done
    done
  done
  local dpkg_output
  dpkg_output=$(LC_ALL=C dpkg -S "${candidates[@]}" 2>/dev/null || true)
  declare -A owner=()  # library path -> package
  local line package file
  while IFS= read -r line; do
    [[ "$line" == *": "* ]] || continue
    package=${line%%: *}
    file=${line#*: }
    [[ "$package" == diversion* ]] && continue
    package=${package%%,*}     # "a, b: path" (a file shared by several packages): the first
    package=${package%%:*}     # strip the architecture qualifier (libc6:amd64)
    path=${wanted_by[$file]:-}
    [[ -n "$path" && -z "${owner[$path]:-}" ]] && owner[$path]=$package
  done <<<"$dpkg_output"
  local -a unowned=()
  for path in "${paths[@]}"; do
    if [[ -z "${owner[$path]:-}" ]]; then
      unowned+=("$path")
    else
      echo "${owner[$path]}"
    fi
  done
  ((${#unowned[@]} == 0)) || die "no installed Debian package owns: ${unowned[*]}"
}

# Package names of LIST; `extra` selects the `# extra:` entries, `derived` the others, `all` both.
list_entries() {
  local list=$1 which=$2
  [[ -r "$list" ]] || die "cannot read package list: $list"
  awk -v which="$which" '
    { line = $0; extra = (line ~ /#[ \t]*extra:/); sub(/#.*/, "", line); gsub(/[ \t]+/, "", line) }
    line == "" { next }
    which == "all" || (which == "extra" && extra) || (which == "derived" && !extra) { print line }
  ' "$list" | sort -u
}

derived_packages() {
  local libraries
  libraries=$(library_paths "$@")
  packages_of <<<"$libraries" | sort -u
}

cmd_check() {
  (($# >= 2)) || usage
  local list=$1
  shift
  local expected actual missing superfluous
  actual=$(derived_packages "$@")
  expected=$(list_entries "$list" derived)
  missing=$(comm -23 <(echo "$actual") <(echo "$expected") | sed '/^$/d')
  superfluous=$(comm -13 <(echo "$actual") <(echo "$expected") | sed '/^$/d')
  if [[ -z "$missing" && -z "$superfluous" ]]; then
    echo "runtime-libs: $list matches the $(wc -l <<<"$actual") packages that $# binaries need"
    return 0
  fi
  echo "runtime-libs: $list is out of date for: $*" >&2
  [[ -z "$missing" ]] || echo "  missing (a binary needs them): $(xargs <<<"$missing")" >&2
  [[ -z "$superfluous" ]] || echo "  superfluous (no binary needs them; mark '# extra: why' to keep): $(xargs <<<"$superfluous")" >&2
  echo "  regenerate the list with: $0 packages $*" >&2
  return 1
}

cmd_install() {
  (($# >= 1 && $# <= 2)) || usage
  local list=$1 dry_run=${2:-}
  [[ -z "$dry_run" || "$dry_run" == "--dry-run" ]] || usage
  local -a packages
  mapfile -t packages < <(list_entries "$list" all)
  ((${#packages[@]} > 0)) || die "empty package list: $list"
  if [[ -n "$dry_run" ]]; then
    # Simulation resolves every name against the package database, so a misspelt or unknown
    # package fails here as it would in the image build.
    LC_ALL=C apt-get install --simulate --no-install-recommends "${packages[@]}" >/dev/null
    echo "runtime-libs: apt-get would install ${#packages[@]} packages from $list"
    return 0
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}"
  apt-get clean
  rm -rf /var/lib/apt/lists/*
}

(($# >= 1)) || usage
command=$1
shift
case "$command" in
  packages) (($# >= 1)) || usage; derived_packages "$@" ;;
  check) cmd_check "$@" ;;
  install) cmd_install "$@" ;;
  -h|--help|help) usage ;;
  *) echo "runtime-libs: unknown command '$command'" >&2; usage ;;
esac
