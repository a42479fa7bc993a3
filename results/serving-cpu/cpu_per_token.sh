# usage: cpu_per_token.sh PID... -- bench args ; prints cpu seconds of each pid during the bench
pids=(); while [[ $1 != -- ]]; do pids+=($1); shift; done; shift
tick=$(getconf CLK_TCK)
cpu() { awk -v t=$tick '{print ($14+$15)/t}' /proc/$1/stat; }
declare -A before; for p in ${pids[@]}; do before[$p]=$(cpu $p); done
t0=$(date +%s.%N)
"$@" > /tmp/cpt-bench.log 2>&1
t1=$(date +%s.%N)
for p in ${pids[@]}; do echo "pid $p cpu $(echo "$(cpu $p) - ${before[$p]}" | bc) s"; done
echo "wall $(echo "$t1 - $t0" | bc)"
grep -E "C=16|tokens in" /tmp/cpt-bench.log
