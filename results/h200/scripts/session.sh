#!/usr/bin/env bash
# The device calls of an H200 session, committed so they outlive a checkout (.gpukit/ is ignored).
#
# Here first:  ../shared/gpu/make-kit.sh --serve "xgrammar>=0.2.9,<0.3"
# then send .gpukit/part-00 .. part-NN one per call (carry [".gpukit/part-NN"], command
# `mkdir -p /tmp/kit && cp .gpukit/part-* /tmp/kit/`), back to back, and the last part with
#   carry [".gpukit/part-NN", ".gpukit/install.sh"]
#   command: source .gpukit/install.sh && bash results/h200/scripts/session.sh a
# then, while the machine is warm:  bash results/h200/scripts/session.sh b   (same carry, same source)
#
# a: test_cuda (the device path changed), phases, the first burst with a fresh kernel cache,
#    the 1.4 B model against og.Engine with a fresh kernel cache.          (~8 min)
# b: MTP K=0..3/auto in rounds, the 8k shared prefix on/off, the 1.4 B model at synthetic
#    acceptance 0.3 and 0.7 in rounds.                                     (~9 min)
# Everything goes under $OUT (copied back); commit what it shows under results/h200/.
set -uo pipefail
part=${1:?usage: session.sh a|b}
root=$PWD
mkdir -p /tmp/pkg/mtpserve
for d in engine actors cluster; do ln -sfn "$root/$d" /tmp/pkg/mtpserve/$d; done
touch /tmp/pkg/mtpserve/__init__.py
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-} PYTHONUNBUFFERED=1
bench() { python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT" "$@"; }
mid=/tmp/mid
make_mid() { [[ -f $mid/genai_config.json ]] || bench --make-model mid --model-out $mid --make-only; }
fresh_cupy() { CUPY_CACHE_DIR=$(mktemp -d /tmp/cupy-XXXX); export CUPY_CACHE_DIR; }
step() { echo "=== $(date +%T) $*" | tee -a "$OUT/log.txt"; }

case $part in
a)
  step test_cuda
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | tail -25 | tee "$OUT/test-cuda.txt"
  step phases bundled
  bench --draft-tokens 0,2 --concurrency 1,16 --num-prompts 32 --max-tokens 128 --phases on --no-plot \
    --name bundled-phases 2>&1 | tail -30
  bench --draft-tokens 0,2 --concurrency 1,16 --num-prompts 32 --max-tokens 128 --phases sync --no-plot \
    --name bundled-phases-sync 2>&1 | tail -30
  make_mid 2>&1 | tail -3
  step first burst, fresh kernel cache
  (fresh_cupy; STACKS=1 python3 results/h200/first-burst/first_burst.py $mid 0 32 48 128) 2>&1 | tail -40 \
    | tee "$OUT/first-burst-fresh-cache.txt"
  step 1.4 B vs og.Engine, fresh kernel cache
  (fresh_cupy; bench --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 48 \
    --concurrency 1,8,32,64 --draft-tokens 0 --compare ortgenai --phases on --name mid-vs-ortgenai) 2>&1 | tail -45
  ;;
b)
  step bundled MTP rounds
  bench --draft-tokens 0,1,2,3,auto --concurrency 1,16,64 --num-prompts 64 --max-tokens 128 --rounds 3 \
    --name bundled-mtp-rounds 2>&1 | tail -40
  make_mid 2>&1 | tail -3
  step 8k shared prefix, cache on/off
  bench --model $mid --prompts random --input-len 128 --shared-prefix-len 7936 --max-tokens 128 \
    --concurrency 1,16 --num-prompts 32 --draft-tokens 0 --prefix-cache on,off --name mid-prefix-8k 2>&1 | tail -30
  for a in 0.3 0.7; do
    step 1.4 B synthetic $a rounds
    bench --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 --concurrency 1,16 \
      --draft-tokens 0,1,2,3,auto --synthetic-acceptance $a --rounds 2 --name mid-synthetic-$a 2>&1 | tail -30
  done
  ;;
*) echo "usage: session.sh a|b" >&2; exit 2 ;;
esac
step done
