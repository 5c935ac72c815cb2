func.func @nothing(%A: tensor<8xf32>) -> tensor<8xf32> {
  return %A : tensor<8xf32>
}
