#!/usr/bin/env bash
# A GPU lease in one prepared call (benchmarks/README.md "On a GPU"). The lent machine's image has torch, numpy,
# pyarrow, h5py, fsspec, grpcio and protobuf, not Apache Beam nor the tokenizers, and reaches no network; the
# shared data beside the checkout does not travel. So, on this machine first:
#
#   bash benchmarks/gpu_lease.sh bundle
#
# writes .whl/ (the wheels the image lacks, for its Python 3.12) and .lease/shared/ (the WikiText-2, SST-2 and
# bilm-tf files the checks read), both ignored by git, about 30 MB with the tree; then one device call, carrying
# [".whl", ".lease"], runs
#
#   bash benchmarks/gpu_lease.sh run [STEP ...]
#
# (default steps: profile levers pipeline quality; also: tests, speed; `commands` prints each step's limit and
# command). Each step runs under its own time limit (LIMIT below: the default four fit one call's 10 minutes with
# the wheels' install); each result JSON lands in benchmarks/results/ and, with lease.log (every step's output), in
# $OUT (the files the device tool brings back).
set -uo pipefail
cd "$(dirname "$0")/.."

# Wheels for what the image lacks: Beam and the dependencies it lacks there, the raw tokenizers, zstd inputs.
WHEELS=(apache-beam==2.77.0 beartype cryptography cffi pycparser fastavro fasteners httplib2 jsonpickle objsize
        proto-plus pytz zstandard==0.25.0 sacremoses==0.2.0 blingfire==0.1.8)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

# step -> seconds it may take, and its command (TAG: the device's name as result files carry it)
declare -A LIMIT=([profile]=180 [levers]=80 [pipeline]=140 [quality]=120 [tests]=300 [speed]=240)
step_command() {
    local r=benchmarks/results
    case "$1" in
        profile)  echo "python3 -m benchmarks.gpu_profile --device cuda --pageable --eager-cell --out $r/gpu_profile_$TAG.json" ;;
        levers)   echo "python3 -m benchmarks.gpu_levers --device cuda --out $r/gpu_levers_$TAG.json" ;;
        pipeline) echo "python3 -m benchmarks.gpu_check --device cuda --steps pipeline --lines 2461 --pipeline-timeout 65 --out $r/gpu_check_${TAG}_pipeline.json" ;;
        quality)  echo "python3 -m benchmarks.gpu_check --device cuda --steps quality --out $r/gpu_check_${TAG}_quality.json" ;;
        tests)    echo "python3 -m benchmarks.gpu_check --device cuda --steps tests --out $r/gpu_check_${TAG}_cuda_tests.json" ;;
        speed)    echo "python3 -m benchmarks.gpu_check --device cuda --steps low_precision model_speed --out $r/gpu_check_${TAG}_speed.json" ;;
        *) return 1 ;;
    esac
}

bundle() {
    rm -rf .whl .lease
    mkdir -p .whl .lease/shared/data/wikitext-2 .lease/shared/data .lease/shared/fixtures
    local args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
    for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
    python3 -m pip download -q "${args[@]}" "${WHEELS[@]}" || { echo "error: pip download failed" >&2; exit 1; }
    # blingfire's wheel is 42 MB of models the sentence splitter does not read: its module and library only
    local bf; bf=$(ls .whl/blingfire-*.whl)
    python3 - "$bf" <<'EOF' || exit 1
import sys, zipfile
src = sys.argv[1]
keep = lambda n: n.startswith("blingfire/__init__") or n.endswith(".so") or ".dist-info/" in n
with zipfile.ZipFile(src) as z:
    files = [(i, z.read(i)) for i in z.infolist() if keep(i.filename)]
with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as z:
    for i, data in files:
        if not i.filename.endswith("RECORD"):
            z.writestr(i, data)
    z.writestr(next(i for i, _ in files if i.filename.endswith("RECORD")), b"")   # pip checks no hashes with --no-deps
EOF
    local shared=../shared
    [ -d "$shared/data/wikitext-2" ] || { echo "error: no $shared beside the checkout" >&2; exit 1; }
    cp "$shared/data/wikitext-2/valid.txt" "$shared/data/wikitext-2/README.txt" .lease/shared/data/wikitext-2/
    head -c 2500000 "$shared/data/wikitext-2/train.txt" > .lease/shared/data/wikitext-2/train.txt
    cp -r "$shared/data/sst2" .lease/shared/data/
    cp -r "$shared/fixtures/bilm-tf" .lease/shared/fixtures/
    du -sh .whl .lease
    echo "carry: [\".whl\", \".lease\"]; command: bash benchmarks/gpu_lease.sh run [STEP ...]"
}

run() {
    : "${OUT:=/tmp/lease-out}"
    mkdir -p "$OUT"
    local log="$OUT/lease.log"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$log" 2>&1 || { echo "error: the wheels did not install (see lease.log)" >&2; cp "$log" "$OUT/" 2>/dev/null; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    [ -e ../shared ] || ln -s "$PWD/.lease/shared" ../shared
    TAG=$(python3 -c "import torch, benchmarks.common as c; print(c.device_tag(torch.cuda.get_device_name()))") \
        || { echo "error: no CUDA device seen by torch" >&2; exit 1; }
    local steps=("$@")
    [ ${#steps[@]} -gt 0 ] || steps=(profile levers pipeline quality)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$log" 2>&1
    for s in "${steps[@]}"; do
        local cmd; cmd=$(step_command "$s") || { echo "error: unknown step $s" >&2; exit 2; }
        local t0=$SECONDS
        echo "== $s: $cmd" | tee -a "$log"
        timeout -k 10 "${LIMIT[$s]}" $cmd >>"$log" 2>&1
        local rc=$?
        echo "== $s: status $rc in $((SECONDS - t0)) s" | tee -a "$log"
        [ -f "${cmd##* }" ] && cp "${cmd##* }" "$OUT/"          # the step's JSON (its --out, the command's last word)
    done
    tail -n 40 "$log"
}

case "${1:-}" in
    bundle) bundle ;;
    run) shift; run "$@" ;;
    commands) TAG=DEVICE; for s in "${!LIMIT[@]}"; do echo "$s ${LIMIT[$s]} $(step_command "$s")"; done ;;
    *) echo "usage: bash benchmarks/gpu_lease.sh bundle | run [STEP ...] | commands  (steps: ${!LIMIT[*]})" >&2
       exit 2 ;;
esac
