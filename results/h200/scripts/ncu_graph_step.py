"""One replay of a captured main-model step, bracketed by cudaProfilerStart/Stop for ncu.

    ncu --clock-control none --profile-from-start off --graph-profiling node \
        --metrics gpu__time_duration.sum,dram__bytes.sum --csv \
        python3 ncu_graph_step.py MODEL_DIR BATCH ROWS_PER_REQUEST > step.csv
    python3 ../../../../shared/probes/ncu_sum.py step.csv step.json

The engine is built as it serves (CUDA graphs, K = ROWS_PER_REQUEST - 1 so that verify shape is
captured), with a 512-token context so start-up captures few shapes; the replayed graph is the
(BATCH, ROWS_PER_REQUEST) step of the smallest KV bucket, its rows the capture's padding rows.
Without ncu it prints the replay's CUDA-event time, to set beside ncu's kernel sum.
"""
import sys

import cupy as cp

from mtpserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from mtpserve.engine.cuda_graphs import GraphShape
from mtpserve.engine.engine import Engine

model_dir, batch, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = EngineConfig(model_dir, device="cuda", warm_up=False,
                      cache=CacheConfig(num_blocks=batch * 40 + 64, max_resident_requests=batch),
                      scheduler=SchedulerConfig(max_requests_per_step=batch, max_tokens_per_step=2048),
                      spec=SpecConfig(draft_tokens=rows - 1), max_model_len=512)
engine = Engine(config)
g = engine.graphs
graph = g._graphs[GraphShape(g.catalog.batch_for(batch), rows, min(g.catalog.table_widths), 0)]
stream = engine._stream
with engine.device_context():
    for _ in range(20):
        g._replay(graph)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(50):
        g._replay(graph)
    end.record(stream)
    end.synchronize()
    print(f"# replay {cp.cuda.get_elapsed_time(start, end) / 50:.4f} ms (CUDA events, 50 back to back)",
          file=sys.stderr, flush=True)
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.profilerStart()
    g._replay(graph)
    stream.synchronize()
    cp.cuda.runtime.profilerStop()
