// A 256x256x256 f32 matmul on tensors: the bundled example of `mlir-ansor tune`.
func.func @matmul(%A: tensor<256x256xf32>, %B: tensor<256x256xf32>) -> tensor<256x256xf32> {
  %zero = arith.constant 0.0 : f32
  %init = tensor.empty() : tensor<256x256xf32>
  %C = linalg.fill ins(%zero : f32) outs(%init : tensor<256x256xf32>) -> tensor<256x256xf32>
  %R = linalg.matmul ins(%A, %B : tensor<256x256xf32>, tensor<256x256xf32>)
                     outs(%C : tensor<256x256xf32>) -> tensor<256x256xf32>
  return %R : tensor<256x256xf32>
}
