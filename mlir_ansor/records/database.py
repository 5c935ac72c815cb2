"""The tuning database: SQLite in WAL mode, one writer (the tuning driver).

Tables:

* ``meta(key, value)``: ``('format', 'mlir-ansor-db')`` and
  ``('schema_version', '1')``. A file without them is refused.
* ``workloads(workload_key, name, task_mlir, flops)``.
* ``records(...)``: one row per measured candidate (see :class:`Record`);
  ``knobs``, ``costs`` are JSON; ``latency_s`` is the median of ``costs`` (NULL
  for an invalid record), indexed for :meth:`Database.best`.

Every :meth:`Database.commit_record` is its own committed transaction
(``synchronous=FULL``), so a tuning run killed with SIGKILL loses nothing it
committed. A file that exists is inspected read-only before anything is
written: a file that is not SQLite, is corrupt, or is someone else's SQLite
database raises :class:`~mlir_ansor.errors.DatabaseError` and is left untouched.
``Database(path, readonly=True)`` only reads (an existing database), also
one that cannot be written (``mode=ro``; ``immutable=1`` where SQLite cannot
even make its ``-shm`` file, in a read-only folder).

Records coming in are checked (`check_record`): costs must be positive finite
numbers, thread counts between 1 and 2**31, knob values booleans, strings or
integers within 2**31; ``NaN``/``Infinity`` literals, lines over
``MAX_LINE_BYTES`` and JSON nested deeper than ``MAX_JSON_DEPTH`` are refused.
`Database.import_jsonl` raises InputError naming the file and line. A stored
row that fails the checks is skipped by every reading method, with a warning
naming the database and the row's id (`Database.invalid_rows`): one bad row
never makes a database unreadable, nor is it ever a best.

:class:`JsonlWriter` appends runs and records to a JSON-lines file in
:meth:`Database.export_jsonl`'s format instead, each line synced on its own
(`measure.gpu_measure --jsonl` writes one for `Database.import_jsonl`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import statistics
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self

from mlir_ansor.errors import DatabaseError, InputError

__all__ = [
    "FORMAT",
    "MAX_INT",
    "MAX_JSON_DEPTH",
    "MAX_LINE_BYTES",
    "RETIME_ATTEMPT_KEY",
    "RETIME_KEY",
    "SCHEMA_VERSION",
    "Database",
    "JsonlWriter",
    "Record",
    "check_record",
    "in_turns",
    "knobs_text",
]

log = logging.getLogger(__name__)

FORMAT = "mlir-ansor-db"
SCHEMA_VERSION = 1
_SQLITE_MAGIC = b"SQLite format 3\x00"
RETIME_KEY = "retime"
"""The key of a re-timing's ``versions`` JSON (`Record.retime`); the tuner writes it."""
RETIME_ATTEMPT_KEY = "retime_attempt"
"""The key of a re-timing's ``versions`` JSON naming its set: the schedules
of one task timed in turns together (`Record.retime_set`)."""
_RETIME_LIKE = f'%"{RETIME_KEY}":%'  # the same test in SQL
# Error kinds of a schedule that failed when it ran (not when it was built):
# a schedule with one of these is never a best (`Database.best`).
_FAILED_RUNS = ("wrong_answer", "run_error", "crash", "timeout", "exception")
MAX_INT = 2**31
"""The largest knob value (in magnitude) and thread count a record may hold."""
_MAX_SQL_INT = 2**63 - 1  # what SQLite stores (flops, seeds, run ids)
MAX_LINE_BYTES = 64 << 20
"""The longest JSON line `Database.import_jsonl` reads (a workload carries its task's MLIR)."""
MAX_JSON_DEPTH = 32
"""The deepest nesting of arrays and objects a JSON line may have."""
_MAX_WARNINGS = 10  # invalid rows warned about one by one, per Database


class _NonFinite:
    """A ``NaN``/``Infinity`` literal as `_loads` reads it (refused where a number is wanted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _loads(text: str, *, constants_under: str | None = None, name: str = "") -> Any:
    """`json.loads`, refusing ``NaN``/``Infinity`` literals (JSON has none;
    Python's reader accepts them) and nesting deeper than MAX_JSON_DEPTH.
    `constants_under`: a top-level key under which such literals are kept
    as floats (a run's free-form ``info``: a configured timeout may be inf).
    `name`: what the text is, for messages."""
    try:
        obj = json.loads(text, parse_constant=_NonFinite)
    except RecursionError:
        raise ValueError(f"JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    stack: list[tuple[Any, int, str, Any, Any]] = [(obj, 1, "", None, None)]
    while stack:
        x, depth, where, parent, key = stack.pop()
        if isinstance(x, _NonFinite):
            if constants_under is not None and where.startswith(f".{constants_under}"):
                parent[key] = float(x.text)
                continue
            raise ValueError(f"{(name + where).lstrip('.') or 'the value'} is {x.text}, which is not a JSON number")
        if isinstance(x, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            for k, v in items:
                sub = f"{where}.{k}" if isinstance(x, dict) else f"{where}[{k}]"
                stack.append((v, depth + 1, sub, x, k))
    return obj


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_record(rec: Record) -> None:
    """Raise ValueError saying what is wrong with `rec`, if anything: a
    cost that is not a positive finite number, a thread count outside
    1..MAX_INT, a knob value that is not a bool, a string or an integer
    within MAX_INT, a duplicate knob, a negative or non-finite build time
    or timestamp, a key field that is not a non-empty string."""
    for name in ("workload_key", "target", "sketch_hash", "error_kind"):
        v = getattr(rec, name)
        if not isinstance(v, str) or not v:
            raise ValueError(f"{name} must be a non-empty string, not {v!r}")
    for name in ("error_msg", "host", "versions"):
        if not isinstance(getattr(rec, name), str):
            raise ValueError(f"{name} must be a string")
    for i, c in enumerate(rec.costs):
        if not (_is_num(c) and math.isfinite(c) and c > 0):
            raise ValueError(f"costs[{i}] is {c!r}: a cost must be a positive finite number of seconds")
    if not (_is_int(rec.threads) and 1 <= rec.threads <= MAX_INT):
        raise ValueError(f"threads is {rec.threads!r}: a thread count must be an integer from 1 to {MAX_INT}")
    seen = set()
    for k, v in rec.knobs:
        if not k:
            raise ValueError("a knob has an empty name")
        if k in seen:
            raise ValueError(f"knob {k} is given twice")
        seen.add(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, str):
            if len(v) > 1000:
                raise ValueError(f"knob {k}: a string value of {len(v)} characters")
            continue
        if not _is_int(v):
            raise ValueError(f"knob {k} is {v!r}: a knob value must be an integer, a boolean or a string")
        if abs(v) > MAX_INT:
            raise ValueError(f"knob {k} is {v}: beyond {MAX_INT} in magnitude")
    for name in ("build_s", "timestamp"):
        v = getattr(rec, name)
        if not (_is_num(v) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} is {v!r}: must be a non-negative finite number")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS workloads (
    workload_key TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    task_mlir    TEXT NOT NULL,
    flops        INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
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
CREATE INDEX IF NOT EXISTS records_best
    ON records (workload_key, target, latency_s);
CREATE INDEX IF NOT EXISTS records_keys
    ON records (workload_key, target, sketch_hash);
CREATE TABLE IF NOT EXISTS runs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    started      REAL NOT NULL,
    seed         INTEGER NOT NULL,
    target       TEXT NOT NULL,
    info         TEXT NOT NULL
);
"""

_RECORD_COLS = (
    "workload_key",
    "target",
    "sketch_hash",
    "knobs",
    "costs",
    "error_kind",
    "error_msg",
    "host",
    "threads",
    "build_s",
    "timestamp",
    "versions",
)


def _norm_knobs(knobs: Any) -> tuple[tuple[str, Any], ...]:
    items = knobs.items() if isinstance(knobs, Mapping) else knobs
    return tuple(sorted((str(k), v) for k, v in items))


def _knobs_json(knobs: tuple[tuple[str, Any], ...]) -> str:
    # canonical text: equal assignments give equal strings (used in UNIQUE)
    return json.dumps([[k, v] for k, v in knobs], separators=(",", ":"))


def _knobs_from_json(text: str) -> tuple[tuple[str, Any], ...]:
    return tuple((str(k), v) for k, v in _loads(text))


def knobs_text(knobs: Any) -> str:
    """The canonical text of an assignment (a dict or ``(name, value)``
    pairs), as the database stores it: equal assignments, equal texts."""
    return _knobs_json(_norm_knobs(knobs))


@dataclass(frozen=True)
class Record:
    """One measured candidate. ``knobs`` may be given as a dict or as pairs;
    it is stored as sorted ``(name, value)`` pairs; values are int/str/bool."""

    workload_key: str
    target: str
    sketch_hash: str
    knobs: tuple[tuple[str, Any], ...]
    costs: tuple[float, ...]
    error_kind: str
    error_msg: str = ""
    host: str = ""
    threads: int = 1
    build_s: float = 0.0
    timestamp: float = 0.0
    versions: str = ""
    row_id: int | None = field(default=None, compare=False)
    """The id of the database row it was read from (None: not read from one)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", _norm_knobs(self.knobs))
        object.__setattr__(self, "costs", tuple(float(c) for c in self.costs))
        # ErrorKind is a str enum: store its value, never "ErrorKind.NONE"
        object.__setattr__(
            self, "error_kind", str(getattr(self.error_kind, "value", self.error_kind))
        )

    @property
    def valid(self) -> bool:
        return self.error_kind == "none" and bool(self.costs)

    @property
    def latency_s(self) -> float:
        """Median of ``costs``; ``inf`` when there are none."""
        return statistics.median(self.costs) if self.costs else math.inf

    def _versions(self) -> dict | None:
        """The ``versions`` JSON as a dict (None: empty or unreadable)."""
        try:
            versions = json.loads(self.versions) if self.versions else None
        except (ValueError, RecursionError):
            return None
        return versions if isinstance(versions, dict) else None

    @property
    def retime(self) -> bool:
        """A second timing of a schedule measured before (the end of a tuning
        run re-times each task's best, `TuneConfig.retime_rounds`), not a new
        candidate: its ``versions`` JSON holds ``"retime"``."""
        versions = self._versions()
        return versions is not None and RETIME_KEY in versions

    @property
    def retime_set(self) -> tuple | None:
        """Which set of schedules this re-timing was timed in turns with:
        ``(run, attempt, threads)`` (`Database.best` compares the schedules
        of one set with each other); None for a record that is not a
        re-timing. A re-timing of a tuner that named no attempt is of the
        run's one set."""
        versions = self._versions()
        if versions is None or RETIME_KEY not in versions:
            return None
        return self.run, versions.get(RETIME_ATTEMPT_KEY), self.threads

    @property
    def run(self) -> int | None:
        """The id (in the ``runs`` table) of the tuning run that measured
        this record, from its ``versions`` JSON; None when it names none."""
        run = (self._versions() or {}).get("run")
        return run if isinstance(run, int) and not isinstance(run, bool) else None

    def to_json(self) -> dict:
        return {
            "workload_key": self.workload_key,
            "target": self.target,
            "sketch_hash": self.sketch_hash,
            "knobs": [[k, v] for k, v in self.knobs],
            "costs": list(self.costs),
            "error_kind": self.error_kind,
            "error_msg": self.error_msg,
            "host": self.host,
            "threads": self.threads,
            "build_s": self.build_s,
            "timestamp": self.timestamp,
            "versions": self.versions,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Record:
        """The record of `d` (`to_json`'s form), checked (`check_record`):
        ValueError, KeyError or TypeError says what is wrong."""
        if not isinstance(d, Mapping):
            raise TypeError("a record must be a JSON object")
        knobs, costs = _knob_pairs_and_costs(d["knobs"], d.get("costs", []))
        rec = cls(
            workload_key=d["workload_key"],
            target=d["target"],
            sketch_hash=d["sketch_hash"],
            knobs=knobs,
            costs=costs,
            error_kind=d["error_kind"],
            error_msg=d.get("error_msg", ""),
            host=d.get("host", ""),
            threads=d.get("threads", 1),
            build_s=d.get("build_s", 0.0),
            timestamp=d.get("timestamp", 0.0),
            versions=d.get("versions", ""),
        )
        check_record(rec)
        return rec


def _knob_pairs_and_costs(knobs: Any, costs: Any) -> tuple[tuple[tuple[str, Any], ...], tuple[float, ...]]:
    """Knobs and costs as read from JSON (a JSON line's or a row's), checked
    for shape before a Record is made of them: a list of [name, value] pairs
    with string names, and a list of numbers (`check_record` checks values)."""
    if not isinstance(knobs, list) or not all(isinstance(p, list) and len(p) == 2 for p in knobs):
        raise ValueError("knobs must be a list of [name, value] pairs")
    if not all(isinstance(k, str) for k, _ in knobs):
        raise ValueError("knob names must be strings")
    if not isinstance(costs, list):
        raise ValueError("costs must be a list of numbers")
    for i, c in enumerate(costs):
        if not _is_num(c):
            raise ValueError(f"costs[{i}] is {c!r}: a cost must be a positive finite number of seconds")
    return tuple((k, v) for k, v in knobs), tuple(costs)


def _row_to_record(row: sqlite3.Row) -> Record:
    """The record of a row, checked (`check_record`); ValueError says what
    is wrong with it."""
    for col in ("knobs", "costs"):
        if not isinstance(row[col], str):
            raise ValueError(f"{col} is not JSON text")
    knobs, costs = _knob_pairs_and_costs(_loads(row["knobs"], name="knobs"), _loads(row["costs"], name="costs"))
    rec = Record(
        workload_key=row["workload_key"],
        target=row["target"],
        sketch_hash=row["sketch_hash"],
        knobs=knobs,
        costs=costs,
        error_kind=row["error_kind"],
        error_msg=row["error_msg"],
        host=row["host"],
        threads=row["threads"],
        build_s=row["build_s"],
        timestamp=row["timestamp"],
        versions=row["versions"],
        row_id=int(row["id"]),
    )
    check_record(rec)
    return rec


def _renumber_run(rec: Record, run_ids: Mapping[int, int]) -> Record:
    """`rec` with the run id in its ``versions`` mapped through `run_ids`
    (run ids are per database; an imported run gets a new one)."""
    try:
        versions = json.loads(rec.versions) if rec.versions else None
    except (ValueError, RecursionError):
        return rec
    if not isinstance(versions, dict) or versions.get("run") not in run_ids:
        return rec
    versions["run"] = run_ids[versions["run"]]
    return replace(rec, versions=json.dumps(versions))


def _connect_ro(path: str, **kw: Any) -> tuple[sqlite3.Connection, bool]:
    """A read-only connection to `path` (``mode=ro``), and whether it had
    to be opened ``immutable=1``: a WAL database that SQLite can neither
    write nor make a ``-shm`` file for (a read-only folder) opens only so.
    Nothing can be writing it then (a writer needs that file too), except a
    ``-wal`` left behind, whose last commits are then not seen (warned)."""
    base = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    con = sqlite3.connect(base, uri=True, timeout=30.0, **kw)
    try:
        con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        return con, False
    except sqlite3.OperationalError as exc:
        con.close()
        name = getattr(exc, "sqlite_errorname", "") or ""
        if not name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN")):
            raise
    con = sqlite3.connect(base + "&immutable=1", uri=True, timeout=30.0, **kw)
    wal = path + "-wal"
    if os.path.exists(wal) and os.path.getsize(wal) > 0:
        log.warning(
            "%s: read-only and its folder cannot be written: read as it stands, without the "
            "commits still in %s (open it once where it can be written to fold them in)", path, wal
        )
    return con, True


def _inspect_existing(path: str) -> None:
    """Refuse a file that is not ours, without writing to it."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise DatabaseError(
            f"{path}: cannot read the tuning database: {exc.strerror or exc}"
        ) from exc
    if head == b"":
        return  # an empty file: SQLite treats it as a new database
    if head != _SQLITE_MAGIC:
        raise DatabaseError(
            f"{path}: not an mlir-ansor tuning database (not an SQLite file); "
            "pass another --db path or move the file away"
        )
    try:
        con, _ = _connect_ro(path)
    except sqlite3.Error as exc:
        raise DatabaseError(f"{path}: cannot open the tuning database: {exc}") from exc
    try:
        try:
            tables = {
                r[0]
                for r in con.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'"
                )
            }
            if "meta" not in tables:
                raise DatabaseError(
                    f"{path}: an SQLite database, but not an mlir-ansor tuning database "
                    "(no 'meta' table); refusing to modify it"
                )
            meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as exc:
            raise DatabaseError(
                f"{path}: corrupt or unreadable tuning database: {exc}"
            ) from exc
    finally:
        con.close()
    if meta.get("format") != FORMAT:
        raise DatabaseError(
            f"{path}: an SQLite database, but not an mlir-ansor tuning database "
            f"(meta format is {meta.get('format')!r}); refusing to modify it"
        )
    try:
        version = int(meta.get("schema_version", "0"))
    except ValueError:
        version = -1
    if version != SCHEMA_VERSION:
        raise DatabaseError(
            f"{path}: tuning database schema version {meta.get('schema_version')!r} is not "
            f"supported (this mlir-ansor reads version {SCHEMA_VERSION})"
        )


def in_turns(records: Iterable[Record]) -> dict[tuple, float]:
    """The latency of each re-timed schedule (``(sketch_hash, knobs,
    threads)`` -> seconds) as its re-timings taken in turns say, for
    `Database.best` to rank by.

    The tuner times a task's best schedules again at the end of a run, in
    turns, in sets (`Record.retime_set`): the first set, then (when a
    schedule re-timed only once now looks best) a set of the new best with
    the incumbent, the best of the earlier sets. Each set is compared
    within itself: a schedule's latency in a set is the median of its
    costs there, scaled so that the schedule it shares with earlier sets
    (the best by those, the incumbent) keeps the latency they gave it. A
    schedule in several sets takes its latency from the last. With every
    cost of a schedule pooled instead, a set timed in a slow phase of the
    machine (a VM's speed moved 1.5x within seconds) sank the schedules in
    it under one timed only in a fast phase: a 16 x 1024 . 1024 x 1024
    GEMM's tune (2 threads, Emerald Rapids) picked a schedule that its
    first set had timed 7-14% slower in each of its three rounds, and it ran
    0.210 ms against the other's 0.196. Records in a set must come in the
    order they were stored (`Database` reads them by id)."""
    sets: dict[tuple, dict[tuple, list[float]]] = {}
    for r in records:
        which = r.retime_set
        if which is not None and r.valid:
            sets.setdefault(which, {}).setdefault((r.sketch_hash, r.knobs, r.threads), []).extend(r.costs)
    score: dict[tuple, float] = {}
    for timed in sets.values():  # in the order each set was first stored
        median = {key: statistics.median(costs) for key, costs in timed.items()}
        shared = [key for key in median if key in score]
        scale = 1.0
        if shared:
            anchor = min(shared, key=score.__getitem__)
            scale = score[anchor] / median[anchor]
        for key, m in median.items():
            score[key] = m * scale
    return score


class Database:
    """The tuning records of one or more workloads and targets.

    `path` is created when missing, unless `create` is False (then only an
    existing database opens; a missing or empty file raises DatabaseError).
    `readonly`: open an existing database for reading only (nothing is
    written to it, its schema neither; writing raises DatabaseError)."""

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False, create: bool = True):
        self.path = os.fspath(path)
        self.readonly = readonly
        memory = self.path == ":memory:"
        exists = not memory and os.path.exists(self.path)
        if exists:
            if os.path.isdir(self.path):
                raise DatabaseError(
                    f"{self.path}: is a directory, not a tuning database"
                )
            _inspect_existing(self.path)
        if readonly or not create:
            if not exists:
                raise DatabaseError(f"{self.path}: no such tuning database")
            if os.path.getsize(self.path) == 0:
                raise DatabaseError(f"{self.path}: an empty file, not a tuning database")
        self.immutable = False  # opened immutable=1: read-only, in a folder SQLite cannot write
        self.invalid_rows: dict[int, str] = {}  # row id -> what is wrong with it (rows read so far, skipped)
        self._tables: set[str] = set()
        try:
            if readonly:
                con, self.immutable = _connect_ro(self.path, check_same_thread=False, isolation_level=None)
                self._tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            else:
                con = sqlite3.connect(
                    self.path, timeout=30.0, check_same_thread=False, isolation_level=None
                )
        except sqlite3.Error as exc:
            raise DatabaseError(
                f"{self.path}: cannot open the tuning database: {exc}"
            ) from exc
        con.row_factory = sqlite3.Row
        self._con: sqlite3.Connection | None = con
        self._lock = threading.RLock()
        if readonly:
            return
        try:
            with self._wrap("open"):
                if not memory:
                    con.execute("PRAGMA journal_mode=WAL")
                con.execute("PRAGMA synchronous=FULL")
                with self._tx():
                    for stmt in _SCHEMA.split(";"):
                        if stmt.strip():
                            con.execute(stmt)
                    con.execute(
                        "INSERT OR IGNORE INTO meta VALUES ('format', ?)", (FORMAT,)
                    )
                    con.execute(
                        "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                        (str(SCHEMA_VERSION),),
                    )
        except BaseException:
            con.close()
            self._con = None
            raise

    # -- plumbing -----------------------------------------------------------

    @property
    def _c(self) -> sqlite3.Connection:
        if self._con is None:
            raise DatabaseError(f"{self.path}: the tuning database is closed")
        return self._con

    @contextlib.contextmanager
    def _wrap(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise DatabaseError(f"{self.path}: {what} failed: {exc}") from exc

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        con = self._c
        con.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    def _checked(self, rows: Iterable[sqlite3.Row]) -> list[tuple[int, Record]]:
        """The records of `rows`, less those that fail `check_record`, each
        warned about (the first few one by one) and kept in `invalid_rows`."""
        out = []
        for row in rows:
            try:
                out.append((int(row["id"]), _row_to_record(row)))
            except (ValueError, TypeError, OverflowError) as exc:
                self._invalid(int(row["id"]), str(exc))
        return out

    def _invalid(self, row_id: int, why: str) -> None:
        if row_id in self.invalid_rows:
            return
        self.invalid_rows[row_id] = why
        n = len(self.invalid_rows)
        if n <= _MAX_WARNINGS:
            log.warning("%s: record %d is invalid and is skipped: %s", self.path, row_id, why)
        if n == _MAX_WARNINGS:
            log.warning("%s: further invalid records are skipped without a warning each", self.path)

    # -- workloads ------------------------------------------------------------

    def add_workload(
        self, workload_key: str, name: str, task_mlir: str, flops: int
    ) -> None:
        """Record a workload; adding the same key again keeps the first entry."""
        with self._lock, self._wrap("add_workload"), self._tx():
            self._c.execute(
                "INSERT OR IGNORE INTO workloads VALUES (?, ?, ?, ?)",
                (workload_key, name, task_mlir, int(flops)),
            )

    def workload(self, key: str) -> dict | None:
        with self._lock, self._wrap("workload"):
            row = self._c.execute(
                "SELECT * FROM workloads WHERE workload_key = ?", (key,)
            ).fetchone()
        return dict(row) if row is not None else None

    def workloads(self) -> list[dict]:
        with self._lock, self._wrap("workloads"):
            rows = self._c.execute("SELECT * FROM workloads ORDER BY rowid").fetchall()
        return [dict(r) for r in rows]

    # -- records --------------------------------------------------------------

    def _insert(self, rec: Record) -> bool:
        lat = rec.latency_s if rec.valid else None
        cur = self._c.execute(
            "INSERT OR IGNORE INTO records (workload_key, target, sketch_hash, knobs, costs, "
            "latency_s, error_kind, error_msg, host, threads, build_s, timestamp, versions) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rec.workload_key,
                rec.target,
                rec.sketch_hash,
                _knobs_json(rec.knobs),
                json.dumps(list(rec.costs)),
                lat,
                rec.error_kind,
                rec.error_msg,
                rec.host,
                int(rec.threads),
                float(rec.build_s),
                float(rec.timestamp),
                rec.versions,
            ),
        )
        return cur.rowcount > 0

    def commit_record(self, rec: Record) -> None:
        """Store ``rec`` durably (its own transaction). An identical record
        (same key fields and timestamp) is stored once."""
        with self._lock, self._wrap("commit_record"), self._tx():
            self._insert(rec)

    def records(
        self, workload_key: str | None = None, target: str | None = None
    ) -> list[Record]:
        """All records, optionally of one workload and/or target, in insertion order."""
        return [rec for _, rec in self.records_with_ids(workload_key, target)]

    def records_with_ids(
        self, workload_key: str | None = None, target: str | None = None
    ) -> list[tuple[int, Record]]:
        """`records`, each with its row id (which names it in messages)."""
        where, params = self._where(workload_key, target)
        with self._lock, self._wrap("records"):
            rows = self._c.execute(
                f"SELECT * FROM records{where} ORDER BY id", params
            ).fetchall()
        return self._checked(rows)

    def count(self, workload_key: str | None = None, target: str | None = None) -> int:
        """Candidates measured: records that are not re-timings (`Record.retime`)."""
        where, params = self._where(workload_key, target)
        where = f"{where} AND" if where else " WHERE"
        with self._lock, self._wrap("count"):
            return self._c.execute(
                f"SELECT COUNT(*) FROM records{where} versions NOT LIKE ?", (*params, _RETIME_LIKE)
            ).fetchone()[0]

    @staticmethod
    def _where(workload_key: str | None, target: str | None) -> tuple[str, tuple]:
        conds, params = [], []
        if workload_key is not None:
            conds.append("workload_key = ?")
            params.append(workload_key)
        if target is not None:
            conds.append("target = ?")
            params.append(target)
        return (" WHERE " + " AND ".join(conds) if conds else ""), tuple(params)

    def best(
        self,
        workload_key: str,
        target: str,
        threads: int | None = None,
        k: int = 1,
        host: str | None = None,
        prefer_host: str | None = None,
    ) -> list[Record]:
        """The ``k`` best schedules (sketch and knobs) by latency (ties: the
        one first measured first), all measured on one kind of host (CPU
        model or GPU name): latencies of different machines are never
        compared. `host` names it; None takes `prefer_host` when it has
        valid records (this machine's model: a schedule measured here),
        else the host with the most valid records (ties: the first seen).

        A schedule measured more than once (re-timed at the end of a tuning
        run, or measured by two merged runs) counts as one: its first valid
        record, holding the costs of all its valid records, so its latency is
        the median over every measurement rather than its luckiest one.
        Re-timed schedules are ranked by what the re-timings say when taken
        in turns (`in_turns`), not by that median: timings of one set taken
        in a fast phase of the machine and of another in a slow one do not
        compare. A schedule with a failed measurement (wrong answer, crash,
        timeout) on the same host and thread count is never returned. An
        invalid row (`check_record`: a NaN or negative cost...) is skipped,
        with a warning."""
        if host is None and prefer_host is not None:
            mine = self.best(workload_key, target, threads, k, host=prefer_host)
            if mine:
                return mine
        sql = "FROM records WHERE workload_key = ? AND target = ?"
        params: list = [workload_key, target]
        if threads is not None:
            sql += " AND threads = ?"
            params.append(int(threads))
        with self._lock, self._wrap("best"):
            if host is None:
                row = self._c.execute(  # candidates, not re-timings, are counted
                    f"SELECT host {sql} AND latency_s > 0 AND versions NOT LIKE ? "
                    "GROUP BY host ORDER BY COUNT(*) DESC, MIN(id) LIMIT 1",
                    [*params, _RETIME_LIKE],
                ).fetchone()
                if row is None:
                    return []
                host = row[0]
            # Every record of the host that counts: its schedules are grouped below.
            failed = ", ".join("?" * len(_FAILED_RUNS))
            rows = self._c.execute(
                f"SELECT * {sql} AND host = ? AND (latency_s IS NOT NULL OR error_kind IN ({failed})) ORDER BY id",
                [*params, host, *_FAILED_RUNS],
            ).fetchall()
        groups: dict[tuple, list[Record]] = {}
        checked = [rec for _, rec in self._checked(rows)]
        for rec in checked:
            groups.setdefault((rec.sketch_hash, rec.knobs, rec.threads), []).append(rec)
        best: list[Record] = []
        for recs in groups.values():
            if not all(r.valid for r in recs):
                continue  # it failed once: not to be trusted
            first = recs[0]
            if len(recs) > 1:
                first = replace(first, costs=tuple(c for r in recs for c in r.costs))
            best.append(first)
        score = in_turns(checked)

        def rank(r: Record) -> float:
            return score.get((r.sketch_hash, r.knobs, r.threads), r.latency_s)

        best.sort(key=rank)  # stable: ties stay in order of first measurement
        return best[: int(k)]

    def measured_keys(self, workload_key: str, target: str) -> set[tuple]:
        """``(sketch_hash, knobs)`` of every record, valid or not, so a resumed
        run can skip them. ``knobs`` is the sorted tuple of pairs, as in Record."""
        with self._lock, self._wrap("measured_keys"):
            rows = self._c.execute(
                "SELECT MIN(id), sketch_hash, knobs FROM records WHERE workload_key = ? AND target = ? "
                "GROUP BY sketch_hash, knobs",
                (workload_key, target),
            ).fetchall()
        out = set()
        for r in rows:
            try:
                out.add((r[1], _knobs_from_json(r[2])))
            except (ValueError, TypeError) as exc:
                self._invalid(int(r[0]), f"unreadable knobs: {exc}")
        return out

    # -- runs -----------------------------------------------------------------

    def add_run(self, seed: int, target: str, info: Mapping[str, Any], started: float) -> int:
        """Record a tuning run (seed, target key, and `info`, any JSON-able
        description); returns its id, which the run's records carry."""
        with self._lock, self._wrap("add_run"), self._tx():
            cur = self._c.execute(
                "INSERT INTO runs (started, seed, target, info) VALUES (?, ?, ?, ?)",
                (float(started), int(seed), target, json.dumps(info, sort_keys=True, default=str)),
            )
            return int(cur.lastrowid)

    def runs(self) -> list[dict]:
        """Every recorded run, oldest first: ``id``, ``started``, ``seed``,
        ``target`` and the fields of its ``info``."""
        if self.readonly and "runs" not in self._tables:
            return []  # a database from before runs were recorded
        with self._lock, self._wrap("runs"):
            rows = self._c.execute("SELECT * FROM runs ORDER BY id").fetchall()
        out = []
        for r in rows:
            d = dict(r)
            out.append({**self._run_info(d.pop("info"), d["id"]), **d})
        return out

    def _run_info(self, text: str | None, run_id: int) -> dict:
        try:
            info = json.loads(text or "{}")
        except (ValueError, TypeError, RecursionError) as exc:
            log.warning("%s: run %s: unreadable info, taken as empty: %s", self.path, run_id, exc)
            return {}
        return info if isinstance(info, dict) else {}

    # -- JSON lines -----------------------------------------------------------

    def export_jsonl(self, path: str | os.PathLike) -> int:
        """Write every workload (``"kind": "workload"``), every tuning run
        (``"kind": "run"``: seed, target, versions, host) and every record
        (``"kind": "record"``), one JSON object a line. Returns the record
        count. Invalid rows are left out, with a warning (`invalid_rows`)."""
        with self._lock, self._wrap("export_jsonl"):
            wls = self._c.execute("SELECT * FROM workloads ORDER BY rowid").fetchall()
            runs = self._c.execute("SELECT * FROM runs ORDER BY id").fetchall()
            rows = self._c.execute("SELECT * FROM records ORDER BY id").fetchall()
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"kind": "workload", **dict(w)}) + "\n" for w in wls)
            f.writelines(
                json.dumps({"kind": "run", **dict(r), "info": self._run_info(r["info"], r["id"])}) + "\n" for r in runs
            )
            recs = self._checked(rows)  # an invalid row is left out (warned): the file must import
            f.writelines(json.dumps({"kind": "record", **rec.to_json()}) + "\n" for _, rec in recs)
        return len(recs)

    def import_jsonl(self, path: str | os.PathLike) -> int:
        """Add the workloads and records of a JSON-lines file (one transaction).
        Records already present are skipped. Returns how many records were added.
        A line without ``kind`` is read as a record. Every line is checked
        (`check_record`, and the module docstring's limits) before anything
        is added: a bad one raises InputError naming the file and line."""
        path = os.fspath(path)
        items: list[tuple[str, Any]] = []
        try:
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), ""), 1):
                    if len(line) > MAX_LINE_BYTES:
                        raise InputError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES} characters")
                    if line.strip():
                        items.append(self._jsonl_item(path, lineno, line))
        except OSError as exc:
            raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not UTF-8 text: {exc}") from exc
        added = 0
        run_ids: dict[int, int] = {}  # the file's run ids -> this database's
        with self._lock, self._wrap("import_jsonl"), self._tx():
            for kind, item in items:
                if kind == "workload":
                    self._c.execute("INSERT OR IGNORE INTO workloads VALUES (?, ?, ?, ?)", item)
                elif kind == "run":
                    run_ids[item[0]] = self._import_run(*item[1:])
                else:
                    added += self._insert(_renumber_run(item, run_ids))
        return added

    @staticmethod
    def _jsonl_item(path: str, lineno: int, line: str) -> tuple[str, Any]:
        """One line of `import_jsonl`'s file, checked: ("workload" | "run" | "record", item)."""
        try:
            d = _loads(line, constants_under="info")
            if not isinstance(d, dict):
                raise ValueError("a line must hold a JSON object")
            kind = d.get("kind", "record")
            if kind == "workload":
                key, name, text, flops = d["workload_key"], d["name"], d["task_mlir"], d["flops"]
                if not all(isinstance(x, str) for x in (key, name, text)) or not key:
                    raise ValueError("workload_key, name and task_mlir must be strings")
                if not (_is_int(flops) and 0 <= flops <= _MAX_SQL_INT):
                    raise ValueError(f"flops is {flops!r}: must be an integer from 0 to {_MAX_SQL_INT}")
                return "workload", (key, name, text, flops)
            if kind == "run":
                run_id, started, seed, target, info = d["id"], d["started"], d["seed"], d["target"], d["info"]
                if not isinstance(info, dict):
                    raise ValueError("a run's info must be an object")
                if not (_is_int(run_id) and 1 <= run_id <= _MAX_SQL_INT):
                    raise ValueError(f"run id is {run_id!r}: must be a positive integer")
                if not (_is_int(seed) and abs(seed) <= _MAX_SQL_INT):
                    raise ValueError(f"seed is {seed!r}: must be an integer within {_MAX_SQL_INT}")
                if not (_is_num(started) and math.isfinite(started) and started >= 0):
                    raise ValueError(f"started is {started!r}: must be a non-negative finite number")
                if not isinstance(target, str):
                    raise ValueError("a run's target must be a string")
                return "run", (run_id, float(started), seed, target, info)
            if kind == "record":
                return "record", Record.from_json(d)
            raise ValueError(f"unknown kind {kind!r}")
        except KeyError as exc:
            raise InputError(f"{path}:{lineno}: not a tuning record: no field {exc}") from exc
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise InputError(f"{path}:{lineno}: not a tuning record: {exc}") from exc

    def _import_run(self, started: float, seed: int, target: str, info: dict) -> int:
        """The id of this run here: an identical run already present keeps
        its id (importing a file twice adds nothing), else a new row."""
        text = json.dumps(info, sort_keys=True, default=str)
        row = self._c.execute(
            "SELECT id FROM runs WHERE started = ? AND seed = ? AND target = ? AND info = ?",
            (started, seed, target, text),
        ).fetchone()
        if row is not None:
            return int(row[0])
        cur = self._c.execute(
            "INSERT INTO runs (started, seed, target, info) VALUES (?, ?, ?, ?)", (started, seed, target, text)
        )
        return int(cur.lastrowid)

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        if len(self.invalid_rows) > _MAX_WARNINGS:
            log.warning("%s: %d invalid records were skipped in all", self.path, len(self.invalid_rows))
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Database({self.path!r})"


class JsonlWriter:
    """Appends tuning runs and records to a JSON-lines file in
    :meth:`Database.export_jsonl`'s format, for :meth:`Database.import_jsonl`
    on another host. Each line is flushed and synced to disk on its own, as
    each :meth:`Database.commit_record` is committed; the writing methods are
    the database's (`add_run`, `commit_record`), so a caller writes to either.

    `reserved_run_ids`: ids taken already (those of the database the file is
    for): a new run takes the id after them and after the file's own runs.
    """

    def __init__(self, path: str | os.PathLike, reserved_run_ids: Iterable[int] = ()) -> None:
        self.path = os.fspath(path)
        self.reserved_run_ids = [int(i) for i in reserved_run_ids]

    def _lines(self) -> list[tuple[int, dict]]:
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = _loads(line, constants_under="info")
                    if not isinstance(d, dict):
                        raise ValueError("not an object")
                except ValueError as exc:
                    raise InputError(f"{self.path}:{lineno}: not a JSON-lines record: {exc}") from exc
                out.append((lineno, d))
        return out

    def records(self) -> list[Record]:
        """The records the file holds already (a line without ``kind`` is
        one), checked as `Database.import_jsonl` checks them."""
        out = []
        for lineno, d in self._lines():
            if d.get("kind", "record") == "record":
                try:
                    out.append(Record.from_json(d))
                except KeyError as exc:
                    raise InputError(f"{self.path}:{lineno}: not a tuning record: no field {exc}") from exc
                except (ValueError, TypeError, OverflowError) as exc:
                    raise InputError(f"{self.path}:{lineno}: not a tuning record: {exc}") from exc
        return out

    def run_ids(self) -> list[int]:
        """The ids of the runs the file holds."""
        out = []
        for lineno, d in self._lines():
            if d.get("kind") == "run":
                if not _is_int(d.get("id")):
                    raise InputError(f"{self.path}:{lineno}: a run without an integer id")
                out.append(d["id"])
        return out

    def add_run(self, seed: int, target: str, info: Mapping[str, Any], started: float) -> int:
        """Append a run (as `Database.add_run`); returns its id."""
        run_id = max([*self.reserved_run_ids, *self.run_ids()], default=0) + 1
        info = json.loads(json.dumps(info, sort_keys=True, default=str))
        self._append({"kind": "run", "id": run_id, "started": started, "seed": seed, "target": target, "info": info})
        return run_id

    def commit_record(self, rec: Record) -> None:
        """Append a record (as `Database.commit_record`)."""
        self._append({"kind": "record", **rec.to_json()})

    def _append(self, obj: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def __repr__(self) -> str:
        return f"JsonlWriter({self.path!r})"
