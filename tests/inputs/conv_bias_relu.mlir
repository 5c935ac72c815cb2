#bias = affine_map<(n, h, w, f) -> (f)>
#id = affine_map<(n, h, w, f) -> (n, h, w, f)>
func.func @conv_block(%img: tensor<1x58x58x64xf32>, %filt: tensor<3x3x64x128xf32>, %b: tensor<128xf32>) -> tensor<1x56x56x128xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<1x56x56x128xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<1x56x56x128xf32>) -> tensor<1x56x56x128xf32>
  %conv = linalg.conv_2d_nhwc_hwcf {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}
      ins(%img, %filt : tensor<1x58x58x64xf32>, tensor<3x3x64x128xf32>) outs(%acc : tensor<1x56x56x128xf32>) -> tensor<1x56x56x128xf32>
  %e2 = tensor.empty() : tensor<1x56x56x128xf32>
  %biased = linalg.generic {indexing_maps = [#id, #bias, #id], iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%conv, %b : tensor<1x56x56x128xf32>, tensor<128xf32>) outs(%e2 : tensor<1x56x56x128xf32>) {
  ^bb0(%x: f32, %y: f32, %o: f32):
    %s = arith.addf %x, %y : f32
    linalg.yield %s : f32
  } -> tensor<1x56x56x128xf32>
  %relu = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel", "parallel", "parallel"]}
      ins(%biased : tensor<1x56x56x128xf32>) outs(%e2 : tensor<1x56x56x128xf32>) {
  ^bb0(%x: f32, %o: f32):
    %m = arith.maximumf %x, %zero : f32
    linalg.yield %m : f32
  } -> tensor<1x56x56x128xf32>
  return %relu : tensor<1x56x56x128xf32>
}
