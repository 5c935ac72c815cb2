"""Layer 4: from scheduled IR to machine code.

- `lowering`: the CPU pipelines (bufferization, vectors, OpenMP) to the LLVM
  dialect; `lower_to_llvm` is the entry point.
- `drivers`: the rewrites `lower_to_llvm` makes between its pipelines, mostly
  of compiled drivers (kernel calls on views, accumulating in place, static
  buffers, strided copies, byte-wide booleans).
- `artifacts`: the runtime libraries (OpenMP, MLIR's C runner utilities) and
  shared libraries emitted from the LLVM dialect.
- `split`: a lowered module split into units (drivers, one per kernel) that
  are code-generated apart, in parallel, and linked by ``cc``.
- `compile_cache`: the folder where the compiler keeps units' object code,
  folded constants and whole compiles, keyed by what decides their bytes.
- `objcode`: object code for a named CPU on any host (``mlir-translate``,
  ``llc -mcpu``), its disassembly and instruction counts.
- `math_approx`: SIMD polynomials for ``exp``, ``erf`` and ``tanh``.
- `nvvm`: GPU mapping, lowering to NVVM and PTX, ptxas and its report.

May import: `errors`, `target`, `ir`, `graph`, `schedule`.
"""
