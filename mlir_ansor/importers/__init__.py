"""Layer 2: models from other frameworks, in as Linalg text.

- `pytorch`: a ``torch.nn.Module`` through torch-mlir's FX importer to Linalg
  on tensors (the `torch` extra).
- `onnx`: an ONNX model through torch-mlir's ONNX importer to Linalg on
  tensors (the `onnx` extra).

May import: `errors`, `target`, `ir`.
"""
