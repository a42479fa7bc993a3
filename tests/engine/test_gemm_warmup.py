"""The start-up warm-up of the model's matrix products (engine/gemm_warmup.py).

Its point, kernels loaded before a live step needs them, shows on CUDA only
(results/h200/scripts/prefill_cost.py --gemm-warm); here: that it finds every weight shape the
model multiplies by, and that the graph it runs multiplies by each of them at any row count."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from mtpserve.engine.gemm_warmup import EVERY_ROW_UP_TO, STRIDE, gemm_model, gemm_shapes, model_gemm_shapes, warm_rows, warm_up_gemms
from mtpserve.engine.manifest import load_manifest


def _weight_matmuls(path) -> set[tuple[int, int, int]]:
    """Every MatMul of the graph whose second input is an initializer, as (K, N, type)."""
    g = onnx.load(str(path), load_external_data=False).graph
    weights = {i.name: i for i in g.initializer}
    return {(w.dims[0], w.dims[1], w.data_type) for n in g.node if n.op_type == "MatMul"
            for w in [weights.get(n.input[1])] if w is not None}


def test_shapes_cover_the_main_graph_and_the_head(model_dir):
    m = load_manifest(model_dir)
    main, head = _weight_matmuls(model_dir / "model.onnx"), _weight_matmuls(model_dir / m.mtp.filename)
    shapes = model_gemm_shapes(model_dir, ["model.onnx", m.mtp.filename])
    assert shapes == main | head
    assert model_gemm_shapes(model_dir, [m.mtp.filename]) == head != set()
    assert (m.hidden_size, m.vocab_size, TensorProto.FLOAT16) in shapes     # the LM head


def test_products_of_two_activations_and_other_ranks_are_left_out():
    w = numpy_helper.from_array(np.zeros((4, 6), np.float16), "w")
    w3 = numpy_helper.from_array(np.zeros((2, 4, 6), np.float16), "w3")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("MatMul", ["x", "y"], ["b"]),
         helper.make_node("MatMul", ["x", "w3"], ["c"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("x", "y")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("a", "b", "c")], [w, w3])
    assert gemm_shapes(graph) == {(4, 6, TensorProto.FLOAT16)}


def test_the_warm_up_graph_multiplies_by_each_shape_at_any_row_count():
    shapes = {(8, 3, TensorProto.FLOAT16), (8, 5, TensorProto.FLOAT16), (3, 7, TensorProto.FLOAT)}
    session = ort.InferenceSession(gemm_model(shapes), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for rows in (1, 5):
        feeds = {}
        for k, n, t in shapes:
            dtype = np.float16 if t == TensorProto.FLOAT16 else np.float32
            feeds.setdefault(f"x_{k}_{t}", rng.standard_normal((rows, k)).astype(dtype))
            feeds[f"w_{k}_{n}_{t}"] = rng.standard_normal((k, n)).astype(dtype)
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for k, n, t in shapes:
            want = feeds[f"x_{k}_{t}"].astype(np.float32) @ feeds[f"w_{k}_{n}_{t}"].astype(np.float32)
            np.testing.assert_allclose(out[f"y_{k}_{n}_{t}"].astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_warm_up_runs_the_bundled_models_shapes(model_dir):
    """The engine's call, on the CPU provider with numpy buffers (bound by pointer, views of the
    largest row count): it runs and releases everything."""
    m = load_manifest(model_dir)
    shapes = model_gemm_shapes(model_dir, ["model.onnx", m.mtp.filename])
    assert warm_up_gemms(shapes, 17, ["CPUExecutionProvider"], np) > 0
    assert warm_up_gemms(set(), 17, ["CPUExecutionProvider"], np) == 0.0


def test_every_row_count_up_to_the_default_budget_and_a_stride_past_it():
    """The warm-up's time grows with the square of its rows: every count up to the CUDA default
    budget (2048), then every STRIDE-th, and the budget itself."""
    assert warm_rows(2048) == list(range(1, 2049))
    assert warm_rows(5) == [1, 2, 3, 4, 5]
    big = warm_rows(8190)
    assert big[:EVERY_ROW_UP_TO] == list(range(1, EVERY_ROW_UP_TO + 1)) and big[-1] == 8190
    assert set(b - a for a, b in zip(big[EVERY_ROW_UP_TO - 1:-2], big[EVERY_ROW_UP_TO:-1])) == {STRIDE}
    assert sum(big) < 4 * sum(warm_rows(2048)), "a 4x budget costs ~3x the default's warm-up, not 16x"
