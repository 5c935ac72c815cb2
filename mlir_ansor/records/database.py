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
``Database(path, readonly=True)`` only reads (an existing database).

:class:`JsonlWriter` appends runs and records to a JSON-lines file in
:meth:`Database.export_jsonl`'s format instead, each line synced on its own
(`measure.gpu_measure --jsonl` writes one for `Database.import_jsonl`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import statistics
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Self

from mlir_ansor.errors import DatabaseError, InputError

__all__ = ["FORMAT", "RETIME_KEY", "SCHEMA_VERSION", "Database", "JsonlWriter", "Record", "knobs_text"]

FORMAT = "mlir-ansor-db"
SCHEMA_VERSION = 1
_SQLITE_MAGIC = b"SQLite format 3\x00"
RETIME_KEY = "retime"
"""The key of a re-timing's ``versions`` JSON (`Record.retime`); the tuner writes it."""
_RETIME_LIKE = f'%"{RETIME_KEY}":%'  # the same test in SQL
# Error kinds of a schedule that failed when it ran (not when it was built):
# a schedule with one of these is never a best (`Database.best`).
_FAILED_RUNS = ("wrong_answer", "run_error", "crash", "timeout", "exception")

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
    return tuple((str(k), v) for k, v in json.loads(text))


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

    @property
    def retime(self) -> bool:
        """A second timing of a schedule measured before (the end of a tuning
        run re-times each task's best, `TuneConfig.retime_rounds`), not a new
        candidate: its ``versions`` JSON holds ``"retime"``."""
        try:
            versions = json.loads(self.versions) if self.versions else None
        except ValueError:
            return False
        return isinstance(versions, dict) and RETIME_KEY in versions

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
        return cls(
            workload_key=str(d["workload_key"]),
            target=str(d["target"]),
            sketch_hash=str(d["sketch_hash"]),
            knobs=tuple((str(k), v) for k, v in d["knobs"]),
            costs=tuple(d.get("costs", ())),
            error_kind=str(d["error_kind"]),
            error_msg=str(d.get("error_msg", "")),
            host=str(d.get("host", "")),
            threads=int(d.get("threads", 1)),
            build_s=float(d.get("build_s", 0.0)),
            timestamp=float(d.get("timestamp", 0.0)),
            versions=str(d.get("versions", "")),
        )


def _row_to_record(row: sqlite3.Row) -> Record:
    return Record(
        workload_key=row["workload_key"],
        target=row["target"],
        sketch_hash=row["sketch_hash"],
        knobs=_knobs_from_json(row["knobs"]),
        costs=tuple(json.loads(row["costs"])),
        error_kind=row["error_kind"],
        error_msg=row["error_msg"],
        host=row["host"],
        threads=row["threads"],
        build_s=row["build_s"],
        timestamp=row["timestamp"],
        versions=row["versions"],
    )


def _renumber_run(rec: Record, run_ids: Mapping[int, int]) -> Record:
    """`rec` with the run id in its ``versions`` mapped through `run_ids`
    (run ids are per database; an imported run gets a new one)."""
    try:
        versions = json.loads(rec.versions) if rec.versions else None
    except ValueError:
        return rec
    if not isinstance(versions, dict) or versions.get("run") not in run_ids:
        return rec
    versions["run"] = run_ids[versions["run"]]
    return replace(rec, versions=json.dumps(versions))


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
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    try:
        con = sqlite3.connect(uri, uri=True, timeout=30.0)
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
        try:
            if readonly:
                uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
                con = sqlite3.connect(uri, uri=True, timeout=30.0, check_same_thread=False, isolation_level=None)
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
        return [(int(r["id"]), _row_to_record(r)) for r in rows]

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
        the median over every measurement rather than its luckiest one. A
        schedule with a failed measurement (wrong answer, crash, timeout) on
        the same host and thread count is never returned."""
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
                    f"SELECT host {sql} AND latency_s IS NOT NULL AND versions NOT LIKE ? "
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
        for row in rows:
            rec = _row_to_record(row)
            groups.setdefault((rec.sketch_hash, rec.knobs, rec.threads), []).append(rec)
        best: list[Record] = []
        for recs in groups.values():
            if not all(r.valid for r in recs):
                continue  # it failed once: not to be trusted
            first = recs[0]
            if len(recs) > 1:
                first = replace(first, costs=tuple(c for r in recs for c in r.costs))
            best.append(first)
        best.sort(key=lambda r: r.latency_s)  # stable: ties stay in order of first measurement
        return best[: int(k)]

    def measured_keys(self, workload_key: str, target: str) -> set[tuple]:
        """``(sketch_hash, knobs)`` of every record, valid or not, so a resumed
        run can skip them. ``knobs`` is the sorted tuple of pairs, as in Record."""
        with self._lock, self._wrap("measured_keys"):
            rows = self._c.execute(
                "SELECT DISTINCT sketch_hash, knobs FROM records WHERE workload_key = ? AND target = ?",
                (workload_key, target),
            ).fetchall()
        return {(r[0], _knobs_from_json(r[1])) for r in rows}

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
        with self._lock, self._wrap("runs"):
            rows = self._c.execute("SELECT * FROM runs ORDER BY id").fetchall()
        out = []
        for r in rows:
            d = dict(r)
            info = json.loads(d.pop("info") or "{}")
            out.append({**info, **d})
        return out

    # -- JSON lines -----------------------------------------------------------

    def export_jsonl(self, path: str | os.PathLike) -> int:
        """Write every workload (``"kind": "workload"``), every tuning run
        (``"kind": "run"``: seed, target, versions, host) and every record
        (``"kind": "record"``), one JSON object a line. Returns the record count."""
        with self._lock, self._wrap("export_jsonl"):
            wls = self._c.execute("SELECT * FROM workloads ORDER BY rowid").fetchall()
            runs = self._c.execute("SELECT * FROM runs ORDER BY id").fetchall()
            rows = self._c.execute("SELECT * FROM records ORDER BY id").fetchall()
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"kind": "workload", **dict(w)}) + "\n" for w in wls)
            f.writelines(
                json.dumps({"kind": "run", **dict(r), "info": json.loads(r["info"] or "{}")}) + "\n" for r in runs
            )
            f.writelines(json.dumps({"kind": "record", **_row_to_record(r).to_json()}) + "\n" for r in rows)
        return len(rows)

    def import_jsonl(self, path: str | os.PathLike) -> int:
        """Add the workloads and records of a JSON-lines file (one transaction).
        Records already present are skipped. Returns how many records were added.
        A line without ``kind`` is read as a record."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError as exc:
            raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        items: list[tuple[str, Any]] = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                kind = d.get("kind", "record")
                if kind == "workload":
                    items.append(
                        (
                            "workload",
                            (
                                str(d["workload_key"]),
                                str(d["name"]),
                                str(d["task_mlir"]),
                                int(d["flops"]),
                            ),
                        )
                    )
                elif kind == "run":
                    info = d["info"]
                    if not isinstance(info, dict):
                        raise ValueError("a run's info must be an object")
                    items.append(("run", (int(d["id"]), float(d["started"]), int(d["seed"]), str(d["target"]), info)))
                elif kind == "record":
                    items.append(("record", Record.from_json(d)))
                else:
                    raise ValueError(f"unknown kind {kind!r}")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise InputError(
                    f"{path}:{lineno}: not a tuning record: {exc}"
                ) from exc
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

    def _lines(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    if not isinstance(d, dict):
                        raise ValueError("not an object")
                except ValueError as exc:
                    raise InputError(f"{self.path}:{lineno}: not a JSON-lines record: {exc}") from exc
                out.append(d)
        return out

    def records(self) -> list[Record]:
        """The records the file holds already (a line without ``kind`` is one)."""
        out = []
        for d in self._lines():
            if d.get("kind", "record") == "record":
                try:
                    out.append(Record.from_json(d))
                except (ValueError, KeyError, TypeError) as exc:
                    raise InputError(f"{self.path}: not a tuning record: {exc}") from exc
        return out

    def run_ids(self) -> list[int]:
        """The ids of the runs the file holds."""
        return [int(d["id"]) for d in self._lines() if d.get("kind") == "run"]

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
