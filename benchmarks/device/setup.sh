#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the checkout's root, with .gpu/ (benchmarks/device/bundle.sh)
# carried: installs the wheels into TMP/site (and Ray, where the bundle has it), unpacks the dataset
# (xz or gzip), writes TMP/gpu-env.sh. Chain it: bash .gpu/setup.sh && . TMP/gpu-env.sh && python3 ...
set -eu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target TMP/site .gpu/whl/*.whl 2>&1 | grep -v -i warn || true
for ray in .gpu/ray-*.tar.xz; do [ -f "$ray" ] && tar xJf "$ray" -C TMP/site; done
mkdir -p TMP/data && cp -r .gpu/data/* TMP/data/
find TMP/data -name "*.xz" -exec xz -d -f {} +
find TMP/data -name "*.gz" -exec gunzip -f {} +
cat > TMP/gpu-env.sh <<ENV
export PYTHONPATH=TMP/site:$PWD PYTHONUNBUFFERED=1 FEDCLUSTER_DATA_DIR=TMP/data FLWR_TELEMETRY_ENABLED=0
ENV
. TMP/gpu-env.sh
python3 -c "import importlib.util, torch, flwr; print('gpu setup: torch', torch.__version__, 'flwr', flwr.__version__, 'ray', 'yes' if importlib.util.find_spec('ray') else 'not carried', 'cuda', torch.cuda.is_available())"
