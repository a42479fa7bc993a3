"""Warming the model's matrix products at every row count a step can have, before the first step.

On CUDA a step's MatMuls go to cuBLAS, whose heuristic picks a kernel by the product's shape;
each kernel is loaded into the process the first time any session uses it. A prompt or mixed
step of a token count no earlier step had can pick kernels not yet loaded, and pays for them on
a live step: on the H200 the 1.4 B model's first prompt step of most new token counts cost 12-20
ms more than the next one (results/h200 session av: 1 x 100 24.3 ms against 5.7; 1 x 101, after
it, 7.8 against 5.7), all of it in MatMul nodes by ORT's own profiler, a few ms in the first node
of each weight shape. Other splits of a total already seen paid nothing (2 x 64 and 4 x 32 after
1 x 128). After this warm-up (8 shapes at 1..2048 rows, 4.6 s) a new count's first call cost
0.3-2.5 ms over its steady time (session aw).

So the engine runs, once at start, a small graph of bare MatMuls, one per weight shape of the
model (main graph and MTP head), at every row count from 1 to the step's token budget, in a
throwaway session on the same device. It computes nothing the engine keeps; the kernels it
makes cuBLAS load are the ones the model's own MatMuls of those shapes pick (the weights are
graph inputs here, zeros, bound once: a large LM head is not copied per run).

    weight [K, N] of each MatMul in model.onnx / mtp.onnx  ->  X_K [M, K] @ W_KN  for M in warm_rows(max_rows)

Its time grows with the square of the rows (the products' work summed over every count): past
EVERY_ROW_UP_TO rows only every STRIDE-th count is run, so a budget of 8192 tokens costs ~3x
the 2048 default's warm-up instead of 16x. (A first call there, on a step of thousands of
tokens and tens of ms, weighs less; those counts were not measured on the device.)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from mtpserve.engine.runner import _Binding

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
EVERY_ROW_UP_TO = 2048
STRIDE = 8


def warm_rows(max_rows: int) -> list[int]:
    """The row counts the warm-up runs: every one up to EVERY_ROW_UP_TO, then every STRIDE-th,
    and max_rows itself."""
    rows = list(range(1, min(max_rows, EVERY_ROW_UP_TO) + 1))
    rows += range(EVERY_ROW_UP_TO + STRIDE, max_rows + 1, STRIDE)
    if rows and rows[-1] != max_rows:
        rows.append(max_rows)
    return rows


def gemm_shapes(graph: onnx.GraphProto) -> set[tuple[int, int, int]]:
    """(K, N, onnx elem type) of every MatMul in ``graph`` whose second operand is a 2-D weight
    (an initializer), read without the weights' data."""
    weights = {i.name: i for i in graph.initializer}
    shapes = set()
    for node in graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in weights:
            w = weights[node.input[1]]
            if len(w.dims) == 2 and w.data_type in _FLOATS:
                shapes.add((int(w.dims[0]), int(w.dims[1]), int(w.data_type)))
    return shapes


def model_gemm_shapes(model_dir: Path, filenames: Iterable[str]) -> set[tuple[int, int, int]]:
    """The weight shapes of the given graphs of an export (weights not loaded)."""
    shapes = set()
    for name in filenames:
        shapes |= gemm_shapes(onnx.load(str(Path(model_dir) / name), load_external_data=False).graph)
    return shapes


def gemm_model(shapes: Iterable[tuple[int, int, int]]) -> bytes:
    """A graph of one MatMul per shape: inputs ``x_K_T`` [M, K] (one per K and type) and
    ``w_K_N_T`` [K, N], outputs ``y_K_N_T`` [M, N]."""
    inputs, outputs, nodes, xs = [], [], [], set()
    for k, n, t in sorted(shapes):
        x, w, y = f"x_{k}_{t}", f"w_{k}_{n}_{t}", f"y_{k}_{n}_{t}"
        if x not in xs:
            xs.add(x)
            inputs.append(helper.make_tensor_value_info(x, t, ["M", k]))
        inputs.append(helper.make_tensor_value_info(w, t, [k, n]))
        outputs.append(helper.make_tensor_value_info(y, t, ["M", n]))
        nodes.append(helper.make_node("MatMul", [x, w], [y]))
    graph = helper.make_graph(nodes, "gemm_warm_up", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def warm_up_gemms(shapes: set[tuple[int, int, int]], max_rows: int, providers: list, xp) -> float:
    """Run ``gemm_model(shapes)`` at each row count of ``warm_rows(max_rows)`` in its own session with
    ``providers`` (pass the engine's CUDA provider options: same device, same stream). Inputs
    are zeros of ``xp`` (cupy on CUDA, numpy on the CPU) made once at the largest row count; a
    run binds views of them (the runner's ``_Binding``: the weights, unchanged, are bound once).
    Returns the seconds it took. The session and its buffers are released afterwards."""
    import onnxruntime as ort

    if not shapes or max_rows < 1:
        return 0.0
    started = time.perf_counter()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_mem_pattern = False
    session = ort.InferenceSession(gemm_model(shapes), so, providers=providers)
    binding = _Binding(session, xp, "cuda")
    buffers = {}
    for k, n, t in sorted(shapes):
        dtype = helper.tensor_dtype_to_np_dtype(t)
        buffers.setdefault(f"x_{k}_{t}", xp.zeros((max_rows, k), dtype))
        buffers[f"w_{k}_{n}_{t}"] = xp.zeros((k, n), dtype)
        buffers[f"y_{k}_{n}_{t}"] = xp.empty((max_rows, n), dtype)
    for rows in warm_rows(max_rows):
        for name, arr in buffers.items():
            binding.bind_at(name, arr if name.startswith("w_") else arr[:rows], output=name.startswith("y_"))
        binding.run(session)
    binding.io.synchronize_outputs()
    del binding, session, buffers
    if hasattr(xp, "get_default_memory_pool"):      # the LM head's zeros: hundreds of MB on a real model
        xp.get_default_memory_pool().free_all_blocks()
    return time.perf_counter() - started
