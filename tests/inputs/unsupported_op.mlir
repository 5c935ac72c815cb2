func.func @concat(%A: tensor<4x8xf32>, %B: tensor<4x8xf32>, %C: tensor<8x8xf32>) -> tensor<8x8xf32> {
  %s = tensor.concat dim(0) %A, %B : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
  %r = linalg.add ins(%s, %C : tensor<8x8xf32>, tensor<8x8xf32>) outs(%C : tensor<8x8xf32>) -> tensor<8x8xf32>
  return %r : tensor<8x8xf32>
}
