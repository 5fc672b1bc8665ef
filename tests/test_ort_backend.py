"""The ONNX Runtime backend's weight sharing: large initializers are read once and every session
(the graphs and each fixed-shape session) uses that one copy in place."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from runtime.backends.ort import SHARED_BYTES, SharedWeights

ROWS = SHARED_BYTES // (4 * 64) + 1  # just over the sharing threshold in float32


def weight_model(folder, external: bool) -> str:
    """y = x + w with w large enough to be shared; stored inline or as external data. (An
    elementwise op: CPU MatMul pre-packs its weights into a copy of its own.)"""
    weight = np.random.default_rng(0).standard_normal((ROWS, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, 64])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    path = str(folder / "weight.onnx")
    onnx.save(model, path, save_as_external_data=external, location="weight.onnx.data")
    return path


def session(weights: SharedWeights, path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    weights.add_to(options, path)
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession) -> np.ndarray:
    x = np.zeros((ROWS, 64), dtype=np.float32)
    return sess.run(None, {"x": x})[0]


def test_sessions_use_the_shared_copy_in_place(tmp_path):
    for external in (False, True):
        folder = tmp_path / str(external)
        folder.mkdir()
        path = weight_model(folder, external)
        weights = SharedWeights(torch.device("cpu"))
        first = session(weights, path)
        before = run(first)
        assert len(weights.values) == 1 and weights.nbytes == ROWS * 64 * 4
        # the existing session reads the shared memory itself (no copy), and so does a new one
        (tensor,) = weights.tensors.values()
        tensor.mul_(2)
        np.testing.assert_allclose(run(first), 2 * before, rtol=1e-6)
        np.testing.assert_allclose(run(session(weights, path)), 2 * before, rtol=1e-6)


def test_graphs_with_the_same_weights_share_one_copy(tmp_path):
    path = weight_model(tmp_path, external=True)
    weights = SharedWeights(torch.device("cpu"))
    weights.load(path)
    copy = tmp_path / "again.onnx"  # a second graph over the same external data file
    copy.write_bytes((tmp_path / "weight.onnx").read_bytes())
    weights.load(str(copy))
    assert len(weights.values) == 1


def test_small_initializers_stay_in_the_graph(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["y"])],
        "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.ones(4, dtype=np.float32), "b")],
    )
    path = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    weights = SharedWeights(torch.device("cpu"))
    assert weights.load(str(path)) == [] and weights.nbytes == 0
