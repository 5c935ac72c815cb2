"""Layer 2: models from other frameworks, in as Linalg text.

- `pytorch`: a ``torch.nn.Module`` through torch-mlir's FX importer to Linalg
  on tensors (the `torch` extra).

May import: `errors`, `target`, `ir`.
"""
