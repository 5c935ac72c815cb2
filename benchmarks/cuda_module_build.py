"""Build whole-module CUDA bundles for the GPU check (`cuda_module_check.py`
runs them on a GPU host that has no MLIR).

  .venv/bin/python benchmarks/cuda_module_build.py --out benchmarks/cuda_modules [--preset test]

Per module, OUT/<name>.cuda is the bundle `mlir-ansor compile --target
cuda:sm_90 -o <name>.cuda` writes (default GPU schedules, or the records of
--db), and OUT/index.json lists them with how to check each: the seed of its
random inputs (`measure.runner.random_inputs`, drawn again on the GPU host)
and the numpy reference of its workload (`examples.workloads.numpy_reference`,
float64); a module without one (mini_net) carries its expected outputs,
computed here by the untuned CPU build, in OUT/<name>.cuda/check.npz. Nothing
large is written: inputs are drawn on the GPU host, so the whole set is a
few hundred KiB, and 28 MB with the BERT layer's weights (the device
machine carries at most 64 MiB).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlir_ansor.cuda_compiler import build_bundle  # noqa: E402
from mlir_ansor.examples import workloads as W  # noqa: E402
from mlir_ansor.target import Target  # noqa: E402

#: name -> (module text, numpy reference name or "" for saved outputs)
FULL = {
    "gemm_f32_4096": (lambda: W.matmul(4096, 4096, 4096), "matmul"),
    "gemm_f16_4096": (lambda: W.matmul(4096, 4096, 4096, "f16"), "matmul"),
    "gemm_f32_1024": (lambda: W.matmul(1024, 1024, 1024), "matmul"),
    "conv_resnet_3x3": (lambda: W.conv_bias_relu(1, 58, 58, 64, 64, 3), "conv_bias_relu"),
    "softmax_1024": (lambda: W.softmax(1024, 1024), "softmax"),
    "mini_net": (lambda: (ROOT / "tests" / "inputs" / "mini_net.mlir").read_text(), ""),
    "bert_layer": (lambda: _bert_layer(), ""),
}


def _bert_layer() -> str:
    """The BERT-base layer of `examples.models` (sequence 128; 28 MB of
    weights, which the bundle carries as .npy files), imported through
    torch-mlir."""
    from mlir_ansor.examples.models import MODELS
    from mlir_ansor.importers.pytorch import import_module

    model, inputs = MODELS["bert_layer"](0)
    return import_module(model, inputs)
TEST = {k: FULL[k] for k in ("gemm_f32_1024", "softmax_1024", "mini_net")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "cuda_modules"))
    p.add_argument("--preset", choices=("full", "test"), default="full")
    p.add_argument("--target", default="cuda:sm_90")
    p.add_argument("--db", default=None, help="records database (default: the default GPU schedules)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S")
    target = Target.parse(args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for name, (text, ref) in (FULL if args.preset == "full" else TEST).items():
        start = time.perf_counter()
        src = out / f"{name}.mlir"
        src.write_text(text())
        folder = out / f"{name}.cuda"
        shutil.rmtree(folder, ignore_errors=True)
        plan = build_bundle(str(src), folder, db=args.db, target=target)
        entry = {"name": name, "bundle": folder.name, "seed": args.seed, "reference": ref,
                 "schedules": [f"{t['name']}: {t['schedule']} {t['sketch']}" for t in plan["tasks"]]}
        if not ref:
            from mlir_ansor.compiler import compile_untuned
            from mlir_ansor.measure.cuda_module import CudaModule
            from mlir_ansor.measure.runner import random_inputs

            inputs = random_inputs(CudaModule(folder).inputs, args.seed)
            cm = compile_untuned(str(src), widen=True)
            outs = cm(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            np.savez(folder / "check.npz", *outs)
            entry["reference"] = "check.npz"
        src.unlink()
        index.append(entry)
        print(f"{name}: {len(plan['kernels'])} kernel(s), {time.perf_counter() - start:.1f} s; "
              + "; ".join(entry["schedules"]), file=sys.stderr)
    (out / "index.json").write_text(json.dumps(index, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({len(index)} bundle(s), {size / 1024:.0f} KiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
