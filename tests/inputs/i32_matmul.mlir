func.func @imm(%A: tensor<8x8xi32>, %B: tensor<8x8xi32>, %C: tensor<8x8xi32>) -> tensor<8x8xi32> {
  %r = linalg.matmul ins(%A, %B : tensor<8x8xi32>, tensor<8x8xi32>) outs(%C : tensor<8x8xi32>) -> tensor<8x8xi32>
  return %r : tensor<8x8xi32>
}
