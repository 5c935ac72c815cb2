func.func @mlp(%x: tensor<32x64xf32>, %w1: tensor<64x64xf32>, %w2: tensor<64x64xf32>, %w3: tensor<64x16xf32>) -> tensor<32x16xf32> {
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<32x64xf32>
  %z = linalg.fill ins(%cst : f32) outs(%e : tensor<32x64xf32>) -> tensor<32x64xf32>
  %h1 = linalg.matmul ins(%x, %w1 : tensor<32x64xf32>, tensor<64x64xf32>) outs(%z : tensor<32x64xf32>) -> tensor<32x64xf32>
  %h2 = linalg.matmul ins(%h1, %w2 : tensor<32x64xf32>, tensor<64x64xf32>) outs(%z : tensor<32x64xf32>) -> tensor<32x64xf32>
  %e3 = tensor.empty() : tensor<32x16xf32>
  %z3 = linalg.fill ins(%cst : f32) outs(%e3 : tensor<32x16xf32>) -> tensor<32x16xf32>
  %h3 = linalg.matmul ins(%h2, %w3 : tensor<32x64xf32>, tensor<64x16xf32>) outs(%z3 : tensor<32x16xf32>) -> tensor<32x16xf32>
  return %h3 : tensor<32x16xf32>
}
