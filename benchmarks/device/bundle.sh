#!/usr/bin/env bash
# Build .gpu/ for a lent GPU machine (benchmarks/device/run.py) within the device's limit: 64 MiB for
# the working tree that travels and the carried paths together. ../shared/gpu/prepare.sh's wheels
# (flwr and what the GPU image lacks, less those of flwr's SuperLink), one dataset recompressed with
# xz (Fashion-MNIST's gzip files are 30 MB, 26 MB as xz), and this folder's setup.sh; no Ray: its
# trimmed 25 MB do not fit beside a dataset, so the agreement step's Ray-actor case reads "not run"
# and every step runs on the batched engine in the script's own process.
#   usage (from the project root):  bash benchmarks/device/bundle.sh fmnist|mnist
# mnist for FL+HC's grid, fmnist for DAC's tables and the timing step: the dataset
# of the queue's next step with work left (run.py's docstring); a step whose dataset is not carried is
# reported "not started".
set -euo pipefail
case "${1:-}" in
  fmnist) folder=FashionMNIST; flag=--with-fmnist ;;
  mnist) folder=MNIST; flag= ;;
  *) echo "usage: bash benchmarks/device/bundle.sh fmnist|mnist (the dataset the queue's next step reads)" >&2; exit 2 ;;
esac
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -f ../shared/gpu/prepare.sh ] || { echo "../shared/gpu/prepare.sh not found beside the checkout" >&2; exit 1; }
bash ../shared/gpu/prepare.sh $flag > /dev/null
rm -f .gpu/ray-*.tar.xz
# Wheels of flwr's SuperLink (its database and REST server: 6 MiB) that no step of run.py imports; the
# slow dry run (tests/test_device_script.py) runs with these imports refused, so a step that comes to
# need one fails there first.
LEFT_OUT="sqlalchemy alembic greenlet mako fastapi starlette uvicorn h11"
for name in $LEFT_OUT; do rm -f .gpu/whl/"$name"-*.whl; done
for other in .gpu/data/*; do [ "$(basename "$other")" = "$folder" ] || rm -rf "$other"; done
for file in .gpu/data/"$folder"/raw/*.gz; do gzip -dc "$file" | xz -9e -T2 > "${file%.gz}.xz"; rm -f "$file"; done
install -m 0755 benchmarks/device/setup.sh .gpu/setup.sh
# total bytes of the NUL-separated paths on stdin; a tracked file deleted in the work tree counts 0
# (stat fails on it: not a reason to stop under pipefail)
total_bytes() { { xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}'; }
tree=$(git ls-files -z --cached --others --exclude-standard | total_bytes)
bundle=$(find .gpu -type f -print0 | total_bytes)
limit=$((64 * 1024 * 1024))
echo ".gpu/: $((bundle / 1024 / 1024)) MiB ($folder), working tree $((tree / 1024 / 1024)) MiB; together $(((tree + bundle) / 1024 / 1024)) of $((limit / 1024 / 1024)) MiB"
if [ $((tree + bundle)) -gt "$limit" ]; then
  echo "over the device's 64 MiB: move untracked files out of the checkout (git status) or carry less" >&2
  exit 1
fi
