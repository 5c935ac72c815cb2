#mA = affine_map<(m, n, k) -> (m, k)>
#mB = affine_map<(m, n, k) -> (k, n)>
#mC = affine_map<(m, n, k) -> (m, n)>
func.func @my_gemm(%x: tensor<128x64xf32>, %y: tensor<64x256xf32>) -> tensor<128x256xf32> {
  %zero = arith.constant 0.0 : f32
  %init = tensor.empty() : tensor<128x256xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%init : tensor<128x256xf32>) -> tensor<128x256xf32>
  %res = linalg.generic {indexing_maps = [#mA, #mB, #mC], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%x, %y : tensor<128x64xf32>, tensor<64x256xf32>) outs(%acc : tensor<128x256xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %p = arith.mulf %a, %b : f32
    %s = arith.addf %c, %p : f32
    linalg.yield %s : f32
  } -> tensor<128x256xf32>
  return %res : tensor<128x256xf32>
}
