#!/bin/sh
# Entrypoint of the rdzv image: one image, both roles.
#   <image>                          rdzv-server --host 0.0.0.0 --port 29400 --data-dir /var/lib/rdzv (the CMD)
#   <image> rdzv-server [flags]      the server
#   <image> rdzv-agent [flags] s.py  an agent
#   <image> server|agent [...]       short names for the two above
#   <image> --port 29500 ...         flags alone: the server with those flags
#   <image> rdzv status | bash | ... anything else runs as is
# exec keeps the program as PID 1, so it gets docker's/kubelet's SIGTERM itself.
set -eu
case "${1:-}" in
  server) shift; set -- rdzv-server "$@" ;;
  agent) shift; set -- rdzv-agent "$@" ;;
  -*) set -- rdzv-server "$@" ;;
  "") set -- rdzv-server --host 0.0.0.0 --port 29400 --data-dir /var/lib/rdzv ;;
esac
exec "$@"
