func.func @mask(%a: tensor<8x8xf32>) -> tensor<8x8xi1> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x8xi1>
  %m = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>], iterator_types = ["parallel", "parallel"]} ins(%a : tensor<8x8xf32>) outs(%e : tensor<8x8xi1>) {
  ^bb0(%x: f32, %o: i1):
    %c = arith.cmpf ogt, %x, %z : f32
    linalg.yield %c : i1
  } -> tensor<8x8xi1>
  return %m : tensor<8x8xi1>
}
