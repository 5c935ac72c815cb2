"""The worked examples of docs/extending.md run as written and do what they
say; registries, plugins (a module, a .py file, an installed entry point)
and the ablation switches select what they name."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import INPUTS

from mlir_ansor import AnsorError, InputError, TuneConfig
from mlir_ansor.examples import workloads
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.records import Database
from mlir_ansor.search import registry
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules import NO_PACKING
from mlir_ansor.search.strategy import EvolutionarySearch, EvolutionConfig
from mlir_ansor.search.strategy.evolutionary import crossover as real_crossover
from mlir_ansor.target import Target

DOC = Path(__file__).parent.parent / "docs" / "extending.md"
AVX2 = Target("cpu", 256, 2, "test", ("avx2", "fma"))


@pytest.fixture(autouse=True)
def clean_registry():
    with registry.isolated():
        yield


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.slow
def test_extending_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__extending__"}
    for i, block in enumerate(blocks):
        code = block.replace('"tests/inputs/matmul.mlir"', repr(str(INPUTS / "matmul.mlir")))
        exec(compile(code, f"docs/extending.md python block {i + 1}", "exec"), ns)  # noqa: S102
    out = capsys.readouterr().out
    # The rule: registered after the built-ins, selected alone, and its
    # sketch (with the added op) is what was measured and won.
    assert "'cuda-contraction', 'tiled-licm']" in out  # after the CPU and the GPU rules
    assert "tiled-licm 4 True" in out
    # The cost model was trained and asked to rank.
    assert "ridge: 4 trials, True (programs scored)" in out
    assert ns["RidgeModel"].scored > 0
    assert "hill-climb: 4 trials" in out
    assert "heaviest-first: 2 trials" in out
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    licm = next(s for s in generate_sketches(task.mlir, Target.host()) if s.name == "tiled-licm")
    assert "transform.apply_licm" in licm.script
    with Database(tmp_path / "extending.db") as db:
        recs = [r for r in db.records() if not r.retime]  # candidates (each run re-times its best)
        runs = db.runs()
    assert len(recs) == 4 + 4 + 4 + 2
    assert sum(r.sketch_hash == licm.hash for r in recs[:4]) == 4  # the rule's sketch comes first
    assert all(r.valid for r in recs[:4])
    assert [r["config"]["strategy"] for r in runs] == ["evolutionary", "evolutionary", "hill-climb", "evolutionary"]
    assert runs[1]["config"]["cost_model"] == "ridge"
    assert runs[3]["config"]["task_scheduler"] == "heaviest-first"


def test_unknown_names_are_errors_that_list_the_known_ones(tmp_path):
    from mlir_ansor import tune

    for kw, known in (
        ({"strategy": "nope"}, "evolutionary, random"),
        ({"cost_model": "nope"}, "random, xgb"),
        ({"task_scheduler": "nope"}, "gradient, random, round-robin"),
        ({"rules": ("nope",)}, "cpu-contraction"),
    ):
        with pytest.raises(AnsorError, match=known):
            tune(str(INPUTS / "matmul.mlir"), config=TuneConfig(trials=1, **kw), db=tmp_path / "x.db")
    with pytest.raises(AnsorError, match="already registered"):
        registry.register_cost_model("xgb", lambda config: None)
    with pytest.raises(AnsorError, match="no rule 'nope'"):
        registry.register_rule("mine", registry.sketch_rules()[0], before="nope")


def test_register_rule_before_and_rule_selection():
    from mlir_ansor.search.rules.elementwise import ElementwiseVectorize

    class Early(ElementwiseVectorize):
        name = "early"

    registry.register_rule("early", Early(), before="cpu-contraction")
    names = registry.rules()
    assert names[names.index("early") + 1] == "cpu-contraction"
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    all_names = [s.name for s in generate_sketches(task.mlir, AVX2)]
    assert all_names == ["cpu-contraction", "cpu-default"]  # `early` skips contractions
    only_default = [s.name for s in generate_sketches(task.mlir, AVX2, rules=("cpu-default",))]
    assert only_default == ["cpu-default"]


CUDA = Target.cuda(90)
F16_MATMUL = workloads.matmul(128, 128, 64, "f16")  # a hand-written task accumulating in f16 (extraction makes it f32): every GPU rule applies


def test_rule_selection_applies_to_cuda_targets():
    """`TuneConfig.rules` / `--rules` select among the GPU rules as among
    the CPU ones; the target's default schedule is always added, and either
    default's name may be given."""
    from mlir_ansor.tools.cli import _parser, config_from_args
    from mlir_ansor.tuner import task_sketches

    mm = F16_MATMUL
    every = generate_sketches(mm, CUDA)
    assert [s.name for s in every] == ["cuda-mma-smem", "cuda-tiled", "cuda-mma", "cuda-contraction", "cuda-default"]
    staged = [s.name for s in generate_sketches(mm, CUDA, rules=("cuda-staged-matmul",))]
    assert staged == ["cuda-mma-smem", "cuda-tiled", "cuda-default"]
    assert [s.name for s in generate_sketches(mm, CUDA, rules=("cuda-mma", "cuda-contraction"))] == [
        "cuda-mma", "cuda-contraction", "cuda-default"
    ]
    for only_default in (("cuda-default",), ("cpu-default",), ("cpu-contraction",)):  # CPU rules skip cuda
        assert [s.name for s in generate_sketches(mm, CUDA, rules=only_default)] == ["cuda-default"]
    assert [s.name for s in generate_sketches(mm, AVX2, rules=("cuda-default", "cuda-mma"))] == ["cpu-default"]
    # Selected sketches are the same sketches (hashes: records stay valid).
    by_name = {s.name: s.hash for s in every}
    assert all(s.hash == by_name[s.name] for s in generate_sketches(mm, CUDA, rules=("cuda-staged-matmul",)))

    # The tuner's path: the configuration's rules, from the command line too.
    args = _parser().parse_args(["tune", "--target", "cuda", "--rules", "cuda-staged-matmul"])
    config = config_from_args(args, TuneConfig)
    assert config.rules == ("cuda-staged-matmul",)
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))  # f32: no tensor-core staged sketch
    assert [s.name for s in task_sketches(task, CUDA, config)] == ["cuda-tiled", "cuda-default"]
    with pytest.raises(AnsorError, match="cuda-default"):
        registry.sketch_rules(("nope",))


GPU_PLUGIN = textwrap.dedent(
    """\
    import dataclasses

    from mlir_ansor.search import registry
    from mlir_ansor.search.rules.gpu_default import GpuDefaultSchedule


    class CseFirst(GpuDefaultSchedule):
        # The GPU default schedule, CSE first (a sketch of its own); like the
        # GPU rules, it skips CPU targets (GpuDefaultSchedule.condition).

        name = "cuda-cse-first"

        def apply(self, ctx):
            (sk,) = super().apply(ctx)
            head = "{transform.consumed}) {\\n"
            script = sk.script.replace(head, head + "    transform.apply_cse to %root : !transform.any_op\\n", 1)
            assert script != sk.script
            return [dataclasses.replace(sk, name=self.name, script=script)]


    registry.register_rule("cuda-cse-first", CseFirst(), before="cuda-contraction")
    """
)


def test_a_plugin_rule_applies_to_a_cuda_target(tmp_path):
    """A rule a plugin registers runs for cuda targets where it says it
    applies (its place in the order kept), is selected by name, and keeps
    the GPU sketch's limits; a CPU target does not see it."""
    from mlir_ansor.search.gpu_sketch import GpuSketch
    from mlir_ansor.tuner import task_sketches

    plugin = tmp_path / "gpu_plugin.py"
    plugin.write_text(GPU_PLUGIN)
    registry.load_plugin(str(plugin))
    assert registry.rules()[-2:] == ["cuda-cse-first", "cuda-contraction"]
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    names = [s.name for s in generate_sketches(task.mlir, CUDA)]
    assert names == ["cuda-tiled", "cuda-mma", "cuda-cse-first", "cuda-contraction", "cuda-default"]
    assert "cuda-cse-first" not in [s.name for s in generate_sketches(task.mlir, AVX2)]
    mine = task_sketches(task, CUDA, TuneConfig(rules=("cuda-cse-first",)))
    assert [s.name for s in mine] == ["cuda-cse-first", "cuda-default"]
    assert isinstance(mine[0], GpuSketch) and mine[0].max_threads == CUDA.max_threads_per_block
    assert mine[0].hash != mine[1].hash and "transform.apply_cse to %root" in mine[0].script


def test_no_packing_fixes_the_pack_knob_and_keeps_the_hash():
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    full = generate_sketches(task.mlir, AVX2)[0]
    fixed = generate_sketches(task.mlir, AVX2, fixed=NO_PACKING)[0]
    assert {k.name: k.options for k in full.knobs}["pack"] == (0, 1)
    assert {k.name: k.options for k in fixed.knobs}["pack"] == (1,)
    assert fixed.hash == full.hash  # records stay replayable with the full sketch


def test_no_crossover_makes_only_mutations(monkeypatch):
    from mlir_ansor.search.strategy import evolutionary

    calls = []

    def spy(*a, **kw):
        calls.append(1)
        return real_crossover(*a, **kw)

    monkeypatch.setattr(evolutionary, "crossover", spy)
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    sketches = generate_sketches(task.mlir, AVX2)
    import random

    import numpy as np

    from mlir_ansor.search.space import sample

    rng = random.Random(0)
    pop = [(sketches[0], sample(sketches[0].knobs, rng)) for _ in range(40)]
    scores = np.arange(len(pop), dtype=float)
    for cross, expect_calls in ((False, False), (True, True)):
        calls.clear()
        s = EvolutionarySearch(EvolutionConfig(population=40, crossover=cross, mutation_prob=0.5))
        s.rng = random.Random(1)
        s._offspring(pop, scores)
        assert bool(calls) is expect_calls


def test_cli_flags_make_the_config(tmp_path):
    from mlir_ansor.tools.cli import _parser, config_from_args

    args = _parser().parse_args(
        ["tune", "--search", "evolutionary", "--no-cost-model", "--no-crossover", "--no-packing",
         "--random-task-scheduler", "--local-share", "0.5", "--rules", "cpu-contraction, cpu-default",
         "--retime-top", "2", "--retime-rounds", "0", "--flush-caches"]
    )
    c = config_from_args(args, TuneConfig)
    assert (c.retime_top, c.retime_rounds) == (2, 0)
    assert c.timing.flush_caches is True
    assert (c.strategy, c.cost_model, c.task_scheduler) == ("evolutionary", "random", "random")
    assert c.packing is False and c.evolution.crossover is False and c.evolution.local_share == 0.5
    assert c.rules == ("cpu-contraction", "cpu-default")
    plain = config_from_args(_parser().parse_args(["tune"]), TuneConfig)
    assert (plain.cost_model, plain.task_scheduler, plain.packing, plain.rules) == ("xgb", "gradient", True, None)
    assert plain.evolution.crossover is True and plain.evolution.local_share == 0.0
    assert (plain.retime_top, plain.retime_rounds) == (TuneConfig.retime_top, TuneConfig.retime_rounds)
    assert plain.timing == TuneConfig().timing and plain.timing.flush_caches is False
    with pytest.raises(SystemExit):
        _parser().parse_args(["tune", "--retime-rounds", "-1"])
    with pytest.raises(InputError, match="--local-share"):
        config_from_args(_parser().parse_args(["tune", "--local-share", "2"]), TuneConfig)


PLUGIN = textwrap.dedent(
    """\
    import dataclasses

    from mlir_ansor.search import registry
    from mlir_ansor.search.rules.default import DefaultSchedule
    from mlir_ansor.search.strategy import RandomSearch


    class Renamed(DefaultSchedule):
        # The default schedule, CSE first (a sketch of its own).

        name = "{name}-rule"

        def apply(self, ctx):
            (sk,) = super().apply(ctx)
            head = "{{transform.consumed}}) {{\\n"
            script = sk.script.replace(head, head + "    transform.apply_cse to %root : !transform.any_op\\n", 1)
            return [dataclasses.replace(sk, name=self.name, script=script)]


    registry.register_strategy("{name}", lambda config: RandomSearch(max_tries=config.max_sample_tries))
    registry.register_rule("{name}-rule", Renamed())
    """
)


@pytest.mark.slow
def test_cli_plugin_file_registers_and_tunes(tmp_path, capsys):
    from mlir_ansor.tools.cli import main

    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(PLUGIN.format(name="file-random"))
    db = tmp_path / "p.db"
    rc = main(["tune", str(INPUTS / "matmul.mlir"), "--plugin", str(plugin), "--search", "file-random",
               "--rules", "file-random-rule", "--trials", "2", "--batch-size", "2", "--db", str(db),
               "--progress", "none", "--json"])
    assert rc == 0
    with Database(db) as d:
        assert d.runs()[0]["config"]["strategy"] == "file-random"
        assert d.runs()[0]["config"]["rules"] == ["file-random-rule"]
        assert d.count() == 2
    capsys.readouterr()
    # The records were made by the plugin's rule; export finds its sketch.
    assert main(["export", str(db), "--plugin", str(plugin)]) == 0
    assert "sketch file-random-rule" in capsys.readouterr().out
    assert main(["tune", "--plugin", "no.such.module", "--db", str(db)]) == 2
    assert "plugin no.such.module: cannot be imported" in capsys.readouterr().err


def test_entry_point_plugins_are_discovered(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "ansor_ep_plugin.py").write_text(PLUGIN.format(name="ep-random"))
    (pkg / "ansor_ep_broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    dist = pkg / "ansor_ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ansor-ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[mlir_ansor.plugins]\nmine = ansor_ep_plugin\nbroken = ansor_ep_broken\n"
    )
    monkeypatch.syspath_prepend(str(pkg))
    loaded = registry.discover_plugins(force=True)
    try:
        assert "mine" in loaded and "broken" not in loaded
        assert "ep-random" in registry.strategies()
        with pytest.raises(AnsorError, match="broken on purpose"):
            registry.make_strategy(TuneConfig(strategy="not-there"))
    finally:
        registry._plugin_errors.clear()
        sys.modules.pop("ansor_ep_plugin", None)
        sys.modules.pop("ansor_ep_broken", None)
