#!/usr/bin/env bash
# gpu_check.py on a lent GPU machine whose time is short (one call of about ten minutes): each section in
# its own process under its own time limit, so a section that overruns costs only itself, and every report
# lands in OUT (default gpu_lease/) as it is written: machine.txt, log.txt and one JSON a section.
#
#   bash benchmarks/gpu_lease.sh                 # python3 of the machine, mudpuppy importable there
#   WHEELS=.whl bash benchmarks/gpu_lease.sh     # first install the wheels in .whl/ into /tmp/site (no network)
#   LAYERS=8 SEQ_LENS=256,1024 bash benchmarks/gpu_lease.sh
#
# The wheels: mudpuppy itself (`pip wheel --no-deps --no-build-isolation -w .whl .`) and what the machine's
# image lacks, downloaded for its Python (see docs/benchmarks.md#gpu-check).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_lease}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [[ -n ${WHEELS:-} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi || rocm-smi; python3 -c 'import torch, transformers, peft, trl, pyarrow; print("torch", torch.__version__,
  "cuda", torch.version.cuda, "hip", torch.version.hip, "transformers", transformers.__version__, "peft",
  peft.__version__, "trl", trl.__version__, "pyarrow", pyarrow.__version__)'; } >"$OUT/machine.txt" 2>&1
tail -1 "$OUT/machine.txt"

# name, time limit (s), extra arguments
section() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  local log=/tmp/gpu_lease-$name.log
  timeout "$limit" python3 benchmarks/gpu_check.py --sections "$name" --out "$OUT/$name" "$@" >"$log" 2>&1
  local rc=$?
  [[ -f $OUT/$name/gpu_check.json ]] && mv "$OUT/$name/gpu_check.json" "$OUT/$name.json"
  rm -rf "${OUT:?}/$name"                  # the .md is made again from the .json: fewer files to bring back
  { echo "=== $name: rc $rc in $((SECONDS - start)) s (limit $limit)"; cat "$log"; } >>"$OUT/log.txt"
  echo "gpu_lease: $name rc $rc in $((SECONDS - start)) s (limit $limit)"
  grep -E "^gpu_check: " "$log" | tail -4
}

# SECTIONS="dequantize parity" ROWS=compile: a second, shorter call for what the first could not finish.
for name in ${SECTIONS:-environment parity dequantize methods scale}; do
  case $name in
    environment) section environment "${LIMIT_ENVIRONMENT:-80}" ;;
    parity) section parity "${LIMIT_PARITY:-150}" ${ROWS:+--rows "$ROWS"} ;;
    dequantize) section dequantize "${LIMIT_DEQUANTIZE:-70}" ;;
    methods) section methods "${LIMIT_METHODS:-40}" ;;
    scale) section scale "${LIMIT_SCALE:-220}" --seq-lens "${SEQ_LENS:-256}" ${LAYERS:+--layers "$LAYERS"} ;;
    *) echo "gpu_lease: unknown section $name" >&2; exit 2 ;;
  esac
done
