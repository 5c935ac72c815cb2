"""Top layer: the `mlir-ansor` command line and its back-ends.

- `cli`: argument parsing, one `_cmd_*` per subcommand (thin: they call the
  API and the modules below).
- `pipeline`: mlir-opt style pass pipelines mixing upstream and ``ansor-*`` passes.
- `report` (`show`, `plot`), `peak`, `export`, `dataset` (`export-dataset`,
  `train-model`), `replay`, `progress` (the live display of `tune`).

May import every layer.
"""
