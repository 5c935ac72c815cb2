"""The tuning records database (SQLite, WAL) and its JSON-lines import/export."""

from mlir_ansor.records.database import FORMAT, SCHEMA_VERSION, Database, Record

__all__ = ["FORMAT", "SCHEMA_VERSION", "Database", "Record"]
