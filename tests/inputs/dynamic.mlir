func.func @dyn(%A: tensor<?x64xf32>, %B: tensor<64x32xf32>, %C: tensor<?x32xf32>) -> tensor<?x32xf32> {
  %r = linalg.matmul ins(%A, %B : tensor<?x64xf32>, tensor<64x32xf32>) outs(%C : tensor<?x32xf32>) -> tensor<?x32xf32>
  return %r : tensor<?x32xf32>
}
