func.func @bad(%A: tensor<4x8xf32>, %B: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %r = linalg.matmul ins(%A, %B : tensor<4x8xf32>, tensor<4x8xf32>) outs(%A : tensor<4x8xf32>) -> tensor<4x8xf32>
  return %r : tensor<4x8xf32>
}
