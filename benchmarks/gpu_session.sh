#!/usr/bin/env bash
# Everything a lent GPU machine should check, in one call (device time is scarce: ~15 min a
# session, a fresh start costs 1-2 min). Run from the repository root there:
#
#     bash benchmarks/gpu_session.sh [OUT_DIR]
#
# 1. the CUDA tests (GPU diff/encode/apply/hash parity, the HF engine on the GPU);
# 2. benchmarks/device.py at 7B: diff + encode, decode + apply in place, the state hash;
# 3. benchmarks/scale.py's API tier at 7B with the trainer's model and the engine both on the GPU
#    (publish() -> applied in a live GPU state dict, trainer in a process of its own;
#    API_FORMAT=1 or 2 codes the wire in that format; the default here is 3, the GPU's format);
# 4. the node tests with CUDA present (nodes' ``device = "auto"`` then keeps weights on the GPU).
#
# Each step has its own time limit and log under OUT_DIR, so a slow step costs only itself.
# Python packages the machine lacks travel as wheels in .whl/ (git-ignored via .git/info/exclude;
# ~28 MB); the machine has torch, numpy, numba, aiohttp, safetensors, transformers, pytest and
# pytest-xdist of its own (Python 3.12, x86-64). Built here from .venv's freeze, in a minute:
#   .venv/bin/pip freeze | grep -v -e p2psync -e '^-e' > /tmp/freeze.txt   # then drop what the
#   # machine has (its package list: the device README's KINDS.md), and for each NAME==VER:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform any -d .whl NAME==VER
# Three have no such wheel: fastecdsa 2.3.2 (take fastecdsa==3.0.1's), python-baseconv and
# varint (pure Python: `.venv/bin/pip wheel --no-deps -w .whl NAME==VER`).
set -u
OUT=${1:-${OUT:-/tmp/gpu_out}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
step() {  # step NAME LIMIT_S CMD...: one timed, logged step
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    | tee -a "$OUT/summary.txt"
want() { [[ " ${STEPS:-cuda_tests device_7b api_7b node_tests} " == *" $1 "* ]]; }
want cuda_tests && step cuda_tests "${CUDA_TESTS_S:-120}" python3 -m pytest -q -x \
    -p no:cacheprovider tests/codec/test_cuda.py tests/weights/test_embedding.py tests/weights/test_statehash.py \
    tests/codec/test_codec_v2.py
want device_7b && step device_7b "${DEVICE_S:-170}" python3 benchmarks/device.py --size 7b \
    --versions 3 --workers 8
want api_7b && step api_7b "${API_S:-230}" python3 benchmarks/scale.py --size 7b --device cuda \
    --trainer-device cuda --skip-processes --versions 3 --patch-format "${API_FORMAT:-3}"
want node_tests && step node_tests "${NODE_S:-120}" python3 -m pytest -q -p no:cacheprovider \
    -n 8 tests/library/test_python_api.py tests/weights/test_export.py tests/transport/test_node_http.py \
    tests/app/test_cli.py tests/processes/test_swarm_integration.py tests/weights/test_catchup.py tests/app/test_examples.py
# where a 7B version's seconds go, serially (one worker: cProfile sees the main thread only);
# the second version is profiled, so numba's first compile (no cache on a fresh machine) is not
want profile_7b && step profile_7b "${PROFILE_S:-150}" python3 benchmarks/device.py --size 7b \
    --versions 2 --workers 1 --profile "$OUT/profile_7b.txt"
# host threads for a GPU apply: the same payloads decoded + applied with 2-16 threads each
want sweep_7b && step sweep_7b "${SWEEP_S:-200}" python3 benchmarks/device.py --size 7b \
    --versions 2 --workers 8 --sweep 2,4,8,16
# where the engine's pause goes (py-spy, both processes, every thread; raw stacks for reading
# after the machine is gone: sort by ``_apply_frame`` / ``_apply_one``)
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
want api_7b_profile && step api_7b_profile "${API_S:-230}" "$SPY" record -r 67 -f raw \
    --subprocesses --threads --nonblocking -o "$OUT/api_7b_spy.txt" -- python3 \
    benchmarks/scale.py --size 7b --device cuda --trainer-device cuda --skip-processes \
    --versions 3 --patch-format "${API_FORMAT:-3}"
# the process tier: a trainer reading files, rollouts keeping their weights on the GPU
want nodes_1b && step nodes_1b "${NODES_S:-160}" python3 benchmarks/scale.py --size 1b \
    --device cuda --skip-api --versions 3
# a sharded trainer's version with both ranks' blocks on the one GPU (gloo between the ranks;
# untried on a GPU so far: not in the default steps)
want sharded_7b && step sharded_7b "${SHARDED_S:-300}" python3 benchmarks/sharded.py --size 7b \
    --ranks 2 --versions 3 --device cuda
for f in cuda_tests device_7b api_7b node_tests profile_7b sweep_7b api_7b_profile nodes_1b \
    sharded_7b; do
    [ -f "$OUT/$f.log" ] || continue
    echo "---- $f"
    tail -n 25 "$OUT/$f.log"
done
