"""Names of the attributes mlir-ansor writes into the IR, in one place.

Each one is set by one layer and read by the layers above it: the partition
into tasks marks ops, the schedule matches them, the lowering reads what the
graph rewrites and the builder left on functions.
"""

NORMALIZED_ATTR = "ansor.normalized"
"""Unit attribute on a function that `graph.normalize.normalize` has brought
into task shape (the compiled driver functions carry it; the lowering's
driver rewrites look for it)."""

ANCHOR_ATTR = "ansor.anchor"
"""Unit attribute on the anchor op of a task (its contraction or reduction)."""

FUSED_ATTR = "ansor.fused"
"""Unit attribute on an op fused into its task's anchor (a fill, an
elementwise consumer)."""

OP_ATTR = "ansor.op"
"""Integer attribute numbering a task's Linalg ops, which a schedule's
``transform.structured.match`` looks for (`search.sketch.prepare_payload`)."""

FLOPS_ATTR = "ansor.flops"
"""Integer attribute on a scheduled kernel function: its task's operation
count, read by the lowering to pick a dynamic OpenMP schedule for large
kernels (`passes.lowering.dynamic_schedules`)."""

PACKED_ATTR = "ansor.packed"
"""Integer attribute on a ``linalg.generic`` that `graph.prepack` made from a
matmul with a constant B: the reduction group B is packed in (B[k/g, n, g]);
the `cpu-dot-product` rule takes the op as already packed."""

SAME_DIMS_ATTR = "ansor.same_dims"
"""Array of strings on a function with dynamic dimensions, each naming
argument dimensions that are one size (``["1.1=2.1"]``: argument 1's
dimension 1 and argument 2's), where its ops alone do not tie them
(`graph.dynamic.symbols`): the PyTorch importer writes the dimensions
``torch.export`` gave one symbol (a KV cache's keys and values), and a
hand-written module may state them."""

DIM_RANGES_ATTR = "ansor.dim_ranges"
"""Array of strings on a function with dynamic dimensions, each the sizes
an argument dimension may take: ``["0.1=2..128"]`` (``"0.1=2.."``: no
upper bound). The PyTorch importer writes the ranges of ``torch.export``'s
``Dim``s (a positional table of 128 rows); a size outside is an error
(`graph.dynamic.specialize`), not a specialization whose slices overrun."""
