// A tiny network: dense weights (non-splat constants), a matmul with a fused
// bias and ReLU, a row reduction, a broadcast division, and a reshape.
#id = affine_map<(d0, d1) -> (d0, d1)>
#col = affine_map<(d0, d1) -> (d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @net(%x: tensor<8x16xf32>) -> (tensor<2x4x8xf32>, tensor<8xf32>) {
  %w = arith.constant dense<[[0.024, 0.901, -0.712, 0.897, -0.376, -0.153, 0.655, -0.182], [0.099, -0.945, 0.507, 0.076, -0.341, 0.577, -0.394, -0.093], [-0.732, -0.194, -0.593, -0.475, 0.501, -0.439, -0.030, 0.961], [0.923, 0.450, 0.082, -0.446, -0.679, 0.940, 0.032, -0.768], [0.247, 0.553, 0.226, 0.835, -0.921, 0.057, -0.081, -0.875], [0.283, 0.705, 0.186, -0.480, 0.680, 0.019, 0.022, 0.506], [-0.704, 0.639, 0.367, 0.574, -0.617, 0.605, -0.617, -0.837], [0.710, 0.723, 0.753, -0.056, -0.452, -0.986, 0.291, 0.440], [0.671, -0.436, -0.570, 0.279, 0.610, 0.927, -0.699, -0.036], [0.789, -0.155, 0.179, -0.951, 0.347, 0.838, 0.654, 0.771], [0.321, -0.509, 0.537, -0.577, 0.663, -0.875, 0.651, -0.671], [-0.250, -0.367, 0.383, -0.643, -0.207, -0.988, -0.475, -0.158], [-0.788, 0.266, -0.239, 0.451, 0.308, -0.138, 0.735, 0.264], [0.621, -0.316, 0.087, -0.607, 0.992, -0.514, -0.486, -0.854], [-0.484, 0.526, 0.396, -0.743, -0.248, -0.158, 0.330, -0.088], [0.173, 0.679, 0.453, -0.270, -0.103, -0.265, -0.781, -0.594]]> : tensor<16x8xf32>
  %b = arith.constant dense<[-0.432, -0.372, -0.374, 0.153, 0.943, 0.549, 0.582, 0.519]> : tensor<8xf32>
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<8x8xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<8x8xf32>) -> tensor<8x8xf32>
  %mm = linalg.matmul ins(%x, %w : tensor<8x16xf32>, tensor<16x8xf32>) outs(%z : tensor<8x8xf32>) -> tensor<8x8xf32>
  %biased = linalg.generic {indexing_maps = [#id, #col, #id], iterator_types = ["parallel", "parallel"]}
      ins(%mm, %b : tensor<8x8xf32>, tensor<8xf32>) outs(%e : tensor<8x8xf32>) {
  ^bb0(%a: f32, %c: f32, %o: f32):
    %s = arith.addf %a, %c : f32
    linalg.yield %s : f32
  } -> tensor<8x8xf32>
  %relu = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%biased : tensor<8x8xf32>) outs(%e : tensor<8x8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %m = arith.maximumf %a, %zero : f32
    linalg.yield %m : f32
  } -> tensor<8x8xf32>
  %e1 = tensor.empty() : tensor<8xf32>
  %init = linalg.fill ins(%one : f32) outs(%e1 : tensor<8xf32>) -> tensor<8xf32>
  %sum = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%relu : tensor<8x8xf32>) outs(%init : tensor<8xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %s = arith.addf %a, %acc : f32
    linalg.yield %s : f32
  } -> tensor<8xf32>
  %norm = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%relu, %sum : tensor<8x8xf32>, tensor<8xf32>) outs(%e : tensor<8x8xf32>) {
  ^bb0(%a: f32, %s: f32, %o: f32):
    %d = arith.divf %a, %s : f32
    linalg.yield %d : f32
  } -> tensor<8x8xf32>
  %r = tensor.expand_shape %norm [[0, 1], [2]] output_shape [2, 4, 8] : tensor<8x8xf32> into tensor<2x4x8xf32>
  return %r, %sum : tensor<2x4x8xf32>, tensor<8xf32>
}
