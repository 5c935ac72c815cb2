"""What a tuned model costs in time: the trials and the wall time `tune`
needs before the compiled model runs 1.2x faster than the best peer (PyTorch
eager, `torch.compile`'s Inductor, IREE), with and without the cost model
shipped in the package (`--pretrained-model builtin`), and what `compile`
of the result costs, cold and warm.

For every model (`mlir_ansor.examples.models`, seeded random weights): the
peers are timed first, in turns (`timing.interleaved_medians`; IREE through
its own venv, `iree_peer.py`, its best flags); the goal is the best peer's
latency / `--goal`. Then, for each arm (cold: the cost model learns from this
run's records only; builtin: it starts from the shipped one) and each budget
of the ladder (`--budgets`, trials for the whole model; 0: no tuning, every
task gets its default schedule), a fresh database is
tuned with that budget by one `mlir-ansor tune` process, as a user would
(nothing an earlier rung made is in memory; its figure is the tune's own
``tuning_time_s``); its best records are compiled in a fresh process twice
(`mlir_ansor.compile`: cold, the cache beside the database empty, then warm,
from the cached objects), then here, checked against PyTorch, and the
compiled module timed in turns with the best peer.
With `--stop-at-goal` an arm stops at the first budget that reaches the
goal. One table at the end: per arm and budget, the tune's wall time and the phases it spent it in
(`TuneResult.profile`), the compile times, the latency and its ratio to the
best peer (>1: ours faster); then per arm the first budget that reached the
goal, and the first within `--near` of the best ratio of the whole run
(where a cost model that starts trained should need fewer trials).

Usage:
  python benchmarks/tune_cost.py [--models resnet50,bert_layer] [--threads 1]
                                 [--budgets "resnet50=0,64,128,256;bert_layer=0,16,64,128"]
                                 [--arms cold,builtin] [--goal 1.2] [--stop-at-goal] [--near 0.05]
                                 [--keep DIR] [--peers eager,compile,iree] [--flush-caches on|off]
Needs the 'torch' extra (torch and torch-mlir); IREE: `bash benchmarks/setup_peers.sh --iree`.
Run it alone on the machine: it times tuning, and tuning times kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iree_peer import DEFAULT_IREE_PYTHON, Iree  # noqa: E402
from timing import interleaved_medians  # noqa: E402

import mlir_ansor  # noqa: E402

DEFAULT_BUDGETS = "resnet50=0,64,128,256;bert_layer=0,16,64,128"
ARMS = {"cold": None, "builtin": "builtin"}
PHASES = ("reference", "propose", "build_wait", "measure", "learn", "retime")


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def parse_budgets(text: str) -> dict[str, list[int]]:
    """"resnet50=64,128;bert_layer=32" -> {model: [trials, ...]}."""
    out: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, ladder = part.partition("=")
        if not ladder:
            raise SystemExit(f"--budgets: {part!r} is not MODEL=N1,N2,...")
        out[name.strip()] = sorted(int(v) for v in ladder.split(","))
    return out


def cli_tune(path: str, db: str, trials: int, threads: int, seed: int, pretrained: str | None, flush: bool = True) -> dict:
    """`mlir-ansor tune ... --json` in a fresh process, as a user runs it
    (nothing made by an earlier tune of this benchmark is in memory): its
    JSON, with ``wall_s`` (the process's whole time, start-up and import of
    the module included)."""
    cmd = [sys.executable, "-m", "mlir_ansor.tools.cli", "tune", path, "--trials", str(trials),
           "--threads", str(threads), "--seed", str(seed), "--db", db, "--json", "--progress", "none"]
    if pretrained:
        cmd += ["--pretrained-model", pretrained]
    if flush:
        cmd.append("--flush-caches")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        raise SystemExit(f"tune failed ({proc.returncode}): {tail[-1] if tail else ''}")
    return {**json.loads(proc.stdout), "wall_s": wall}


def compile_in_fresh_process(path: str, db: str, threads: int) -> float:
    """Seconds `mlir_ansor.compile` of the module with the database takes in
    a fresh process (cold when the cache beside the database is empty, warm
    once a compile filled it), import of our package not counted."""
    code = (
        "import sys, time, mlir_ansor; t0 = time.perf_counter(); "
        "mlir_ansor.compile(sys.argv[1], db=sys.argv[2], threads=int(sys.argv[3]), cache_dir=sys.argv[2] + '.cache')"
        ".close(); "
        "print(time.perf_counter() - t0)"
    )
    proc = subprocess.run([sys.executable, "-c", code, path, db, str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        print(f"compile failed: {tail[-1] if tail else proc.returncode}", file=sys.stderr)
        return float("nan")
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert_layer")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budgets", default=DEFAULT_BUDGETS, help="per model, the ladder of trial budgets")
    ap.add_argument("--arms", default="cold,builtin", help="of: cold, builtin")
    ap.add_argument("--goal", type=float, default=1.2, help="the speed-up over the best peer to reach")
    ap.add_argument("--stop-at-goal", action="store_true", help="end an arm's ladder at the first budget that reaches the goal")
    ap.add_argument("--near", type=float, default=0.05,
                    help="also report the trials to come within this share of the best ratio of the whole run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flush-caches", choices=("on", "off"), default="on",
                    help="tune with `--flush-caches`, as `models.py` does: kernels timed with their weights in "
                         "memory, as a model runs them (off: warm timings, which pick schedules that run "
                         "slower in the model: BERT 20.1 ms against 18.2)")
    ap.add_argument("--keep", default=None, help="folder for the MLIR and the databases (default: a temporary one)")
    ap.add_argument("--peers", default="eager,compile,iree", help="of: eager, compile (torch.compile), iree")
    ap.add_argument("--iree-python", default=DEFAULT_IREE_PYTHON, help="python of IREE's env")
    args = ap.parse_args()
    budgets = parse_budgets(args.budgets)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    peers = {p.strip() for p in args.peers.split(",") if p.strip()}

    import torch

    from mlir_ansor.examples import models
    from mlir_ansor.importers.pytorch import import_module

    torch.set_num_threads(args.threads)
    wd_ctx = tempfile.TemporaryDirectory(prefix="ansor-tune-cost-") if args.keep is None else None
    wd = args.keep or wd_ctx.name
    os.makedirs(wd, exist_ok=True)
    rows: list[dict] = []
    peer_rows: dict[str, dict[str, float]] = {}
    for name in args.models.split(","):
        model, inputs = models.MODELS[name](args.seed)
        model.eval()
        path = os.path.join(wd, f"{name}.mlir")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(import_module(model, inputs))
        x = [i.numpy() for i in inputs]
        with torch.no_grad():
            want = model(*inputs).numpy()
        fns = {}
        if "eager" in peers:
            fns["eager"] = lambda m=model, i=inputs: m(*i)
        if "compile" in peers:
            inductor = torch.compile(model)
            with torch.no_grad():
                inductor(*inputs)
            fns["torch.compile"] = lambda c=inductor, i=inputs: c(*i)
        with torch.no_grad():
            peer = interleaved_medians(fns) if fns else {}
        iree = None
        if "iree" in peers:
            if os.path.exists(args.iree_python):
                work = SimpleNamespace(name=name, path=path, arrays=x, reference=[want])
                iree = Iree(args.iree_python, wd, ["best"], min_time=1.0)
                timed, _ = iree.latencies(work, args.threads)
                peer.update({f"IREE {fs}": v for fs, v in timed.items()})
            else:
                print(f"IREE: no {args.iree_python} (bash benchmarks/setup_peers.sh --iree); not timed", file=sys.stderr)
        if not peer:
            raise SystemExit("no peer was timed: the goal needs one (--peers)")
        best_name, best_s = min(peer.items(), key=lambda kv: kv[1])
        peer_rows[name] = peer
        goal_s = best_s / args.goal
        print(
            f"{name}: peers " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in peer.items())
            + f"; goal {goal_s * 1e3:.2f} ms ({args.goal}x {best_name})",
            file=sys.stderr,
            flush=True,
        )
        for arm in arms:
            for trials in budgets.get(name, []):
                if trials == 0 and arm != arms[0]:  # no tuning: the same for every arm
                    rows.append({**next(r for r in rows if r["model"] == name and r["budget"] == 0), "arm": arm})
                    if args.stop_at_goal and rows[-1]["ratio"] >= args.goal:
                        break
                    continue
                db = os.path.join(wd, f"{name}_{arm}_{trials}.db")
                for stale in (db, db + "-wal", db + "-shm"):
                    if os.path.exists(stale):
                        os.remove(stale)
                shutil.rmtree(db + ".cache", ignore_errors=True)  # compiled cold: no objects of an earlier run
                # Budget 0: no tuning; compile gives every task its default schedule.
                res = (
                    cli_tune(path, db, trials, args.threads, args.seed, ARMS[arm], args.flush_caches == "on")
                    if trials
                    else None
                )
                tune_s = res["tuning_time_s"] if res else 0.0
                compile_s = compile_in_fresh_process(path, db, args.threads)  # cold: the cache was emptied
                warm_s = compile_in_fresh_process(path, db, args.threads)
                cm = mlir_ansor.compile(path, db=db, threads=args.threads, cache_dir=db + ".cache")
                err = _rel_err(np.asarray(cm(*x)), want)
                run, _ = cm.bind(*x)
                # The best peer timed again: in turns with ours, or (IREE, in
                # its own process) right after.
                with torch.no_grad():
                    timed = interleaved_medians({"ours": run, **({best_name: fns[best_name]} if best_name in fns else {})})
                cm.close()
                ours = timed["ours"]
                best_now = timed.get(best_name, best_s)
                if iree is not None and best_name.startswith("IREE "):
                    again = iree.time(work, args.threads, [best_name[len("IREE "):]])
                    best_now = next((v for v in again.values() if isinstance(v, float)), best_s)
                row = dict(
                    model=name, arm=arm, trials=res["trials"] if res else 0, budget=trials, tune_s=tune_s,
                    tune_wall_s=res["wall_s"] if res else 0.0,
                    phases={k: (res.get("profile") or {}).get(k, 0.0) for k in PHASES} if res else {},
                    compile_s=compile_s, warm_compile_s=warm_s, ours=ours, best_peer=best_name, best_peer_s=best_now,
                    ratio=best_now / ours, err=err,
                )
                rows.append(row)
                print(
                    f"{name} {arm} {trials} trials: tuned in {tune_s:.0f} s, compiled in {compile_s:.1f} s "
                    f"(warm {warm_s:.1f} s), {ours * 1e3:.2f} ms against {best_name} {best_now * 1e3:.2f} ms: "
                    f"{best_now / ours:.2f}x; rel err {err:.1e}",
                    file=sys.stderr,
                    flush=True,
                )
                if args.stop_at_goal and best_now / ours >= args.goal:
                    break
    report(rows, peer_rows, args)
    if args.keep:
        with open(os.path.join(wd, "tune_cost.json"), "w") as f:
            json.dump({"rows": rows, "peers": peer_rows}, f, indent=1)
    if wd_ctx is not None:
        wd_ctx.cleanup()


def report(rows: list[dict], peers: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\n{args.threads} thread(s); goal: {args.goal}x the best peer; ratios > 1: mlir-ansor is faster")
    for name, peer in peers.items():
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in peer.items()))
    head = (
        f"{'model':<11} {'arm':<8} {'trials':>6} {'tune s':>7} {'ref.':>5} {'prop.':>5} {'build':>5} {'learn':>5} "
        f"{'compile s':>9} {'warm s':>6} {'ours ms':>8} {'best peer':>16} {'ratio':>6}  goal"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ph = r["phases"]
        print(
            f"{r['model']:<11} {r['arm']:<8} {r['trials']:>6} {r['tune_s']:>7.0f} {ph.get('reference', 0):>5.0f} "
            f"{ph.get('propose', 0):>5.0f} {ph.get('build_wait', 0):>5.0f} {ph.get('learn', 0):>5.0f} "
            f"{r['compile_s']:>9.1f} {r['warm_compile_s']:>6.1f} {r['ours'] * 1e3:>8.2f} "
            f"{r['best_peer'] + ' ' + format(r['best_peer_s'] * 1e3, '.2f'):>16} {r['ratio']:>5.2f}x  "
            f"{'reached' if r['ratio'] >= args.goal else 'not yet'}"
        )
    for name in peers:
        mine = [r for r in rows if r["model"] == name]
        if not mine:
            continue
        # Ratios, not latencies: each is timed beside its peer, so it holds
        # while the machine's speed drifts from one rung to the next.
        best = max(r["ratio"] for r in mine)
        for arm in dict.fromkeys(r["arm"] for r in mine):
            ladder = [r for r in mine if r["arm"] == arm]
            hit = [r for r in ladder if r["ratio"] >= args.goal]
            near = [r for r in ladder if r["ratio"] >= best * (1 - args.near)]
            print(
                f"{name} {arm}: "
                + (f"{args.goal}x the best peer after {hit[0]['trials']} trials, {hit[0]['tune_s']:.0f} s of tuning"
                   if hit else f"{args.goal}x not reached within the ladder")
                + (f"; within {args.near:.0%} of the run's best ratio ({best:.2f}x) after {near[0]['trials']} "
                   f"trials, {near[0]['tune_s']:.0f} s" if near else f"; never within {args.near:.0%} of the run's best")
                + f"; best ratio {max(r['ratio'] for r in ladder):.2f}x"
            )


if __name__ == "__main__":
    main()
