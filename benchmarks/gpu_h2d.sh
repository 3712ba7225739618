#!/usr/bin/env bash
# The GPU checks, prepared to run in at most about nine minutes on a lent GPU machine that
# cannot reach PyPI: the arena benchmark (benchmarks/gpu_arena.py: pixels from the
# tokenizer to each TP rank's GPU by every path, and the EPD GPU hop; at most 5 minutes),
# the wrap's copy threads, and `mmshm bench --device cuda` (its table prints the producer's
# copy threads and wrap/floor too). The machine: one H200 or H100, its image's
# python3 with torch, click, rich, prometheus-client, scikit-image,
# transformers, wrapt and matplotlib; no msgspec, blake3 or pyzmq).
#
# On the development machine, in the repository root, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec blake3 pyzmq
# Then run this script there with `.whl` carried; results land in $OUT.
set -euo pipefail
OUT=${OUT:-/tmp/mmshm-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target /tmp/site .
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
  | tee -a "$OUT/gpu.txt"
# the arena: the time from the tokenizer to the GPU (plain pickle, SGLang's CUDA IPC, mmshm
# today, mmshm's arena, the pinned floor; 1/8/32 720p photos, 1 and 2 consumers) and the EPD
# GPU hop (mmshm, safetensors on tmpfs, the pinned round trip), every row over its floor;
# then the mixed-size workload with the server's own copy and the race check (settle on: no
# torn photo; settle off, the control: torn photos), registrations per request, and the
# memlock probe (cudaHostRegister of 64 MiB as nobody under ulimit -l 64);
# its own limit (--timeout) is below the shell's, so the table is printed whatever happens
timeout 300 python3 benchmarks/gpu_arena.py --timeout 280 --json "$OUT/arena.json" 2>&1 \
  | tee "$OUT/arena.txt" || true
# the producer's wrap at the host's speed: 1 and 8 photos at 720p into new and
# pooled segments, with and without the hash asked for now, on 1, 2, 4, 8 and 16 copy
# threads and the automatic setting (0), each line with the threads used, GB/s and the
# ratio to a warm multi-threaded copy of the same bytes (about 20 s)
timeout 60 python3 benchmarks/wrap_threads.py --images 1,8 --threads 1,2,4,8,16,0 --reps 3 \
  --json "$OUT/wrap.json" 2>&1 | tee "$OUT/wrap.txt" || true
# 720p, TP=2, n=1, 1/8/32 images: mmshm's views against inline tensors,
# each copied to the GPU from pageable and from registered memory
timeout 150 python3 -m mmshm.cli bench --device cuda --tp 2 --n 1 --images 1,8,32 \
  --modes inline,mmshm --repeat 2 --budget 4 --json "$OUT/gpu.json" --plot "$OUT/gpu.png" \
  2>&1 | tee "$OUT/bench.txt"
