#!/usr/bin/env bash
# Register SuperNodes' public keys with a SuperLink (`flwr supernode register`), so that only
# these devices may connect:
#
#   deploy/register_supernodes.sh CONNECTION KEY.pub [KEY.pub ...]
#
# CONNECTION names a SuperLink connection in $FLWR_HOME/config.toml (default ~/.flwr/config.toml).
# A key already registered counts as done, so running it again (e.g. on every `docker compose up`)
# is harmless. A SuperLink that does not answer yet (just started) is retried every 2 s for up to
# FEDCLUSTER_REGISTER_TRIES tries (default 30) before giving up.
set -euo pipefail

usage="usage: $(basename "$0") CONNECTION KEY.pub [KEY.pub ...]"
fail() { echo "error: $*" >&2; exit 2; }

[ "$#" -ge 2 ] || fail "give a connection name and at least one public key; $usage"
command -v flwr >/dev/null || fail "flwr is not on PATH (install this project: pip install -e .)"
connection=$1
shift
tries=${FEDCLUSTER_REGISTER_TRIES:-30}
[[ "$tries" =~ ^[1-9][0-9]*$ ]] || fail "FEDCLUSTER_REGISTER_TRIES='$tries' is not a positive number"
for key in "$@"; do
  [ -f "$key" ] || fail "public key '$key' does not exist"
  [[ "$key" == *.pub ]] || fail "'$key' is not a public key (.pub); the private key stays on the device"
  # Checked here so that only a SuperLink not answering yet is retried, not a key it would never take.
  read -r kind _ <"$key" || true
  [[ "$kind" == ecdsa-sha2-nistp* ]] || fail "'$key' is not an ECDSA (NIST curve) public key; make one with: ssh-keygen -t ecdsa -b 384 -N \"\" -f NAME"
done

for key in "$@"; do
  for ((try = 1; ; try++)); do
    if output=$(flwr supernode register "$key" "$connection" 2>&1); then
      echo "$key: ${output##*$'\n'}"
      break
    fi
    case "$output" in
      *"already in use"*) echo "$key: already registered"; break ;;
      *"unavailable"*) ;;  # flwr: "Connection to the SuperLink is unavailable": not up yet, retry
      *) echo "$output" >&2; fail "could not register $key with '$connection' (flwr's messages above)" ;;
    esac
    if [ "$try" -ge "$tries" ]; then
      echo "$output" >&2
      fail "could not register $key with '$connection' after $tries tries (flwr's messages above)"
    fi
    sleep 2
  done
done
