"""The lowering's own IR rewrites (`passes/lowering.py`, `passes/drivers.py`)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import filecheck
from mlir import ir, passmanager

import mlir_ansor
from mlir_ansor.passes.drivers import forward_output_copies
from mlir_ansor.passes.lowering import _front

# A kernel returning a fresh tensor, and drivers that return what it returned.
KERNEL = """
  func.func private @k(%a: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %e = tensor.empty() : tensor<4x8xf32>
    %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                         iterator_types = ["parallel", "parallel"]}
        ins(%a : tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) {
      ^bb0(%x: f32, %o: f32):
        %y = arith.addf %x, %x : f32
        linalg.yield %y : f32
    } -> tensor<4x8xf32>
    return %r : tensor<4x8xf32>
  }
"""


def _front_ir(drivers: str) -> ir.Module:
    m = ir.Module.parse("module {" + KERNEL + drivers + "}")
    passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
    return m


def _func(m: ir.Module, name: str) -> str:
    for op in m.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == name:
            return str(op)
    raise KeyError(name)


def test_driver_result_is_computed_in_the_output_argument():
    with ir.Context(), ir.Location.unknown():
        m = _front_ir("""
  func.func @main(%a: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %r = call @k(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %r : tensor<4x8xf32>
  }""")
        # what the upstream pass leaves: the result in a buffer, copied out
        filecheck(_func(m, "main"), r"""
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<4x8xf32>, %[[OUT:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    %[[BUF:\w+]] = memref.alloc() : memref<4x8xf32>
CHECK-NEXT:    call @k(%[[A]], %[[BUF]])
CHECK-NEXT:    memref.copy %[[BUF]], %[[OUT]]
CHECK-NEXT:    memref.dealloc %[[BUF]]
""")
        assert forward_output_copies(m) == 1
        m.operation.verify()
        after = _func(m, "main")
    # the kernel writes the output argument, and nothing else is left
    filecheck(after, r"""
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<4x8xf32>, %[[OUT:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    call @k(%[[A]], %[[OUT]])
CHECK-NEXT:    return
""")


def test_buffer_still_read_after_the_copy_or_a_busy_output_keeps_the_copy():
    with ir.Context(), ir.Location.unknown():
        # the same result returned twice: two outputs, one buffer; only the
        # last copy may become the buffer (the first one reads it after)
        m = _front_ir("""
  func.func @twice(%a: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
    %r = call @k(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %r, %r : tensor<4x8xf32>, tensor<4x8xf32>
  }""")
        assert forward_output_copies(m) == 1
        m.operation.verify()
        after = _func(m, "twice")
    filecheck(after, r"""
CHECK-LABEL: func.func @twice(
CHECK-SAME:    %[[A:\w+]]: memref<4x8xf32>, %[[OUT0:\w+]]: memref<4x8xf32>, %[[OUT1:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    call @k(%[[A]], %[[OUT1]])
CHECK-NEXT:    memref.copy %[[OUT1]], %[[OUT0]]
CHECK-NEXT:    return
""")


def test_compiled_driver_results_match_numpy(tmp_path):
    # compile makes each op a kernel, and @main a driver that returns what
    # they return: both outputs come from the rewritten copies
    path = tmp_path / "twice.mlir"
    path.write_text("""
func.func @main(%a: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  %r = linalg.add ins(%a, %a : tensor<4x8xf32>, tensor<4x8xf32>) outs(%a : tensor<4x8xf32>) -> tensor<4x8xf32>
  %e = tensor.empty() : tensor<4x8xf32>
  %s = linalg.mul ins(%r, %a : tensor<4x8xf32>, tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  return %s, %r : tensor<4x8xf32>, tensor<4x8xf32>
}
""")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    s, r = mlir_ansor.compile(str(path), db=None)(x)
    np.testing.assert_allclose(r, 2 * x, rtol=1e-6)
    np.testing.assert_allclose(s, 2 * x * x, rtol=1e-6)


CHAIN = """
func.func @main(%a: tensor<8x8xf32>) -> tensor<1x8x8xf32> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x8xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<8x8xf32>) -> tensor<8x8xf32>
  %r = linalg.matmul ins(%a, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %s = linalg.matmul ins(%r, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %t = linalg.matmul ins(%s, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %u = linalg.matmul ins(%t, %s : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %x = tensor.expand_shape %u [[0, 1], [2]] output_shape [1, 8, 8] : tensor<8x8xf32> into tensor<1x8x8xf32>
  return %x : tensor<1x8x8xf32>
}
"""


def _lowered_driver(tmp_path, text: str) -> tuple[str, int, int]:
    """The driver of `text` after compile's front half and the two rewrites,
    with how many copies were forwarded and how many buffers made static."""
    from mlir_ansor.passes.drivers import static_driver_buffers

    path = tmp_path / "m.mlir"
    path.write_text(text)
    cm = mlir_ansor.compile(str(path), db=None)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(cm.mlir)
        passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
        forwarded = forward_output_copies(m)
        static = static_driver_buffers(m)
        m.operation.verify()
        return str(m), forwarded, static


def test_driver_buffers_are_static_and_shared_when_lifetimes_do_not_overlap(tmp_path):
    text, forwarded, static = _lowered_driver(tmp_path, CHAIN)
    # the last result is computed in the output (through the expand_shape);
    # r, s and t need buffers: r dies at s, so t takes r's; s lives to u
    assert forwarded == 1 and static == 3
    # two uninitialized globals (declared in the order the driver takes them)
    # and a driver with no allocation and no copy: every line is below
    filecheck(text, r"""
CHECK:       memref.global "private" @[[BUF0:\w+]] : memref<8x8xf32> = uninitialized
CHECK-NEXT:  memref.global "private" @[[BUF1:\w+]] : memref<8x8xf32> = uninitialized
CHECK-NOT:   memref.global
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<8x8xf32>, %[[OUT:\w+]]: memref<1x8x8xf32>)
CHECK-NEXT:    %[[R:\w+]] = memref.get_global @[[BUF0]] : memref<8x8xf32>
CHECK-NEXT:    call @{{\w+}}(%[[A]], %[[R]])
CHECK-NEXT:    %[[S:\w+]] = memref.get_global @[[BUF1]] : memref<8x8xf32>
CHECK-NEXT:    call @{{\w+}}(%[[R]], %[[A]], %[[S]])
CHECK-NEXT:    %[[T:\w+]] = memref.get_global @[[BUF0]] : memref<8x8xf32>
CHECK-NEXT:    call @{{\w+}}(%[[S]], %[[A]], %[[T]])
CHECK-NEXT:    %[[U:\w+]] = memref.collapse_shape %[[OUT]] {{\[\[}}0, 1], [2]] : memref<1x8x8xf32> into memref<8x8xf32>
CHECK-NEXT:    call @{{\w+}}(%[[T]], %[[S]], %[[U]])
CHECK-NEXT:    return
""")


def test_static_buffers_give_the_same_results_call_after_call(tmp_path):
    path = tmp_path / "chain.mlir"
    path.write_text(CHAIN)
    cm = mlir_ansor.compile(str(path), db=None)
    rng = np.random.default_rng(1)
    for _ in range(3):  # the globals keep the previous call's values: they must not leak into this one
        a = rng.standard_normal((8, 8)).astype(np.float32)
        s = a @ a @ a
        np.testing.assert_allclose(cm(a), ((s @ a) @ s)[None], rtol=1e-4)


# A driver that feeds the two column halves of its input (strided slices) to
# @k, and puts @k's results into the two halves of its output.
HALVES = """
  func.func @main(%a: tensor<4x16xf32>) -> tensor<4x16xf32> attributes {ansor.normalized} {
    %s0 = tensor.extract_slice %a[0, 0] [4, 8] [1, 1] : tensor<4x16xf32> to tensor<4x8xf32>
    %s1 = tensor.extract_slice %a[0, 8] [4, 8] [1, 1] : tensor<4x16xf32> to tensor<4x8xf32>
    %r0 = call @KERNEL(%s0) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    %r1 = call @KERNEL(%s1) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    %e = tensor.empty() : tensor<4x16xf32>
    %o0 = tensor.insert_slice %r0 into %e[0, 0] [4, 8] [1, 1] : tensor<4x8xf32> into tensor<4x16xf32>
    %o1 = tensor.insert_slice %r1 into %o0[0, 8] [4, 8] [1, 1] : tensor<4x8xf32> into tensor<4x16xf32>
    return %o1 : tensor<4x16xf32>
  }"""

# The same kernel, reading its argument and writing its result through
# reshapes (which a strided view cannot take).
RESHAPING = """
  func.func private @r(%a: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %c = tensor.collapse_shape %a [[0, 1]] : tensor<4x8xf32> into tensor<32xf32>
    %e = tensor.empty() : tensor<32xf32>
    %d = linalg.add ins(%c, %c : tensor<32xf32>, tensor<32xf32>) outs(%e : tensor<32xf32>) -> tensor<32xf32>
    %x = tensor.expand_shape %d [[0, 1]] output_shape [4, 8] : tensor<32xf32> into tensor<4x8xf32>
    return %x : tensor<4x8xf32>
  }
"""


# HALVES once bufferized: each slice copied into a buffer for the kernel,
# each result copied from its buffer into its half of the output.
HALVES_COPIED = r"""
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<4x16xf32>, %[[OUT:\w+]]: memref<4x16xf32>)
CHECK:         %[[S0:\w+]] = memref.subview %[[A]][0, 0] [4, 8] [1, 1]
CHECK:         %[[S1:\w+]] = memref.subview %[[A]][0, 8] [4, 8] [1, 1]
CHECK:         memref.copy %[[S0]], %[[IN0:\w+]] : memref<4x8xf32, strided<[16, 1]>> to memref<4x8xf32>
CHECK:         call @KERNEL(%[[IN0]], %[[R0:\w+]])
CHECK:         memref.copy %[[S1]], %[[IN1:\w+]] : memref<4x8xf32, strided<[16, 1], offset: 8>> to memref<4x8xf32>
CHECK:         call @KERNEL(%[[IN1]], %[[R1:\w+]])
CHECK:         %[[O0:\w+]] = memref.subview %[[OUT]][0, 0] [4, 8] [1, 1]
CHECK-NEXT:    memref.copy %[[R0]], %[[O0]] : memref<4x8xf32> to memref<4x8xf32, strided<[16, 1]>>
CHECK:         %[[O1:\w+]] = memref.subview %[[OUT]][0, 8] [4, 8] [1, 1]
CHECK-NEXT:    memref.copy %[[R1]], %[[O1]] : memref<4x8xf32> to memref<4x8xf32, strided<[16, 1], offset: 8>>
CHECK-NOT:     memref.copy
"""


def test_kernels_read_and_write_slices_in_place():
    from mlir_ansor.passes.drivers import views_into_kernels

    with ir.Context(), ir.Location.unknown():
        m = _front_ir(HALVES.replace("KERNEL", "k"))
        forward_output_copies(m)
        # two slices copied in, two results copied out
        filecheck(_func(m, "main"), HALVES_COPIED.replace("KERNEL", "k"))
        assert views_into_kernels(m) == 4
        m.operation.verify()
        text = str(m)
    # both calls share one copy of @k (inserted before it) taking strided
    # views at any offset; no copy, no buffer, no call of @k is left
    filecheck(text, r"""
CHECK:       func.func private @[[VIEW:k__view\w*]](
CHECK-SAME:    %{{\w+}}: memref<4x8xf32, strided<[16, 1], offset: ?>>, %{{\w+}}: memref<4x8xf32, strided<[16, 1], offset: ?>>)
CHECK-NOT:   func.func private @k__view
CHECK:       func.func private @k(
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<4x16xf32>, %[[OUT:\w+]]: memref<4x16xf32>)
CHECK-NOT:     memref.alloc
CHECK-NOT:     memref.copy
CHECK:         memref.subview %[[A]][0, 0] [4, 8] [1, 1]
CHECK:         memref.subview %[[A]][0, 8] [4, 8] [1, 1]
CHECK-NOT:     memref.alloc
CHECK-NOT:     memref.copy
CHECK:         memref.subview %[[OUT]][0, 0] [4, 8] [1, 1]
CHECK-NOT:     memref.alloc
CHECK-NOT:     memref.copy
CHECK:         call @[[VIEW]]({{.*}}) : (memref<4x8xf32, strided<[16, 1], offset: ?>>, memref<4x8xf32, strided<[16, 1], offset: ?>>) -> ()
CHECK-NOT:     memref.alloc
CHECK-NOT:     memref.copy
CHECK:         memref.subview %[[OUT]][0, 8] [4, 8] [1, 1]
CHECK-NOT:     memref.alloc
CHECK-NOT:     memref.copy
CHECK:         call @[[VIEW]](
CHECK-NOT:     memref.copy
CHECK-NOT:     memref.dealloc
CHECK:         return
""")


def test_a_kernel_that_reshapes_its_arguments_keeps_the_copies():
    from mlir_ansor.passes.drivers import views_into_kernels

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse("module {" + RESHAPING + HALVES.replace("KERNEL", "r") + "}")
        passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
        forward_output_copies(m)
        n = views_into_kernels(m)
        m.operation.verify()
        after = _func(m, "main")
        text = str(m)
    assert n == 0
    filecheck(after, HALVES_COPIED.replace("KERNEL", "r"))
    filecheck(text, "CHECK-NOT: r__view")


def test_compiled_slices_in_place_match_numpy(tmp_path):
    path = tmp_path / "halves.mlir"
    path.write_text("""
func.func @main(%a: tensor<4x16xf32>) -> tensor<4x16xf32> {
  %s0 = tensor.extract_slice %a[0, 0] [4, 8] [1, 1] : tensor<4x16xf32> to tensor<4x8xf32>
  %s1 = tensor.extract_slice %a[0, 8] [4, 8] [1, 1] : tensor<4x16xf32> to tensor<4x8xf32>
  %e = tensor.empty() : tensor<4x8xf32>
  %r0 = linalg.mul ins(%s0, %s0 : tensor<4x8xf32>, tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  %r1 = linalg.mul ins(%s1, %s1 : tensor<4x8xf32>, tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  %f = tensor.empty() : tensor<4x16xf32>
  %o0 = tensor.insert_slice %r1 into %f[0, 0] [4, 8] [1, 1] : tensor<4x8xf32> into tensor<4x16xf32>
  %o1 = tensor.insert_slice %r0 into %o0[0, 8] [4, 8] [1, 1] : tensor<4x8xf32> into tensor<4x16xf32>
  return %o1 : tensor<4x16xf32>
}
""")
    cm = mlir_ansor.compile(str(path), db=None)
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    want = np.concatenate([x[:, 8:] ** 2, x[:, :8] ** 2], axis=1)
    for _ in range(2):
        np.testing.assert_allclose(cm(x), want, rtol=1e-6)


# Kernels that must not take the driver's slice in place. @w fills the
# buffer it is given: the driver's copy of the slice is @w's to change, and
# the slice itself must not be. @u reads a slice of %a and writes all of %a:
# reading the slice in place would read what @u already overwrote.
WRITES_ITS_COPY = ("""
  func.func private @w(%b: memref<4x8xf32>) {
    %z = arith.constant 0.0 : f32
    linalg.fill ins(%z : f32) outs(%b : memref<4x8xf32>)
    return
  }""", "call @w(%t) : (memref<4x8xf32>) -> ()")
WRITES_THE_SLICED_BUFFER = ("""
  func.func private @u(%x: memref<4x8xf32>, %y: memref<4x16xf32>) {
    %z = arith.constant 0.0 : f32
    linalg.fill ins(%z : f32) outs(%y : memref<4x16xf32>)
    return
  }""", "call @u(%t, %a) : (memref<4x8xf32>, memref<4x16xf32>) -> ()")


@pytest.mark.parametrize("kernel, call", [WRITES_ITS_COPY, WRITES_THE_SLICED_BUFFER], ids=["writes-its-copy", "writes-the-sliced-buffer"])
def test_the_copy_stays_when_the_kernel_writes(kernel, call):
    from mlir_ansor.passes.drivers import views_into_kernels

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(kernel + """
  func.func @main(%a: memref<4x16xf32>) attributes {ansor.normalized} {
    %s = memref.subview %a[0, 8] [4, 8] [1, 1] : memref<4x16xf32> to memref<4x8xf32, strided<[16, 1], offset: 8>>
    %t = memref.alloc() : memref<4x8xf32>
    memref.copy %s, %t : memref<4x8xf32, strided<[16, 1], offset: 8>> to memref<4x8xf32>
    CALL
    memref.dealloc %t : memref<4x8xf32>
    return
  }""".replace("CALL", call))
        assert views_into_kernels(m) == 0
        # the slice is still copied into the buffer the kernel takes
        filecheck(_func(m, "main"), r"""
CHECK-LABEL: func.func @main(
CHECK:         %[[S:\w+]] = memref.subview
CHECK:         %[[T:\w+]] = memref.alloc() : memref<4x8xf32>
CHECK-NEXT:    memref.copy %[[S]], %[[T]]
CHECK-NEXT:    call @{{[uw]}}(%[[T]]
""")


@pytest.mark.parametrize(
    "size, threads, dynamic",
    [(512, 2, True), (512, 1, False), (64, 2, False)],
)
def test_large_kernels_schedule_their_parallel_loop_dynamically(size, threads, dynamic):
    """A kernel of at least DYNAMIC_MIN_FLOPS (512^3 GEMM: 268 MFLOP) on two
    threads gets ``schedule(dynamic)``; one thread, or a small kernel (64^3),
    keeps the static split."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.ir.attrs import FLOPS_ATTR
    from mlir_ansor.ir.program import load
    from mlir_ansor.passes.lowering import DYNAMIC_MIN_FLOPS, lower_to_llvm
    from mlir_ansor.schedule.apply import apply_schedule
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    (task,) = extract_tasks(load(text=workloads.matmul(size, size, size)))
    assert (task.flops >= DYNAMIC_MIN_FLOPS) == (size == 512)
    sk = generate_sketches(task.mlir, Target.host())[0]
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sk.payload, sk.concrete(default_assignment(sk, threads)))
        (fn,) = [o.operation for o in module.body.operations if o.operation.name == "func.func"]
        assert ir.IntegerAttr(fn.attributes[FLOPS_ATTR]).value == task.flops
        lower_to_llvm(module, threads)
        loops = re.findall(r"omp\.wsloop[^{]*", str(module))
    assert len(loops) == 1 and ("schedule(dynamic)" in loops[0]) == dynamic


def test_compiled_kernels_keep_their_operation_count():
    """`compile` schedules kernels through the same `apply_schedule`, so the
    kernels of the scheduled module carry their count into the lowering."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.ir.program import load

    cm = mlir_ansor.compile(load(text=workloads.matmul(512, 512, 512)), threads=2)
    assert re.search(r"func\.func @ansor_\w+\(.* attributes \{[^}]*ansor\.flops = 268435456", cm.mlir)


# A mask (i1) between two f32 ops, as torch-mlir's attention makes them: the
# mask's generic is left out of the tasks (its element type), and its buffer
# is stored as bytes (the wheels abort on a memref.store of i1).
MASKED = """
func.func @main(%a: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %z = arith.constant 0.0 : f32
  %em = tensor.empty() : tensor<4x8xi1>
  %m = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%a : tensor<4x8xf32>) outs(%em : tensor<4x8xi1>) {
    ^bb0(%x: f32, %o: i1):
      %c = arith.cmpf ogt, %x, %z : f32
      linalg.yield %c : i1
  } -> tensor<4x8xi1>
  %e = tensor.empty() : tensor<4x8xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%m, %a : tensor<4x8xi1>, tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) {
    ^bb0(%c: i1, %x: f32, %o: f32):
      %d = arith.mulf %x, %x : f32
      %s = arith.select %c, %d, %x : f32
      linalg.yield %s : f32
  } -> tensor<4x8xf32>
  %e2 = tensor.empty() : tensor<4x8xf32>
  %t = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%r : tensor<4x8xf32>) outs(%e2 : tensor<4x8xf32>) {
    ^bb0(%x: f32, %o: f32):
      %y = arith.addf %x, %x : f32
      linalg.yield %y : f32
  } -> tensor<4x8xf32>
  return %t : tensor<4x8xf32>
}
"""


def test_ops_on_masks_stay_out_of_tasks_and_masks_are_stored_as_bytes(tmp_path):
    from mlir_ansor.compiler import compile_untuned
    from mlir_ansor.passes.drivers import widen_bool_buffers

    path = tmp_path / "masked.mlir"
    path.write_text(MASKED)
    (task,) = mlir_ansor.extract_tasks(str(path))  # the last op only: the others read or write i1
    assert task.inputs[0].dtype == "f32" and task.flops == 32
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    want = 2 * np.where(x > 0, x * x, x)
    np.testing.assert_allclose(mlir_ansor.compile(str(path), db=None)(x), want, rtol=1e-6)
    np.testing.assert_allclose(compile_untuned(str(path))(x), want, rtol=1e-6)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(MASKED)
        passmanager.PassManager.parse(f"builtin.module({_front()},convert-linalg-to-loops)").run(m.operation)
        assert widen_bool_buffers(m) == 1
        m.operation.verify()
        filecheck(str(m), """
CHECK-NOT: xi1>
CHECK:     memref.alloc() {{.*}}: memref<4x8xi8>
CHECK-NOT: xi1>
""")


def test_a_folded_value_read_by_a_task_and_by_another_constant_op(tmp_path):
    """%c1 is computed from constants and read both by %c2 (also constant)
    and by the task: folding replaces %c2's operand, which changes its hash
    with these bindings; compile used to fail with a KeyError there."""
    path = tmp_path / "fold.mlir"
    ident = "affine_map<(i) -> (i)>"
    path.write_text(f"""
func.func @main(%x: tensor<8xf32>) -> tensor<8xf32> {{
  %w = arith.constant dense<[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]> : tensor<8xf32>
  %e = tensor.empty() : tensor<8xf32>
  %c1 = linalg.generic {{indexing_maps = [{ident}, {ident}], iterator_types = ["parallel"]}}
      ins(%w : tensor<8xf32>) outs(%e : tensor<8xf32>) {{
    ^bb0(%a: f32, %o: f32):
      %y = arith.mulf %a, %a : f32
      linalg.yield %y : f32
  }} -> tensor<8xf32>
  %c2 = linalg.generic {{indexing_maps = [{ident}, {ident}], iterator_types = ["parallel"]}}
      ins(%c1 : tensor<8xf32>) outs(%e : tensor<8xf32>) {{
    ^bb0(%a: f32, %o: f32):
      %y = arith.negf %a : f32
      linalg.yield %y : f32
  }} -> tensor<8xf32>
  %e2 = tensor.empty() : tensor<8xf32>
  %r = linalg.generic {{indexing_maps = [{ident}, {ident}, {ident}, {ident}], iterator_types = ["parallel"]}}
      ins(%x, %c1, %c2 : tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) outs(%e2 : tensor<8xf32>) {{
    ^bb0(%a: f32, %b: f32, %c: f32, %o: f32):
      %s = arith.addf %a, %b : f32
      %t = arith.mulf %s, %c : f32
      linalg.yield %t : f32
  }} -> tensor<8xf32>
  return %r : tensor<8xf32>
}}
""")
    x = np.arange(8, dtype=np.float32) / 4
    w = np.arange(8, dtype=np.float32)
    np.testing.assert_allclose(mlir_ansor.compile(str(path), db=None)(x), (x + w * w) * -(w * w), rtol=1e-6)


# A kernel that accumulates into a copy of its initial value (the form of a
# tuned kernel of one depth tap of a 3-D convolution), and a driver summing
# three terms through it.
ACCUMULATE = """
  func.func private @first(%a: memref<4x8xf32>, %out: memref<4x8xf32>) {
    linalg.add ins(%a, %a : memref<4x8xf32>, memref<4x8xf32>) outs(%out : memref<4x8xf32>)
    return
  }
  func.func private @acc(%a: memref<4x8xf32>, %init: memref<4x8xf32>, %out: memref<4x8xf32>) {
    memref.copy %init, %out : memref<4x8xf32> to memref<4x8xf32>
    linalg.add ins(%a, %out : memref<4x8xf32>, memref<4x8xf32>) outs(%out : memref<4x8xf32>)
    return
  }
  func.func @main(%a: memref<4x8xf32>, %b: memref<4x8xf32>, %c: memref<4x8xf32>, %r: memref<4x8xf32>) attributes {ansor.normalized} {
    %t = memref.alloc() : memref<4x8xf32>
    call @first(%a, %t) : (memref<4x8xf32>, memref<4x8xf32>) -> ()
    %u = memref.alloc() : memref<4x8xf32>
    call @acc(%b, %t, %u) : (memref<4x8xf32>, memref<4x8xf32>, memref<4x8xf32>) -> ()
    BETWEEN
    call @acc(%c, %u, %r) : (memref<4x8xf32>, memref<4x8xf32>, memref<4x8xf32>) -> ()
    AFTER
    memref.dealloc %t : memref<4x8xf32>
    memref.dealloc %u : memref<4x8xf32>
    return
  }"""


def _accumulate(between: str = "", after: str = "", last_input: str = "%c") -> tuple[int, str, str]:
    from mlir_ansor.passes.drivers import accumulate_in_place

    with ir.Context(), ir.Location.unknown():
        text = ACCUMULATE.replace("BETWEEN", between).replace("AFTER", after)
        m = ir.Module.parse(text.replace("call @acc(%c,", f"call @acc({last_input},"))
        n = accumulate_in_place(m)
        m.operation.verify()
        return n, _func(m, "main"), str(m)


def test_accumulating_kernels_add_to_the_output_in_place():
    n, driver, text = _accumulate()
    assert n == 2
    # every term lands in the output argument: no buffer, no copy; the
    # in-place kernel adds to its output without copying its initial value
    # first, and the original @acc is gone (no call needs it any more)
    filecheck(text, r"""
CHECK-NOT:   func.func private @acc(
CHECK-LABEL: func.func private @acc__inplace(
CHECK-SAME:    %[[X:\w+]]: memref<4x8xf32>, %{{\w+}}: memref<4x8xf32>, %[[ACC:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    linalg.add ins(%[[X]], %[[ACC]] : {{.*}}) outs(%[[ACC]] : memref<4x8xf32>)
CHECK-NEXT:    return
CHECK-NOT:   func.func private @acc(
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<4x8xf32>, %[[B:\w+]]: memref<4x8xf32>, %[[C:\w+]]: memref<4x8xf32>, %[[R:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    call @first(%[[A]], %[[R]])
CHECK-NEXT:    call @acc__inplace(%[[B]], %[[R]], %[[R]])
CHECK-NEXT:    call @acc__inplace(%[[C]], %[[R]], %[[R]])
CHECK-NEXT:    return
CHECK-NOT:   func.func private @acc(
""")


@pytest.mark.parametrize(
    "between, after, last_input",
    [
        # the output is written between the first term and the last call
        ("call @first(%c, %r) : (memref<4x8xf32>, memref<4x8xf32>) -> ()", "", "%c"),
        # the last call's initial value is read after it
        ("", "call @first(%u, %b) : (memref<4x8xf32>, memref<4x8xf32>) -> ()", "%c"),
        # the last call also reads its output buffer (as its other input)
        ("", "", "%r"),
    ],
    ids=["output-busy", "init-read-after", "input-is-the-output"],
)
def test_accumulating_in_place_keeps_the_copy_where_it_would_change_results(between, after, last_input):
    n, driver, _ = _accumulate(between, after, last_input)
    # the middle call still adds in place (into the buffer); the last one
    # keeps its copy: it calls @acc, which copies its initial value
    assert n == 1
    filecheck(driver, r"""
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[A:\w+]]: memref<4x8xf32>, %[[B:\w+]]: memref<4x8xf32>, %{{\w+}}: memref<4x8xf32>, %[[R:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    %[[T:\w+]] = memref.alloc() : memref<4x8xf32>
CHECK-NEXT:    call @first(%[[A]], %[[T]])
CHECK-NEXT:    call @acc__inplace(%[[B]], %[[T]], %[[T]])
CHECK-NOT:     call @acc__inplace(
CHECK:         call @acc(%{{\w+}}, %[[T]], %[[R]])
CHECK-NOT:     call @acc
CHECK:         memref.dealloc %[[T]]
""")


_LINEAR_RELU = """
func.func @linear(%x: tensor<4x32xf32>, %w: tensor<32x64xf32>, %b: tensor<64xf32>) -> tensor<4x64xf32> {
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4x64xf32>
  %z = linalg.fill ins(%cst : f32) outs(%e : tensor<4x64xf32>) -> tensor<4x64xf32>
  %mm = linalg.generic {indexing_maps = [affine_map<(i, j, k) -> (i, k)>, affine_map<(i, j, k) -> (k, j)>,
                                         affine_map<(i, j, k) -> (i, j)>],
                        iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%x, %w : tensor<4x32xf32>, tensor<32x64xf32>) outs(%z : tensor<4x64xf32>) {
  ^bb0(%a: f32, %bb: f32, %acc: f32):
    %prod = arith.mulf %a, %bb : f32
    %sum = arith.addf %acc, %prod : f32
    linalg.yield %sum : f32
  } -> tensor<4x64xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (j)>,
                                        affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%mm, %b : tensor<4x64xf32>, tensor<64xf32>) outs(%e : tensor<4x64xf32>) {
  ^bb0(%m: f32, %c: f32, %o: f32):
    %s = arith.addf %m, %c : f32
    linalg.yield %s : f32
  } -> tensor<4x64xf32>
  %relu = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                          iterator_types = ["parallel", "parallel"]}
      ins(%r : tensor<4x64xf32>) outs(%e : tensor<4x64xf32>) {
  ^bb0(%v: f32, %o: f32):
    %gt = arith.cmpf ugt, %v, %cst : f32
    %p = arith.select %gt, %v, %cst : f32
    linalg.yield %p : f32
  } -> tensor<4x64xf32>
  return %relu : tensor<4x64xf32>
}
"""


@pytest.mark.parametrize("source, sketch, knobs", [
    # A one-wide reduction tile (the peeled last step of u_d2 = 2 over
    # K = 33; odd rows are no longer offered u_d2 = 1) of a matmul written as
    # a generic (torch-mlir's form of a linear layer whose weight is an
    # argument), and a one-wide reduction vector: both leave a vector<Nx1>
    # shape cast.
    (_LINEAR_RELU.replace("4x32xf32", "4x33xf32").replace("32x64xf32", "33x64xf32"), "cpu-contraction",
     {"k_d2": 33, "p_d0": 3, "p_d1": 64, "r_d0": 1, "r_d1": 16, "u_d2": 2}),
    ("reduce_last", "cpu-reduction", {"p_d0": 8, "r_d0": 8, "rfactor": 0, "v_d1": 1}),
])
def test_shape_casts_of_unit_tiles_build_and_compute_right(source, sketch, knobs, tmp_path):
    """Lowering a shape cast that drops a trailing unit dimension beside
    canonicalization, which folds the lowered form back, never stopped: the
    builder grew to its memory limit and died (a crash record, 30 s per
    candidate). Now these schedules build in well under a second and match
    the reference."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.ir.program import load
    from mlir_ansor.measure.measurer import Candidate, Measurement, Measurer
    from mlir_ansor.measure.pool import ErrorKind
    from mlir_ansor.measure.runner import TimingPolicy
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import TuneConfig

    text = workloads.reduce_last(64, 300) if source == "reduce_last" else source
    task = max(extract_tasks(load(text=text)), key=lambda t: t.flops)
    (sk,) = [s for s in generate_sketches(task.mlir, Target.host()) if s.name == sketch]
    config = TuneConfig(build_timeout_s=20.0, timing=TimingPolicy(warmup=0, min_repeat=1, max_repeat=1,
                                                                  min_time_s=0.0))
    with Measurer(config) as m:
        data, ref = m.reference(sk.payload, task, 0, 0)
        assert ref.ok
        c = Candidate(sk, tuple(sorted(knobs.items())), data, so_path=m.path("c.so"))
        c.script = sk.concrete(c.knobs)
        (built,) = m.build([c])
        assert built.ok, built.error_msg
        meas = Measurement.of_run(m.run(c, task.tolerance), task.tolerance)
    assert meas.error_kind == ErrorKind.NONE, meas.error_msg


_UNROLLED_LOOP = """
import sys
from mlir import ir
from mlir_ansor.passes.artifacts import emit_object
from mlir_ansor.passes.lowering import lower_to_llvm
with ir.Context(), ir.Location.unknown():
    m = ir.Module.parse('''
func.func @k(%a: memref<4096xvector<8xf32>>, %b: memref<4096xvector<8xf32>>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %n = arith.constant 4096 : index
  scf.for %i = %c0 to %n step %c1 {
    %x = memref.load %a[%i] : memref<4096xvector<8xf32>>
    %y = memref.load %b[%i] : memref<4096xvector<8xf32>>
    %p = arith.mulf %x, %y : vector<8xf32>
    %q = arith.addf %p, %x : vector<8xf32>
    memref.store %q, %b[%i] : memref<4096xvector<8xf32>>
  }
  return
}''')
    lower_to_llvm(m)
    emit_object(m, sys.argv[1])
"""


def test_llvm_does_not_unroll_a_vector_loop_partially(tmp_path):
    """`artifacts.LLVM_OPTIONS` reach the LLVM the ExecutionEngine uses: a
    loop of vector ops with 4096 iterations is not unrolled (the loop
    vectorizer may still interleave it: 4 multiplies on Sapphire Rapids),
    where LLVM's defaults (``MLIR_ANSOR_LLVM_OPTIONS=""``) unroll it (by a
    factor that depends on the host's core: 8 on Zen 4, fewer on Sapphire
    Rapids); each build in a process of its own, since LLVM keeps the
    options in global state."""
    import os
    import subprocess
    import sys

    from mlir_ansor.passes.artifacts import llvm_options
    from mlir_ansor.passes.compile_cache import toolchain_key
    from mlir_ansor.passes.objcode import instruction_counts

    assert "-unroll-allow-partial=0" in llvm_options() and "-unroll-allow-partial=0" in toolchain_key()
    muls = {}
    for name, env in (("ours", {}), ("llvm", {"MLIR_ANSOR_LLVM_OPTIONS": ""})):
        obj = tmp_path / f"{name}.o"
        script = tmp_path / "emit.py"
        script.write_text(_UNROLLED_LOOP)
        subprocess.run([sys.executable, str(script), str(obj)], check=True, env={**os.environ, **env}, timeout=120)
        muls[name] = instruction_counts(obj, ["vmulps"])["vmulps"]
    assert muls["llvm"] >= 2 * muls["ours"] > 0, muls


def test_divisions_by_constants_may_use_the_reciprocal():
    """A GELU's ``x / sqrt(2)`` (scalar and splat divisors) gets ``arcp``, so
    LLVM multiplies by the reciprocal as PyTorch does; a division by a
    value stays exact, and other flags on the op are kept."""
    from mlir_ansor.passes.lowering import constant_divisors

    text = """
func.func @f(%x: f32, %y: f32, %v: vector<16xf32>) -> (f32, f32, vector<16xf32>, vector<16xf32>) {
  %c = arith.constant 1.41421354 : f32
  %s = arith.constant dense<3.0> : vector<16xf32>
  %b = vector.broadcast %c : f32 to vector<16xf32>
  %0 = arith.divf %x, %c fastmath<contract> : f32
  %1 = arith.divf %x, %y : f32
  %2 = arith.divf %v, %s : vector<16xf32>
  %3 = arith.divf %v, %b : vector<16xf32>
  return %0, %1, %2, %3 : f32, f32, vector<16xf32>, vector<16xf32>
}
"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert constant_divisors(m) == 3
        out = str(m)
    filecheck(out, r"""
CHECK: arith.divf %{{\w+}}, %{{\w+}} fastmath<arcp,contract> : f32
CHECK: arith.divf %{{\w+}}, %{{\w+}} : f32
CHECK: arith.divf %{{\w+}}, %{{\w+}} fastmath<arcp> : vector<16xf32>
CHECK: arith.divf %{{\w+}}, %{{\w+}} fastmath<arcp> : vector<16xf32>
""")


_LANE_LOADS = """
func.func @f(%a: memref<8x16xf32>, %i: index, %j: index) -> (f32, f32, vector<2xf32>, vector<2xi1>) {
  %v = vector.load %a[%i, %j] : memref<8x16xf32>, vector<2xf32>
  %x = vector.extract %v[0] : f32 from vector<2xf32>
  %y = vector.extract %v[1] : f32 from vector<2xf32>
  %w = vector.load %a[%j, %i] : memref<8x16xf32>, vector<2xf32>
  %z = vector.extract %w[1] : f32 from vector<2xf32>
  %b = arith.cmpf olt, %w, %w : vector<2xf32>
  return %x, %y, %w, %b : f32, f32, vector<2xf32>, vector<2xi1>
}
"""


def test_short_loads_read_lane_by_lane_become_scalar_loads():
    """A vector<2xf32> load whose lanes are only extracted (a register
    tile's A row, u = 2) is read as two scalars, so each broadcast of a lane
    reads memory; a load with another use stays whole."""
    from mlir_ansor.passes.lane_loads import scalarize_lane_loads

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(_LANE_LOADS)
        assert scalarize_lane_loads(module) == 1
        module.operation.verify()
        text = str(module)
    filecheck(
        text,
        """
        CHECK: %[[X:.*]] = memref.load %arg0[%arg1, %arg2]
        CHECK: %[[J1:.*]] = arith.addi %arg2, %c1
        CHECK: %[[Y:.*]] = memref.load %arg0[%arg1, %[[J1]]]
        CHECK: %[[W:.*]] = vector.load %arg0[%arg2, %arg1]
        CHECK: vector.extract %[[W]][1]
        CHECK: return %[[X]], %[[Y]], %[[W]]
        """,
    )
