func.func @splat(%x: f32, %C: tensor<8x8xf32>) -> tensor<8x8xf32> {
  %s = tensor.splat %x : tensor<8x8xf32>
  %r = linalg.add ins(%s, %C : tensor<8x8xf32>, tensor<8x8xf32>) outs(%C : tensor<8x8xf32>) -> tensor<8x8xf32>
  return %r : tensor<8x8xf32>
}
