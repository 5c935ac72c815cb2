func.func @broken(%A: tensor<4x4xf32>) -> tensor<4x4xf32> {
  %e = tensor.empty() : tensor<4x4xf32>
  %r = linalg.matmul ins(%A, %A : tensor<4x4xf32>, tensor<4x4xf32>) outs(%e : tensor<4x4xf32> -> tensor<4x4xf32>
  return %r : tensor<4x4xf32>
}
