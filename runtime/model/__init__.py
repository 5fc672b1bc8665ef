"""The model the engines run: the vision tower, one language-model pass and the Gated DeltaNet
cores, in plain PyTorch on an export's weights (transformers 5.17 `Qwen3_5*`, docs/model.md §2-§6).

The ONNX export traces these modules; the torch backend runs them.
"""
