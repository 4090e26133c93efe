#!/usr/bin/env bash
# A private CA and a SuperLink server certificate for a Flower deployment.
#
#   deploy/make_certificates.sh OUTDIR HOST [HOST ...]
#
# HOST: every DNS name or IP address the SuperNodes (and `flwr`) dial the SuperLink at, e.g.
#   deploy/make_certificates.sh certs superlink.example.org 10.0.0.5
# The certificate's subjectAltName lists these HOSTs plus localhost and 127.0.0.1, always: the
# operator on the SuperLink's own machine (or a published docker port) dials 127.0.0.1, and since
# the CA is made here for this deployment alone, naming localhost lets no one else in.
#
# Writes OUTDIR/ca.crt (to every device and to whoever runs `flwr`), OUTDIR/server.pem and the
# private keys OUTDIR/ca.key, OUTDIR/server.key (mode 600, stay on the SuperLink's machine).
# Refuses to overwrite an existing CA or server key: certificates already handed out would stop
# matching. FEDCLUSTER_CERT_DAYS sets the validity (default 365 days).
set -euo pipefail

usage="usage: $(basename "$0") OUTDIR HOST [HOST ...]  (HOST: the SuperLink's DNS names / IP addresses that devices dial)"
fail() { echo "error: $*" >&2; exit 2; }

[ "$#" -ge 1 ] || fail "no OUTDIR and no HOST given; $usage"
[ "$#" -ge 2 ] || fail "no HOST given: name the SuperLink's DNS name or IP address that devices dial; $usage"
command -v openssl >/dev/null || fail "openssl is not installed"
outdir=$1
shift
days=${FEDCLUSTER_CERT_DAYS:-365}
[[ "$days" =~ ^[1-9][0-9]*$ ]] || fail "FEDCLUSTER_CERT_DAYS='$days' is not a positive number of days"

is_ipv4() {
  local IFS=. octet
  local -a octets
  [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || return 1
  read -ra octets <<<"$1"
  for octet in "${octets[@]}"; do
    [[ "$octet" =~ ^(0|[1-9][0-9]{0,2})$ ]] && [ "$octet" -le 255 ] || return 1
  done
}
is_ipv6() {  # hex groups and colons (at least two), optionally ending in a dotted IPv4; openssl checks the rest
  [[ "$1" =~ ^[0-9A-Fa-f:]+(:[0-9.]+)?$ && "$1" == *:*:* ]]
}
is_dns_name() {  # RFC 1123 labels: letters, digits, inner hyphens, at most 63 each, 253 in all
  [ "${#1}" -le 253 ] && [[ "$1" =~ ^([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$ ]]
}

san="DNS:localhost,IP:127.0.0.1"
for host in "$@"; do
  if [[ "$host" == *://* ]]; then
    fail "HOST '$host' is a URL; give only the host name or IP address (e.g. ${host#*://})"
  elif [[ "$host" =~ ^[^:]+:[0-9]+$ ]]; then
    fail "HOST '$host' has a port; give only the host name or IP address (${host%:*})"
  elif [[ "$host" =~ ^\[(.*)\](:[0-9]+)?$ ]]; then
    fail "HOST '$host': give an IPv6 address without brackets or port (${BASH_REMATCH[1]})"
  elif is_ipv4 "$host"; then
    entry="IP:$host"
  elif [[ "$host" =~ ^[0-9.]+$ ]]; then
    fail "HOST '$host' is not an IPv4 address (four numbers 0-255 separated by dots)"
  elif is_ipv6 "$host"; then
    entry="IP:$host"
  elif is_dns_name "$host"; then
    entry="DNS:$host"
  else
    fail "HOST '$host' is neither an IPv4/IPv6 address nor a DNS name (letters, digits, hyphens, dots)"
  fi
  case ",$san," in *",$entry,"*) ;; *) san="$san,$entry" ;; esac
done

[ ! -e "$outdir" ] || [ -d "$outdir" ] || fail "OUTDIR '$outdir' exists and is not a folder"
for existing in ca.key server.key; do
  [ ! -e "$outdir/$existing" ] || fail "$outdir/$existing exists; not overwriting it (certificates made from it may be in use): remove it or choose another OUTDIR"
done
mkdir -p "$outdir"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Everything is made in $work and moved into OUTDIR only once all of it succeeded: a failed step
# leaves OUTDIR as it was (not a CA key without a certificate that blocks the next try).
# The server's CN is fixed: clients check the subjectAltName, and a CN is limited to 64 characters.
(
  umask 077  # the private keys are readable by their owner only
  openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj /CN=fedcluster-ca \
    -keyout "$work/ca.key" -out "$work/ca.crt" 2>"$work/log" \
    && openssl req -newkey rsa:2048 -nodes -subj /CN=fedcluster-superlink -keyout "$work/server.key" \
      -out "$work/server.csr" 2>>"$work/log"
) || { cat "$work/log" >&2; fail "openssl could not make the CA or the server key (its messages above)"; }
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$san" >"$work/server.ext"
openssl x509 -req -in "$work/server.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
  -CAserial "$work/ca.srl" -days "$days" -extfile "$work/server.ext" -out "$work/server.pem" 2>>"$work/log" \
  || { cat "$work/log" >&2; fail "openssl could not sign the server certificate for subjectAltName $san (its messages above)"; }
chmod 644 "$work/ca.crt" "$work/server.pem"
mv "$work/ca.key" "$work/ca.crt" "$work/server.key" "$work/server.pem" "$outdir/"
echo "wrote $outdir/{ca.crt,server.pem,server.key,ca.key}; server certificate valid $days days for $san"
