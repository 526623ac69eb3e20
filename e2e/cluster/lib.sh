# Shared by up.sh, node-up.sh, down.sh and node-down.sh (sourced; RUN must be set): processes are started in
# the background with their output in RUN/log/NAME.log and their PID in RUN/NAME.pid, and stopped by that PID.

start() { # name command...: run in the background, record the PID
  local name=$1; shift
  "$@" > "$RUN/log/$name.log" 2>&1 &
  echo $! > "$RUN/$name.pid"
}

stop() { # name...: SIGTERM, up to 10 s, then SIGKILL; the PID file goes either way
  local name f pid
  for name in "$@"; do
    f="$RUN/$name.pid"; [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null && echo "[cluster] $name ($pid) needed SIGKILL"
    fi
    rm -f "$f"
  done
}
