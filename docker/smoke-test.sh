#!/usr/bin/env bash
# Smoke test of the eldr-router image, run inside `podman build` by docker/Dockerfile.smoke (a
# throw-away image FROM the built one; scripts/build-image.sh passes what the image declares):
#
#   ELDR_COMMAND      the image's ENTRYPOINT followed by its CMD, as shell words
#   ELDR_HEALTHCHECK  the image's HEALTHCHECK command, as shell words
#
#   smoke-test.sh prepare   (root) writes a small centroid artifact and a static worker list at the
#                           paths the command's --centroids and --workers name, read-only for
#                           others, as a ConfigMap or `-v ...:ro` mount would provide them
#   smoke-test.sh run       (the image's USER) checks that the user is 65532:65532, that every
#                           binary's libraries resolve in this image, starts the command in the
#                           background, and checks that the health probe passes within 20 s, that
#                           the HEALTHCHECK command passes, that /metrics answers, that the
#                           daemon's real, effective, saved and file-system ids are 65532, and that
#                           SIGTERM makes it exit 0 within 15 s (its default 10 s grace, plus 5)
#
# Any failed check exits 1 and prints the daemon's log. RUN steps share the host's network under
# `--isolation chroot`, so when a port of the command is already taken on the host, every port
# (command and HEALTHCHECK alike) is moved up by 10000 and the log says so.
set -euo pipefail

readonly EXPECTED_UID=65532 EXPECTED_GID=65532
readonly WORK=/tmp/eldr-smoke
readonly READY_TIMEOUT_S=20 EXIT_TIMEOUT_S=15 PORT_SHIFT=10000

log() { echo "smoke: $*"; }
fail() {
  echo "smoke: FAIL: $*" >&2
  if [[ -s $WORK/router.log ]]; then sed 's/^/smoke:   router| /' "$WORK/router.log" >&2; fi
  exit 1
}

[[ -n "${ELDR_COMMAND:-}" ]] || fail "ELDR_COMMAND (the image's ENTRYPOINT and CMD) is empty"
cmdline=()
eval "cmdline=($ELDR_COMMAND)"
healthcheck=()
[[ -z "${ELDR_HEALTHCHECK:-}" ]] || eval "healthcheck=($ELDR_HEALTHCHECK)"

# The value of --NAME=VALUE in the command, or nothing (status 1).
flag_value() {
  local word
  for word in "${cmdline[@]}"; do
    if [[ "$word" == "--$1="* ]]; then
      printf '%s\n' "${word#--"$1"=}"
      return 0
    fi
  done
  return 1
}

prepare() {
  local centroids workers
  centroids=$(flag_value centroids) || fail "the image's command has no --centroids: $ELDR_COMMAND"
  workers=$(flag_value workers) || fail "the image's command has no --workers (static discovery): $ELDR_COMMAND"
  mkdir -p "$(dirname "$centroids")" "$(dirname "$workers")"
  # Two unit-norm rows over one layer of two experts, one per static worker. Static workers are
  # routable as listed (nothing needs to listen at their addresses), so health turns SERVING as
  # soon as the artifact is installed.
  printf '%s\n' '{"model": "eldr-image-smoke", "k": 2, "L": 1, "e": 2, "variant": "count",' \
    ' "centroids": [[1.0, 0.0], [0.0, 1.0]], "workers": ["smoke-0", "smoke-1"]}' >"$centroids"
  printf '%s\n' '{"workers": [{"id": "smoke-0", "address": "127.0.0.1:18001", "capacity": 8},' \
    '             {"id": "smoke-1", "address": "127.0.0.1:18002", "capacity": 8}]}' >"$workers"
  chmod 0755 "$(dirname "$centroids")" "$(dirname "$workers")"
  chmod 0644 "$centroids" "$workers"
  log "wrote the artifact $centroids (k=2, L=1, e=2) and the worker list $workers (2 static workers)"
}

port_taken() { (: <>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Moves the port of every --listen, --admin_listen, --metrics_listen and --addr word of the named
# array up by PORT_SHIFT.
shift_ports() {
  local -n words=$1
  local i word
  for i in "${!words[@]}"; do
    word=${words[$i]}
    if [[ "$word" =~ ^(--(listen|admin_listen|metrics_listen|addr)=.*:)([0-9]+)$ ]] && ((BASH_REMATCH[3] > 0)); then
      words[i]="${BASH_REMATCH[1]}$((BASH_REMATCH[3] + PORT_SHIFT))"
    fi
  done
}

command_ports() {
  local name value
  for name in listen admin_listen metrics_listen; do
    if value=$(flag_value "$name"); then echo "${value##*:}"; fi
  done
}

daemon_pid=""
# However the run ends, the daemon does not outlive it: under --isolation chroot nothing else would
# stop it, and it would keep the host's ports.
stop_daemon() {
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then kill -KILL "$daemon_pid" 2>/dev/null || true; fi
}

run() {
  trap stop_daemon EXIT
  local uid gid binary missing port moved pid i status_line metrics_port response rc watchdog field expected
  uid=$(id -u)
  gid=$(id -g)
  log "running as: $(id)"
  [[ "$uid" == "$EXPECTED_UID" && "$gid" == "$EXPECTED_GID" ]] ||
    fail "the image's USER is $uid:$gid, expected $EXPECTED_UID:$EXPECTED_GID"
  log "ok: user is $EXPECTED_UID:$EXPECTED_GID (not root)"

  for binary in /usr/local/bin/*; do
    missing=$(LC_ALL=C ldd "$binary" 2>&1 | grep 'not found' || true)
    [[ -z "$missing" ]] || fail "$binary: libraries missing from the image: $missing"
  done
  log "ok: every library of $(cd /usr/local/bin && echo *) resolves in the image"

  for port in $(command_ports); do
    if port_taken "$port"; then
      log "port $port is taken on this host (RUN shares the host's network): ports moved up by $PORT_SHIFT"
      shift_ports cmdline
      shift_ports healthcheck
      for moved in $(command_ports); do
        if port_taken "$moved"; then fail "port $moved is taken as well"; fi
      done
      break
    fi
  done

  mkdir -p "$WORK"
  log "starting: ${cmdline[*]}"
  "${cmdline[@]}" >"$WORK/router.log" 2>&1 &
  pid=$!
  daemon_pid=$pid
  port=$(flag_value listen) || fail "the image's command has no --listen"
  port=${port##*:}

  for ((i = 0; ; i++)); do
    if /usr/local/bin/eldr-health-probe --addr="127.0.0.1:$port" --timeout=1s >"$WORK/probe.out" 2>&1; then
      break
    fi
    kill -0 "$pid" 2>/dev/null || { wait "$pid" && rc=0 || rc=$?; fail "eldr-router exited with $rc before serving"; }
    ((i < READY_TIMEOUT_S * 2)) || fail "not SERVING within ${READY_TIMEOUT_S}s: $(cat "$WORK/probe.out")"
    sleep 0.5
  done
  log "ok: eldr-health-probe --addr=127.0.0.1:$port: $(cat "$WORK/probe.out") after ~$((i / 2)) s"

  ((${#healthcheck[@]} > 0)) || fail "the image has no HEALTHCHECK (an OCI-format build drops it: use --format docker)"
  "${healthcheck[@]}" >"$WORK/healthcheck.out" 2>&1 ||
    fail "the HEALTHCHECK command failed: ${healthcheck[*]}: $(cat "$WORK/healthcheck.out")"
  log "ok: HEALTHCHECK ${healthcheck[*]}: $(cat "$WORK/healthcheck.out")"

  metrics_port=$(flag_value metrics_listen) || fail "the image's command has no --metrics_listen"
  metrics_port=${metrics_port##*:}
  exec 3<>"/dev/tcp/127.0.0.1/$metrics_port" || fail "cannot connect to the metrics port $metrics_port"
  printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
  response=$(timeout 5 cat <&3 || true)
  exec 3<&-
  status_line=${response%%$'\r'*}
  [[ "$status_line" == "HTTP/1."?" 200"* ]] || fail "GET /metrics on $metrics_port answered '$status_line'"
  log "ok: GET http://127.0.0.1:$metrics_port/metrics: $status_line, $(grep -c '^eldr_' <<<"$response") eldr_* samples"

  log "daemon $(grep -E '^(Uid|Gid):' "/proc/$pid/status" | tr '\t' ' ' | xargs)"
  for field in Uid Gid; do
    expected=$EXPECTED_UID
    [[ $field == Gid ]] && expected=$EXPECTED_GID
    awk -v want="$expected" -v field="$field:" \
      '$1 == field { ok = ($2 == want && $3 == want && $4 == want && $5 == want) } END { exit !ok }' \
      "/proc/$pid/status" || fail "the daemon's $field is not $expected: $(grep "^$field:" "/proc/$pid/status")"
  done
  log "ok: the daemon (pid $pid) runs with uid and gid $EXPECTED_UID (real, effective, saved, fs)"

  kill -TERM "$pid"
  (sleep "$EXIT_TIMEOUT_S"; kill -KILL "$pid" 2>/dev/null) &
  watchdog=$!
  wait "$pid" && rc=0 || rc=$?
  kill "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
  ((rc != 137)) || fail "eldr-router did not exit within ${EXIT_TIMEOUT_S}s of SIGTERM"
  ((rc == 0)) || fail "eldr-router exited with $rc after SIGTERM, expected 0"
  log "ok: SIGTERM: exited 0"
  sed 's/^/smoke:   router| /' "$WORK/router.log"
  rm -rf "$WORK"
  log "all checks passed"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
