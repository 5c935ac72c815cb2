func.func @matmul(%A: tensor<128x64xf32>, %B: tensor<64x256xf32>) -> tensor<128x256xf32> {
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<128x256xf32>
  %C = linalg.fill ins(%cst : f32) outs(%e : tensor<128x256xf32>) -> tensor<128x256xf32>
  %R = linalg.matmul ins(%A, %B : tensor<128x64xf32>, tensor<64x256xf32>) outs(%C : tensor<128x256xf32>) -> tensor<128x256xf32>
  return %R : tensor<128x256xf32>
}
