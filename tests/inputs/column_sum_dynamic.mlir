// Sums the rows of A: a reduction over the dynamic dimension, which is
// therefore not paddable (padded rows would be added in).
func.func @colsum(%A: tensor<?x32xf32>) -> tensor<32xf32> {
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<32xf32>
  %z = linalg.fill ins(%cst : f32) outs(%e : tensor<32xf32>) -> tensor<32xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (j)>],
      iterator_types = ["reduction", "parallel"]} ins(%A : tensor<?x32xf32>) outs(%z : tensor<32xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = arith.addf %x, %o : f32
    linalg.yield %y : f32
  } -> tensor<32xf32>
  return %r : tensor<32xf32>
}
