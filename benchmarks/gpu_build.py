"""Build GPU candidates into a folder of cubins + a JSON manifest (needs MLIR
and ptxas, no GPU). `benchmarks/gpu_check.sh` times them on a GPU host.

    .venv/bin/python benchmarks/gpu_build.py --out benchmarks/gpu_artifacts -n 8
    .venv/bin/python benchmarks/gpu_build.py --preset test --out tests/inputs/gpu -n 5

Presets: "bench" (GEMM 4096 f16 and f32, ResNet-50 convs 3x3 and 1x1
64->64 at 56x56, NHWC f32), "test" (a 64^3 f32 GEMM and a 128x128x64 f16 GEMM: small
artifacts for the runner tests, one candidate per sketch with -n 5).
Candidates are sampled per sketch with a fixed seed, built in isolated
worker processes, and kept only when ptxas accepts them within the target's
limits (no spills, no stack frame, shared memory and registers within the
block's limits; `passes.nvvm.check_limits`). Most candidates go to the
staged sketches (`cuda-mma-smem`, `cuda-tiled`: shared-memory tiles,
accumulators in registers); every older sketch keeps at least one candidate,
so a GPU run still has a working fallback if a newer kernel is wrong. Each
manifest entry carries ptxas's figures and the features made of them
(`passes.nvvm.ptxas_features`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlir_ansor.examples import workloads  # noqa: E402
from mlir_ansor.measure.pool import WorkerPool  # noqa: E402
from mlir_ansor.search.generate import generate_sketches  # noqa: E402
from mlir_ansor.search.gpu_sketch import sample  # noqa: E402
from mlir_ansor.search.space import is_valid, make_assignment  # noqa: E402
from mlir_ansor.target import Target  # noqa: E402

#: First candidate of a sketch, when the workload allows it: the block and
#: warp/thread shapes hand-written CUDA GEMMs commonly use (a starting point
#: like the heuristic members of Ansor's initial population; the rest of the
#: set is sampled).
FIRST = {
    "cuda-mma-smem": {"b_d0": 128, "b_d1": 128, "w_d0": 64, "w_d1": 32, "k_d2": 32},
    "cuda-tiled": {"b_d0": 128, "b_d1": 128, "t_d0": 16, "t_d1": 16, "k_d2": 16},
    # 8 x 8 output pixels x 64 filters per block, 256 threads of 4 x 4
    # outputs; each K step (one filter tap, 16 channels) copies 256 16-byte
    # pieces of input and 256 of filter: one per thread, so cp.async applies
    "cuda-conv-smem": {"b_d1": 8, "b_d2": 8, "b_d3": 64, "t_d2": 2, "t_d3": 16, "k_d6": 16},
}

#: cp.async stages built for the FIRST candidate of a staged sketch (each one
#: valid under the target's shared-memory limit), so the device check times
#: stages 1 vs 2 vs 3 on the same tiles (GEMMs and convs).
STAGE_SWEEP = (1, 2, 3)

#: Sketches that stage operand tiles in shared memory and keep accumulators
#: in registers: they get the candidates the fallbacks do not.
STAGED = ("cuda-mma-smem", "cuda-tiled", "cuda-conv-smem")


def _build_one(payload: str, script: str, arch: str, cubin_path: str) -> dict:
    from mlir_ansor.passes.nvvm import build_cuda

    target = Target.cuda(arch)
    b = build_cuda(payload, script, target, cubin_path)
    out = b.to_json()
    out["dropped"] = b.dropped(target)
    return out


def presets(name: str) -> list[dict]:
    if name == "test":
        return [{"name": "gemm_64_f32", "kind": "matmul", "dtype": "f32", "mnk": [64, 64, 64],
                 "mlir": workloads.matmul(64, 64, 64, "f32"), "flops": 2 * 64**3},
                {"name": "gemm_128_f16", "kind": "matmul", "dtype": "f16", "mnk": [128, 128, 64],
                 "mlir": workloads.matmul(128, 128, 64, "f16"), "flops": 2 * 128 * 128 * 64}]
    n = 4096
    conv = dict(n=1, h=58, w=58, c=64, f=64, kh=3, kw=3)
    conv1 = dict(n=1, h=56, w=56, c=64, f=64, kh=1, kw=1)
    return [
        {"name": "gemm_4096_f16", "kind": "matmul", "dtype": "f16", "mnk": [n, n, n],
         "mlir": workloads.matmul(n, n, n, "f16"), "flops": 2 * n**3},
        {"name": "gemm_4096_f32", "kind": "matmul", "dtype": "f32", "mnk": [n, n, n],
         "mlir": workloads.matmul(n, n, n, "f32"), "flops": 2 * n**3},
        {"name": "resnet_conv3x3_64_56", "kind": "conv2d_nhwc", "dtype": "f32", "conv": conv,
         "mlir": workloads.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3), "flops": 2 * 56 * 56 * 64 * 64 * 9},
        {"name": "resnet_conv1x1_64_56", "kind": "conv2d_nhwc", "dtype": "f32", "conv": conv1,
         "mlir": workloads.conv2d_nhwc(1, 56, 56, 64, 64, 1, 1), "flops": 2 * 56 * 56 * 64 * 64},
    ]


def _split(n: int, names: list[str]) -> dict[str, int]:
    """How many candidates each sketch gets: one each first (when n allows),
    then the rest round-robin over the staged sketches (over all of them
    when a task has none)."""
    share = {k: 0 for k in names}
    for k in names[:n]:
        share[k] += 1
    favoured = [k for k in names if k in STAGED] or names
    for i in range(max(0, n - len(names))):
        share[favoured[i % len(favoured)]] += 1
    return share


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/gpu_artifacts")
    ap.add_argument("-n", type=int, default=8, help="candidates per workload")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="bench", choices=["bench", "test"])
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    target = Target.cuda(args.arch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.cubin"):
        old.unlink()
    manifest = {"target": target.key, "seed": args.seed, "workloads": []}
    t0 = time.perf_counter()
    pool = WorkerPool(args.workers or 2, memory_limit_mb=8192)
    try:
        for wl in presets(args.preset):
            sketches = generate_sketches(wl["mlir"], target)
            share = _split(args.n, [s.name for s in sketches])
            jobs, meta = [], []
            rng = random.Random(args.seed)
            for sk in sketches:
                seen = set()
                first = None
                if sk.name in FIRST and share[sk.name]:
                    for stages in STAGE_SWEEP[1:] if any(k.name == "stages" for k in sk.knobs) else ():
                        a = sk.complete(make_assignment({**FIRST[sk.name], "stages": stages}))
                        if is_valid(sk.knobs, a) and sk.violation(a) is None:
                            seen.add(a)
                            cubin = out / f"{wl['name']}_{len(jobs)}.cubin"
                            jobs.append((sk.payload, sk.concrete(a), args.arch, str(cubin)))
                            meta.append({"sketch": sk.name, "knobs": dict(a), "sketch_hash": sk.hash})
                    first = sk.complete(make_assignment({**FIRST[sk.name], "stages": 1}))
                    if not is_valid(sk.knobs, first) or sk.violation(first) is not None:
                        first = None
                extra = len(seen)  # the stage sweep comes on top of the sketch's share
                for _ in range(share[sk.name] * 4):
                    if len(seen) >= share[sk.name] + extra:
                        break
                    a, first = (first, None) if first is not None else (sample(sk, rng), None)
                    if a in seen:
                        continue
                    seen.add(a)
                    cubin = out / f"{wl['name']}_{len(jobs)}.cubin"
                    jobs.append((sk.payload, sk.concrete(a), args.arch, str(cubin)))
                    meta.append({"sketch": sk.name, "knobs": dict(a), "sketch_hash": sk.hash})
            results = pool.map(_build_one, jobs, timeout_s=300)
            cands = []
            for m, r, job in zip(meta, results, jobs):
                if not r.ok:
                    print(f"{wl['name']}: {m['sketch']} {m['knobs']}: build failed: {r.error_msg.strip()[-300:]}", file=sys.stderr)
                    continue
                if r.value["dropped"]:
                    print(f"{wl['name']}: {m['sketch']} {m['knobs']}: dropped: {r.value['dropped']}", file=sys.stderr)
                    Path(job[3]).unlink(missing_ok=True)
                    continue
                cands.append({**m, **r.value})
                fig = next(iter(r.value["ptxas"].values()))
                feats = r.value["features"]
                print(f"{wl['name']:>22} {m['sketch']:>17} regs {fig['registers']:>3} spill {fig['spill_stores']} "
                      f"stack {fig['stack']} smem {fig['smem']:>6} occ {feats['occupancy']:.2f} "
                      f"grid {r.value['launches'][0]['grid']} block {r.value['launches'][0]['block']} {m['knobs']}")
            entry = {k: v for k, v in wl.items() if k != "mlir"}
            entry["candidates"] = cands
            manifest["workloads"].append(entry)
    finally:
        pool.close()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out}/manifest.json: {sum(len(w['candidates']) for w in manifest['workloads'])} candidates, "
          f"{size / 1024:.0f} KiB, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
