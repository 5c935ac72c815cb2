"""The `mlir-ansor` command line: parse arguments, call the API, print.

Subcommands (shared/DESIGN.md, "The command line"):
  tune [INPUT] [--target cpu|cuda[:sm_XX]] [--trials N] [--db FILE] [--threads N] [--seed N] [--profile]
       [--timeout S] [--memory-limit MB] [--executor local|auto|ray://ADDR] [--json] [--build-only]
       [--no-reference-cache]
       [--search NAME] [--cost-model NAME] [--task-scheduler NAME] [--rules a,b]
       [--plugin MODULE_OR_FILE.py]... [--pretrained-model FILE]
       [--no-cost-model] [--no-crossover] [--no-packing] [--random-task-scheduler]
       [--no-default-candidate] [--share-best] [--local-share F] [--retime-top N] [--retime-rounds R]
  compile [INPUT] [--db FILE] [--threads N] [-o OUT.mlir|OUT.so] [--cache-dir DIR] [--no-cache]
  run [INPUT] [--db FILE] [--threads N] [--repeat N] [--memory-limit MB] [--json] [--cache-dir DIR] [--no-cache]
  show FILE.db [--json]
  plot FILE.db [-o curve.png] [--input MODULE.mlir]
  peak [--threads N] [--json]
  export FILE.db [--task NAME_OR_KEY] [-o schedule.mlir] [--payload payload.mlir]
  opt [INPUT] --pass-pipeline='builtin.module(...)' [-o OUT] [--print-ir-after-all]
  export-dataset FILE.db -o DIR            measured candidates for offline training (docs/dataset.md)
  train-model DIR -o model.json            fit a cost model on an exported dataset
  replay FILE.db [--top K] [--json]        rebuild and re-measure the best records; drift
  import MODEL.onnx [-o MODEL.mlir]        ONNX in, Linalg out (torch-mlir's ONNX importer)

User errors (bad input, unsupported ops, a corrupt database) print one
message to stderr and exit with status 2; nothing reaches the user as a
Python traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from importlib import resources

from mlir_ansor.errors import AnsorError, InputError
from mlir_ansor.version import version_line

EXAMPLE = "matmul_256.mlir"


def _example_path() -> str:
    return str(resources.files("mlir_ansor") / "examples" / EXAMPLE)


def _positive(kind, zero_ok: bool = False):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if v < 0 or (v == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"expected a {'non-negative' if zero_ok else 'positive'} number, got {text!r}")
        return v

    return parse


class _VersionAction(argparse.Action):
    """``--version``: one unwrapped line (argparse's own action wraps it)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_line())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlir-ansor", description="Auto-scheduler for MLIR Linalg.")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    p.add_argument("--version", action=_VersionAction,
                   help="print our version and the MLIR wheels' versions, and exit")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tune", help="search schedules for every task of a module")
    t.add_argument("input", nargs="?", help="MLIR file ('-' for stdin) or ONNX model (.onnx); default: a bundled 256^3 matmul")
    t.add_argument("--target", default="cpu",
                   help="cpu (the host), or cuda / cuda:sm_XX (NVIDIA: builds need ptxas, measuring needs a GPU)")
    t.add_argument("--trials", type=_positive(int), default=64, help="candidates to measure (whole module)")
    t.add_argument("--db", default="tuning.db", help="records database (created or resumed)")
    t.add_argument("--threads", type=_positive(int), default=1, help="threads the kernels use")
    t.add_argument("--seed", type=_positive(int, zero_ok=True), default=0, help="random seed: the same seed gives the same candidates")
    t.add_argument("--timeout", type=_positive(float), default=60.0, help="seconds per build and per run")
    t.add_argument("--memory-limit", type=_positive(int), default=6144, metavar="MB",
                   help="MiB each builder and runner process may allocate (its data rlimit; default 6144); "
                        "a task whose buffers would not fit is refused before anything is allocated")
    t.add_argument("--batch-size", type=_positive(int), default=16, help="candidates built before measuring")
    t.add_argument("--func", default=None, help="tune only this function")
    t.add_argument("--no-between", action="store_true",
                   help="with --sizes: do not also measure the sizes between those given that a library of the "
                        "function specialises (the powers of two between sizes more than twice apart), each on its "
                        "default point and its neighbours' best schedules (TuneConfig.carry)")
    t.add_argument("--sizes", action="append", default=[], metavar="ARG.DIM=V1,V2,...",
                   help="sizes of a dynamic dimension (argument ARG's dimension DIM, 0-based), for example "
                        "0.0=1,16,64, or 0.0=..N for a spread up to N (the powers of 4 below N, and N): the "
                        "function is tuned at each size (each combination, with several); dimensions the ops "
                        "tie to it take the same size")
    t.add_argument("--profile", action="store_true",
                   help="print where the tuning time went, phase by phase (--json always has it, as 'profile')")
    t.add_argument("--search", default="evolutionary",
                   help="search strategy: evolutionary, random, or a registered one (default evolutionary)")
    t.add_argument("--cost-model", default="xgb", help="cost model of the evolutionary search: xgb, random, or registered")
    t.add_argument("--task-scheduler", default="gradient",
                   help="which task gets the next batch: gradient, round-robin, random, or registered")
    t.add_argument("--rules", default=None,
                   help="comma-separated sketch rules to run (default: all registered; the default schedule is always added)")
    t.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import a module (or a .py file) that registers rules, models, strategies or schedulers; repeatable")
    t.add_argument("--local-share", type=float, default=0.0, metavar="F",
                   help="share of every evolutionary batch given to the incumbent's one-knob neighbours "
                        "(EvolutionConfig.local_share; default 0)")
    t.add_argument("--retime-top", type=_positive(int), default=4, metavar="N",
                   help="when the search ends, time each task's N best schedules again (default 4)")
    t.add_argument("--retime-rounds", type=_positive(int, zero_ok=True), default=3, metavar="R",
                   help="timings of each re-timed schedule, taking turns; the pick is made on all of a "
                        "schedule's timings (default 3; 0: no re-timing)")
    t.add_argument("--flush-caches", action="store_true",
                   help="evict the caches before each timed run, so kernels are timed with their inputs in memory, "
                        "as a model's kernels find their weights (TimingPolicy.flush_caches; keep such records in "
                        "a database of their own)")
    t.add_argument("--share-best", action="store_true",
                   help="seed each batch with the best schedule of a task whose sketch has the same knobs "
                        "(one per batch; off by default, see TuneConfig.share_best)")
    t.add_argument("--no-transfer", action="store_true",
                   help="do not seed a task's search with the best schedules of the same task at other sizes "
                        "(tuned before into the database, or in this run: tune --sizes; TuneConfig.transfer)")
    t.add_argument("--pretrained-model", default=None, metavar="FILE",
                   help="a saved cost model to start the evolutionary search from (transfer learning); "
                        "'builtin': the one shipped in the package, trained on the bundled operators and models")
    ab = t.add_argument_group("ablations (one flag each)")
    ab.add_argument("--no-cost-model", action="store_true", help="rank candidates at random (cost model 'random')")
    ab.add_argument("--no-crossover", action="store_true", help="evolutionary search with mutations only")
    ab.add_argument("--no-packing", action="store_true", help="drop the packing alternative of multi-level tiling")
    ab.add_argument("--random-task-scheduler", action="store_true", help="give each batch to a random task")
    ab.add_argument("--no-default-candidate", action="store_true",
                    help="do not measure the rule's default point first (random points only)")
    t.add_argument("--executor", default="local", metavar="local|auto|ray://ADDR",
                   help="where candidates are built and measured: local worker processes (default), "
                        "auto (Ray: a running cluster, else a local instance), or ray://HOST:PORT (a Ray cluster)")
    t.add_argument("--build-only", action="store_true",
                   help="build (for cuda: and ptxas-check) candidates without measuring them; records are "
                        "'not_measured' (or the build error / 'ptxas_limit'), and a later run on the same --db "
                        "with a GPU measures them. For a cuda target on a machine without a GPU")
    t.add_argument("--no-reference-cache", action="store_true",
                   help="compute every task's reference and untuned baseline again, not from DB.cache/references")
    t.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    t.add_argument("--progress", choices=("auto", "live", "log", "none"), default="auto",
                   help="progress display: live on a terminal, log lines otherwise (auto)")

    c = sub.add_parser("compile", help="compile a module with the best schedules of a records database")
    c.add_argument("input", nargs="?", help="MLIR file ('-' for stdin) or ONNX model (.onnx); default: a bundled 256^3 matmul")
    c.add_argument("--target", default="cpu", help="cpu (the host), or cuda[:sm_XX] (NVIDIA: kernels and a host plan)")
    c.add_argument("--db", default="tuning.db", help="records database (a missing file: default schedules)")
    c.add_argument("--threads", type=_positive(int), default=1, help="threads the kernels use")
    c.add_argument("--untuned", action="store_true", help="naive lowering for every task (ignore --db)")
    c.add_argument("--sizes", action="append", default=[], metavar="ARG.DIM=V1,V2,...",
                   help="a function with dynamic dimensions: the sizes to specialise in its one library, which "
                        "dispatches among them at run time (default: the sizes the database has records for); "
                        "with --static, the one size to build")
    c.add_argument("--static", action="store_true",
                   help="with --sizes: build the function's static specialization at one size, no dispatch")
    c.add_argument("--func", default=None, help="the function with dynamic dimensions")
    c.add_argument("-o", "--output", default=None,
                   help="OUT.mlir (scheduled MLIR) or OUT.so (shared library); default: MLIR on stdout. With "
                        "--target cuda: OUT.ptx (every kernel's PTX in one file; default: on stdout), or a bundle "
                        "folder, a name ending in .cuda or / (kernels' PTX and cubins, weights, and plan.json: "
                        "the buffers and launches that `mlir_ansor.measure.cuda_module.CudaModule` runs)")
    c.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import a module that registers the sketch rules the records were made with")
    c.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="compile cache: kernels' object code, folded constants and whole compiles, reused by the "
                        "next compile of the same thing (default: $MLIR_ANSOR_CACHE_DIR, else DB.cache beside --db)")
    c.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the compile cache (also: MLIR_ANSOR_NO_CACHE=1)")

    r = sub.add_parser("run", help="compile, run on random inputs, time, and check against the untuned module")
    r.add_argument("input", nargs="?", help="MLIR file ('-' for stdin) or ONNX model (.onnx); default: a bundled 256^3 matmul")
    r.add_argument("--target", default="cpu", help="cpu (the host), or cuda[:sm_XX] (needs a GPU here)")
    r.add_argument("--db", default="tuning.db", help="records database (a missing file: default schedules)")
    r.add_argument("--threads", type=_positive(int), default=1, help="threads the kernels use")
    r.add_argument("--repeat", type=_positive(int), default=10,
                   help="timed runs of the compiled module (the median is reported); the untuned reference "
                        "is timed as often within about a second, at least once")
    r.add_argument("--seed", type=_positive(int, zero_ok=True), default=0, help="seed of the random inputs")
    r.add_argument("--reference", choices=("auto", "numpy", "untuned"), default="auto",
                   help="what the outputs are checked against: numpy (the function evaluated in numpy, sums in "
                        "float64: seconds, no untimed speedup), untuned (the module lowered without schedules: "
                        "its build costs a minute on ResNet-50, and it is timed for the speedup), or auto: the "
                        "untuned build where the compile cache holds it, else numpy where it evaluates every op, "
                        "else the untuned build")
    r.add_argument("--cache-dir", default=None, metavar="DIR", help="compile cache folder (as for compile)")
    r.add_argument("--no-cache", action="store_true", help="neither read nor write the compile cache")
    r.add_argument("--func", default=None, help="the function to run (default: the first with tasks)")
    r.add_argument("--sizes", action="append", default=[], metavar="ARG.DIM=V",
                   help="run and check a function with dynamic dimensions at these sizes (one per dimension), "
                        "for example 0.0=333")
    r.add_argument("--memory-limit", type=_positive(int), default=None, metavar="MB",
                   help="MiB the run's arrays and libraries may allocate (a data rlimit while it runs); "
                        "a module whose buffers would not fit is refused before anything is allocated "
                        "(default: 80%% of this machine's memory, or of its cgroup's limit)")
    r.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    r.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import a module that registers the sketch rules the records were made with")

    s = sub.add_parser("show", help="summarize a records database (per task: best, GFLOP/s, %% of peak, errors)")
    s.add_argument("db")
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    pl = sub.add_parser("plot", help="plot the tuning curves of a records database")
    pl.add_argument("db")
    pl.add_argument("-o", "--output", default="curve.png", help="image file (.png, .svg, .pdf); default curve.png")
    pl.add_argument("--input", default=None, help="the tuned module: weights of its tasks for the end-to-end curve")
    pl.add_argument("--title", default=None)

    pk = sub.add_parser("peak", help="measure the machine's FMA peak and memory bandwidth, and cache them")
    pk.add_argument("--threads", type=_positive(int), default=None, help="threads of the multi-thread figures (default: all cores)")
    pk.add_argument("--min-time", type=_positive(float), default=0.3, help="seconds each figure is measured for")
    pk.add_argument("--cache", default=None, help="cache file (default: $MLIR_ANSOR_PEAK or ~/.cache/mlir-ansor/peak.json)")
    pk.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    e = sub.add_parser("export", help="the best schedule of a task as a transform script mlir-opt applies")
    e.add_argument("db")
    e.add_argument("--task", default=None, help="task name or workload key (default: the only task)")
    e.add_argument("-o", "--output", default=None, help="schedule file (default: stdout)")
    e.add_argument("--payload", default=None, help="also write the tagged task module the schedule applies to")
    e.add_argument("--threads", type=_positive(int), default=None, help="only records measured on this many threads")
    e.add_argument("--target", default="cpu", help="cpu (the host)")
    e.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import a module that registers the sketch rules the records were made with")

    ed = sub.add_parser("export-dataset", help="write every measured candidate (task, script, features, costs) to a folder")
    ed.add_argument("db")
    ed.add_argument("-o", "--output", required=True, help="output folder (docs/dataset.md describes its files)")
    ed.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                    help="import a module that registers the sketch rules the records were made with")

    tm = sub.add_parser("train-model", help="fit a cost model on an exported dataset and save it (for --pretrained-model)")
    tm.add_argument("dataset", help="a folder written by export-dataset")
    tm.add_argument("-o", "--output", required=True, help="model file to write")
    tm.add_argument("--cost-model", default="xgb", help="which cost model (xgb, or a registered one)")
    tm.add_argument("--seed", type=_positive(int, zero_ok=True), default=0)
    tm.add_argument("--plugin", action="append", default=[], metavar="MODULE")

    rp = sub.add_parser("replay", help="rebuild and re-measure the best records of a database; report drift")
    rp.add_argument("db")
    rp.add_argument("--top", type=_positive(int), default=1, help="records per task (the best K)")
    rp.add_argument("--threads", type=_positive(int), default=None, help="only records measured on this many threads")
    rp.add_argument("--target", default="cpu", help="cpu (the host)")
    rp.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    rp.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    o = sub.add_parser("opt", help="run an mlir-opt style pass pipeline mixing upstream and mlir-ansor passes")
    o.add_argument("input", nargs="?", default="-", help="MLIR file ('-' for stdin, the default)")
    o.add_argument("--pass-pipeline", required=True,
                   help="e.g. 'builtin.module(canonicalize,ansor-apply-best{db=tuning.db},ansor-lower-to-llvm)'")
    o.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    o.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every element (stderr)")
    im = sub.add_parser("import", help="import an ONNX model as Linalg-on-tensors MLIR (through torch-mlir)")
    im.add_argument("input", help="the model (.onnx)")
    im.add_argument("-o", "--output", default="-", help="the MLIR file to write ('-': stdout, the default)")
    return p


def _check_output(path: str, flag: str = "-o") -> None:
    """Fail, before any work, on an output file that cannot be written: a
    folder, a missing or non-folder parent, no permission."""
    if path == "-":
        return
    where = f"{flag} {path}"
    if os.path.isdir(path):
        raise InputError(f"{where}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise InputError(f"{where}: the folder {os.path.dirname(path) or parent} does not exist")
    if not os.path.isdir(parent):
        raise InputError(f"{where}: {os.path.dirname(path)} is a file, not a folder")
    if (os.path.exists(path) and not os.access(path, os.W_OK)) or not os.access(parent, os.W_OK):
        raise InputError(f"{where}: cannot write (permission denied)")


def _write_text(path: str, text: str, flag: str = "-o") -> None:
    _check_output(path, flag)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot write: {e.strerror or e}") from None


def _fmt_s(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.1f} us"


def _sized(args: argparse.Namespace, source: str, one: bool) -> str:
    return _sized_carried(args, source, one)[0]


def _sized_carried(args: argparse.Namespace, source: str, one: bool) -> tuple[str, tuple[str, ...]]:
    """`source`, or with ``--sizes`` a file of its static specializations
    (`graph.dynamic.specializations`; `one`: a single size per dimension,
    the function keeping its name). The file is named by its text's digest
    in a ``sized`` folder of the compile cache (``DB.cache``), so that a
    second run of the same sizes finds its compiles cached. For tune (not
    `one`), the file also holds the sizes between those named that a
    library specialises (`dispatch.sizes_to_tune`, unless
    ``--no-between``); their functions' names come second, for
    `TuneConfig.carry`."""
    if not args.sizes:
        return source, ()
    import hashlib

    from mlir_ansor.graph.dynamic import parse_sizes, size_label, specializations
    from mlir_ansor.importers import load as load_any

    sizes = parse_sizes(args.sizes)
    if one and any(len(v) > 1 for v in sizes.values()):
        raise InputError(f"--sizes: {args.command} takes one size per dimension (tune takes several)")
    program = load_any(source)
    with program.context:
        text = str(program.module)
    carried: tuple[str, ...] = ()
    if one:
        sized, made = specializations(text, sizes, func=args.func, keep_name=True)
    else:
        from mlir_ansor.dispatch import sizes_to_tune

        sized, made, carried = sizes_to_tune(text, sizes, func=args.func, between=not args.no_between)
    digest = hashlib.sha256(sized.encode()).hexdigest()[:16]
    folder = os.path.join(getattr(args, "cache_dir", None) or (args.db + ".cache"), "sized")
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(os.path.basename(source))[0] if source != "-" else "stdin"
    path = os.path.join(folder, f"{stem}-{digest}.mlir")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(sized)
        os.replace(tmp, path)
    labels = "; ".join(f"@{name} ({size_label(vals)}{', carried' if name in carried else ''})" for name, vals in made)
    logging.getLogger("mlir_ansor").info("--sizes: %s, in %s", labels, path)
    return path, carried


def _cmd_tune(args: argparse.Namespace) -> int:
    import dataclasses

    from mlir_ansor.measure.executor import parse_executor
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import TuneConfig, tune

    executor = parse_executor(args.executor)
    target = Target.parse(args.target)
    source, carried = _sized_carried(args, args.input or _example_path(), one=False)
    config = dataclasses.replace(config_from_args(args, TuneConfig), executor=executor, carry=carried)
    from mlir_ansor.tools.progress import ProgressDisplay

    if args.progress == "none":
        result = tune(source, target=target, config=config, db=args.db, func=None if args.sizes else args.func)
    else:
        live = {"auto": None, "live": True, "log": False}[args.progress]
        with ProgressDisplay(sys.stderr, live=live) as display:
            result = tune(source, target=target, config=config, db=args.db, func=None if args.sizes else args.func,
                          on_progress=display)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(f"tuned {source} on {target.model} ({target.key}), {args.threads} thread(s), {result.measured} trials "
          f"in {result.elapsed_s:.1f} s ({result.candidates_per_s:.2f} candidates/s)")
    header = f"{'task':<44} {'weight':>6} {'trials':>6} {'untuned':>11} {'tuned':>11} {'GFLOP/s':>8} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for r in result.tasks:
        found = math.isfinite(r.best_latency_s) and r.best_latency_s > 0
        speed = r.baseline_latency_s / r.best_latency_s if found else math.nan
        speed_s = f"{speed:.1f}x" if math.isfinite(speed) else "-"
        gflops_s = f"{r.gflops:.1f}" if found and math.isfinite(r.gflops) else "-"
        print(
            f"{r.task.name[:44]:<44} {r.task.weight:>6} {r.trials:>6} {_fmt_s(r.baseline_latency_s):>11} "
            f"{_fmt_s(r.best_latency_s):>11} {gflops_s:>8} {speed_s:>8}"
        )
        if r.errors:
            print(f"{'':<4}errors: " + ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())))
    print(f"whole module: {_fmt_s(result.latency_s)} (records in {result.db_path})")
    if args.profile:
        _print_profile(result)
    if config.build_only:
        print("build only: nothing was measured; run the same command without --build-only on a host with "
              "the target's hardware (same --db) to measure what was built")
        if target.kind == "cuda":
            from mlir_ansor.measure.gpu_measure import bundle_dir

            print(f"or, on a GPU host without MLIR, with {result.db_path}, {bundle_dir(result.db_path)}/ and the "
                  f"mlir_ansor package copied there: python -m mlir_ansor.measure.gpu_measure {result.db_path}")
    return 0


def _print_profile(result) -> None:
    """`tune --profile`: wall seconds per phase, and the builders' own time."""
    from mlir_ansor.tuner import PHASES

    prof = result.profile_json()
    total = result.elapsed_s or 1.0
    print(f"where the {result.elapsed_s:.1f} s went:")
    for name, what in (*PHASES, ("other", "the rest: task scheduling, the driver")):
        print(f"  {name:<11} {prof[name]:>8.2f} s {100 * prof[name] / total:>5.1f}%  {what}")
    per = prof["builder_s"] / prof["builds"] if prof["builds"] else 0.0
    print(f"  builders    {prof['builder_s']:>8.2f} s in worker processes, {prof['builds']} builds "
          f"({per:.2f} s each; they overlap measuring)")


def _load_plugins(args: argparse.Namespace) -> None:
    from mlir_ansor.search.registry import load_plugin

    for spec in getattr(args, "plugin", None) or []:
        load_plugin(spec)


def _share(x: float) -> float:
    if not 0.0 <= x <= 1.0:
        raise InputError(f"--local-share must be between 0 and 1, got {x}")
    return x


def config_from_args(args: argparse.Namespace, config_cls):
    """The `TuneConfig` that the `tune` flags describe (plugins imported
    first, so the names they register can be selected). The ablation flags
    override the corresponding selections."""
    from mlir_ansor.measure.runner import TimingPolicy
    from mlir_ansor.search.strategy import EvolutionConfig

    _load_plugins(args)
    rules = tuple(r.strip() for r in args.rules.split(",") if r.strip()) if args.rules else None
    return config_cls(
        trials=args.trials,
        threads=args.threads,
        seed=args.seed,
        batch_size=args.batch_size,
        build_timeout_s=max(args.timeout, 1.0),
        run_timeout_s=max(args.timeout, 1.0),
        memory_limit_mb=getattr(args, "memory_limit", None) or config_cls.memory_limit_mb,
        strategy=args.search,
        cost_model="random" if args.no_cost_model else args.cost_model,
        task_scheduler="random" if args.random_task_scheduler else args.task_scheduler,
        rules=rules,
        packing=not args.no_packing,
        default_candidate=not args.no_default_candidate,
        reference_cache=not args.no_reference_cache,
        share_best=args.share_best,
        transfer=not args.no_transfer,
        evolution=EvolutionConfig(crossover=not args.no_crossover, local_share=_share(args.local_share)),
        pretrained_model=args.pretrained_model,
        build_only=getattr(args, "build_only", False),
        retime_top=args.retime_top,
        retime_rounds=args.retime_rounds,
        **({"timing": TimingPolicy(flush_caches=True)} if getattr(args, "flush_caches", False) else {}),
    )


def _cmd_export_dataset(args: argparse.Namespace) -> int:
    from mlir_ansor.tools.dataset import export_dataset

    _load_plugins(args)
    s = export_dataset(args.db, args.output)
    skipped = ", ".join(f"{v} {k}" for k, v in s.skipped.items()) or "none"
    print(f"wrote {s.candidates} candidate(s) of {s.tasks} task(s) ({s.valid} valid) to {s.out_dir}; "
          f"skipped: {skipped}", file=sys.stderr)
    return 0


def _cmd_train_model(args: argparse.Namespace) -> int:
    from types import SimpleNamespace

    from mlir_ansor.search.registry import make_cost_model
    from mlir_ansor.tools.dataset import load, train_cost_model

    _load_plugins(args)
    _check_output(args.output)
    ds = load(args.dataset)
    model = make_cost_model(SimpleNamespace(cost_model=args.cost_model, seed=args.seed, pretrained_model=None))
    train_cost_model(ds, model)
    if not model.trained:
        raise AnsorError(f"{args.dataset}: too few valid candidates ({int(ds.valid.sum())}) to train a model")
    try:
        model.save(args.output)
    except OSError as e:
        raise InputError(f"-o {args.output}: cannot write: {e.strerror or e}") from None
    print(f"trained {args.cost_model} on {len(ds)} candidate(s) of {len(ds.tasks)} task(s); wrote {args.output}",
          file=sys.stderr)
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from mlir_ansor.target import Target
    from mlir_ansor.tools.replay import replay

    _load_plugins(args)
    report = replay(args.db, top=args.top, target=Target.parse(args.target), threads=args.threads)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    header = f"{'task':<40} {'rank':>4} {'threads':>7} {'recorded':>11} {'now':>11} {'drift':>7}  note"
    print(header)
    print("-" * len(header))
    for r in report.rows:
        drift = f"{r.drift:.2f}x" if math.isfinite(r.drift) else "-"
        notes = [r.error] if r.error else []
        if r.other_host:
            notes.append(f"recorded on {r.recorded_host}")
        if r.changed_versions:
            notes.append("versions changed: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in r.changed_versions.items()))
        print(f"{r.name[:40]:<40} {r.rank:>4} {r.threads:>7} {_fmt_s(r.old_latency_s):>11} "
              f"{_fmt_s(r.new_latency_s):>11} {drift:>7}  {'; '.join(notes)}")
    if not report.rows:
        print(f"no valid record for target {report.target} in {args.db}")
    for reason, n in report.skipped.items():
        print(f"skipped {n} record(s): {reason}")
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    import shutil

    from mlir_ansor.compiler import compile as compile_module
    from mlir_ansor.target import Target

    _load_plugins(args)
    target = Target.parse(args.target)
    source = args.input or _example_path()
    out = args.output
    if target.kind == "cuda":
        return _compile_cuda(args, target, _sized(args, source, one=True), out)
    if out is not None:
        if not out.endswith((".so", ".mlir")):
            raise AnsorError(f"-o {out}: expected a file name ending in .mlir or .so")
        _check_output(out)
    db = None if args.untuned else args.db
    cache_dir = False if args.no_cache else (args.cache_dir or (None if db is not None else args.db + ".cache"))
    default = "naive" if args.untuned else "sketch"
    if not args.static and _may_be_dynamic(source):
        from mlir_ansor.dispatch import dynamic_entry

        if dynamic_entry(source, args.func) is not None:
            return _compile_dispatch(args, target, source, db, cache_dir, default)
    source = _sized(args, source, one=True)
    if out is None or out.endswith(".mlir"):  # the scheduled module: no code generation needed
        from mlir_ansor.compiler import schedule_module
        from mlir_ansor.passes.compile_cache import cache_for

        text = schedule_module(source, db=db, threads=args.threads, target=target, default=default,
                               cache=cache_for(cache_dir, db)).mlir
        if out is None:
            sys.stdout.write(text)
        else:
            _write_text(out, text)
            print(f"wrote {out}", file=sys.stderr)
        return 0
    cm = compile_module(source, db=db, threads=args.threads, target=target, default=default, cache_dir=cache_dir)
    try:
        shutil.copyfile(cm.library_path, out)
    except OSError as e:
        raise InputError(f"-o {out}: cannot write: {e.strerror or e}") from None
    entries = ", ".join(f"_mlir_ciface_{name}" for name in cm.functions)
    print(f"wrote {out} (C entry points: {entries}; memref descriptors, inputs then outputs)", file=sys.stderr)
    return 0


def _may_be_dynamic(source: str) -> bool:
    """Whether an MLIR file's text has a shaped type with a dynamic
    dimension (a quick look before parsing it; stdin is not read twice)."""
    import re

    if source == "-" or not source.endswith(".mlir") or not os.path.isfile(source):
        return False
    with open(source, "rb") as f:
        text = f.read()
    end = text.rfind(b"{-#")  # not in the weights' hex (a regular expression over ResNet-50's took 4 s)
    end = len(text) if end < 0 else end
    return text.find(b"?", 0, end) >= 0 and re.compile(rb"\b(tensor|memref)<[^<>]*\?").search(text, 0, end) is not None


def _compile_dispatch(args: argparse.Namespace, target, source: str, db, cache_dir, default: str) -> int:
    """`compile` of a function with dynamic dimensions: one library that
    dispatches among its specialised sizes (`dispatch.build_library`), with
    the database, cache folder and default schedule `_cmd_compile` chose
    (which also checked ``-o``); ``-o X.so`` also writes ``X.so.json``,
    what `DynamicLibrary.load` reads."""
    from mlir_ansor.dispatch import build_library
    from mlir_ansor.graph.dynamic import parse_sizes

    out = args.output
    lib = build_library(source, sizes=parse_sizes(args.sizes) if args.sizes else None, db=db, threads=args.threads,
                        target=target, default=default, entry=args.func, cache_dir=cache_dir)
    table = "; ".join(lib.to_json()["dispatch"])
    if out is None:
        sys.stdout.write(lib.mlir)
    elif out.endswith(".so"):
        try:
            side = lib.save(out)
        except OSError as e:
            raise InputError(f"-o {out}: cannot write: {e.strerror or e}") from None
        print(f"wrote {out} and {side} (C entry point _mlir_ciface_{lib.entry}: memref descriptors with their "
              f"sizes, inputs then outputs; dispatch: {table})", file=sys.stderr)
    else:
        _write_text(out, lib.mlir)
        print(f"wrote {out} (dispatch: {table})", file=sys.stderr)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from mlir_ansor.target import Target as _Target

    if _Target.parse(args.target).kind == "cuda":
        return _cmd_run_cuda(args)
    import statistics

    import numpy as np

    from mlir_ansor.compiler import compile as compile_module
    from mlir_ansor.compiler import compile_untuned
    from mlir_ansor.ir.dtypes import tolerance
    from mlir_ansor.measure.pool import data_limit, default_memory_limit_mb, is_memory_error
    from mlir_ansor.measure.runner import TimingPolicy, random_inputs, relative_error, time_callable
    from mlir_ansor.target import Target

    _load_plugins(args)
    target = Target.parse(args.target)
    source = _sized(args, args.input or _example_path(), one=True)
    limit_mb = args.memory_limit or default_memory_limit_mb()
    cm = compile_module(source, db=args.db, threads=args.threads, target=target, entry=args.func,
                        cache_dir=False if args.no_cache else args.cache_dir)
    ins_spec, outs_spec, _ = cm.functions[cm.entry]
    _check_run_memory(cm.entry, ins_spec, outs_spec, limit_mb)
    # bf16/f16 computed in f32; kept in the compile cache beside the database
    untuned = dict(threads=args.threads, widen=True, db=args.db, cache_dir=False if args.no_cache else args.cache_dir)
    ref = compile_untuned(source, **untuned, only_cached=True) if args.reference == "auto" else None
    if ref is None and args.reference == "untuned":
        ref = compile_untuned(source, **untuned)
    policy = TimingPolicy(warmup=1, min_repeat=args.repeat, max_repeat=args.repeat, min_time_s=0.0)
    # The untuned reference is only the speedup's denominator: its checking
    # run warms it, and it is timed `repeat` times or for about a second,
    # whichever is fewer (once at least). Untuned ResNet-50 runs 2 s a call:
    # timing it like the tuned module doubled a warm `run`.
    ref_policy = TimingPolicy(warmup=0, min_repeat=1, max_repeat=args.repeat, min_time_s=1.0)
    try:
        with data_limit(limit_mb):
            inputs = random_inputs(ins_spec, args.seed)
            run, outs = cm.bind(*inputs)
            run()
            if ref is None:  # auto without a cached untuned build, or numpy
                ref_outs = _numpy_reference(source, cm.entry, inputs, required=args.reference == "numpy")
                if ref_outs is None:
                    ref = compile_untuned(source, **untuned)
            if ref is not None:
                ref.entry = cm.entry
                ref_run, ref_outs = ref.bind(*inputs)
                ref_run()
                reference = "untuned build (from the compile cache)" if ref.cache_stats.get("module_hit") else "untuned build"
            else:
                reference = "numpy evaluation"
            red = max((k.task.reduction_length for k in cm.kernels), default=1)
            dtypes = [d for _, d in outs_spec] or [d for _, d in ins_spec]
            rounded = sorted({k.task.rounding_dtype for k in cm.kernels} - {""}) or [None]  # bf16 on the way
            tol = max(tolerance(d, red, rounds_to=n, whole_module=True) for d in dtypes for n in rounded) if dtypes else 0.0
            err = max((relative_error(o, r) for o, r in zip(outs, ref_outs)), default=0.0)
            ok = bool(err <= tol)
            lat = statistics.median(time_callable(run, policy))
            ref_costs = time_callable(ref_run, ref_policy) if ref is not None else []
            ref_lat = statistics.median(ref_costs) if ref_costs else None
    except (MemoryError, OSError) as e:
        if not is_memory_error(e):
            raise
        raise AnsorError(
            f"@{cm.entry}: out of memory under the memory limit of {limit_mb} MB ({e}); "
            "pass a larger --memory-limit, or run a smaller shape"
        ) from None
    result = {
        "input": source,
        "function": cm.entry,
        "threads": args.threads,
        "target": target.key,
        "tasks": [k.to_json() for k in cm.kernels],
        "latency_s": lat,
        "untuned_latency_s": ref_lat,
        "untuned_repeat": len(ref_costs),
        "speedup": ref_lat / lat if ref_lat and lat > 0 else None,
        "max_relative_error": err if np.isfinite(err) else None,
        "tolerance": tol,
        "reference": reference,
        "ok": ok,
        "repeat": args.repeat,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        header = f"{'task':<44} {'weight':>6} {'schedule':>8} {'trials':>6} {'record':>11} {'GFLOP/s':>8}"
        print(header)
        print("-" * len(header))
        for k in cm.kernels:
            t = k.to_json()
            print(f"{k.task.name[:44]:<44} {k.task.weight:>6} {k.source:>8} {k.trials:>6} "
                  f"{_fmt_s(t['best_latency_s']):>11} {t['gflops']:>8.1f}")
        untuned_note = f" (untuned {_fmt_s(ref_lat)}, {ref_lat / lat:.2f}x)" if ref_lat else ""
        print(f"@{cm.entry}, {args.threads} thread(s): {_fmt_s(lat)}{untuned_note}, max relative error {err:.3g} "
              f"(tolerance {tol:.3g}) against the {reference}: {'ok' if ok else 'MISMATCH'}")
    if not ok:
        print(f"mlir-ansor: error: the compiled module does not match the {reference} "
              f"(relative error {err:.3g} > {tol:.3g})", file=sys.stderr)
        return 1
    return 0


def _numpy_reference(source: str, entry: str, inputs, required: bool):
    """`entry`'s outputs on `inputs` computed with numpy (`graph.interpret`:
    seconds where the untuned build's code generation took a minute), or None
    where the function holds something that evaluator does not compute (the
    untuned build is then the reference; with `required`, an error naming it)."""
    import time

    from mlir_ansor.graph.interpret import NotInterpretable, interpret
    from mlir_ansor.importers import load as load_any
    from mlir_ansor.ir.program import resource_blobs

    log = logging.getLogger("mlir_ansor")
    start = time.perf_counter()
    program = load_any(source)
    with program.context:
        if source.endswith(".mlir") and os.path.isfile(source):
            with open(source, encoding="utf-8", errors="replace") as f:
                blobs = resource_blobs(f.read())
        else:
            blobs = resource_blobs(str(program.module))
        try:
            outs = interpret(program.module, entry, inputs, blobs)
        except NotInterpretable as e:
            if required:
                raise AnsorError(f"--reference numpy: @{entry} cannot be evaluated with numpy: {e}") from None
            log.info("run: numpy cannot evaluate @%s (%s); the reference is the untuned build", entry, e)
            return None
        except MemoryError:
            raise
        except Exception as e:  # a fault of the evaluator must not cost the user their check
            if required:
                raise AnsorError(f"--reference numpy: evaluating @{entry} failed: {type(e).__name__}: {e}") from None
            log.warning("run: the numpy evaluation of @%s failed (%s: %s); the reference is the untuned build",
                        entry, type(e).__name__, e)
            return None
    log.info("run: the numpy reference took %.2f s", time.perf_counter() - start)
    return outs


def _is_bundle_path(out: str) -> bool:
    """Whether `-o OUT` names a CUDA bundle folder (not a .ptx file)."""
    return out.endswith((".cuda", "/", os.sep)) or os.path.isdir(out)


def _compile_cuda(args: argparse.Namespace, target, source: str, out: str | None) -> int:
    """`compile --target cuda[:sm_XX]`: the whole module's kernels and host
    plan (`cuda_compiler.build_bundle`), written as a bundle folder, or as
    the PTX of every kernel in one file (or on stdout)."""
    import tempfile

    from mlir_ansor.cuda_compiler import build_bundle, bundle_ptx

    bundle = out is not None and _is_bundle_path(out)
    if out is not None and not bundle:
        if not out.endswith(".ptx"):
            raise AnsorError(f"-o {out}: with --target {args.target}, expected OUT.ptx or a bundle folder "
                             "(a name ending in .cuda or /)")
        _check_output(out)
    if bundle:
        folder = out.rstrip("/" + os.sep) or out
        parent = os.path.dirname(os.path.abspath(folder))
        if not os.path.isdir(parent):
            raise InputError(f"-o {out}: the folder {parent} does not exist")
        if os.path.isdir(folder) and os.listdir(folder) and not os.path.exists(os.path.join(folder, "plan.json")):
            raise InputError(f"-o {out}: a folder that is not empty and holds no bundle; give a new name")
    db = None if args.untuned else args.db
    with tempfile.TemporaryDirectory(prefix="mlir-ansor-cuda-") as tmp:
        plan = build_bundle(source, folder if bundle else tmp, db=db, target=target, entry=args.func)
        figures = "; ".join(
            f"{entry}: {fig['registers']} registers, {fig['smem']} B smem"
            + (f", {fig['stack']} B stack" if fig["stack"] else "")
            for k in plan["kernels"] for entry, fig in k["ptxas"].items()
        )
        if bundle:
            print(f"wrote {folder} ({len(plan['kernels'])} kernel(s), {len(plan['launches'])} launch(es) of "
                  f"@{plan['entry']}; {figures})", file=sys.stderr)
            return 0
        text = bundle_ptx(tmp)
    if out is None:
        sys.stdout.write(text)
    else:
        _write_text(out, text)
        print(f"wrote {out} ({len(plan['kernels'])} kernel(s) for {target.key}; {figures})", file=sys.stderr)
    return 0


def _cmd_run_cuda(args: argparse.Namespace) -> int:
    """`run --target cuda[:sm_XX]`: compile the bundle, run it on this
    machine's GPU on seeded random inputs, check it against the untuned CPU
    build, and time it with CUDA events. Without a GPU: a one-line error
    before anything is compiled."""
    import statistics
    import tempfile

    import numpy as np

    from mlir_ansor.compiler import compile_untuned
    from mlir_ansor.cuda_compiler import build_bundle
    from mlir_ansor.ir.dtypes import tolerance
    from mlir_ansor.measure.cuda_module import CudaModule
    from mlir_ansor.measure.cuda_runner import CudaRunError, CudaUnavailable, device_count
    from mlir_ansor.measure.runner import random_inputs, relative_error
    from mlir_ansor.target import Target

    _load_plugins(args)
    target = Target.parse(args.target)
    count, why = device_count()
    if not count:
        raise AnsorError(f"run --target {args.target}: no CUDA device here ({why}); build the bundle with "
                         f"`mlir-ansor compile --target {target.key} -o OUT.cuda` and run it on a GPU host")
    source = _sized(args, args.input or _example_path(), one=True)
    with tempfile.TemporaryDirectory(prefix="mlir-ansor-cuda-") as tmp:
        plan = build_bundle(source, tmp, db=args.db, target=target, entry=args.func)
        module = CudaModule(tmp)
        try:
            inputs = random_inputs(module.inputs, args.seed)
            outs = module(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            costs = module.time(*inputs, repeat=args.repeat)
            device = getattr(module.backend, "device_name", "")
        except (CudaUnavailable, CudaRunError) as e:
            raise AnsorError(f"run --target {args.target}: {str(e).splitlines()[0]}") from None
        finally:
            module.close()
    ref = compile_untuned(source, threads=args.threads, widen=True, db=args.db,
                          cache_dir=False if args.no_cache else args.cache_dir)
    ref.entry = plan["entry"]
    ref_outs = ref(*inputs)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    red = max((t.get("reduction_length", 1) for t in plan["tasks"]), default=1)
    rounded = sorted(({t.get("rounding_dtype", "") for t in plan["tasks"]}
                      | {k.get("rounds_to", "") for k in plan["kernels"]}) - {""}) or [None]
    dtypes = [d for _, d in module.outputs]
    tol = max(tolerance(d, red, rounds_to=n, whole_module=True) for d in dtypes for n in rounded) if dtypes else 0.0
    err = max((relative_error(o, r) for o, r in zip(outs, ref_outs)), default=0.0)
    ok = bool(err <= tol)
    lat = statistics.median(costs)
    result = {"input": source, "function": plan["entry"], "target": target.key, "device": device,
              "tasks": plan["tasks"], "latency_s": lat, "max_relative_error": err if np.isfinite(err) else None,
              "tolerance": tol, "reference": "untuned build (CPU)", "ok": ok, "repeat": args.repeat}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for t in plan["tasks"]:
            print(f"{t['name'][:44]:<44} {t['weight']:>6} {t['schedule']:>8} {t['sketch']}")
        print(f"@{plan['entry']} on {device or target.key}: {_fmt_s(lat)}, max relative error {err:.3g} "
              f"(tolerance {tol:.3g}) against the untuned CPU build: {'ok' if ok else 'MISMATCH'}")
    if not ok:
        print(f"mlir-ansor: error: the CUDA module does not match the untuned CPU build "
              f"(relative error {err:.3g} > {tol:.3g})", file=sys.stderr)
        return 1
    return 0


def run_bytes(ins_spec, outs_spec) -> int:
    """Bytes `mlir-ansor run` allocates for a function's buffers: the inputs
    (and their float64 draw), a copy of them for each of the compiled and
    the untuned module, and an output of each."""
    from mlir_ansor.measure.runner import buffer_bytes, draw_bytes

    return 3 * buffer_bytes(ins_spec) + 2 * buffer_bytes(outs_spec) + draw_bytes(ins_spec)


def _check_run_memory(entry: str, ins_spec, outs_spec, limit_mb: int) -> None:
    """Refuse a function whose buffers would not fit in `limit_mb` MiB,
    before anything is allocated."""
    from mlir_ansor.measure.runner import buffer_bytes, format_bytes

    need = run_bytes(ins_spec, outs_spec)
    if need > limit_mb * 2**20:
        raise AnsorError(
            f"@{entry}: running it needs about {format_bytes(need)} of buffers "
            f"(inputs {format_bytes(buffer_bytes(ins_spec))}, "
            f"outputs {format_bytes(buffer_bytes(outs_spec))}, "
            f"for the compiled and the untuned module), more than the memory limit of {limit_mb} MB; "
            "pass a larger --memory-limit, or run a smaller shape"
        )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"


def _cmd_show(args: argparse.Namespace) -> int:
    from mlir_ansor.target import Target
    from mlir_ansor.tools.peak import load_peak, peak_cache_path
    from mlir_ansor.tools.report import summarize

    peak = load_peak(host=Target.host().model)
    rows = summarize(args.db, peak)
    if args.json:
        print(json.dumps({"tasks": [r.to_json() for r in rows], "peak": peak.__dict__ if peak else None}, indent=2))
        return 0
    header = (f"{'task':<40} {'trials':>6} {'best':>11} {'GFLOP/s':>8} {'threads':>7} "
              f"{'%peak':>6} {'%roof':>6}  errors")
    print(header)
    print("-" * len(header))
    for r in rows:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "-"
        print(
            f"{r.name[:40]:<40} {r.trials:>6} {_fmt_s(r.best_latency_s):>11} {r.gflops:>8.1f} "
            f"{r.threads or '-':>7} {_pct(r.percent_of_peak):>6} {_pct(r.percent_of_roofline):>6}  {errs}"
        )
    if peak is None:
        print(f"note: no peak measurement for this machine in {peak_cache_path()}; run `mlir-ansor peak` "
              "to see % of peak and of the roofline")
    else:
        print(f"peak ({peak.host}): {peak.fma_gflops_1t:.1f} GFLOP/s on 1 thread, {peak.fma_gflops:.1f} on "
              f"{peak.threads}; bandwidth {peak.bandwidth_gbs_1t:.1f} / {peak.bandwidth_gbs:.1f} GB/s. "
              "%roof: of min(peak, flops/bytes x bandwidth)")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from mlir_ansor.tools.report import plot

    weights = None
    if args.input:

        # The tasks as `tune` on this host cut them (constant weights packed).
        from mlir_ansor.importers import load
        from mlir_ansor.search.tasks import tasks_for
        from mlir_ansor.target import Target

        program = load(args.input)
        weights = {t.workload_key: t.weight for t in tasks_for(program, Target.host())}
    output = args.output
    if os.path.isdir(output):
        output = os.path.join(output, "curve.png")
    elif output.endswith(os.sep) or (os.altsep and output.endswith(os.altsep)):
        raise InputError(f"-o {output}: no such folder")
    if os.path.splitext(output)[1].lower() not in (".png", ".svg", ".pdf"):
        raise InputError(f"-o {output}: expected an image file name ending in .png, .svg or .pdf, or a folder")
    _check_output(output)
    c = plot(args.db, output, weights=weights, title=args.title)
    n = max((len(v) for v in c.tasks.values()), default=0)
    print(f"wrote {output} ({len(c.tasks)} task(s), {len(c.end_to_end)} trials, at most {n} per task)",
          file=sys.stderr)
    return 0


def _cmd_peak(args: argparse.Namespace) -> int:
    from mlir_ansor.tools.peak import measure_peak, save_peak

    if args.cache:
        _check_output(args.cache, "--cache")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    peak = measure_peak(args.threads, min_time_s=args.min_time)
    if load > 0.5:
        print(f"mlir-ansor: warning: the machine was busy (load average {load:.2f}); the all-core figures "
              "may be low: run `mlir-ansor peak` again on an idle machine", file=sys.stderr)
    path = save_peak(peak, args.cache)
    if args.json:
        print(json.dumps({**peak.__dict__, "cache": path}, indent=2))
        return 0
    print(f"{peak.host} ({peak.target})")
    print(f"FMA peak (f32):   {peak.fma_gflops_1t:8.1f} GFLOP/s on 1 thread, {peak.fma_gflops:8.1f} on {peak.threads}")
    print(f"memory (triad):   {peak.bandwidth_gbs_1t:8.1f} GB/s on 1 thread, {peak.bandwidth_gbs:8.1f} on {peak.threads}")
    print(f"saved to {path}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from mlir_ansor.target import Target
    from mlir_ansor.tools.export import MLIR_OPT_HINT, export_best

    _load_plugins(args)
    if args.output:
        _check_output(args.output)
    if args.payload:
        _check_output(args.payload, "--payload")
    ex = export_best(args.db, args.task, target=Target.parse(args.target), threads=args.threads)
    if args.output:
        _write_text(args.output, ex.schedule)
    else:
        sys.stdout.write(ex.schedule)
    if args.payload:
        _write_text(args.payload, ex.payload, "--payload")
    print(f"task {ex.name}: {ex.sketch} {dict(ex.knobs)}, {_fmt_s(ex.latency_s)} ({ex.gflops:.1f} GFLOP/s, "
          f"{ex.threads} thread(s))", file=sys.stderr)
    if args.output and args.payload:
        print("apply with: " + MLIR_OPT_HINT.format(payload=args.payload, schedule=args.output), file=sys.stderr)
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from mlir_ansor.importers.onnx import import_onnx

    if not args.input.lower().endswith(".onnx"):
        raise InputError(f"{args.input}: expected an ONNX model (a .onnx file); PyTorch models come in through "
                         "mlir_ansor.importers.pytorch or torch.compile(backend='mlir_ansor')")
    if args.output != "-":
        _check_output(args.output)
    text = import_onnx(args.input)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        _write_text(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _cmd_opt(args: argparse.Namespace) -> int:
    from mlir_ansor.tools.pipeline import run_pipeline_on_file

    if args.output and args.output != "-":
        _check_output(args.output)
    run_pipeline_on_file(args.input, args.pass_pipeline, args.output, print_ir_after_all=args.print_ir_after_all)
    if args.output and args.output != "-":
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname).1s %(message)s",
        datefmt="%H:%M:%S",
    )
    old_term = _install_sigterm()
    try:
        if args.command == "tune":
            return _cmd_tune(args)
        if args.command == "show":
            return _cmd_show(args)
        if args.command == "compile":
            return _cmd_compile(args)
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "plot":
            return _cmd_plot(args)
        if args.command == "peak":
            return _cmd_peak(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "import":
            return _cmd_import(args)
        if args.command == "opt":
            return _cmd_opt(args)
        if args.command == "export-dataset":
            return _cmd_export_dataset(args)
        if args.command == "train-model":
            return _cmd_train_model(args)
        if args.command == "replay":
            return _cmd_replay(args)
    except AnsorError as e:
        print(f"mlir-ansor: error: {e}", file=sys.stderr)
        return 2
    except _Terminated:
        print("mlir-ansor: terminated by SIGTERM (measured records are kept in the database)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("mlir-ansor: interrupted (measured records are kept in the database)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`show DB | head -1`); keep Python from
        # failing again when it flushes stdout at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        print("mlir-ansor: error: the output was closed before it was all written (broken pipe)", file=sys.stderr)
        return 2
    finally:
        _restore_sigterm(old_term)
    return 1


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every cleanup runs (worker
    processes stopped, temporary folders removed)."""


def _on_sigterm(signum, frame) -> None:
    if os.getpid() == _MAIN_PID:  # not in a forked worker that inherited the handler
        raise _Terminated()
    os._exit(143)


_MAIN_PID = os.getpid()


def _install_sigterm():
    import signal
    import threading

    global _MAIN_PID
    if threading.current_thread() is not threading.main_thread():
        return None
    _MAIN_PID = os.getpid()
    try:
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return None


def _restore_sigterm(old) -> None:
    import signal

    if old is not None:
        try:
            signal.signal(signal.SIGTERM, old)
        except (ValueError, OSError):
            pass


if __name__ == "__main__":
    sys.exit(main())
