#!/usr/bin/env bash
# Start or stop the throw-away Prometheus server that the Prometheus provider tests query.
# Usage: scripts/prometheus.sh start DIR PORT [CONFIG] | stop DIR
#
# start installs the Debian package `prometheus` when the binary is missing (as root; otherwise it
# says what to run), starts it on 127.0.0.1:PORT with its data in DIR/data, waits until it is
# ready and prints its URL. Without CONFIG it writes DIR/prometheus.yml: every target listed in
# DIR/targets/*.json (file_sd, Prometheus' file-based discovery) is scraped every second, so a
# test adds the model servers it starts by writing one small JSON file there.
set -euo pipefail
cmd=${1:?usage: scripts/prometheus.sh start DIR PORT [CONFIG] | stop DIR}
dir=${2:?usage: scripts/prometheus.sh start DIR PORT [CONFIG] | stop DIR}

stop() {
  if [ -f "$dir/prometheus.pid" ]; then
    pid=$(cat "$dir/prometheus.pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/prometheus.pid"
  fi
}

install_if_missing() {
  command -v prometheus >/dev/null && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "prometheus is not installed and this is not root: run 'sudo apt-get install -y prometheus', then retry" >&2
    return 1
  fi
  echo "prometheus is not installed: installing the Debian package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600 prometheus >&2
  # The package enables a system service; the tests run their own server, never that one.
  command -v prometheus >/dev/null
}

case $cmd in
  start)
    port=${3:?usage: scripts/prometheus.sh start DIR PORT [CONFIG]}
    config=${4:-}
    install_if_missing
    mkdir -p "$dir/targets"
    stop
    rm -rf "$dir/data"
    if [ -z "$config" ]; then
      config=$dir/prometheus.yml
      cat >"$config" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: weightship
    file_sd_configs:
      - files: ["$dir/targets/*.json"]
        refresh_interval: 1s
EOF
    fi
    prometheus --config.file="$config" --storage.tsdb.path="$dir/data" \
      --web.listen-address="127.0.0.1:$port" --storage.tsdb.retention.time=2h --log.level=warn \
      </dev/null >"$dir/prometheus.log" 2>&1 &
    echo $! >"$dir/prometheus.pid"
    for _ in $(seq 300); do
      if curl -fsS "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1; then
        echo "http://127.0.0.1:$port"
        exit 0
      fi
      if ! kill -0 "$(cat "$dir/prometheus.pid")" 2>/dev/null; then
        echo "prometheus exited before it was ready; its log ($dir/prometheus.log):" >&2
        tail -20 "$dir/prometheus.log" >&2
        exit 1
      fi
      sleep 0.2
    done
    echo "prometheus did not become ready on port $port within 60 s; see $dir/prometheus.log" >&2
    stop
    exit 1
    ;;
  stop)
    stop
    rm -rf "$dir"
    ;;
  *)
    echo "unknown command '$cmd'; usage: scripts/prometheus.sh start DIR PORT [CONFIG] | stop DIR" >&2
    exit 2
    ;;
esac
