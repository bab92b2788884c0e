#!/usr/bin/env bash
# Installs what scripts/bench-proxy and scripts/bench-memory need, idempotently: Debian's nginx
# with its echo module and wrk (apt), Envoy into .venv (scripts/setup python), Pillow into .venv
# (benches/proxy/requirements.txt). Prints progress only when it installs something.
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
command -v nginx >/dev/null || need+=(nginx)
[ -e /usr/lib/nginx/modules/ngx_http_echo_module.so ] || need+=(libnginx-mod-http-echo)
command -v wrk >/dev/null || need+=(wrk)
if [ ${#need[@]} -gt 0 ]; then
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "bench: apt-get install ${need[*]}" >&2
  "${sudo[@]}" apt-get update -qq >&2
  # The benchmark starts its own nginx on a free port; the package's service is not needed (in a
  # container policy-rc.d usually keeps it from starting anyway).
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "${need[@]}" >&2
fi

scripts/setup python >&2
if ! .venv/bin/python -c 'import PIL' 2>/dev/null; then
  echo "bench: pip install -r benches/proxy/requirements.txt" >&2
  .venv/bin/pip install -q --disable-pip-version-check -r benches/proxy/requirements.txt >&2
fi
