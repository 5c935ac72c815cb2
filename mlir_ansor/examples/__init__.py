"""Top layer: example inputs a newcomer can run, and the benchmarks' workloads.

- `workloads`: Ansor's single-operator set (C1D ... T2D) and GEMMs written as
  Linalg text, with numpy references.
- `models`: ResNet-50, a BERT encoder layer and a small CNN in plain
  ``torch.nn`` with seeded random weights (`python -m
  mlir_ansor.examples.models NAME -o FILE.mlir`; the `torch` extra).
- ``*.mlir``: the bundled example `tune` and `run` use with no input.

May import every layer.
"""
