func.func @slice(%A: tensor<8x8xf32>, %B: tensor<4x8xf32>, %C: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %s = tensor.extract_slice %A[0, 0] [4, 8] [1, 1] : tensor<8x8xf32> to tensor<4x8xf32>
  %r = linalg.add ins(%s, %B : tensor<4x8xf32>, tensor<4x8xf32>) outs(%C : tensor<4x8xf32>) -> tensor<4x8xf32>
  return %r : tensor<4x8xf32>
}
