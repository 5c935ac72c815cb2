BEGIN TRANSACTION;
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO "meta" VALUES('format','mlir-ansor-db');
INSERT INTO "meta" VALUES('schema_version','1');
CREATE TABLE records (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    workload_key TEXT NOT NULL,
    target       TEXT NOT NULL,
    sketch_hash  TEXT NOT NULL,
    knobs        TEXT NOT NULL,
    costs        TEXT NOT NULL,
    latency_s    REAL,
    error_kind   TEXT NOT NULL,
    error_msg    TEXT NOT NULL,
    host         TEXT NOT NULL,
    threads      INTEGER NOT NULL,
    build_s      REAL NOT NULL,
    timestamp    REAL NOT NULL,
    versions     TEXT NOT NULL,
    UNIQUE (workload_key, target, sketch_hash, knobs, host, threads, timestamp)
);
INSERT INTO "records" VALUES(1,'a7fd50a7d2497452','cuda:sm_90','6d256510836178db','[["b_d0",64],["b_d1",16],["cp_a",8],["cp_b",2],["k_d2",32],["t_d0",16],["t_d1",4]]','[]',NULL,'not_measured','built, not measured (build-only run); {"ptxas": {"kernel_kernel": {"registers": 64, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 10240, "barriers": 1}}, "launches": [{"entry": "kernel_kernel", "grid": [8, 1, 1], "block": [4, 16, 1], "args": [2, 0, 1], "dynamic_smem": 0}]}','AMD EPYC',1,6.51144308001676108688e-01,1.79603818928539681436e+09,'{"mlir_ansor": "0.1.0", "mlir": "22.1.8.4", "mlir_tools": "22.1.8.4", "llvm_tools": "22.1.8.2", "xgboost": "3.2.0", "numpy": "2.4.6", "python": "3.11.7", "seed": 2, "run": 1}');
INSERT INTO "records" VALUES(2,'a7fd50a7d2497452','cuda:sm_90','6d256510836178db','[["b_d0",16],["b_d1",16],["cp_a",8],["cp_b",8],["k_d2",64],["t_d0",4],["t_d1",8]]','[]',NULL,'not_measured','built, not measured (build-only run); {"ptxas": {"kernel_kernel": {"registers": 59, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 8192, "barriers": 1}}, "launches": [{"entry": "kernel_kernel", "grid": [8, 4, 1], "block": [8, 4, 1], "args": [2, 0, 1], "dynamic_smem": 0}]}','AMD EPYC',1,8.58092848000524099916e-01,1.7960381892927544117e+09,'{"mlir_ansor": "0.1.0", "mlir": "22.1.8.4", "mlir_tools": "22.1.8.4", "llvm_tools": "22.1.8.2", "xgboost": "3.2.0", "numpy": "2.4.6", "python": "3.11.7", "seed": 2, "run": 1}');
INSERT INTO "records" VALUES(3,'a7fd50a7d2497452','cuda:sm_90','6d256510836178db','[["b_d0",32],["b_d1",16],["cp_a",1],["cp_b",1],["k_d2",4],["t_d0",8],["t_d1",4]]','[]',NULL,'not_measured','built, not measured (build-only run); {"ptxas": {"kernel_kernel": {"registers": 64, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 768, "barriers": 1}}, "launches": [{"entry": "kernel_kernel", "grid": [8, 2, 1], "block": [4, 8, 1], "args": [2, 0, 1], "dynamic_smem": 0}]}','AMD EPYC',1,4.17385278000438120216e-01,1.79603818929881930348e+09,'{"mlir_ansor": "0.1.0", "mlir": "22.1.8.4", "mlir_tools": "22.1.8.4", "llvm_tools": "22.1.8.2", "xgboost": "3.2.0", "numpy": "2.4.6", "python": "3.11.7", "seed": 2, "run": 1}');
CREATE TABLE runs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    started      REAL NOT NULL,
    seed         INTEGER NOT NULL,
    target       TEXT NOT NULL,
    info         TEXT NOT NULL
);
INSERT INTO "runs" VALUES(1,1.79603818725274348255e+09,2,'cuda:sm_90','{"config": {"baseline_timing": {"max_repeat": 3, "min_repeat": 1, "min_time_s": 0.5, "warmup": 0}, "batch_size": 3, "build_only": true, "build_timeout_s": 120.0, "build_workers": null, "cost_model": "xgb", "cutoff_factor": 2.0, "default_candidate": true, "evolution": {"crossover": true, "eps_greedy": 0.1, "fallback_after": 32, "generations": 4, "init_measured": 32, "isolate_probes": true, "local_share": 0.25, "max_tries": 200, "min_distance": 3, "min_train": 16, "mutation_prob": 0.85, "population": 256}, "executor": "local", "hang_factor": 50.0, "max_sample_tries": 200, "memory_limit_mb": 6144, "min_run_timeout_s": 5.0, "opt_level": 3, "overlap": true, "packing": true, "pretrained_model": null, "rules": null, "run_timeout_s": 60.0, "runner_resource": null, "seed": 2, "strategy": "random", "task_scheduler": "gradient", "threads": 1, "timing": {"max_repeat": 50, "min_repeat": 3, "min_time_s": 0.05, "warmup": 0}, "trials": 3}, "host": {"cpu_count": 2, "machine": "x86_64", "model": "sm_90", "node": "vm", "platform": "Linux-6.18.44-fc-v595-x86_64-with-glibc2.36", "python_implementation": "CPython"}, "runner_host": "AMD EPYC", "target_info": {"arch": 90, "cores": 1, "features": ["sm_90"], "kind": "cuda", "max_registers_per_thread": 255, "max_threads_per_block": 1024, "model": "sm_90", "registers_per_block": 65536, "smem_per_block": 49152, "smem_per_block_optin": 232448, "vector_bits": 128, "warp_size": 32}, "tasks": ["a7fd50a7d2497452"], "versions": {"llvm_tools": "22.1.8.2", "mlir": "22.1.8.4", "mlir_ansor": "0.1.0", "mlir_tools": "22.1.8.4", "numpy": "2.4.6", "python": "3.11.7", "xgboost": "3.2.0"}}');
CREATE TABLE workloads (
    workload_key TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    task_mlir    TEXT NOT NULL,
    flops        INTEGER NOT NULL
);
INSERT INTO "workloads" VALUES('a7fd50a7d2497452','matmul_64x128x64_f32','module {
  func.func @kernel(%arg0: tensor<64x64xf32>, %arg1: tensor<64x128xf32>) -> tensor<64x128xf32> {
    %cst = arith.constant 0.000000e+00 : f32
    %0 = tensor.empty() : tensor<64x128xf32>
    %1 = linalg.fill ins(%cst : f32) outs(%0 : tensor<64x128xf32>) -> tensor<64x128xf32>
    %2 = linalg.matmul {ansor.anchor} ins(%arg0, %arg1 : tensor<64x64xf32>, tensor<64x128xf32>) outs(%1 : tensor<64x128xf32>) -> tensor<64x128xf32>
    return %2 : tensor<64x128xf32>
  }
}
',1048576);
CREATE INDEX records_best
    ON records (workload_key, target, latency_s);
CREATE INDEX records_keys
    ON records (workload_key, target, sketch_hash);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('runs',1);
INSERT INTO "sqlite_sequence" VALUES('records',3);
COMMIT;
