#!/usr/bin/env bash
# Where a direct-ingress replica's time goes at C=16 (bundled model, CUDA): `mtpserve serve` with
# --direct-port, `bench --url` against the replica's own port, the replica's and the engine
# process's CPU seconds over the load (per streamed token), and py-spy of both (GIL holder and
# all threads, idle left out), in one file $OUT/http-profile-LABEL.tgz. With --api-servers N the
# API server processes serve port 8100: their CPU is counted with the replica's, and the first
# one is profiled beside it.
# Usage: http_profile.sh LABEL [SERVE_FLAG ...] (under session.sh; DEVICE=cpu to try it here;
# PORT=8000 drives Serve's proxy instead of the replica's own port 8100; CLIENTS=P splits the load
# over P client processes).
set -uo pipefail
label=$1; shift
pyspy=$(ls /tmp/site/bin/py-spy 2>/dev/null || command -v py-spy)
dir="$OUT/http-profile-$label"; mkdir -p "$dir"
python3 -m mtpserve.cluster.cli serve --device "${DEVICE:-cuda}" --port 8000 --direct-port 8100 --engine-process on --draft-tokens 0 \
  "$@" > "$dir/serve.txt" 2>&1 &
serve_pid=$!
for _ in $(seq 120); do grep -q "Ctrl-C to stop" "$dir/serve.txt" && break; sleep 1; done
replica=$(pgrep -f "ServeReplica:mtpserve" | head -1); engine=$(pgrep -f "mtpserve.actors.engine_process" | head -1)
apis=$(pgrep -f "mtpserve.actors.api_servers" | tr '\n' ' ')
echo "replica $replica engine $engine api servers $apis" | tee "$dir/pids.txt"
tick=$(getconf CLK_TCK)
cpu() { local s=0; for p in "$@"; do s=$(awk -v s=$s -v t=$tick '{print s + ($14+$15)/t}' /proc/$p/stat); done; echo $s; }
run_load() {   # $1 name, $2 prompts: bench --url on the direct port at C=16
  python3 -m mtpserve.cluster.cli bench --url http://127.0.0.1:${PORT:-8100} --concurrency 16 --num-prompts "$2" --max-tokens 128 \
    --client-processes "${CLIENTS:-1}" \
    --results-dir "$dir" --name "$1" --no-plot 2>&1 | grep -v INFO | tail -4
}
run_load warm 32 > /dev/null
r0=$(cpu $replica $apis); e0=$(cpu $engine); t0=$(date +%s.%N)
run_load c16 256 | tee "$dir/bench.txt"
t1=$(date +%s.%N); r1=$(cpu $replica $apis); e1=$(cpu $engine)
awk -v t="$t1 $t0" -v r="$r1 $r0" -v e="$e1 $e0" 'BEGIN { split(t, a); split(r, b); split(e, c)
  printf "wall %.2f s, replica (and API servers) cpu %.2f s (%.1f us a token), engine cpu %.2f s, for 256 x 128 = 32768 tokens\n",
    a[1] - a[2], b[1] - b[2], (b[1] - b[2]) / 32768e-6, c[1] - c[2] }' | tee "$dir/cpu.txt"
run_load profiled 512 > "$dir/bench-profiled.txt" &
bench_pid=$!
sleep 2
front=${apis%% *}; front=${front:-$replica}      # who serves the port: the first API server, or the replica
timeout 20 "$pyspy" record -p $front -d 6 -r 250 -f raw -o "$dir/front-gil.raw" --gil --nonblocking > /dev/null 2>&1 &
timeout 20 "$pyspy" record -p $replica -d 6 -r 250 -f raw -o "$dir/replica-gil.raw" --gil --nonblocking > /dev/null 2>&1 &
timeout 20 "$pyspy" record -p $replica -d 6 -r 250 -f raw -o "$dir/replica-threads.raw" --threads --nonblocking > /dev/null 2>&1 &
timeout 20 "$pyspy" record -p $engine -d 6 -r 250 -f raw -o "$dir/engine-threads.raw" --threads --nonblocking > /dev/null 2>&1
wait $bench_pid
kill -INT $serve_pid; sleep 5; kill $serve_pid 2>/dev/null; ray stop --force > /dev/null 2>&1
tar -czf "$OUT/http-profile-$label.tgz" -C "$OUT" "http-profile-$label" && rm -rf "$dir"   # one file: a call returns few
ls -la "$OUT/http-profile-$label.tgz"
