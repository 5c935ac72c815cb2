func.func @matmul_buf(%A: memref<64x32xf64>, %B: memref<32x16xf64>, %C: memref<64x16xf64>) {
  %cst = arith.constant 0.0 : f64
  linalg.fill ins(%cst : f64) outs(%C : memref<64x16xf64>)
  linalg.matmul ins(%A, %B : memref<64x32xf64>, memref<32x16xf64>) outs(%C : memref<64x16xf64>)
  return
}
