"""Layer 1: the tuning records database (SQLite, WAL) and its JSON-lines
import/export (`JsonlWriter` appends runs and records to such a file).

May import: `errors`. No MLIR and no numpy: a GPU host that only measures
cubins reads and writes the same database.
"""

from mlir_ansor.records.database import FORMAT, SCHEMA_VERSION, Database, JsonlWriter, Record, knobs_text

__all__ = ["FORMAT", "SCHEMA_VERSION", "Database", "JsonlWriter", "Record", "knobs_text"]
