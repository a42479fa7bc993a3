#!/usr/bin/env bash
# The device calls of an H200 session, committed so they outlive a checkout (.gpukit/ is ignored).
#
# Here first:  ../shared/gpu/make-kit.sh --serve "xgrammar>=0.2.9,<0.3"
# then send .gpukit/part-00 .. part-NN one per call (carry [".gpukit/part-NN"], command
# `mkdir -p /tmp/kit && cp .gpukit/part-* /tmp/kit/`), back to back, and the last part with
#   carry [".gpukit/part-NN", ".gpukit/install.sh"]
#   command: source .gpukit/install.sh && bash results/h200/scripts/session.sh a
# then, while the machine is warm, the same carry and `source` with `session.sh b`, then `c`.
# Each part stays under the 600 s a call may run (every step has its own timeout); in order of
# what the open issues need most:
# a: test_cuda (the device path changed; the 1.4 B model is made beside it), phases of the
#    bundled model's steps, the first burst with a fresh CuPy kernel cache.
# b: the 1.4 B model against og.Engine with a fresh kernel cache (tokens/s and TTFT p99 goals,
#    phases of its steps), the 8k shared prefix on/off (issue 12's last goal).
# c: bundled MTP K=0..3/auto in rounds (the MTP and auto goals), the 1.4 B model at synthetic
#    acceptance 0.7 in rounds.
# d: (a diagnostic call) the seeded test in graph mode, HTTP through direct ingress vs in process,
#    the 1.4 B model's step phases at C=16 with drafts (K=0 / 2 / auto, synthetic 0.7).
# e: test_cuda after a device-path change, the 1.4 B model at synthetic 0.7 and the bundled model
#    with K=0 / 2 / auto at C=1 / 16 (a session's last call: what its changes did).
# f: (a diagnostic call) step_costs.py on the bundled and the 1.4 B model: each captured graph's
#    GPU time alone, the commit's, the K=2 step's ceiling at zero host time, cProfile of the loop.
# g: (a diagnostic call) ncu by kernel of one captured 1.4 B step: decode B=1, verify B=16 x 3.
# h: after host-path changes: test_cuda, the bundled model's step costs (no profile), bundled
#    K=0 / 2 / 3 / auto at C=1 / 16 in 2 rounds.
# i: then the 1.4 B model: step costs (no profile), synthetic 0.7 K=0 / 2 / auto at C=1 / 16, and
#    ncu of its captured decode (B=1) and verify (B=16 x 3) steps.
# j: test_cuda, bundled K=0 / 2 / 3 / auto at C=1 / 16 in 3 rounds, the 1.4 B model at synthetic 0.7
#    K=0 / 2 / auto in 2 rounds (a session's last call: what its changes did).
# k: the bundled model, K=0, against og.Engine at C=1 / 8 / 32 (the issue's ">= 2x og.Engine at C=1").
# l: after overlapped decoding: test_cuda, the bundled model K=0 with overlap on / off against
#    og.Engine at C=1 / 8 / 32, then bundled K=0 / 2 / 3 / auto at C=1 / 16 in 2 rounds.
# m: the 1.4 B model K=0 with overlap on / off against og.Engine, C=1 / 8 / 32 / 64, fresh kernel
#    cache (tokens/s, TTFT p99 and batch-1 TPOT against its replay), and its step costs (replays).
# n: after overlap in MTP engines: test_cuda, bundled K=0 / 2 / 3 / auto at C=1 / 16 in 2 rounds,
#    the 1.4 B model at synthetic 0.7 and 0.3, K=0 / 2 / auto, C=1 / 16, 2 rounds each.
# o: the 1.4 B model K=0, overlap off first, then on, against og.Engine (64 requests): TTFT p99.
# p: test_cuda's overlap tests alone (what parted, if anything), then o.
# q: (needs the --serve kit) test_cuda, bundled K=0 vs og.Engine, HTTP direct ingress vs in process
#    (bundled, C=1 / 16), the 1.4 B model's B=1 replay and its C=1 TPOT with overlap on / off.
# r: (a session's last minutes) test_cuda's sampled overlap test and its greedy K=0 graph case.
# s: after draft steps in flight: test_cuda, bundled K=0 / 2 / 3 / auto at C=1 / 16 in 2 rounds.
# t: the 1.4 B model at synthetic 0.7 and 0.3, K=0 / 2 / auto, C=1 / 16, 2 rounds each.
# u: test_cuda's seeded test (its partings printed), then t.
# v: (a diagnostic call) step_costs.py on the bundled model with draft steps in flight: replays,
#    commits, and the cProfile of the overlapped step loop at K=2 and K=0, B=1 / 16.
# w: test_cuda, then v (after the accept kernels' warm-up at start).
# x: (the session's last seconds) test_cuda's overlap tests and MTP on == off.
# y: test_cuda, HTTP direct ingress vs in process (bundled, C=1 / 16), then scripts/http_profile.sh:
#    the replica's CPU per streamed token and py-spy of it and the engine process at C=16, with
#    the route on its own thread (Serve's default) and on Serve's loop.
# z: HTTP vs in process in one run: direct ingress at C=16 with 256 prompts (past the start-up
#    burst), the proxy at C=1 / 16; the replica's profile (routes on Serve's loop, no proxy
#    middlewares in it); bundled K=0 / 2 / 3 / auto at C=1 / 16 with 96 prompts, 2 rounds.
# aa: (next) what the tenth session built after z: direct ingress vs in process past the burst,
#    the replica's profile with events as tuples and SSEChunks, and through the proxy with the
#    default pacing against none (PORT=8000 http_profile.sh).
# ab: the replica's own API servers: Serve's direct ingress vs 2 API servers vs in process
#    (bundled, C=1 / 16, 256 prompts), then the proxy with the default pacing against none.
# ac: the same with the load split over 4 client processes (one Python client was 16k chunks/s
#    busy), 0 / 2 / 4 API servers; the CPU per token and profile of 2 API servers.
# ad: ORT's intra-op threads on CUDA (default: one per core, spinning between runs) against one
#    thread, each: in process vs Serve's direct ingress vs 2 API servers, C=1 / 16, 256 prompts.
# ae: the engine in process with one ORT thread against ORT's default, alternated 1 / 0 / 1 / 0
#    (bundled, K=0, C=1 / 16, 128 prompts): what --num-threads 1 costs without HTTP.
# af: where the C=16 TTFT over HTTP goes: 2 API servers (one ORT thread) vs in process, C=1 / 16,
#    each HTTP run's server-side TTFT split into queue / prefill / serving (from /metrics), the
#    engine's steps counted, the requests saved.
# ag: (a diagnostic call) af's C=16 burst stalled twice for 70-80 ms, on mixed steps (decode rows
#    beside new prompts): mixed_first_calls.py times such steps by phase at B = 1..16, three
#    passes (same shapes again, then new prompt lengths), with CUDA's lazy module loading and
#    with CUDA_MODULE_LOADING=EAGER; then af's HTTP run with EAGER.
# ah: af again, with each replica's owner-thread stalls per load (turns >= 25 ms and 4x the step
#    average: what the turn spent its time on), to place af's two 70-80 ms stalls at C=16.
# ai: (next) ah again, now that the replica, its engine process and its API servers run at nice 0
#    (ah's ran at Ray's worker niceness 15): are the 57-93 ms steps gone? --stall-phases splits
#    any left (ah: not the garbage collector, not the events' hand-out, not a CPU quota) by phase;
#    then HTTP vs in process at Poisson 100 req/s (arrivals out of step in both: the closed loop
#    in process runs its waves in lockstep, one prompt step each), cpu_throttle_probe.py.
# aj: (a diagnostic call) ai kept the 45-75 ms stalls at nice 0, inside graph replays. Whose are
#    they? engine_process_alone.py (no Ray: the engine loop in a thread, in its own process, and
#    beside 3 spinning processes), then HTTP at C=16 through Serve's direct ingress and 2 API
#    servers with each stall's owner-thread CPU time and involuntary switches, while nvidia-smi
#    pmon says which processes use the GPU and ps which threads use the CPU.
# ak: (a diagnostic call) aj: no other process used the GPU, and each stall's owner thread was on
#    the CPU for all of it (no switch away): the engine in its own process beside 3 spinners, no
#    Ray, stalls too. The same with py-spy sampling the engine process's native stacks.
# al: ak found them: ORT captures a graph again (2 eager runs with cuDNN's NVRTC builds, then
#    cudaGraphInstantiate) on the owner thread's first replay of each shape, because ORT's CUDA
#    provider keeps graphs per thread and the engine was built on the process's main thread.
#    After EngineLoop.launch (the engine built on its owner thread): engine_process_alone.py, then
#    ai's two HTTP comparisons (2 API servers vs in process, C=1 / 16; Poisson 100 req/s).
# am: test_cuda (the 1.4 B model made beside it), then the 1.4 B model over HTTP against the same
#    engine in process (its first calls of a shape cost 0.5-0.85 s: what the per-thread graphs
#    cost a real model's replica until al), C=1 / 16.
# an: al's C=16 client was 67% busy (one Python process reading 16 streams at ~15k chunks/s) and
#    4.2 ms of its TTFT p50 lay outside the server's own: the same comparison with the load split
#    over 4 client processes, twice (the host's spread), C=1 / 16.
# ao: (a diagnostic call) a mixed step costs 5-21 ms on the bundled model (ag), and over HTTP at
#    C=16 about 100 of them set the TTFT gap: prefill_cost.py times an eager prompt step against
#    the same step captured, splits its kernels' GPU time by op (torch's CUPTI profiler), and
#    checks a captured prompt step replayed with other prompt lengths (same total) stays exact;
#    bundled and 1.4 B; test_cuda (the foreign-thread warning's test has not run here yet).
# ap: test_cuda (keep_step on every overlapped step), then al's Poisson comparison again over 4
#    client processes: al's one client (67% busy at C=16) saw TTFT p50 +11.8 ms, ITL p50 +1.1 ms,
#    and the replica ran 2,197 steps for the tokens the engine in process ran in 7,362.
# aq: bundled K=0 / 2 / 3 / auto at C=1 / 16, 96 prompts, 3 rounds: auto's per-step host costs
#    (its depth judged again only when its inputs change, the fit folded once per solve).
# ar: (a diagnostic call) aq: auto at C=16 drafts on 760 of 762 steps' none, yet its steps take
#    0.57-0.58 ms against K=0's 0.46 (main replay 0.20 vs 0.14 ms): auto_k0_profile.py, the same
#    closed loop of 16 in a K=0 and an auto engine, cProfile's own time per step side by side.
# as: ar: CuPy's ndarray.copy() of the step's hidden rows cost 59 us a step (an MTP engine's
#    every step): now one memcpy into chunks (cuda_graphs._RowCopies). test_cuda, then ar and aq.
# at: (a diagnostic call) outer_graph_probe.py: can ORT's graph replays (~0.1 ms of host time each,
#    three a K=2 step) be stream-captured inside a CUDA graph of our own, with CuPy kernels between
#    them, exact, and for how much host time a launch? Then prefill_cost.py on the 1.4 B model with
#    each shape's first call timed (am: two 48-50 ms prompt steps at C=16).
# au: (written, never run: av and aw did its grid, ax-az its auto rounds)
# av: test_cuda (the review mend routed keep_hidden through keep_step), then au's grid of the
#    1.4 B model's prompt first calls, and ORT's own profiler on the shapes that paid (which nodes
#    a new token count pays for): what a prompt warm-up at start would have to cover.
# aw: av: a new prompt token count pays 15-20 ms once, in MatMul nodes (cuBLAS loading kernels):
#    the same grid after the engine's start-up warm-up of the matrix products at 1..2048 rows
#    (engine/gemm_warmup.py) in a session of its own, then the 1.4 B model K=0 vs og.Engine
#    (b's run, fresh kernel cache: its TTFT p99 at C=32 / 64 is where mixed steps of new token
#    counts land).
# ax: test_cuda (the engine's start-up now warms the matrix products), then auto_ab.py: K=0,
#    auto and an MTP engine that never drafts taking turns in one process (the bench's rounds
#    saw the same K=0 run take 0.49-0.82 ms a step from one round to the next), bundled, C=16 with
#    each run's step p50 / p90 and garbage-collector passes, the same after gc.freeze(), and C=1
#    with K=2 / 3 beside them (auto against the best fixed K).
# ay: (a diagnostic call) ax: at C=16 auto ran 0.859x K=0 while an MTP engine that never drafts
#    ran 0.976x (its p50 step +30-40 us, p90 +100 us; one exploring draft step a run; gc.freeze
#    changed nothing): auto_ab.py --profile, cProfile's own time per step of auto against it.
# az: after the draft policy's drafting term (ay: auto held K=4 at C=16, 0.55-0.80x K=0, its fit
#    extrapolating K=0 from the depths it saw): auto_ab.py at C=16 and 8 (K=0 / auto / never
#    drafts), and at C=1 with K=2 / 3 beside (auto against the best fixed K).
# ba: the adaptive policy exploring in bursts and fitting only pipelined steps beside the
#    default (written for session 16, never run: the device went back mid-kit and no machine was
#    lent again that session; removed, bc runs its engines and more)
# Next, in this order, one device call each (~450-580 s; session 17 split them so none passes
# a call's 600 s):
# bc: test_cuda first (the draft calibration's new test; the engine's start-up, forget_start_up,
#    abort on the engine's stream, long head catch-ups in pieces and scheduler rule 3 changed),
#    then auto_ab.py --table --bursts: K=0, the fit (auto), the fit in bursts, auto on a table
#    timed at start-up (--draft-calibration on) and an MTP engine that never drafts, bundled, at
#    C=16 and 8. The table and its live drift are in each run's "fits".
# bd: the same at C=1 with K=2 / 3 beside (auto against the best fixed K), then the bench's own
#    rounds: K=0 / 3 / auto / auto-timed at C=1 / 16.
# bb / be: the 1.4 B model at synthetic acceptance 0.7 (bb) and 0.3 (be) (the issue's auto goal
#    names both): auto_ab.py --table --bursts --synthetic A --random-prompts 128 at C=16, and
#    --table at C=1 with K=2 beside; fewer rounds (each 1.4 B engine takes ~25 s to build).
# Session 18 (bb's C=16 run had run out of device memory building a fourth 1.4 B engine):
# bf: the table corrected by live steps (and trial holds) against the fit, K=0 and an MTP engine
#     that never drafts, bundled, all engines interleaved in turns of 64 steps (--interleave: the
#     host's 2x swings between runs shared), C=16 and 8, then C=1 with K=2 / 3 beside.
# bg: the 1.4 B model at synthetic 0.7, three engines a process: K=0 / table / fit at C=16, then
#     K=0 / table / K=2 at C=1, interleaved.
# Next (session 19), one call each:
# bh: test_cuda (graphs are now captured largest first), then the 1.4 B model's MTP engine's
#     capture memory, largest first, by ORT arena growth (next power of two; kSameAsRequested),
#     one engine a process (graph_memory_probe.py; session 18: 15.0 + 14.5 GiB in growing
#     order), then bundled auto (its policy's host time cut ~1/3 on the CPU) against K=0 and
#     never drafting at C=16, interleaved, each run's host time a step outside ORT's run calls,
#     and after the rounds cProfile of each (K=0 / never / auto).
# bi: the KV block size (session 19, no device; results/h200/README.md "Nineteenth session"): the
#     1.4 B model served with 64-token blocks (--kv-block-size), which ORT's flash PagedAttention
#     should read in place for multi-token steps (head size 256), against its export's 16: the
#     kernel ORT picks, an MTP engine's capture memory, MTP on == off (greedy, graphs) request by
#     request, ms a step; bj: the auto engine's captures at 64 and an eager prompt step's time
#     (prefill_cost.py) at both.
# bk: the bundled model at 256-token blocks (its head size is 64: flash's minimum), MTP K=0 / 2 /
#     3 / auto at C=1 / 16, 3 rounds, against 16: a K=2 verify replay took 0.37 ms against a
#     decode's 0.32 on its MEA gather, the ceiling that kept K=2 under 1.8x at C=1.
# Next (session 20), after bh / bi:
# bl: the host time a step before and after session 20's cut of the step's per-request Python
#     (results/h200/README.md "Twentieth session"): the engine as of a498f6a (host-ab-base.patch
#     taken back) and this one, alternated twice, bundled K=0 and never drafting at C=16.
# Next (session 21): test_cuda's 256-token-block test parted MTP on from off for 1 of 8 requests:
# bm: flash_tie_probe.py: the test's workload at 256 and 16 with logprobs, K=0 against K=2 (graphs
#     and prefix cache / no prefix cache / eager): each parting's position, both runs' top-two
#     margin there and the rounding gap before it; then the attention kernel each eager step's
#     PagedAttention picks at 256 (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1), counted.
# bn: test_cuda's greedy MTP on == off tests under the near-tie rule (bm's finding), then the
#     bundled model K=0 / 2 / auto at C=1 / 16 at 256- and 16-token blocks, 2 rounds (bk, shorter).
# bo: bundled auto against K=0 and never drafting, interleaved (bh's method: the H200's 0.895x),
#     at C=16 and C=8, 3 rounds each (~200 s).
# Next (session 22): session 20's auto turns at C=16 alternated ~0.79x / ~1.0x K=0 by half-wave.
# bp: step_trace.py: every step of auto, never drafting and K=0, interleaved, bundled C=16: which
#     steps auto loses its time in (prompt steps, steps launched alone, overlapped decode steps),
#     with one output length for all (waves) and with lengths from 128 x [0.5, 1.5].
# bq: the same comparisons on a workload without waves (--range-ratio 0.5): auto_ab.py at C=16 / 8,
#     and bench rounds K=0 / 2 / auto at C=1 / 16.
# bs: bp and bq's auto_ab.py at C=16 in one call (when device time is short; ~330 s).
# bt: the least of bs (device time nearly spent): the trace with waves, auto_ab.py at C=16 without (~200 s).
# bu: bt's auto_ab.py alone (~85 s).
# Session 23:
# bv: step_costs.py on the bundled model at this code (replays, the commit on the device, the K=2
#     ceiling at zero host time, cProfile of the K=0 and K=2 loops at B=1 / 16: where a drafting
#     step's host time goes now; session 9 profiled it last), then bt (~420 s).
# bw: live_compiles.py with a fresh kernel cache (bv's K=2 profile at 16 requests caught 3 NVRTC
#     builds, 0.32 s, on live steps: which kernels, called from where), then bq's C=8 and bench
#     rounds without waves (~400 s).
# bx: test_cuda (the head's catch-up stacks rows with device copies, not CuPy's concatenate; the
#     new test that live steps build no kernel), then, if that test failed, live_compiles.py with a
#     fresh cache: which builds, from where (~220 s, ~370 s with it).
# bxl: bx's tests of what changed only (the live builds, concat_rows, the commit replay, MTP on
#     == off, prefix hits, a draft step after a decode step; ~180 s) when device time is short.
# by: bq's C=8 and the bench's rounds without waves (~230 s).
# bz: step_trace.py without waves with K=2 beside K=0 / auto / never drafting, C=16: a steady K=2
#     step's wall time against K=0's overlapped steps, and why steps could not follow; K=2 and auto
#     with draft_after_decode on beside them (run after bx passed; ~200 s).
# br: what HTTP adds (an's method: 2 API servers, 4 client processes) on that workload: in process
#     a closed loop at C=16 had its 16 prompts arrive in one step a wave, over HTTP they spread out.
# Everything goes under $OUT (copied back); commit what it shows under results/h200/.
set -uo pipefail
part=${1:?usage: session.sh CASE (the cases are the labels of the case statement below, each with a comment saying what it runs)}
root=$PWD
mkdir -p /tmp/pkg/mtpserve
for d in engine actors cluster; do ln -sfn "$root/$d" /tmp/pkg/mtpserve/$d; done
touch /tmp/pkg/mtpserve/__init__.py
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-} PYTHONUNBUFFERED=1
bench=(python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT")   # an array: `timeout` runs it
mid=/tmp/mid
make_mid() { [[ -f $mid/genai_config.json ]] || "${bench[@]}" --make-model mid --model-out $mid --make-only; }
fresh_cupy() { CUPY_CACHE_DIR=$(mktemp -d /tmp/cupy-XXXX); export CUPY_CACHE_DIR; }
step() { echo "=== $(date +%T) $*" | tee -a "$OUT/log.txt"; }
run_test_cuda() {        # the device tests of this checkout, their summary under $OUT
  step test_cuda
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning | tail -8 \
    | tee "$OUT/test-cuda.txt"
}
recordings_bench_and_turns() {   # $1: the switch_ab JSON's suffix; the bench at C=16 (its flagged steps' calls) and C=1 (step recordings on by default), then host-staged recordings and admission holds in turns (~300 s)
  step "bench C=16, K=0 / 2, 512 prompts, 3 interleaved rounds: the flagged steps' calls (pipelined, after a prompt step, prompt steps launched)"
  timeout 120 "${bench[@]}" --draft-tokens 0,2 --concurrency 16 --num-prompts 512 --max-tokens 128 --rounds 3 --name c16-calls 2>&1 \
    | grep -v "Warning\|No registered" | grep "speedup\|flag" | tail -6 | cut -c1-300
  step "bench C=1, K=0 / 2, 64 prompts, 3 interleaved rounds (step recordings on by default)"
  timeout 90 "${bench[@]}" --draft-tokens 0,2 --concurrency 1 --num-prompts 64 --max-tokens 128 --rounds 3 --name c1-recordings 2>&1 \
    | grep -v "Warning\|No registered" | grep "speedup\|flag" | tail -4 | cut -c1-300
  step "switch_ab.py: defaults (hold 8 steps, group 0.25) / host-staged recordings / hold0 / hold2 / group125, K=2 C=16, lengths 64-192, 2 rounds"
  timeout 150 python3 results/h200/scripts/switch_ab.py engine/bundled/model "$OUT/switch-ab-$1.json" --variant hs:record_host_staged=1 \
    --variant hold0:scheduler.admission_hold_steps=0 --variant hold2:scheduler.admission_hold_steps=2 \
    --variant group125:scheduler.admission_group=0.125 --configs 2:16:1024 --rounds 2 --range-ratio 0.5 2>&1 \
    | grep -v "Warning\|No registered" | tail -6 | cut -c1-600
}
step_trace_c16() {       # $1: --range-ratio, $2: timeout (s); every step of auto / never drafting / K=0 at C=16
  step "step_trace.py, bundled, C=16, 128 requests, 2 rounds, --range-ratio $1"
  timeout "$2" python3 results/h200/scripts/step_trace.py engine/bundled/model "$OUT/step-trace-c16-r$1.json" \
    --concurrency 16 --requests 128 --rounds 2 --range-ratio "$1" 2>&1 | grep -v "No registered plugin\|Warning" \
    | tail -36 | cut -c1-400
}
auto_ab_without_waves() {   # $1: concurrency, $2: timeout (s); K=0 / auto / never drafts on lengths from 128 x [0.5, 1.5]
  step "auto_ab.py --interleave 64 --range-ratio 0.5, bundled, C=$1, 128 requests, 3 rounds (K=0 / auto / never drafts)"
  timeout "$2" python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c$1-r0.5.json" \
    --concurrency "$1" --requests 128 --rounds 3 --interleave 64 --range-ratio 0.5 2>&1 | grep "^round\|median" \
    | cut -c1-500
}
bundled_mtp_rounds() {   # $1 rounds of K=0 / 2 / 3 / auto at C=1 / 16, phases on
  step bundled K=0/2/3/auto, C=1/16, $1 rounds
  timeout 200 "${bench[@]}" --draft-tokens 0,2,3,auto --concurrency 1,16 --num-prompts 32 --max-tokens 128 --rounds "$1" \
    --phases on --name bundled-mtp-rounds 2>&1 | grep -v "prefill:" | tail -22
}
mid_synthetic_rounds() { # the 1.4 B model at synthetic 0.7 and 0.3 (or $2), K=0 / 2 / auto, C=1 / 16, 2 rounds; $1 s each
  for a in ${2:-0.7 0.3}; do
    step 1.4 B synthetic $a K=0/2/auto, C=1/16, 2 rounds
    timeout "$1" "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 \
      --concurrency 1,16 --draft-tokens 0,2,auto --synthetic-acceptance $a --rounds 2 --phases on \
      --name mid-synthetic-$a-rounds 2>&1 | grep -v "prefill:" | tail -14
  done
}
ncu_mid_steps() {        # ncu by kernel of the 1.4 B model's captured decode (B=1) and verify (B=16 x 3); $1 s each
  local ncu=(ncu --clock-control none --cache-control none --profile-from-start off --graph-profiling node
             --metrics gpu__time_duration.sum,dram__bytes.sum --csv)
  for shape in "1 1" "16 3"; do
    set -- "$1" $shape
    step ncu 1.4 B B=$2 rows=$3
    timeout "$1" "${ncu[@]}" python3 results/h200/scripts/ncu_graph_step.py $mid $2 $3 > "$OUT/ncu-mid-b$2-r$3.csv" \
      2> "$OUT/ncu-mid-b$2-r$3.err"
    grep -h "^# replay" "$OUT/ncu-mid-b$2-r$3.err"; grep -v "^#\|Warning\|onnxruntime" "$OUT/ncu-mid-b$2-r$3.err" | tail -3
    python3 results/h200/scripts/ncu_table.py "$OUT/ncu-mid-b$2-r$3.csv" "$OUT/ncu-mid-b$2-r$3.json" | head -24
  done
}

base_pkg() {             # /tmp/pkg_base: the package with the base checkout's engine (.base/engine: `git archive BASE engine` less the bundled model) and this checkout's actors and cluster
  mkdir -p /tmp/pkg_base/mtpserve
  ln -sfn "$root/.base/engine" /tmp/pkg_base/mtpserve/engine
  ln -sfn "$root/engine/bundled/model" "$root/.base/engine/bundled/model"
  for d in actors cluster; do ln -sfn "$root/$d" /tmp/pkg_base/mtpserve/$d; done
  touch /tmp/pkg_base/mtpserve/__init__.py
}
host_ab_rounds() {       # $1 rounds of the base checkout (.base/engine: `git archive BASE engine` less the bundled model; session 30: ab4cd8b) and this one, alternating, bundled K=2 / K=0 at C=16 and K=2 at C=1, waves
  base_pkg
  for round in $(seq "$1"); do
    for label in base new; do
      step "host_ab.py $label, round $round"
      pkg=/tmp/pkg; [[ $label == base ]] && pkg=/tmp/pkg_base
      PYTHONPATH=$pkg:${PYTHONPATH#/tmp/pkg:} timeout 120 python3 results/h200/scripts/host_ab.py engine/bundled/model $label \
        "${host_ab_extra[@]}" 2>&1 | grep "^{" | tee -a "$OUT/host-ab.jsonl" | cut -c1-200
    done
  done
  python3 results/h200/scripts/host_ab_table.py "$OUT/host-ab.jsonl" base new "$OUT/host-ab.json"
}
k2_auto_c16() {          # K=2 / auto against K=0, bundled, C=16, lengths 64-192 then waves, 2 rounds each; $1: the files' suffix
  for r in 0.5 0; do
    step "auto_ab.py --fixed 2 --range-ratio $r, bundled, C=16, 128 requests, 2 rounds"
    timeout 110 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r$r$1.json" \
      --concurrency 16 --requests 128 --rounds 2 --interleave 64 --range-ratio $r --fixed 2 --no-never \
      2>&1 | tee "$OUT/auto-ab-c16-r$r$1.txt" | grep "^round\|median\|Error" | cut -c1-1500
  done
}
host_ab_extra=()         # more host_ab.py arguments for host_ab_rounds and switch_ab_rounds (e.g. --resident 16: the bench's pools)
switch_ab_rounds() {     # $1 rounds of this checkout with each of "$@" (LABEL or LABEL:SWITCH,SWITCH), alternating (host_ab.py --set)
  local rounds=$1; shift
  for round in $(seq "$rounds"); do
    for spec in "$@"; do
      local label=${spec%%:*} sets=() xs=()
      [[ $spec == *:* ]] && IFS=, read -ra xs <<< "${spec#*:}"
      for x in "${xs[@]}"; do
        if [[ $x == scheduler.* ]]; then sets+=(--scheduler "${x#scheduler.}")
        elif [[ $x == --* ]]; then sets+=("$x")             # a host_ab.py option (--prompt-graphs)
        else sets+=(--set "$x"); fi
      done
      step "host_ab.py $label, round $round"
      timeout 120 python3 results/h200/scripts/host_ab.py engine/bundled/model "$label" "${sets[@]}" "${host_ab_extra[@]}" \
        2>&1 | grep "^{" | tee -a "$OUT/switch-ab.jsonl" | cut -c1-200
    done
  done
  for spec in "${@:2}"; do
    python3 results/h200/scripts/host_ab_table.py "$OUT/switch-ab.jsonl" "${1%%:*}" "${spec%%:*}"
  done
}
spy_loops() {            # py-spy (wall time, waits included) of the bundled model's closed loop: K=2 / K=0 at C=16 with waves, K=2 at C=1
  local pyspy=/tmp/site/bin/py-spy
  [[ -x $pyspy ]] || { mkdir -p /tmp/site/bin && python3 -c "import zipfile; import glob; z = zipfile.ZipFile(glob.glob('.gpukit*/py_spy.whl')[0]); \
open('$pyspy', 'wb').write(z.read('py_spy-0.4.3.data/scripts/py-spy'))" && chmod +x $pyspy; }
  for run in "2 16" "0 16" "2 1"; do
    set -- $run
    step "py-spy, bundled, K=$1, C=$2, waves"
    timeout 150 $pyspy record --nonblocking --idle -r 1000 -f raw -o "$OUT/spy-k$1-c$2.raw" -- \
      python3 results/h200/scripts/spy_loop.py engine/bundled/model --draft-tokens $1 --concurrency $2 \
      --requests $((${2} == 1 ? 24 : 256)) 2>&1 | grep -v "Warning\|No registered\|^py-spy>" | tail -2 | tee "$OUT/spy-k$1-c$2.txt"
    ms=$(grep -o "[0-9.]* ms/step" "$OUT/spy-k$1-c$2.txt" | cut -d" " -f1)
    [[ -n $ms ]] && python3 results/h200/scripts/spy_table.py "$OUT/spy-k$1-c$2.raw" --ms-per-step $ms --top 60 \
      --json "$OUT/spy-k$1-c$2.json" > "$OUT/spy-k$1-c$2-table.txt" && head -25 "$OUT/spy-k$1-c$2-table.txt"
  done
  (cd "$OUT" && tar -czf spy.tgz spy-* && rm spy-*)     # one file: a call brings back only a few
}

case $part in
a)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | tail -25 | tee "$OUT/test-cuda.txt"
  step phases bundled
  timeout 120 "${bench[@]}" --draft-tokens 0,2 --concurrency 1,16 --num-prompts 32 --max-tokens 128 --phases on --no-plot \
    --name bundled-phases 2>&1 | tail -20
  timeout 60 "${bench[@]}" --draft-tokens 0,2 --concurrency 1 --num-prompts 16 --max-tokens 128 --phases sync --no-plot \
    --name bundled-phases-sync 2>&1 | tail -8
  step waiting for the 1.4 B model; wait
  tail -3 "$OUT/make-mid.txt"
  step first burst, fresh kernel cache
  (fresh_cupy; timeout 120 env STACKS=1 python3 results/h200/first-burst/first_burst.py $mid 0 32 48 128) 2>&1 \
    | tail -40 | tee "$OUT/first-burst-fresh-cache.txt"
  ;;
b)
  step 1.4 B vs og.Engine, fresh kernel cache
  (fresh_cupy; timeout 330 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 48 \
    --concurrency 1,8,32,64 --draft-tokens 0 --compare ortgenai --phases on --name mid-vs-ortgenai) 2>&1 | tail -45
  step 8k shared prefix, cache on/off
  timeout 240 "${bench[@]}" --model $mid --prompts random --input-len 128 --shared-prefix-len 7936 --max-tokens 128 \
    --concurrency 1,16 --num-prompts 32 --draft-tokens 0 --prefix-cache on,off --name mid-prefix-8k 2>&1 | tail -30
  ;;
c)
  step bundled MTP rounds
  timeout 330 "${bench[@]}" --draft-tokens 0,1,2,3,auto --concurrency 1,16,64 --num-prompts 48 --max-tokens 128 --rounds 3 \
    --name bundled-mtp-rounds 2>&1 | tail -40
  step 1.4 B synthetic 0.7 rounds
  timeout 240 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 --concurrency 1,16 \
    --draft-tokens 0,2,3,auto --synthetic-acceptance 0.7 --rounds 2 --name mid-synthetic-0.7 2>&1 | tail -30
  ;;
d)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step seeded test, graph mode
  timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda.py -k seeded 2>&1 | grep -v Warning | tail -12 \
    | tee "$OUT/test-cuda-seeded.txt"
  step HTTP direct ingress vs in process, bundled
  timeout 150 "${bench[@]}" --replicas 0,1 --direct-ingress --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
    --draft-tokens 0 --no-plot --name bundled-http-direct 2>&1 | grep -v INFO | tail -14
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  step 1.4 B phases K=0/2/auto, synthetic 0.7, C=16
  timeout 150 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 --concurrency 16 \
    --draft-tokens 0,2,auto --synthetic-acceptance 0.7 --phases on --no-plot --name mid-phases-c16 2>&1 | tail -16
  timeout 100 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 --concurrency 16 \
    --draft-tokens 0,2 --synthetic-acceptance 0.7 --phases sync --no-plot --name mid-phases-c16-sync 2>&1 | tail -6
  ;;
e)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning | tail -8 \
    | tee "$OUT/test-cuda.txt"
  step bundled K=0/2/auto, C=1/16
  timeout 90 "${bench[@]}" --draft-tokens 0,2,auto --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
    --name bundled-mtp 2>&1 | tail -14
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  step 1.4 B K=0/2/auto, synthetic 0.7, C=16, phases
  timeout 170 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 --concurrency 16 \
    --draft-tokens 0,2,auto --synthetic-acceptance 0.7 --phases on --name mid-synthetic-0.7-phases 2>&1 | tail -20
  ;;
f)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step step costs, bundled
  timeout 200 python3 results/h200/scripts/step_costs.py engine/bundled/model "$OUT/step-costs-bundled.json" \
    --batches 1,16 2>&1 | grep -v Warning | tee "$OUT/step-costs-bundled.txt" | head -40
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  step step costs, 1.4 B
  timeout 260 python3 results/h200/scripts/step_costs.py $mid "$OUT/step-costs-mid.json" --batches 1,16 \
    --profile-requests 32 2>&1 | grep -v Warning | tee "$OUT/step-costs-mid.txt" | head -40
  ;;
g)
  make_mid > "$OUT/make-mid.txt" 2>&1
  ncu_mid_steps 250
  ;;
h)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  step step costs, bundled
  timeout 80 python3 results/h200/scripts/step_costs.py engine/bundled/model "$OUT/step-costs-bundled.json" \
    --batches 1,16 --no-profile 2>&1 | grep -v Warning | tee "$OUT/step-costs-bundled.txt" | grep -v onnxruntime
  bundled_mtp_rounds 2
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  ;;
i)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step step costs, 1.4 B
  timeout 70 python3 results/h200/scripts/step_costs.py $mid "$OUT/step-costs-mid.json" --batches 1,16 --no-profile \
    2>&1 | grep -v Warning | tee "$OUT/step-costs-mid.txt" | grep -v onnxruntime
  step 1.4 B synthetic 0.7 K=0/2/auto, C=1/16
  timeout 200 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 \
    --concurrency 1,16 --draft-tokens 0,2,auto --synthetic-acceptance 0.7 --phases on --name mid-synthetic-0.7 2>&1 | tail -20
  ncu_mid_steps 150
  ;;
j)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  bundled_mtp_rounds 3
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  step 1.4 B synthetic 0.7 K=0/2/auto, C=1/16, 2 rounds
  timeout 260 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 32 \
    --concurrency 1,16 --draft-tokens 0,2,auto --synthetic-acceptance 0.7 --rounds 2 --phases on \
    --name mid-synthetic-0.7-rounds 2>&1 | grep -v "prefill:" | tail -16
  ;;
k)
  step bundled K=0 vs og.Engine, C=1/8/32
  timeout 170 "${bench[@]}" --draft-tokens 0 --concurrency 1,8,32 --num-prompts 32 --max-tokens 128 \
    --compare ortgenai --name bundled-vs-ortgenai 2>&1 | grep -v INFO | tail -14
  ;;
l)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning | tail -8 \
    | tee "$OUT/test-cuda.txt"
  step bundled K=0 overlap on/off vs og.Engine, C=1/8/32
  timeout 150 "${bench[@]}" --draft-tokens 0 --concurrency 1,8,32 --num-prompts 32 --max-tokens 128 \
    --overlap-decode on,off --compare ortgenai --name bundled-overlap-vs-ortgenai 2>&1 | grep -v INFO | tail -16
  bundled_mtp_rounds 2
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  ;;
m)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step 1.4 B K=0 overlap on/off vs og.Engine, fresh kernel cache
  (fresh_cupy; timeout 400 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 48 \
    --concurrency 1,8,32,64 --draft-tokens 0 --overlap-decode on,off --compare ortgenai --phases on \
    --name mid-overlap-vs-ortgenai) 2>&1 | grep -v "INFO\|prefill:" | tail -40
  step step costs, 1.4 B
  timeout 70 python3 results/h200/scripts/step_costs.py $mid "$OUT/step-costs-mid.json" --batches 1,16 --no-profile \
    2>&1 | grep -v Warning | tee "$OUT/step-costs-mid.txt" | grep -v onnxruntime | head -12
  ;;
n)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  bundled_mtp_rounds 2
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  mid_synthetic_rounds 200
  ;;
o)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step 1.4 B K=0 overlap off then on, vs og.Engine, C=1/8/32/64
  (fresh_cupy; timeout 400 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 64 \
    --concurrency 1,8,32,64 --draft-tokens 0 --overlap-decode off,on --compare ortgenai --phases on \
    --name mid-overlap-off-first-vs-ortgenai) 2>&1 | grep -v "INFO\|prefill:" | tail -30
  ;;
p)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda, the overlap tests
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda.py -k overlapped 2>&1 \
    | grep -v "Warning\|onnxruntime_pybind" | grep "overlap (\|sequences part\|passed\|failed\|Error\|assert" | cut -c1-1500 \
    | tee "$OUT/test-cuda-overlap.txt"
  step waiting for the 1.4 B model; wait
  step 1.4 B K=0 overlap off then on, vs og.Engine, C=1/8/32/64
  (fresh_cupy; timeout 330 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 64 \
    --concurrency 1,8,32,64 --draft-tokens 0 --overlap-decode off,on --compare ortgenai --phases on \
    --name mid-overlap-off-first-vs-ortgenai) 2>&1 | grep -v "INFO\|prefill:\|decode:" | tail -24
  ;;
q)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  step bundled K=0 vs og.Engine, C=1/8/32
  timeout 100 "${bench[@]}" --draft-tokens 0 --concurrency 1,8,32 --num-prompts 32 --max-tokens 128 \
    --compare ortgenai --no-plot --name bundled-vs-ortgenai 2>&1 | grep -v INFO | tail -8
  step HTTP direct ingress vs in process, bundled
  timeout 170 "${bench[@]}" --replicas 0,1 --direct-ingress --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
    --draft-tokens 0 --no-plot --name bundled-http-direct 2>&1 | grep -v INFO | tail -14
  step waiting for the 1.4 B model; wait
  step step costs, 1.4 B, B=1
  timeout 60 python3 results/h200/scripts/step_costs.py $mid "$OUT/step-costs-mid.json" --batches 1 --no-profile \
    2>&1 | grep "^main\|^head" | tee "$OUT/step-costs-mid.txt"
  step 1.4 B K=0 C=1 overlap on/off
  timeout 90 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 24 \
    --concurrency 1 --draft-tokens 0 --overlap-decode on,off --no-plot --name mid-c1-overlap 2>&1 | grep -v INFO | tail -8
  ;;
r)
  step test_cuda, sampled and greedy overlap
  timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda.py \
    -k "overlapped_sampled or (overlapped and True-0)" 2>&1 | grep -v "Warning\|onnxruntime_pybind" \
    | grep "overlap\|sequences part\|passed\|failed\|Error\|assert" | cut -c1-1500 | tee "$OUT/test-cuda-overlap.txt"
  ;;
s)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  bundled_mtp_rounds 2
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  ;;
t|u)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  if [[ $part == u ]]; then
    step test_cuda, the seeded test
    timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda.py -k seeded_sampling 2>&1 \
      | grep -v "Warning\|onnxruntime_pybind" | grep "seeded sequences\|passed\|failed\|Error\|assert" | cut -c1-2500 \
      | tee "$OUT/test-cuda-seeded.txt"
  fi
  step waiting for the 1.4 B model; wait
  mid_synthetic_rounds 230
  ;;
v|w)
  [[ $part == w ]] && run_test_cuda
  step step costs, bundled, draft steps in flight
  timeout 300 python3 results/h200/scripts/step_costs.py engine/bundled/model "$OUT/step-costs-bundled.json" \
    --batches 1,16 2>&1 | grep -v Warning | tee "$OUT/step-costs-bundled.txt" | head -90
  ;;
x)
  step test_cuda, overlap and MTP on == off
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py -k "overlapped or mtp_on_is" 2>&1 \
    | grep -v "Warning\|onnxruntime_pybind" | tail -4 | tee "$OUT/test-cuda-overlap.txt"
  ;;
y)
  run_test_cuda
  step HTTP direct ingress vs in process, bundled
  timeout 170 "${bench[@]}" --replicas 0,1 --direct-ingress --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
    --draft-tokens 0 --no-plot --name bundled-http-direct 2>&1 | grep -v INFO | tail -14
  step HTTP profile, user code on its own thread
  timeout 140 bash results/h200/scripts/http_profile.sh own-thread --routes-on-serve-loop off
  step HTTP profile, user code on Serve\'s loop
  timeout 140 bash results/h200/scripts/http_profile.sh serve-loop --routes-on-serve-loop on
  ;;
z)
  step HTTP direct ingress vs in process, bundled, C=16, 256 prompts
  timeout 150 "${bench[@]}" --replicas 0,1 --direct-ingress --concurrency 16 --num-prompts 256 --max-tokens 128 \
    --draft-tokens 0 --no-plot --name bundled-http-direct-c16 2>&1 | grep -v INFO | tail -9
  step HTTP through the proxy vs in process, bundled, C=1 / 16, 64 prompts
  timeout 150 "${bench[@]}" --replicas 0,1 --concurrency 1,16 --num-prompts 64 --max-tokens 128 \
    --draft-tokens 0 --no-plot --name bundled-http-proxy 2>&1 | grep -v INFO | tail -11
  step HTTP profile, routes on Serve\'s loop, no proxy middlewares in the replica
  timeout 140 bash results/h200/scripts/http_profile.sh serve-loop
  step bundled K=0/2/3/auto, C=1/16, 96 prompts, 2 rounds
  timeout 150 "${bench[@]}" --draft-tokens 0,2,3,auto --concurrency 1,16 --num-prompts 96 --max-tokens 128 --rounds 2 \
    --phases on --name bundled-mtp-rounds-96 2>&1 | grep -v "prefill:" | tail -22
  ;;
aa)
  step HTTP direct ingress vs in process, bundled, C=16, 256 prompts
  timeout 150 "${bench[@]}" --replicas 0,1 --direct-ingress --concurrency 16 --num-prompts 256 --max-tokens 128 \
    --draft-tokens 0 --no-plot --name bundled-http-direct-c16 2>&1 | grep -v INFO | tail -9
  step HTTP profile, direct, events as tuples and SSEChunks
  timeout 140 bash results/h200/scripts/http_profile.sh direct
  step HTTP profile, through the proxy, paced at the default 2000 chunks/s
  PORT=8000 timeout 140 bash results/h200/scripts/http_profile.sh proxy-paced
  step HTTP profile, through the proxy, unpaced
  PORT=8000 timeout 140 bash results/h200/scripts/http_profile.sh proxy-unpaced --proxy-chunks-per-s 0
  ;;
ab)
  step HTTP: Serve direct ingress vs 2 API servers vs in process, bundled, C=1 / 16, 256 prompts
  timeout 420 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 0,2 --concurrency 1,16 --num-prompts 256 \
    --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-api-servers 2>&1 | grep -v INFO | tail -16
  step HTTP profile, through the proxy, paced at the default 2000 chunks/s
  PORT=8000 timeout 100 bash results/h200/scripts/http_profile.sh proxy-paced
  ;;
ac)
  step HTTP: direct ingress vs 2 / 4 API servers vs in process, 4 client processes, bundled, C=1 / 16, 256 prompts
  timeout 400 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 0,2,4 --client-processes 4 --concurrency 1,16 \
    --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-api-servers-4-clients 2>&1 \
    | grep -v INFO | grep -E "client CPU|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -24
  step HTTP profile, 2 API servers, 4 client processes
  CLIENTS=4 timeout 120 bash results/h200/scripts/http_profile.sh api2 --api-servers 2
  ;;
ad)
  for threads in 1 0; do
    step "HTTP vs in process with --num-threads $threads (0: ORT's default), bundled, C=1 / 16, 256 prompts"
    timeout 270 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 0,2 --num-threads $threads --concurrency 1,16 \
      --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-threads-$threads 2>&1 \
      | grep -v INFO | grep -E "client CPU|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -24
  done
  ;;
ae)
  for threads in 1 0 1 0; do
    step "in process, --num-threads $threads, bundled, K=0, C=1 / 16, 128 prompts"
    timeout 100 "${bench[@]}" --draft-tokens 0 --num-threads $threads --concurrency 1,16 --num-prompts 128 \
      --max-tokens 128 --no-plot --name bundled-threads-$threads 2>&1 | grep -E "^mtpserve K=0|results:" | tail -3
  done
  ;;
af)
  filter="client CPU|server's mean|^in-process|^1 replica|serving adds|^HTTP|results:"
  step "HTTP split: 2 API servers vs in process, --num-threads 1, bundled, C=1 / 16, 256 prompts, requests saved"
  timeout 260 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --concurrency 1,16 \
    --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --save-requests --name bundled-http-split 2>&1 \
    | grep -v INFO | grep -E "$filter" | tail -16
  ;;
ag)
  for loading in LAZY EAGER; do
    step "mixed steps' first calls, CUDA_MODULE_LOADING=$loading"
    CUDA_MODULE_LOADING=$loading timeout 200 python3 results/h200/scripts/mixed_first_calls.py engine/bundled/model \
      "$OUT/mixed-first-calls-$loading.json" 2>&1 | grep -v "INFO\|Warning" | tail -20
  done
  step "HTTP split with CUDA_MODULE_LOADING=EAGER: 2 API servers vs in process, bundled, C=1 / 16"
  CUDA_MODULE_LOADING=EAGER timeout 260 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 \
    --concurrency 1,16 --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --save-requests \
    --name bundled-http-split-eager 2>&1 | grep -v INFO \
    | grep -E "client CPU|server's mean|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -16
  ;;
ah)
  step "HTTP split with the replica's stalls: 2 API servers vs in process, --num-threads 1, bundled, C=1 / 16"
  timeout 260 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --concurrency 1,16 \
    --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --save-requests --name bundled-http-stalls 2>&1 \
    | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -18
  ;;
ai)
  step "HTTP with the replica's stalls split by phase: 2 API servers vs in process, --num-threads 1, bundled, C=1 / 16"
  timeout 260 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --stall-phases \
    --concurrency 1,16 --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-stall-phases \
    2>&1 | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -18
  step "HTTP vs in process at Poisson 100 req/s (the same arrival times in both: none in step), bundled, 384 prompts"
  timeout 200 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --request-rate 100 \
    --num-prompts 384 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-poisson 2>&1 | grep -v INFO \
    | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -12
  step "CPU quota and wake-up lateness"
  timeout 60 python3 results/h200/scripts/cpu_throttle_probe.py 16 3 | tee "$OUT/cpu-throttle.txt"
  ;;
aj)
  step "the engine alone, no Ray: in a thread, in its own process, beside 3 spinning processes; bundled, C=16"
  timeout 240 python3 results/h200/scripts/engine_process_alone.py "$OUT/engine-process-alone.json" 2>&1 \
    | grep -v "INFO\|Warning" | tail -8
  step "HTTP C=16: Serve's direct ingress vs 2 API servers, stalls with the owner's CPU time; GPU and CPU users sampled"
  nvidia-smi pmon -s u -d 1 > "$OUT/pmon.txt" 2>&1 & pmon=$!
  (for _ in $(seq 1 80); do date +%T; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
     ps -eLo pid,tid,ni,pcpu,stat,comm --sort=-pcpu | head -16; sleep 3; done) > "$OUT/cpu-gpu-users.txt" 2>&1 & users=$!
  timeout 280 "${bench[@]}" --replicas 1 --direct-ingress --api-servers 0,2 --num-threads 1 --stall-phases \
    --concurrency 16 --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-stall-cpu \
    2>&1 | grep -v INFO | grep -E "client CPU|server's mean|stalls|^1 replica|results:" | tail -12
  kill $pmon $users 2>/dev/null
  ;;
ak)
  step "the engine in its own process beside 3 spinners, then alone, no Ray, py-spy --native on it; bundled, C=16"
  timeout 300 python3 results/h200/scripts/engine_process_alone.py "$OUT/engine-process-spy.json" --modes process+,process \
    --num-prompts 512 --py-spy /tmp/site/bin/py-spy 2>&1 | grep -v "INFO\|Warning" | tail -8
  ;;
al)
  step "the engine alone, no Ray, after EngineLoop.launch: in a thread, in its own process, beside 3 spinners; bundled, C=16"
  timeout 200 python3 results/h200/scripts/engine_process_alone.py "$OUT/engine-process-alone.json" 2>&1 \
    | grep -v "INFO\|Warning" | tail -6
  step "HTTP: 2 API servers vs in process, --num-threads 1, bundled, C=1 / 16, 256 prompts"
  timeout 240 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 \
    --concurrency 1,16 --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-owner-built \
    2>&1 | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -18
  step "HTTP vs in process at Poisson 100 req/s, bundled, 384 prompts"
  timeout 200 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --request-rate 100 \
    --num-prompts 384 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-poisson-owner-built 2>&1 \
    | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -12
  ;;
am)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  step "waiting for the 1.4 B model"; wait
  step "1.4 B over HTTP: 2 API servers vs in process, --num-threads 1, C=1 / 16, 96 x 128 tokens, random 128-token prompts"
  timeout 330 "${bench[@]}" --model $mid --prompts random --input-len 128 --replicas 0,1 --direct-ingress --api-servers 2 \
    --num-threads 1 --concurrency 1,16 --num-prompts 96 --max-tokens 128 --draft-tokens 0 --no-plot --name mid-http-owner-built \
    2>&1 | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -18
  ;;
an)
  for round in 1 2; do
    step "HTTP round $round: 2 API servers vs in process, 4 client processes, bundled, C=1 / 16, 256 prompts"
    timeout 240 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --client-processes 4 \
      --concurrency 1,16 --num-prompts 256 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-4-clients-$round \
      2>&1 | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -18
  done
  ;;
ao)
  step "prompt steps eager vs captured, bundled"
  timeout 150 python3 results/h200/scripts/prefill_cost.py engine/bundled/model "$OUT/prefill-cost-bundled.json" 2>&1 \
    | grep -v "Warning\|STAGE\|USDT" | tail -8
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  step "waiting for the 1.4 B model"; wait
  step "prompt steps eager vs captured, 1.4 B"
  timeout 200 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-cost-mid.json" --shapes 1x128,4x128,16x32,16x128 \
    2>&1 | grep -v "Warning\|STAGE\|USDT" | tail -6
  ;;
ap)
  run_test_cuda
  step "HTTP vs in process at Poisson 100 req/s, 4 client processes, bundled, 384 prompts"
  timeout 220 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --client-processes 4 \
    --request-rate 100 --num-prompts 384 --max-tokens 128 --draft-tokens 0 --no-plot --name bundled-http-poisson-4-clients \
    2>&1 | grep -v INFO | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -12
  ;;
aq)
  step "bundled K=0/2/3/auto, C=1/16, 96 prompts, 3 rounds"
  timeout 420 "${bench[@]}" --draft-tokens 0,2,3,auto --concurrency 1,16 --num-prompts 96 --max-tokens 128 --rounds 3 \
    --phases on --no-plot --name bundled-mtp-rounds-96 2>&1 | grep -v "prefill:" | tail -30
  ;;
ar)
  step "auto vs K=0 at 16 requests, host profile"
  timeout 240 python3 results/h200/scripts/auto_k0_profile.py engine/bundled/model "$OUT/auto-k0-profile.json" 2>&1 \
    | grep -v "Warning\|INFO" | tail -28
  ;;
as)
  run_test_cuda
  bash "$0" ar
  bash "$0" aq
  ;;
at)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step "ORT's replays inside an outer CUDA graph, bundled"
  timeout 120 python3 results/h200/scripts/outer_graph_probe.py "$OUT/outer-graph-probe.json" 2>&1 \
    | grep -v "Warning\|INFO" | tail -30
  step "waiting for the 1.4 B model"; wait
  step "prompt steps eager (first calls timed) vs captured, 1.4 B"
  timeout 200 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-cost-mid-first.json" --no-kernels \
    --shapes 1x128,4x128,2x256,8x64,16x32,1x100,1x101,3x100 2>&1 | grep -v "Warning\|STAGE\|USDT" | tail -9
  ;;
av)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  step "waiting for the 1.4 B model"; wait
  step "prompt steps' first calls over token counts, 1.4 B"
  shapes=$(python3 -c "print(','.join(f'1x{t}' for t in (8, 16, 24, 32, 48, 64, 96, 100, 101, 128, 160, 192, 256, 384, 512, 768, 1024)))")
  timeout 150 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-first-calls-mid.json" --no-kernels \
    --shapes "$shapes,2x64,4x32,3x100,5x61,7x73,16x32" 2>&1 | grep -v "Warning\|STAGE\|USDT" \
    | python3 -c "import json,sys; [print(r['batch'], r['prompt'], r['eager_first_ms'], r['eager_ms'], r['eager_exact_meta_first_ms'], r['eager_exact_meta_ms']) for r in map(json.loads, (l for l in sys.stdin if l.startswith('{')))]"
  step "the same first calls under ORT's profiler: which nodes pay"
  timeout 90 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-first-nodes-mid.json" --ort-profile \
    --shapes "1x8,1x100,1x101,1x128,4x128,2x256,3x100,1x512,1x1024" 2>&1 | grep "^{" | tee "$OUT/first-nodes.txt" | cut -c1-400
  step done
  ;;
ax)
  run_test_cuda
  for f in "" --freeze; do
    step "auto_ab.py, bundled, C=16, 128 requests, 12 rounds $f"
    timeout 120 python3 results/h200/scripts/auto_ab.py "$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')" \
      "$OUT/auto-ab-c16$f.json" --concurrency 16 --requests 128 --rounds 12 $f 2>&1 | grep "^round\|median" | cut -c1-420
  done
  step "auto_ab.py, bundled, C=1, 16 requests, 8 rounds, K=2 / 3 beside"
  timeout 150 python3 results/h200/scripts/auto_ab.py "$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')" \
    "$OUT/auto-ab-c1.json" --concurrency 1 --requests 16 --rounds 8 --fixed 2,3 2>&1 | grep "^round\|median" | cut -c1-600
  step done
  ;;
bc)          # test_cuda, then auto on the timed table at C=16 / 8 (~450 s)
  run_test_cuda
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  for c in 16 8; do
    step "auto_ab.py --table --bursts, bundled, C=$c, 128 requests, 8 rounds"
    timeout 140 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-table-c$c.json" --concurrency $c \
      --requests 128 --rounds 8 --table --bursts 2>&1 | grep "^auto table:\|^round\|median" | cut -c1-900
  done
  step done
  ;;
bd)          # C=1 with K=2 / 3 beside, then the bench's rounds with auto-timed (~300 s)
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  step "auto_ab.py --table --bursts, bundled, C=1, 16 requests, 5 rounds, K=2 / 3 beside"
  timeout 170 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-table-c1.json" --concurrency 1 \
    --requests 16 --rounds 5 --fixed 2,3 --table --bursts 2>&1 | grep "^auto table:\|^round\|median" | cut -c1-900
  step "bench K=0 / 3 / auto / auto-timed, C=1 / 16, 32 prompts, 2 rounds"
  timeout 150 "${bench[@]}" --draft-tokens 0,3,auto,auto-timed --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
    --rounds 2 --name bundled-auto-timed-rounds 2>&1 | grep -v "prefill:" | tail -16
  step done
  ;;
bf)          # bundled, interleaved: C=16 / 8 (K=0, fit, never, table), C=1 with K=2 / 3 (~420 s)
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  for c in 16 8; do
    step "auto_ab.py --table --interleave 64, bundled, C=$c, 128 requests, 5 rounds"
    timeout 130 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-corrected-c$c.json" --concurrency $c \
      --requests 128 --rounds 5 --table --interleave 64 2>&1 | tee "$OUT/auto-ab-corrected-c$c.txt" \
      | grep "^auto table:\|^round\|median\|device memory" | cut -c1-900
  done
  step "auto_ab.py --table --interleave 16, bundled, C=1, 16 requests, 4 rounds, K=2 / 3 beside"
  timeout 150 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-corrected-c1.json" --concurrency 1 \
    --requests 16 --rounds 4 --fixed 2,3 --no-never --table --interleave 16 2>&1 | tee "$OUT/auto-ab-corrected-c1.txt" \
    | grep "^auto table:\|^round\|median" | cut -c1-900
  step done
  ;;
bg)          # the 1.4 B model at synthetic 0.7, three engines a process, interleaved (~550 s)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "auto_ab.py --table --interleave 64, 1.4 B, synthetic 0.7, C=16, 64 requests, 3 rounds (K=0 / fit / table)"
  timeout 230 python3 results/h200/scripts/auto_ab.py $mid "$OUT/auto-ab-mid-0.7-c16.json" --concurrency 16 \
    --requests 64 --rounds 3 --table --no-never --interleave 64 --synthetic 0.7 --random-prompts 128 2>&1 \
    | tee "$OUT/auto-ab-mid-0.7-c16.txt" | grep "^auto table:\|^round\|median\|device memory" | cut -c1-900
  step "auto_ab.py --table --interleave 16, 1.4 B, synthetic 0.7, C=1, 6 requests, 3 rounds (K=0 / table / K=2)"
  timeout 200 python3 results/h200/scripts/auto_ab.py $mid "$OUT/auto-ab-mid-0.7-c1.json" --concurrency 1 \
    --requests 6 --rounds 3 --fixed 2 --table --no-never --no-fit --interleave 16 --synthetic 0.7 --random-prompts 128 \
    2>&1 | tee "$OUT/auto-ab-mid-0.7-c1.txt" | grep "^auto table:\|^round\|median\|device memory" | cut -c1-900
  step done
  ;;
bh)          # test_cuda, the 1.4 B model's graph memory by arena growth, bundled auto at C=16 (~460 s)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  run_test_cuda
  wait
  for v in "largest next-power" "largest same"; do     # growing next-power: session 18's 15.0 + 14.5 GiB
    set -- $v
    step "graph_memory_probe.py, 1.4 B, MTP auto, order $1, arena $2"
    timeout 110 python3 results/h200/scripts/graph_memory_probe.py $mid "$OUT/graph-memory-mid-$1-$2.json" \
      --order $1 --arena $2 2>&1 | grep -v "No registered plugin" | tail -3 | cut -c1-600
  done
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  step "auto_ab.py --interleave 64, bundled, C=16, 128 requests, 5 rounds (K=0 / auto / never drafts)"
  timeout 80 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-policy-c16.json" --concurrency 16 \
    --requests 128 --rounds 5 --interleave 64 --profile 2>&1 | tee "$OUT/auto-ab-policy-c16.txt" \
    | grep "^round\|median\|^profiled" | cut -c1-700
  step done
  ;;
bi)          # the 1.4 B model at 64- and 16-token KV blocks: kernel, capture memory, MTP on == off (~420 s; run it on
             # the machine bh left warm: its make_mid is then done, else it adds ~70 s to at most 460 s of timeouts)
  make_mid > "$OUT/make-mid.txt" 2>&1
  for b in 64 16; do
    step "the kernel ORT's PagedAttention picks for a 4 x 96 prompt step at $b-token blocks (ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1)"
    ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 timeout 60 python3 results/h200/scripts/prefill_cost.py $mid \
      "$OUT/kernel-info-b$b.json" --shapes 4x96 --no-kernels --block-size $b > "$OUT/kernel-info-b$b.txt" 2>&1
    grep -i -m 12 "attention\|flash\|efficient\|kernel" "$OUT/kernel-info-b$b.txt" | cut -c1-300
  done
  for b in 64 16; do
    step "block_size_probe.py, $b-token blocks: K=0 vs K=2 (greedy, graphs), C=8, 16 x 96-token prompts, 48 tokens"
    timeout 170 python3 results/h200/scripts/block_size_probe.py $mid "$OUT/block-size-b$b.json" --kv-block-size $b 2>&1 \
      | grep "^K=\|^block size" | cut -c1-700
  done
  step done
  ;;
bj)          # bi's sequel: the auto MTP engine's captures at 64-token blocks, eager prompt steps at 64 / 16 (~250 s)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "graph_memory_probe.py, 1.4 B, MTP auto, largest first, 64-token blocks (bh: the same at 16)"
  timeout 150 python3 results/h200/scripts/graph_memory_probe.py $mid "$OUT/graph-memory-mid-b64.json" \
    --kv-block-size 64 2>&1 | grep -v "No registered plugin" | tail -3 | cut -c1-600
  step "prefill_cost.py, eager prompt steps 1x128 / 16x128 at 64- and 16-token blocks"
  for b in 64 16; do
    timeout 90 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-cost-b$b.json" \
      --shapes 1x128,16x128 --no-kernels --block-size $b 2>&1 | tail -4 | cut -c1-400
  done
  step done
  ;;
bk)          # the bundled model (head size 64) at 256-token blocks, where flash reads its verifies in place, vs 16 (~420 s)
  for b in 256 16; do
    step "bundled K=0/2/3/auto, C=1/16, 3 rounds, --kv-block-size $b"
    timeout 200 "${bench[@]}" --draft-tokens 0,2,3,auto --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
      --rounds 3 --kv-block-size $b --name bundled-mtp-rounds-b$b 2>&1 | grep -v "prefill:" | tail -14
  done
  step done
  ;;
bl)          # host time a step, before / after session 20's host-path change, alternated (~300 s)
  # the base tree: this checkout's engine with host-ab-base.patch (git diff a498f6a -- engine) taken back
  rm -rf /tmp/base && mkdir -p /tmp/base/mtpserve && cp -r engine actors cluster /tmp/base/mtpserve/
  touch /tmp/base/mtpserve/__init__.py     # a package of its own: else /tmp/pkg's (a package, above) wins
  (cd /tmp/base/mtpserve && { patch -s -R -p1 < "$OLDPWD/results/h200/scripts/host-ab-base.patch" 2>/dev/null \
    || git apply -R -p1 "$OLDPWD/results/h200/scripts/host-ab-base.patch"; }) || { echo "patch failed"; exit 1; }
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  for r in 1 2; do
    for tree in base new; do
      step "auto_ab.py --no-fit --interleave 64, bundled, C=16, 128 requests, 3 rounds, the $tree tree ($r)"
      pp=$PYTHONPATH; [[ $tree == base ]] && pp=/tmp/base:$PYTHONPATH
      PYTHONPATH=$pp timeout 70 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/host-ab-$tree-$r.json" \
        --concurrency 16 --requests 128 --rounds 3 --interleave 64 --no-fit 2>&1 | grep "^round\|median" | cut -c1-500
    done
  done
  step done
  ;;
bm)          # why MTP on parted from off at 256-token blocks (~250 s)
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  step "flash_tie_probe.py, bundled, 256- and 16-token blocks, K=0 vs K=2 with logprobs"
  timeout 300 python3 results/h200/scripts/flash_tie_probe.py $bundled "$OUT/flash-tie.json" 2>&1 \
    | grep -v "No registered plugin" | tail -40 | cut -c1-600
  step "the kernel each eager PagedAttention call picks at 256-token blocks, K=2 (counted)"
  ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1 timeout 120 python3 -c "
import sys; sys.path.insert(0, 'results/h200/scripts')
import flash_tie_probe as f
f.run(f.engine_on('$bundled', 'cuda', 2, budget=48, block_size=256, cuda_graphs=False), None)
" > "$OUT/kernel-info-b256.txt" 2>&1
  grep -v "^\s*$" "$OUT/kernel-info-b256.txt" | sed 's/[0-9]\+/N/g' | sort | uniq -c | sort -rn | head -30 | cut -c1-300
  step done
  ;;
bn)          # the near-tie tests, then bundled at 256 vs 16 (~330 s)
  step "test_cuda: greedy MTP on == off up to near-ties (16- and 256-token blocks)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py -s \
    -k "greedy_mtp_on_equals or flash_reads_in_place" 2>&1 | grep -v Warning \
    | grep "part\|passed\|failed\|Error\|assert" | tail -16 | cut -c1-700 | tee "$OUT/test-cuda-near-ties.txt"
  for b in 256 16; do
    step "bundled K=0/2/auto, C=1/16, 2 rounds, --kv-block-size $b"
    timeout 90 "${bench[@]}" --draft-tokens 0,2,auto --concurrency 1,16 --num-prompts 32 --max-tokens 128 \
      --rounds 2 --kv-block-size $b --name bundled-mtp-rounds-b$b 2>&1 | grep -v "prefill:" | tail -10
  done
  step done
  ;;
bo)          # bundled auto vs K=0 and never drafting, interleaved, C=16 / 8 (~200 s)
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  for c in 16 8; do
    step "auto_ab.py --interleave 64, bundled, C=$c, 128 requests, 3 rounds (K=0 / auto / never drafts)"
    timeout 95 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-c$c.json" --concurrency $c \
      --requests 128 --rounds 3 --interleave 64 2>&1 | grep "^round\|median" | cut -c1-500
  done
  step done
  ;;
bp)          # every step of auto / never drafting / K=0, bundled C=16, interleaved, with waves and without (~240 s)
  step_trace_c16 0 120
  step_trace_c16 0.5 120
  step done
  ;;
bq)          # bo and the bench's rounds on a workload without waves: output lengths from 128 x [0.5, 1.5] (~330 s)
  auto_ab_without_waves 16 95
  auto_ab_without_waves 8 95
  step "bench K=0/2/auto, C=1/16, 64 prompts, 3 rounds, --range-ratio 0.5"
  timeout 130 "${bench[@]}" --draft-tokens 0,2,auto --concurrency 1,16 --num-prompts 64 --max-tokens 128 \
    --range-ratio 0.5 --rounds 3 --name bundled-mtp-rounds-r0.5 2>&1 | grep -v "prefill:" | tail -12
  step done
  ;;
bs)          # bp, then bq's auto_ab.py at C=16 only (~330 s)
  step_trace_c16 0 120
  step_trace_c16 0.5 120
  auto_ab_without_waves 16 95
  step done
  ;;
bt)          # the trace with waves, then auto_ab.py at C=16 without (~200 s)
  step_trace_c16 0 105
  auto_ab_without_waves 16 85
  step done
  ;;
bv)          # step costs at this code, then bt (~420 s)
  step step costs, bundled, B=1 / 16, K=2 at synthetic 0.8
  timeout 200 python3 results/h200/scripts/step_costs.py engine/bundled/model "$OUT/step-costs-bundled.json" \
    --batches 1,16 2>&1 | grep -v "Warning\|No registered plugin" | tee "$OUT/step-costs-bundled.txt" | head -24
  step_trace_c16 0 105
  auto_ab_without_waves 16 85
  step done
  ;;
bw)          # NVRTC builds on live steps, then bq's C=8 and bench rounds without waves (~400 s)
  step "live_compiles.py, bundled, fresh kernel cache"
  ( fresh_cupy; timeout 180 python3 results/h200/scripts/live_compiles.py engine/bundled/model "$OUT/live-compiles.json" \
    2>&1 | grep -v "Warning\|No registered plugin" | tee "$OUT/live-compiles.txt" | head -80 )
  auto_ab_without_waves 8 95
  step "bench K=0/2/auto, C=1/16, 64 prompts, 3 rounds, --range-ratio 0.5"
  timeout 130 "${bench[@]}" --draft-tokens 0,2,auto --concurrency 1,16 --num-prompts 64 --max-tokens 128 \
    --range-ratio 0.5 --rounds 3 --name bundled-mtp-rounds-r0.5 2>&1 | grep -v "prefill:" | tail -12
  step done
  ;;
bx)          # test_cuda, then (if live steps built kernels) which ones (~220-370 s)
  step test_cuda
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning | tail -12 \
    | tee "$OUT/test-cuda.txt"
  if grep -q "FAILED.*build_no_kernel" "$OUT/test-cuda.txt"; then    # which builds, called from where
    step "live_compiles.py, bundled, fresh kernel cache"
    ( fresh_cupy; timeout 150 python3 results/h200/scripts/live_compiles.py engine/bundled/model "$OUT/live-compiles.json" \
      2>&1 | grep -v "Warning\|No registered plugin" | tee "$OUT/live-compiles.txt" | head -60 )
  fi
  step done
  ;;
bxl)         # what changed, from test_cuda (~150 s)
  step "test_cuda: live builds, concat_rows, commit replay, MTP on == off, prefix hits"
  timeout "${BXL_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    -k "live_steps or concat_rows or commit_replay or greedy_mtp_on or prefix_cache_hits or after_a_decode" 2>&1 \
    | grep -v Warning \
    | tail -12 | tee "$OUT/test-cuda-changed.txt"
  step done
  ;;
bz)          # the trace without waves, K=2 (and draft_after_decode) beside the others (~200 s)
  step "step_trace.py, bundled, C=16, 128 requests, 2 rounds, --range-ratio 0.5 --fixed 2"
  timeout 220 python3 results/h200/scripts/step_trace.py engine/bundled/model "$OUT/step-trace-c16-r0.5-k2.json" \
    --concurrency 16 --requests 128 --rounds 2 --range-ratio 0.5 --fixed 2 --after-decode 2>&1 \
    | grep -v "No registered plugin\|Warning" | grep -v "^     {" | cut -c1-600
  step done
  ;;
by)          # bq's C=8 and the bench's rounds without waves (~230 s)
  auto_ab_without_waves 8 95
  step "bench K=0/2/auto, C=1/16, 64 prompts, 3 rounds, --range-ratio 0.5"
  timeout 130 "${bench[@]}" --draft-tokens 0,2,auto --concurrency 1,16 --num-prompts 64 --max-tokens 128 \
    --range-ratio 0.5 --rounds 3 --name bundled-mtp-rounds-r0.5 2>&1 | grep -v "prefill:" | tail -12
  step done
  ;;
cc)          # after the copy_columns / sampler warm-up fixes: the changed tests, then bz's trace (~360 s)
  step "test_cuda: live builds, copy_columns, concat_rows, draft after decode, sampled, MTP on == off"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    -k "live_steps or copy_columns or concat_rows or after_a_decode or sampl or greedy_mtp_on" 2>&1 | grep -v Warning \
    > "$OUT/test-cuda-changed.txt"
  grep -E "^E  |draft after decode|LIVE|passed|failed" "$OUT/test-cuda-changed.txt" | cut -c1-500 | tail -30
  if grep -q "FAILED.*build_no_kernel" "$OUT/test-cuda-changed.txt"; then
    step "live_compiles.py, bundled, fresh kernel cache"
    ( fresh_cupy; timeout 150 python3 results/h200/scripts/live_compiles.py engine/bundled/model "$OUT/live-compiles.json" \
      2>&1 | grep -v "Warning\|No registered plugin" | tee "$OUT/live-compiles.txt" | grep -E "BUILD|builds" | head -30 )
  fi
  step "step_trace.py, bundled, C=16, 128 requests, 2 rounds, --range-ratio 0.5 --fixed 2 --after-decode"
  timeout 220 python3 results/h200/scripts/step_trace.py engine/bundled/model "$OUT/step-trace-c16-r0.5-k2.json" \
    --concurrency 16 --requests 128 --rounds 2 --range-ratio 0.5 --fixed 2 --after-decode 2>&1 \
    | grep -v "No registered plugin\|Warning" | grep -v "^     {" | cut -c1-600 | tee "$OUT/step-trace.txt" | tail -60
  step done
  ;;
cd)          # cc when device time is short: the changed tests, then the trace's one round (~250 s)
  step "test_cuda: live builds, copy_columns, stack_segments, draft after decode"
  timeout 150 python3 -m pytest -q -rP -p no:cacheprovider tests/engine/test_cuda.py \
    -k "live_steps or copy_columns or stack_segments or after_a_decode" 2>&1 | grep -v Warning > "$OUT/test-cuda-changed.txt"
  grep -E "^E  |draft after decode|LIVE|passed|failed" "$OUT/test-cuda-changed.txt" | cut -c1-500 | tail -30
  step "step_trace.py, bundled, C=16, 128 requests, 1 round, --range-ratio 0.5: K=0, K=2, K=2 after decode"
  timeout "${CD_TRACE_TIMEOUT:-150}" python3 results/h200/scripts/step_trace.py engine/bundled/model \
    "$OUT/step-trace-c16-r0.5-k2.json" --concurrency 16 --requests 128 --rounds 1 --range-ratio 0.5 --fixed 2 \
    --after-decode --only "K=0,K=2,K=2 after decode" 2>&1 | grep -v "No registered plugin\|Warning" | grep -v "^     {" | cut -c1-600 \
    | tee "$OUT/step-trace.txt" | tail -60
  step done
  ;;
cf)          # session 25's device-path changes: the whole test_cuda, then the bundled model's step costs (~350 s)
  step test_cuda
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  step "step_costs.py, bundled, B=1 / 16: each graph's GPU time alone, the commit's, K=2's ceiling at zero host time"
  timeout 180 python3 results/h200/scripts/step_costs.py engine/bundled/model "$OUT/step-costs-bundled.json" \
    --batches 1,16 2>&1 | grep -v Warning | tee "$OUT/step-costs-bundled.txt" | head -40
  step done
  ;;
cg)          # then: where a K=2 step's time goes (ce), and auto vs K=0 at C=16 without waves (bu) (~220 s)
  bash "$0" ce
  auto_ab_without_waves 16 85
  step done
  ;;
cj)          # can our own CUDA graph record ORT's eager run (a whole step in one launch)? (eager_capture_probe.py, ~60 s)
  step "eager_capture_probe.py, bundled, K=2 engine: ORT's eager decode run (and the head's) captured by CuPy"
  timeout 150 python3 results/h200/scripts/eager_capture_probe.py "$OUT/eager-capture-probe.json" engine/bundled/model 2>&1 \
    | grep -v "Warning\|No registered" | tail -30 | cut -c1-600
  step done
  ;;
da)          # session 28: test_cuda at session 27's device-path defaults, then the 1.4 B model at synthetic 0.7 as shipped (~450 s)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  mid_synthetic_rounds 220 0.7
  step done
  ;;
dc)          # session 28: the 1.4 B model at synthetic 0.3 as shipped (after da, on the same machine: /tmp/mid) (~230 s)
  make_mid > "$OUT/make-mid.txt" 2>&1
  mid_synthetic_rounds 220 0.3
  step done
  ;;
db)          # session 28: the admission lookahead with waves (C=16, all 128 tokens) and without, then auto at C=1 (~480 s)
  step "auto_ab.py --fixed 2 --lookahead-ab 2,4 --range-ratio 0, bundled, C=16, 128 requests, 3 rounds"
  timeout 230 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r0-lookahead.json" \
    --concurrency 16 --requests 128 --rounds 3 --interleave 64 --range-ratio 0 --fixed 2 --no-never --lookahead-ab 2,4 \
    2>&1 | tee "$OUT/auto-ab-c16-r0-lookahead.txt" | grep "^round\|median\|Error" | cut -c1-3000
  step "auto_ab.py --fixed 2 --lookahead-ab 2 --range-ratio 0.5, bundled, C=16, 128 requests, 2 rounds"
  timeout 150 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r0.5-lookahead.json" \
    --concurrency 16 --requests 128 --rounds 2 --interleave 64 --range-ratio 0.5 --fixed 2 --no-never --lookahead-ab 2 \
    2>&1 | tee "$OUT/auto-ab-c16-r0.5-lookahead.txt" | grep "^round\|median\|Error" | cut -c1-2400
  step "auto_ab.py --fixed 2,3, bundled, C=1, 32 requests, 2 rounds (the shipped defaults)"
  timeout 90 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c1.json" \
    --concurrency 1 --requests 32 --rounds 2 --range-ratio 0 --fixed 2,3 --no-never \
    2>&1 | tee "$OUT/auto-ab-c1.txt" | grep "^round\|median\|Error" | cut -c1-2400
  step done
  ;;
dd)          # session 28: where a K=2 step's host time goes at C=16 (cProfile: own time and the engine's cumulative) (~60 s)
  step "auto_ab.py --fixed 2 --no-fit --profile --range-ratio 0.5, bundled, C=16, 128 requests, 1 round"
  timeout 150 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r0.5-k2-profile.json" \
    --concurrency 16 --requests 128 --rounds 1 --interleave 64 --range-ratio 0.5 --fixed 2 --no-never --no-fit --profile \
    2>&1 | grep -v "Warning\|No registered" > "$OUT/auto-ab-c16-r0.5-k2-profile.txt"
  grep "^round\|^profiled" "$OUT/auto-ab-c16-r0.5-k2-profile.txt" | cut -c1-600
  step done
  ;;
de)          # session 28: test_cuda after land_prompts_first, then its A/B on the bundled model at C=1 (~360 s)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  step "auto_ab.py --fixed 2 --land-ab, bundled, C=1, 32 requests, 2 rounds"
  timeout 150 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c1-land.json" \
    --concurrency 1 --requests 32 --rounds 2 --range-ratio 0 --fixed 2 --no-never --land-ab \
    2>&1 | tee "$OUT/auto-ab-c1-land.txt" | grep "^round\|median\|Error" | cut -c1-3000
  step waiting for the 1.4 B model; wait
  step done
  ;;
df)          # session 28: land_prompts_first A/B, the 1.4 B model at synthetic 0.7 at C=1, then bundled C=16 (~300 s)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "auto_ab.py --fixed 2 --no-fit --land-ab --synthetic 0.7 --random-prompts 128, 1.4 B, C=1, 16 requests, 2 rounds"
  timeout 200 python3 results/h200/scripts/auto_ab.py $mid "$OUT/auto-ab-mid-c1-land.json" \
    --concurrency 1 --requests 16 --rounds 2 --range-ratio 0 --fixed 2 --no-never --no-fit --land-ab --synthetic 0.7 \
    --random-prompts 128 2>&1 | tee "$OUT/auto-ab-mid-c1-land.txt" | grep "^round\|median\|Error" | cut -c1-3000
  step "auto_ab.py --fixed 2 --land-ab --range-ratio 0.5, bundled, C=16, 96 requests, 2 rounds"
  timeout 150 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r0.5-land.json" \
    --concurrency 16 --requests 96 --rounds 2 --interleave 64 --range-ratio 0.5 --fixed 2 --no-never --land-ab \
    2>&1 | tee "$OUT/auto-ab-c16-r0.5-land.txt" | grep "^round\|median\|Error" | cut -c1-3000
  step done
  ;;
dg)          # session 28, last: test_cuda's pipeline tests after the dead-continuation rule, then bundled C=1 / 16 waves as shipped (~200 s)
  step "test_cuda -k overlapped, after_a_decode, mtp_on_equals, graph_steps"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
    -k "overlapped or after_a_decode or mtp_on_equals or graph_steps" 2>&1 | grep -v Warning > "$OUT/test-cuda-pipeline.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda-pipeline.txt" | cut -c1-400 | tail -20
  step "auto_ab.py --fixed 2, bundled, C=1, 24 requests, 1 round (shipped: land_prompts_first, no dead continuations)"
  timeout 60 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c1-shipped.json" \
    --concurrency 1 --requests 24 --rounds 1 --range-ratio 0 --fixed 2 --no-never \
    2>&1 | tee "$OUT/auto-ab-c1-shipped.txt" | grep "^round\|median\|Error" | cut -c1-3000
  step done
  ;;
eh)          # session 31: the bench (K=0 / K=2 / auto, C=16, 512 prompts: as many slots and rows as clients) at the session's start (.base/ = ddb3896) and this head, ${2:-2} rounds alternating (~60 s a round)
  base_pkg
  for round in $(seq "${2:-2}"); do
    for label in base new; do
      step "bench $label, round $round"
      pkg=/tmp/pkg; [[ $label == base ]] && pkg=/tmp/pkg_base
      mkdir -p "$OUT/bench-$label-$round"
      PYTHONPATH=$pkg:${PYTHONPATH#/tmp/pkg:} timeout 100 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/bench-$label-$round" --draft-tokens 0,2,auto \
        --concurrency 16 --num-prompts 512 --max-tokens 128 2>&1 | grep -E "speedup_vs_k0|^mtpserve (K=.|auto) +C=16 |prompt steps|Error" | cut -c1-200
    done
  done
  ;;
eu)          # session 34, first: the whole test_cuda (session 33 changed the device path: the graphs' staging blocks and capture loop, graph ids by set, and the new prompt graphs, none of it run on a GPU), then et (~270 s); then ev
  bash "$0" cl
  bash "$0" et
  ;;
ev)          # session 34, second: host_ab with eager prompt steps against captured ones (--prompt-graphs) in the bench's pools, 3 rounds: tokens/s, prompt steps' share, TTFT p50 (~330 s)
  host_ab_extra=(--resident 16)
  switch_ab_rounds 3 eager "graphs:--prompt-graphs"
  step done
  ;;
ew)          # session 34, fourth (if eu's start-up check passed): the 1.4 B model against og.Engine with captured prompt steps, K=0, C=1/8/32/64, fresh kernel cache: the issue's tokens/s and TTFT p99 goals (~400 s with the model's making)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "1.4 B vs og.Engine, --prompt-graphs on, fresh kernel cache"
  (fresh_cupy; timeout 420 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts ${EW_PROMPTS:-48} \
    --concurrency 1,8,32,64 --draft-tokens 0 --prompt-graphs ${EW_PROMPT_GRAPHS:-on} --compare ortgenai --name mid-prompt-graphs-${EW_PROMPT_GRAPHS:-on}-vs-ortgenai) 2>&1 \
    | grep -v "prefill:\|Warning\|No registered" | tail -40 | cut -c1-400
  python3 -c "import glob, json; d = json.load(open(sorted(glob.glob('$OUT/*mid-prompt-graphs-${EW_PROMPT_GRAPHS:-on}-vs-ortgenai.json'))[-1])); \
[print(r['label'], r['concurrency'], 'prompt steps', r['extra'].get('prompt_steps'), 'replayed', r['extra'].get('prompt_graph_steps'), r['extra'].get('engine', {}).get('graphs'), \
'off:', r['extra'].get('prompt_graphs_off')) for r in d['results'] if 'extra' in r]" 2>&1 | tail -8
  step done
  ;;
ey)          # session 35, after ew (run as separate calls that session): the bundled K=0 / K=2 at C=1 with captured prompt steps, 3 rounds; C=16 K=0 / 2 with --phases on; er's C=16 half alone (~190 s)
  step "bench C=1, K=0 / 2, 3 rounds, --prompt-graphs on"
  mkdir -p "$OUT/c1"
  timeout 230 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/c1" --draft-tokens 0,2 --concurrency 1 \
    --num-prompts 48 --max-tokens 128 --rounds 3 --prompt-graphs on 2>&1 | grep -E "speedup_vs_k0|^round|median|Error|K=. +C=1 " | cut -c1-220
  step "bench C=16, K=0 / 2, --prompt-graphs on --phases on"
  mkdir -p "$OUT/ph"
  timeout 170 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/ph" --draft-tokens 0,2 --concurrency 16 \
    --num-prompts 512 --max-tokens 128 --prompt-graphs on --phases on 2>&1 | grep -v "Warning\|No registered" | tail -45 | cut -c1-250
  step "step_capture_probe.py --phases, C=16 (16 requests of 256 tokens)"
  timeout 140 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-capture-phases-c16.json" engine/bundled/model --phases 2>&1 \
    | grep -v "Warning\|No registered" | tail -40 | cut -c1-900
  step done
  ;;
fi)          # session 39, first: test_cuda's new tests (the head's catch-up queued behind a prompt step, with and without captured prompt steps; recorded draft steps with arrivals and for a steady batch), then the 1.4 B model's start-up with the bounded prompt catalog (512 rows, 65536 slot-tokens: session 38 measured 16.9 GiB with rows alone bounded) (~400 s)
  step "test_cuda: early head catch-up, recorded draft steps"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_cuda.py -k "catch_up_queued or recorded_draft_steps or steady_batch" 2>&1 \
    | grep -v Warning | grep "early=\|step recordings\|passed\|failed\|Error\|assert" | tail -16 | cut -c1-700 | tee "$OUT/test-cuda-early.txt"
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "startup_cost.py, 1.4 B, prompt graphs on (bounded: 512 rows, 65536 slot-tokens), off"
  timeout 120 python3 results/h200/scripts/startup_cost.py "$OUT/startup-cost-mid-bounded.json" $mid --also-off 2>&1 \
    | grep -v "Warning\|No registered" | tail -4 | cut -c1-900
  step done
  ;;
fp)          # session 40: the admission hold against shorter ones and a smaller group now that an arrival need not stop the draft pipeline (prompt continuations, on by default), K=2 C=16 in turns (~150 s)
  step "switch_ab.py: defaults (hold 8 steps, group 0.25) / aa / hold0 / hold2 / group125, K=2 C=16, lengths 64-192, 3 rounds"
  timeout 240 python3 results/h200/scripts/switch_ab.py engine/bundled/model "$OUT/switch-ab-fp.json" \
    --variant aa: --variant hold0:scheduler.admission_hold_steps=0 --variant hold2:scheduler.admission_hold_steps=2 \
    --variant group125:scheduler.admission_group=0.125 --configs 2:16:1024 --rounds 3 --range-ratio 0.5 2>&1 \
    | grep -v "Warning\|No registered" | tail -8 | cut -c1-600
  step done
  ;;
fo)          # session 40: step recordings (a steady draft step launched as one graph of ours; off by default) against the defaults, in turns, at C=16 and C=1, with an identical engine and K=0 beside them (~230 s)
  step "switch_ab.py: defaults (prompt graphs, continuations, early catch-up) / aa / rec (--step-recordings) / k0, K=2 C=16 and C=1, lengths 64-192, 3 rounds"
  timeout 300 python3 results/h200/scripts/switch_ab.py engine/bundled/model "$OUT/switch-ab-fo.json" \
    --variant aa: --variant rec:--step-recordings --variant k0:K=0 --configs 2:16:1024,2:1:96 --rounds 3 --range-ratio 0.5 2>&1 \
    | grep -v "Warning\|No registered" | tail -10 | cut -c1-600
  step done
  ;;
fh1|fh2)     # session 42: test_cuda in two halves (odd / even collected tests), each with its slowest tests: the whole file took 505 s on session 42's H100, near a call's 600 s
  half=${part#fh}
  step "test_cuda, half $half of the collected tests, slowest 25"
  python3 -m pytest -q --collect-only -p no:cacheprovider tests/engine/test_cuda.py 2>/dev/null | grep '::' \
    | awk -v h="$half" 'NR % 2 == h % 2' > /tmp/test-cuda-half.txt
  echo "$(wc -l < /tmp/test-cuda-half.txt) tests"
  tr '\n' '\0' < /tmp/test-cuda-half.txt | timeout 560 xargs -0 python3 -m pytest -q -p no:cacheprovider -rfE --durations=25 2>&1 \
    | grep -v Warning | tail -45 | cut -c1-600 | tee "$OUT/test-cuda-$part.txt"
  step done
  ;;
fw)          # session 42: fr without its tests (session 42 ran the whole test_cuda): the bench at C=16 (its flagged steps' calls) and C=1 (recordings on), then host-staged recordings and admission holds in turns (~300 s)
  recordings_bench_and_turns fw
  step done
  ;;
fu)          # session 41: the whole test_cuda at this head (step recordings on by default; 51 tests, ~420 s on an H200: session 41's fm was cut at 420 s)
  step "test_cuda, the whole file"
  timeout 570 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning | tail -12 | cut -c1-600 \
    | tee "$OUT/test-cuda-fu.txt"
  step done
  ;;
fs)          # session 41: why the bench's K=2 steps at C=16 took 1.4-1.6 ms (p50) with lengths 64-192 against 0.81-0.91 with one length, and 0.86 in switch_ab's turns with lengths 64-192 (whose engines have 64 state rows and a large KV pool, the bench's 16 and a pool sized to them): the bench with lengths 64-192 at its pools, with a 4,096-block pool, and at 64 rows, per-phase step times on (~200 s)
  for pools in "16" "16 --num-blocks 4096" "64"; do       # (the bench's KV pool is sized to its rows, switch_ab's is the default: rows or pool?)
    step "bench C=16, K=2, lengths 64-192, 512 prompts, state rows $pools, --phases on"
    timeout 70 "${bench[@]}" --draft-tokens 2 --concurrency 16 --num-prompts 512 --max-tokens 128 --range-ratio 0.5 \
      --max-resident-requests $pools --phases on --name "c16-range-rows${pools// /}" 2>&1 | grep -v "Warning\|No registered" \
      | grep "mtpserve K=2\|flag" | tail -3 | cut -c1-300
  done
  step "bench C=16, K=2, one length (128), 512 prompts, --phases on"
  timeout 70 "${bench[@]}" --draft-tokens 2 --concurrency 16 --num-prompts 512 --max-tokens 128 --phases on --name c16-waves \
    2>&1 | grep -v "Warning\|No registered" | grep "mtpserve K=2\|flag" | tail -3 | cut -c1-300
  step done
  ;;
fr)          # session 41: step recordings on by default (CUDA graphs, MTP): test_cuda's defaults and recordings tests under it, then the bench at C=16 (its flagged steps' calls) and C=1 (recordings on), then host-staged recordings and fp's admission holds in turns, 2 rounds (~450 s)
  step "test_cuda: the defaults (recordings on), recordings beside captured prompt steps, recorded steps"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_cuda.py -k "defaults or recordings or recorded" 2>&1 \
    | grep -v Warning | grep "recordings\|continuations\|passed\|failed\|Error\|assert" | tail -20 | cut -c1-700 | tee "$OUT/test-cuda-fr.txt"
  recordings_bench_and_turns fr
  step done
  ;;
fm)          # session 40: the defaults as of session 40 (captured prompt steps on with CUDA graphs; prompt continuations and the early catch-up on with CUDA): the whole test_cuda under them, then the bench at C=1 with K=0 / 2 in 3 interleaved rounds, then step_timeline.py at C=1 profiled (~560 s)
  step "test_cuda, the whole file, session 40's defaults"
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning | tail -8 | cut -c1-600 \
    | tee "$OUT/test-cuda-fm.txt"
  step "bench C=1, K=0 / 2, 64 prompts, 3 interleaved rounds"
  timeout 150 "${bench[@]}" --draft-tokens 0,2 --concurrency 1 --num-prompts 64 --max-tokens 128 --rounds 3 --name c1-rounds 2>&1 \
    | grep -v "Warning\|No registered" | tail -6 | cut -c1-300
  step "step_timeline.py K=0 / 2, C=1, 64 requests, captured prompt steps, --profile: where a steady step's host time goes at C=1 (the 1.8x goal's lever)"
  timeout 100 python3 results/h200/scripts/step_timeline.py engine/bundled/model "$OUT/timeline-c1.json" --fixed 0,2 --concurrency 1 \
    --requests 64 --prompt-graphs --profile "$OUT/profile-c1" 2>&1 | grep -v "Warning\|No registered" | cut -c1-600 | tail -10
  step done
  ;;
fn)          # session 40: the bench at C=16 with K=0 / 2 in 5 interleaved rounds (the engines built once; K=2 is host-bound, so back-to-back runs follow the host's drift), then fo and fp (~540 s)
  step "bench C=16, K=0 / 2, 512 prompts, 5 interleaved rounds"
  timeout 170 "${bench[@]}" --draft-tokens 0,2 --concurrency 16 --num-prompts 512 --max-tokens 128 --rounds 5 --name c16-rounds 2>&1 \
    | grep -v "Warning\|No registered" | tail -8 | cut -c1-300
  bash "$root/results/h200/scripts/session.sh" fo
  bash "$root/results/h200/scripts/session.sh" fp
  ;;
fq)          # session 40: the 1.4 B model against og.Engine with the default captured prompt steps, K=0, C=1/8/32/64, fresh kernel cache (~480 s with the model's making)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "1.4 B vs og.Engine, K=0, the default prompt steps (captured), fresh kernel cache"
  (fresh_cupy; timeout 420 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 48 \
    --concurrency 1,8,32,64 --draft-tokens 0 --compare ortgenai --name mid-defaults-vs-ortgenai) 2>&1 \
    | grep -v "prefill:\|Warning\|No registered" | tail -16 | cut -c1-300
  step done
  ;;
fl)          # session 39: prompt steps launched as a draft step's continuation (new, off by default): test_cuda's new test with the other new ones (early catch-up, recordings), then switch_ab.py at C=16 with lengths 64-192 (base: captured prompt steps; aa; early catch-up; prompt continuations with it; a larger admission group; K=0 beside them, for the issue's ratio in the same turns), 3 rounds; then the 1.4 B model's start-up with the bounded prompt catalog (~520 s)
  step "test_cuda: prompt continuations, early head catch-up, recorded draft steps"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_cuda.py -k "launched_behind or catch_up_queued" 2>&1 \
    | grep -v Warning | grep "continuations\|early=\|step recordings\|passed\|failed\|Error\|assert" | tail -20 | cut -c1-700 | tee "$OUT/test-cuda-fl.txt"
  step "switch_ab.py: base (prompt graphs) / aa / early / pc (+ prompt_continuations, early) / group50 / k0 (K=0), K=2 C=16, lengths 64-192, 3 rounds"
  timeout 260 python3 results/h200/scripts/switch_ab.py engine/bundled/model "$OUT/switch-ab-fl.json" --base=--prompt-graphs \
    --variant aa: --variant early:early_head_catch_up=1 --variant pc:prompt_continuations=1,early_head_catch_up=1 \
    --variant group50:scheduler.admission_group=0.5 --variant k0:K=0 --configs 2:16:1024 --rounds 3 --range-ratio 0.5 2>&1 \
    | grep -v "Warning\|No registered" | tail -8 | cut -c1-600
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "startup_cost.py, 1.4 B, prompt graphs on (bounded: 512 rows, 65536 slot-tokens), off"
  timeout 100 python3 results/h200/scripts/startup_cost.py "$OUT/startup-cost-mid-bounded.json" $mid --also-off 2>&1 \
    | grep -v "Warning\|No registered" | tail -4 | cut -c1-900
  step done
  ;;
fk)          # session 39: early_head_catch_up against without, with captured prompt steps, in one process with the engines taking turns (switch_ab.py: host_ab's alternating processes spread 0.72-1.36x on session 38's host), an identical engine beside them as the noise floor, and admission holds that gather more arrivals a prompt step (group 0.5 of the decoding requests, or 16 steps' hold), 3 rounds, K=2 at C=16, output lengths 64-192 (arrivals spread, as the bench's); early catch-up again at C=1 (~350 s)
  step "switch_ab.py: base (prompt graphs) / aa (the same) / early (+ early_head_catch_up) / group50 / hold16, K=2 C=16, 3 rounds"
  timeout 330 python3 results/h200/scripts/switch_ab.py engine/bundled/model "$OUT/switch-ab-early.json" --base=--prompt-graphs \
    --variant aa: --variant early:early_head_catch_up=1 --variant group50:scheduler.admission_group=0.5 \
    --variant hold16:scheduler.admission_hold_steps=16 --configs 2:16:1024 --rounds 3 --range-ratio 0.5 2>&1 \
    | grep -v "Warning\|No registered" | tail -8 | cut -c1-500
  step "switch_ab.py: base (prompt graphs) / aa / early, K=2 C=1, 3 rounds"
  timeout 150 python3 results/h200/scripts/switch_ab.py engine/bundled/model "$OUT/switch-ab-early-c1.json" --base=--prompt-graphs \
    --variant aa: --variant early:early_head_catch_up=1 --configs 2:1:96 --rounds 3 --range-ratio 0.5 2>&1 \
    | grep -v "Warning\|No registered" | tail -6 | cut -c1-400
  step done
  ;;
fj)          # session 39: where the arrival steps go with the engine's defaults (draft after decode on; session 38's timeline had it off) and captured prompt steps, without and with early_head_catch_up, and with prompt continuations: step_timeline.py K=2 C=16 with --profile, then the bench at C=16 K=0 / 2 with --prompt-graphs on (~300 s)
  for sets in "early_head_catch_up=0" "early_head_catch_up=1" "early_head_catch_up=1 prompt_continuations=1"; do
    tag=$(echo "$sets" | tr ' =' '-_')
    step "step_timeline.py K=2, C=16, 256 requests, --prompt-graphs, $sets, --profile"
    timeout 120 python3 results/h200/scripts/step_timeline.py engine/bundled/model "$OUT/timeline-pg-$tag.json" --fixed 2 \
      --requests 256 --prompt-graphs $(printf -- '--set %s ' $sets) --profile "$OUT/profile-pg-$tag" 2>&1 \
      | grep -v "Warning\|No registered" | cut -c1-900 | tail -8
  done
  step "bench C=16, K=0 / 2, --prompt-graphs on"
  mkdir -p "$OUT/bench"
  timeout 150 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/bench" --draft-tokens 0,2 --concurrency 16 \
    --num-prompts 512 --max-tokens 128 --prompt-graphs on 2>&1 | grep -v "Warning\|No registered" | tail -14 | cut -c1-300
  step done
  ;;
fh)          # session 38: captured prompt steps bounded at 512 rows (EngineConfig.prompt_graph_rows, new default): the 1.4 B model's start-up cost (session 37, unbounded: 484 shapes, 17,164 MiB, 41 s; 16,386 MiB of it at the first, largest capture), the bundled K=2 engine on / off; then on against off, host_ab 3 rounds alternating, K=2 / K=0 at C=16 (~330 s)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "startup_cost.py, 1.4 B, prompt graphs on (512 rows at most), off"
  timeout 150 python3 results/h200/scripts/startup_cost.py "$OUT/startup-cost-mid-512.json" $mid --also-off 2>&1 \
    | grep -v "Warning\|No registered" | tail -4 | cut -c1-900
  step "startup_cost.py, bundled, K=2, prompt graphs on (512 rows at most) then off"
  timeout 90 python3 results/h200/scripts/startup_cost.py "$OUT/startup-cost-bundled-k2-512.json" engine/bundled/model \
    --draft-tokens 2 --also-off 2>&1 | grep -v "Warning\|No registered" | tail -4 | cut -c1-900
  host_ab_extra=(--configs 2:16:1024,0:16:1024)
  switch_ab_rounds 3 off "pg:--prompt-graphs"
  step done
  ;;
fg)          # session 38: the recorded-steps test again (why draft steps are not steady: StepRecordings.skipped), step_timeline.py's after-prompt calls against steady ones with cProfile (K=0 / 2, C=16, captured prompt steps), then landing prompt steps first against launching their continuation behind them, with captured prompt steps (host_ab, 2 rounds, K=2 C=16 / C=1) (~300 s)
  step "test_cuda: recorded draft steps"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_cuda.py -k recorded_draft_steps 2>&1 \
    | grep -v Warning | grep "step recordings\|passed\|failed\|Error\|assert" | tail -12 | cut -c1-900 | tee "$OUT/test-cuda-recordings.txt"
  step "step_timeline.py K=0 / 2, C=16, 256 requests, lengths 64-192, --prompt-graphs --profile"
  timeout 200 python3 results/h200/scripts/step_timeline.py engine/bundled/model "$OUT/timeline-pg.json" --fixed 0,2 \
    --requests 256 --prompt-graphs --profile "$OUT/profile-pg" 2>&1 | grep -v "Warning\|No registered" | cut -c1-900 | tail -16
  for f in "$OUT"/profile-pg-K2-*.txt; do echo "== $f"; head -42 "$f" | cut -c1-160; done
  host_ab_extra=(--configs 2:16:1024,2:1:96)
  switch_ab_rounds 2 "land:--prompt-graphs" "behind:--prompt-graphs,land_prompts_first=0"
  step done
  ;;
ff)          # session 37's step recordings, first: test_cuda's recorded-steps test (K=2, 3: exact against launching call by call), then host_ab with --step-recordings against without, alternating in one checkout, K=2 at C=16 and C=1, 3 rounds (~330 s); then the whole test_cuda (cl: the launches of the draft path now go through engine/launches.py)
  step "test_cuda: recorded draft steps"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_cuda.py -k recorded_draft_steps 2>&1 \
    | grep -v Warning | grep "step recordings\|passed\|failed\|Error\|assert" | tail -12 | cut -c1-600 | tee "$OUT/test-cuda-recordings.txt"
  host_ab_extra=(--configs 2:16:1024,2:1:96)
  switch_ab_rounds 3 calls "recordings:--step-recordings"
  grep -o '"step_recordings": {[^}]*}' "$OUT/switch-ab.jsonl" | sort | uniq -c | head -8
  step done
  ;;
fe)          # session 37: which prompt shapes the 1.4 B model's 17 GiB of prompt graphs go to (startup_cost.py: each capture's MiB, totals by rows, KV bucket and batch), then the bundled model's K=2 engine the same (~200 s with the model's making)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "startup_cost.py, 1.4 B, prompt graphs on, by shape"
  timeout 150 python3 results/h200/scripts/startup_cost.py "$OUT/startup-cost-mid-by-shape.json" $mid 2>&1 \
    | grep -v "Warning\|No registered" | tail -6 | cut -c1-1500
  step "startup_cost.py, bundled, K=2, prompt graphs on then off"
  timeout 90 python3 results/h200/scripts/startup_cost.py "$OUT/startup-cost-bundled-k2.json" engine/bundled/model \
    --draft-tokens 2 --also-off 2>&1 | grep -v "Warning\|No registered" | tail -6 | cut -c1-1500
  step done
  ;;
fd)          # session 37: where the step after each prompt step goes (host_ab: ~1.8 ms at K=2 C=16 against K=0's 0.23, 30% of a K=2 round): the bench's C=16 K=0 / 2 with captured prompt steps, --phases on (after_prefill steps apart: launch, land, head catch-up and fills), then --phases sync (each phase owns its GPU work) (~300 s)
  for mode in on sync; do
    step "bench C=16, K=0 / 2, --prompt-graphs on --phases $mode"
    mkdir -p "$OUT/ph-$mode"
    timeout 170 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/ph-$mode" --draft-tokens 0,2 --concurrency 16 \
      --num-prompts 512 --max-tokens 128 --prompt-graphs on --phases $mode 2>&1 | grep -v "Warning\|No registered" | tail -45 | cut -c1-300
  done
  step done
  ;;
fc)          # session 36: can a recorded whole steady K=2 step be launched again for later steps (step_capture_probe.py --replay: each steady continuation recorded, its host side run for real; an earlier recording of the same key launched instead), C=16 then C=1: tokens against an engine that never recorded, integrity (~200 s)
  step "step_capture_probe.py --replay, C=16 (16 requests of 256 tokens)"
  timeout 200 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-replay-c16.json" engine/bundled/model --replay 2>&1 \
    | grep -v "Warning\|No registered" | tail -30 | cut -c1-900
  step "the same at C=1 (1 request of 512 tokens)"
  timeout 150 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-replay-c1.json" engine/bundled/model --replay \
    --requests 1 --tokens 512 2>&1 | grep -v "Warning\|No registered" | tail -30 | cut -c1-900
  step done
  ;;
fb)          # session 36: the C=16 floors on one machine: every captured graph's GPU time (K=0's decode and K=2's verify and head replays at B=1 and 16, step_costs.py), then er's C=16 half (a steady K=2 step's GPU time by part at the bench's KV lengths) (~250 s)
  step "step costs, bundled, B=1 / 16"
  timeout 200 python3 results/h200/scripts/step_costs.py engine/bundled/model "$OUT/step-costs-bundled.json" \
    --batches 1,16 --no-profile 2>&1 | grep -v Warning | tee "$OUT/step-costs-bundled.txt" | head -40
  step "step_capture_probe.py --phases, C=16 (16 requests of 256 tokens)"
  timeout 200 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-capture-phases-c16.json" engine/bundled/model --phases 2>&1 \
    | grep -v "Warning\|No registered" | tail -40 | cut -c1-900
  step done
  ;;
fa)          # session 36: the byte-level detokenizer (landing a step) against the one before it: .base/ = e038028 (`git archive e038028 engine | tar -x -C .base` less engine/bundled/model, carried) against this head, host_ab 3 rounds alternating, bundled K=2 / K=0 at C=16 and K=2 at C=1, waves, with the landing's host time (~330 s)
  host_ab_extra=(--land-times)
  host_ab_rounds 3
  step done
  ;;
ez)          # session 35's next, first: ev (host_ab, eager against captured prompt steps alternating in one checkout: is ex's 1.5x the prompt steps or the host), then et with its new timings (the varlen step's GPU time with a tight max_query_len, the engine's eager path) (~400 s); ez2 second (~450 s)
  bash "$0" ev
  bash "$0" et
  ;;
ez2)         # ez's second call: ew with 128 prompts, eager prompt steps then captured ones (the model made once)
  EW_PROMPTS=128 EW_PROMPT_GRAPHS=off bash "$0" ew
  EW_PROMPTS=128 EW_PROMPT_GRAPHS=on bash "$0" ew
  ;;
ex)          # session 34 (if eu's start-up check passed): el with captured prompt steps, then el as it was, on one machine: the issue's bundled K=2 / K=0 >= 1.3x at C=16 in the bench (~250 s)
  step "bench, 3 rounds interleaved, --prompt-graphs on"
  mkdir -p "$OUT/bench-rounds-prompt-graphs"
  timeout 300 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/bench-rounds-prompt-graphs" --draft-tokens 0,2,auto \
    --concurrency 16 --num-prompts 512 --max-tokens 128 --rounds 3 --prompt-graphs on 2>&1 \
    | grep -E "speedup_vs_k0|^round|median|Error|prompt steps are off" | cut -c1-200
  bash "$0" el
  ;;
es)          # session 34, first: er (where a K=2 step's GPU time goes, C=1 and C=16), then et (~250 s)
  bash "$0" er
  bash "$0" et
  ;;
et)          # session 33's probe: can ORT capture a varlen step (prompt chunks and decode rows of different lengths, the ranges on the device) and replay it exactly for other lengths of the same total rows (~60 s)
  step "prompt_capture_probe.py, bundled: a varlen step captured by ORT, replayed on other lengths"
  timeout 200 python3 results/h200/scripts/prompt_capture_probe.py "$OUT/prompt-capture-probe.json" engine/bundled/model 2>&1 \
    | grep -v "Warning\|No registered" | tail -40 | cut -c1-900
  step done
  ;;
er)          # session 33, third: eo with every other usual launch split into its parts' GPU time (ORT's replays and our kernels in each part, behind the spin), at C=1 first (is a lone K=2 step host-bound, and by how much), then at C=16 (~150 s)
  step "step_capture_probe.py --phases, bundled, K=2, 1 request of 512 tokens"
  timeout 150 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-capture-phases-c1.json" engine/bundled/model --phases \
    --requests 1 --tokens 512 2>&1 | grep -v "Warning\|No registered" | tail -40 | cut -c1-900
  step "the same at C=16 (16 requests of 256 tokens)"
  timeout 200 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-capture-phases.json" engine/bundled/model --phases 2>&1 \
    | grep -v "Warning\|No registered" | tail -40 | cut -c1-900
  step done
  ;;
eq)          # session 33, second: eo again, every timed launch behind a GPU spin (its events time the GPU's work alone) and each recording uploaded before its timed launch, then ei (~420 s)
  bash "$0" eo
  bash "$0" ei
  ;;
ek)          # session 33, first: test_cuda (session 32's readback wait counter: the device path), then whether our own CUDA graph records ORT's eager runs exactly (cj, not run since its probe staged real rows), then eo (~400 s); then ei, then el
  bash "$0" cl
  bash "$0" cj
  bash "$0" eo
  ;;
ep)          # session 33: session 32's start (.base/ = 6e343b2) against this head (draft steps' accept arrays and hidden rows, the readback's wait counter), host_ab 3 rounds alternating, waves (~330 s; eh's bench cannot run a base older than 646dfcb: the bench reads engine.device_wait_s)
  host_ab_rounds 3
  step done
  ;;
eo)          # session 32's probe: a whole steady K=2 continuation (head drafting, verify, accept, commit, readback) recorded as one CUDA graph of ours with ORT's runs eager inside, launched once, 4 times in a C=16 batch; tokens against an engine that never recorded, and one launch's host us against the usual launch's (~90 s)
  step "step_capture_probe.py, bundled, K=2, 16 requests of 256 tokens"
  timeout 200 python3 results/h200/scripts/step_capture_probe.py "$OUT/step-capture-probe.json" engine/bundled/model 2>&1 \
    | grep -v "Warning\|No registered" | tail -30 | cut -c1-900
  step done
  ;;
el)          # session 33: the bench's K=0 / K=2 / auto at C=16 (512 prompts, its own pools) in 3 interleaved rounds, one engine per K built once: the ratio on a host that drifts (~120 s)
  step "bench, 3 rounds interleaved"
  mkdir -p "$OUT/bench-rounds"
  timeout 300 python3 -m mtpserve.cluster.cli bench --device cuda --results-dir "$OUT/bench-rounds" --draft-tokens 0,2,auto \
    --concurrency 16 --num-prompts 512 --max-tokens 128 --rounds 3 2>&1 | grep -E "speedup_vs_k0|^round|median|Error" | cut -c1-200
  step done
  ;;
ej)          # session 32, first: the whole test_cuda (session 31's scheduler changes not run on a GPU yet), then eh's bench base against head, 2 rounds (~370 s)
  bash "$0" cl
  bash "$0" eh 2
  ;;
ei)          # session 32: in the bench's pools (16 rows and slots), this head against itself with a prompt step's continuation launched before it lands (the GPU idle during that launch, ~0.7 ms an arrival, against the first token's wait), and with a lookahead of 4 steps (CPU counts: 140 -> 98 prompt steps), 3 rounds (~330 s)
  host_ab_extra=(--resident 16)
  switch_ab_rounds 3 on "launch_first:land_prompts_first=0" "lookahead4:scheduler.admission_lookahead=4"
  step done
  ;;
ed)          # session 31: session 30's features and the commit's two index blocks against themselves off, in one checkout, 3 rounds (~450 s)
  switch_ab_rounds 3 on "steady_off:graphs.steady_staging=0" "carry_off:carry_dead_rows=0" \
    "single_block:state_bank.fused_replay.double_buffered=0"
  step done
  ;;
ef)          # session 31, first: the whole test_cuda (the review mends and the commit's two index blocks not run on a GPU yet), then ee (~300 s)
  step test_cuda
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  bash "$0" ee
  ;;
eg)          # session 31: arrivals held in groups of half the decoding requests against a quarter, 3 rounds (~230 s)
  switch_ab_rounds 3 on "group_half:scheduler.admission_group=0.5"
  step done
  ;;
ee)          # session 31: a prompt-only engine's steps beside an MTP engine's draft steps, each on its own thread and stream (~80 s)
  for g in 4 16; do
    step "concurrent_prefill_probe.py, bundled, $g prompts a step"
    timeout 100 python3 results/h200/scripts/concurrent_prefill_probe.py engine/bundled/model "$OUT/concurrent-prefill-g$g.json" \
      --group $g 2>&1 | grep -v "Warning\|No registered" | grep "kept\|slowed\|Error"
  done
  step done
  ;;
ea)          # session 30, first: the whole test_cuda at session 29's head (device-path commits after dj), then py-spy of its loop (~350 s)
  step test_cuda
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  spy_loops
  step done
  ;;
eb)          # session 30: test_cuda (session 29's device-path commits and this session's steady continuations), then session 30's start (.base/ = ab4cd8b) against this head, 3 rounds (~480 s)
  step test_cuda
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed|steady" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  host_ab_rounds 3
  step done
  ;;
ec)          # session 30: py-spy of this head's loop, then K=2 / auto against K=0 at C=16, lengths 64-192 and waves (~300 s)
  spy_loops
  k2_auto_c16 ""
  step done
  ;;
dl)          # session 29, last: this head's K=2 / auto against K=0 at C=16, lengths 64-192 then waves, 2 rounds each (~170 s)
  k2_auto_c16 -final
  step done
  ;;
dj)          # session 29: test_cuda after the host-path kernels, then the base commit's engine (.base/, carried) against this one, rounds alternating (~480 s)
  step test_cuda
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  host_ab_rounds 3
  step done
  ;;
dk)          # session 29: dj's A/B alone (~250 s)
  host_ab_rounds 3
  step done
  ;;
dh)          # session 29: test_cuda at session 28's head, py-spy of the bundled model's loop (K=2 / K=0 at C=16 with waves, K=2 at C=1), the 1.4 B model at C=1 K=0 / 2 / auto (~560 s)
  (make_mid > "$OUT/make-mid.txt" 2>&1) &
  step test_cuda
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  spy_loops
  step waiting for the 1.4 B model; wait
  tail -1 "$OUT/make-mid.txt"
  step "1.4 B synthetic 0.7 K=0/2/auto, C=1, 16 prompts (MTP's first token after the dead-continuation rule)"
  timeout 150 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 16 \
    --concurrency 1 --draft-tokens 0,2,auto --synthetic-acceptance 0.7 --name mid-c1-dead-rule 2>&1 | tail -8
  step done
  ;;
di)          # session 29: py-spy of the bundled model's loop alone (dh's second part) (~120 s)
  spy_loops
  step done
  ;;
cm)          # the defaults as shipped in session 27 (holds in MTP engines only, draft_after_decode on): C=16, lengths 64-192 (~150 s)
  step "auto_ab.py --fixed 2 --hold-ab 0 --range-ratio 0.5, bundled, C=16, 128 requests, 2 rounds"
  timeout 200 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r0.5-shipped.json" \
    --concurrency 16 --requests 128 --rounds 2 --interleave 64 --range-ratio 0.5 --fixed 2 --no-never --hold-ab 0 \
    2>&1 | tee "$OUT/auto-ab-c16-r0.5-shipped.txt" | grep "^round\|median\|Error" | cut -c1-2400
  step done
  ;;
cl)          # the whole test_cuda alone (~220 s)
  step test_cuda
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  step done
  ;;
ck)          # admission holds (CUDA's default, 8 steps) against admitting at once: K=0 / auto / K=2 (and after decode), C=16 with and without waves, C=8 (~400 s)
  for run in "16 0.5 3" "16 0 3" "8 0.5 2"; do
    set -- $run
    step "auto_ab.py --fixed 2 --hold-ab 0 --after-decode --range-ratio $2, bundled, C=$1, 128 requests, $3 rounds"
    timeout 200 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c$1-r$2-holds.json" \
      --concurrency $1 --requests 128 --rounds $3 --interleave 64 --range-ratio $2 --fixed 2 --no-never --hold-ab 0 \
      --after-decode 2>&1 | tee "$OUT/auto-ab-c$1-r$2-holds.txt" | grep "^round\|median\|device memory\|Error" | cut -c1-2400
  done
  step done
  ;;
ci)          # session 26's fills against eager head catch-ups in one run: K=0 / auto / K=2 (and after decode), with and without (~400 s)
  for r in 0.5 0; do
    step "auto_ab.py --fixed 2 --eager-fills --range-ratio $r, bundled, C=16, 128 requests, 3 rounds"
    timeout 240 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r$r-fills-ab.json" \
      --concurrency 16 --requests 128 --rounds 3 --interleave 64 --range-ratio $r --fixed 2 --no-never --eager-fills \
      --after-decode \
      2>&1 | grep "^round\|median\|device memory" | cut -c1-2000
  done
  step done
  ;;
ch)          # session 26's captured head fills: the whole test_cuda, the step timeline with calls, auto vs K=0 (~380 s)
  step test_cuda
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py 2>&1 | grep -v Warning > "$OUT/test-cuda.txt"
  grep -E "^E  |^FAILED|passed|failed" "$OUT/test-cuda.txt" | cut -c1-400 | tail -20
  step "step_timeline.py, bundled, C=16, 128 requests, --range-ratio 0.5: K=0, K=2 (each launch's calls)"
  timeout 120 python3 results/h200/scripts/step_timeline.py engine/bundled/model "$OUT/step-timeline-c16-r0.5.json" \
    --fixed 0,2 2>&1 | grep -v "No registered plugin\|Warning" | tee "$OUT/step-timeline.txt" | tail -8
  auto_ab_without_waves 16 85
  step done
  ;;
ce)          # where a steady K=2 step's 1.08 ms goes at C=16: GPU gaps and spans, host launch / wait / other (~120 s)
  step "step_timeline.py, bundled, C=16, 128 requests, --range-ratio 0.5: K=0, K=2, K=2 after decode"
  timeout 150 python3 results/h200/scripts/step_timeline.py engine/bundled/model "$OUT/step-timeline-c16-r0.5.json" \
    --fixed 0,2 2>&1 | grep -v "No registered plugin\|Warning" | tee "$OUT/step-timeline.txt" | tail -14
  timeout 100 python3 results/h200/scripts/step_timeline.py engine/bundled/model \
    "$OUT/step-timeline-c16-r0.5-after-decode.json" --fixed 2 --after-decode 2>&1 \
    | grep -v "No registered plugin\|Warning" | tee -a "$OUT/step-timeline.txt" | tail -8
  step done
  ;;
ca)          # host time per step of K=2 against K=0 at C=16 without waves: cProfile, per step and per token (~150 s)
  step "auto_ab.py --fixed 2 --profile --range-ratio 0.5, bundled, C=16, 128 requests, 2 rounds"
  timeout 170 python3 results/h200/scripts/auto_ab.py engine/bundled/model "$OUT/auto-ab-c16-r0.5-k2-profile.json" \
    --concurrency 16 --requests 128 --rounds 2 --interleave 64 --range-ratio 0.5 --fixed 2 --no-never --profile 2>&1 \
    | grep -v "Warning\|onnxruntime" | cut -c1-300 | tail -60 | tee "$OUT/auto-ab-c16-r0.5-k2-profile.txt"
  step done
  ;;
bu)          # auto vs K=0 at C=16 without waves (~85 s)
  auto_ab_without_waves 16 85
  step done
  ;;
br)          # what HTTP adds, on output lengths from 128 x [0.5, 1.5] (needs the --serve kit; ~240 s)
  step "HTTP: 2 API servers vs in process, 4 client processes, bundled, C=1 / 16, 256 prompts, --range-ratio 0.5"
  timeout 260 "${bench[@]}" --replicas 0,1 --direct-ingress --api-servers 2 --num-threads 1 --client-processes 4 \
    --concurrency 1,16 --num-prompts 256 --max-tokens 128 --range-ratio 0.5 --draft-tokens 0 --no-plot \
    --name bundled-http-4-clients-r0.5 2>&1 | grep -v INFO \
    | grep -E "client CPU|server's mean|stalls|^in-process|^1 replica|serving adds|^HTTP|results:" | tail -18
  step done
  ;;
bb|be)       # the 1.4 B model at synthetic acceptance 0.7 (bb) or 0.3 (be), C=16 then C=1 (~500 s)
  make_mid > "$OUT/make-mid.txt" 2>&1
  a=$([[ $part == bb ]] && echo 0.7 || echo 0.3)
  step "auto_ab.py --table --bursts, 1.4 B, synthetic $a, C=16, 64 requests, 4 rounds"
  timeout 280 python3 results/h200/scripts/auto_ab.py $mid "$OUT/auto-ab-table-mid-$a-c16.json" --concurrency 16 \
    --requests 64 --rounds 4 --table --bursts --synthetic $a --random-prompts 128 2>&1 \
    | tee "$OUT/auto-ab-table-mid-$a-c16.txt" | grep "^auto table:\|^round\|median" | cut -c1-900
  step "auto_ab.py --table, 1.4 B, synthetic $a, C=1, 6 requests, 3 rounds, K=2 beside"
  timeout 180 python3 results/h200/scripts/auto_ab.py $mid "$OUT/auto-ab-table-mid-$a-c1.json" --concurrency 1 \
    --requests 6 --rounds 3 --fixed 2 --table --synthetic $a --random-prompts 128 2>&1 \
    | tee "$OUT/auto-ab-table-mid-$a-c1.txt" | grep "^auto table:\|^round\|median" | cut -c1-900
  step done
  ;;
az)
  bundled=$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')
  for c in 16 8; do
    step "auto_ab.py, bundled, C=$c, 128 requests, 12 rounds"
    timeout 120 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-c$c.json" --concurrency $c --requests 128 \
      --rounds 12 2>&1 | grep "^round\|median" | cut -c1-420
  done
  step "auto_ab.py, bundled, C=1, 16 requests, 8 rounds, K=2 / 3 beside"
  timeout 150 python3 results/h200/scripts/auto_ab.py $bundled "$OUT/auto-ab-c1.json" --concurrency 1 --requests 16 \
    --rounds 8 --fixed 2,3 2>&1 | grep "^round\|median" | cut -c1-600
  step done
  ;;
ay)
  step "auto_ab.py --profile, bundled, C=16, 128 requests, 4 rounds"
  timeout 150 python3 results/h200/scripts/auto_ab.py "$(python3 -c 'from mtpserve.engine.bundled import MODEL_DIR; print(MODEL_DIR)')" \
    "$OUT/auto-ab-c16-profile.json" --concurrency 16 --requests 128 --rounds 4 --profile 2>&1 \
    | grep -v "Warning\|onnxruntime" | cut -c1-300 | tail -34
  step done
  ;;
aw)
  make_mid > "$OUT/make-mid.txt" 2>&1
  step "prompt first calls over token counts after the GEMM warm-up, 1.4 B"
  shapes=$(python3 -c "print(','.join(f'1x{t}' for t in (8, 16, 24, 32, 48, 64, 96, 100, 101, 128, 160, 192, 256, 384, 512, 768, 1024)))")
  timeout 150 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-first-calls-mid-gemm-warm.json" --no-kernels \
    --gemm-warm 2048 --shapes "$shapes,2x64,4x32,3x100,5x61,7x73,16x32,3x333,9x111" 2>&1 | grep -v "Warning\|STAGE\|USDT" \
    | python3 -c "import json,sys; [print(l.strip()) if l.startswith('#') else print(r['batch'], r['prompt'], r['eager_first_ms'], r['eager_ms']) for l in sys.stdin for r in ([json.loads(l)] if l.startswith('{') else [None]) if l.startswith(('#', '{'))]"
  step "the same under ORT's profiler, after the warm-up"
  timeout 90 python3 results/h200/scripts/prefill_cost.py $mid "$OUT/prefill-first-nodes-mid-gemm-warm.json" --ort-profile \
    --gemm-warm 2048 --shapes "1x8,1x100,1x128,4x128,3x100,1x1024,5x61" 2>&1 | grep "^[{#]" | cut -c1-300
  step 1.4 B vs og.Engine, fresh kernel cache, with the GEMM warm-up
  (fresh_cupy; timeout 330 "${bench[@]}" --model $mid --prompts random --input-len 128 --max-tokens 128 --num-prompts 48 \
    --concurrency 1,8,32,64 --draft-tokens 0 --compare ortgenai --phases on --name mid-vs-ortgenai-gemm-warm) 2>&1 \
    | grep -v "prefill:" | tail -40
  step done
  ;;
*) echo "usage: session.sh a|b|...|z|aa|ab|ac|ad|ae|af|ag|ah|ai|aj|ak|al|am|an|ao|ap|aq|ar|as|at|au" >&2; exit 2 ;;
esac
step done
